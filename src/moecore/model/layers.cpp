#include "moecore/model/layers.h"

#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/norm.h"
#include "moecore/ops/reduce.h"
#include "moecore/ops/swiglu.h"

namespace moecore {

Tensor add_tensors(const Tensor& a, const Tensor& b) {
  Tensor y = Tensor::empty(a.shape(), a.dtype(), a.device());
  ops::add(a, b, y);
  return y;
}

void add_into(Tensor& a, const Tensor& b) { ops::add(a, b, a); }

// ---- Linear ---------------------------------------------------------------------------
Linear::Linear(ParamStore& store, const std::string& name, int64_t in_full, int64_t out_full, bool with_bias,
               double std, Param* shared_weight, const LinearSplit& split, bool fp8_eligible)
    : in(in_full), out(out_full) {
  const int64_t n = split.kind == LinearSplit::None ? 1 : split.size;
  MC_CHECK(split.kind != LinearSplit::Column || out_full % (n * (split.glu ? 2 : 1)) == 0, "'", name, "': ", out_full,
           " output features do not split over --tensor-model-parallel-size ", n);
  MC_CHECK(split.kind != LinearSplit::Row || in_full % n == 0, "'", name, "': ", in_full,
           " input features do not split over --tensor-model-parallel-size ", n);
  if (split.kind == LinearSplit::Column) out = out_full / n;
  if (split.kind == LinearSplit::Row) in = in_full / n;
  auto mark = [&](Param& p, int64_t dim) {
    p.part_size = n;
    p.part_rank = split.rank;
    p.part_dim = dim;
    p.part_glu = split.glu;
  };
  if (shared_weight) {
    MC_CHECK(shared_weight->shape == Shape({out, in}), "'", name, "': the shared weight '", shared_weight->name, "' is ",
             shape_str(shared_weight->shape), ", expected ", shape_str({out, in}));
    weight = shared_weight;
  } else {
    weight = &store.add(name + ".weight", {out, in}, Init::Normal, std, true);
    if (n > 1) mark(*weight, split.kind == LinearSplit::Column ? 0 : 1);
  }
  if (with_bias) {
    bias = &store.add(name + ".bias", {out}, Init::Zeros, 0.0, false);
    if (n > 1 && split.kind == LinearSplit::Column) mark(*bias, 0);
    if (n > 1 && split.kind == LinearSplit::Row) {
      adds_bias = split.rank == 0;
      bias->tp_partial_grad = true;
    }
  }
  if (store.fp8() && fp8_eligible) {
    fp8 = Fp8Linear(*store.fp8(), store, name, 1, n > 1 ? store.fp8()->tensor_parallel_group() : nullptr, in, out);
    fp8.gather_weight(*weight, 0, 1);  // --fp8-param-gather only
  }
}

Tensor Linear::forward(const Tensor& x, Ctx& ctx) const {
  const int64_t rows = x.numel() / in;
  const Tensor x2 = x.view({rows, in});
  Tensor y = Tensor::empty({rows, out}, x.dtype(), x.device());
  forward_rows(x2, y);
  ctx.x = x2;
  return y;
}

void Linear::forward_rows(const Tensor& x2, Tensor& y) const {
  const int64_t rows = x2.size(0);
  if (fp8.on()) {
    fp8.forward(x2, weight->weight, y);
  } else {
    ops::gemm(x2, weight->weight, y, false, true);
  }
  if (bias && adds_bias) {
    // y += ones [rows, 1] @ b [1, out]: the bias broadcast as a rank-1 GEMM.
    Tensor ones = Tensor::empty({rows, 1}, x2.dtype(), x2.device());
    ops::fill(ones, 1.0);
    ops::gemm(ones, bias->weight.view({1, out}), y, false, false, 1.0f, 1.0f);
  }
}

Tensor Linear::backward(const Tensor& dy, Ctx& ctx) const {
  Tensor dx = Tensor::empty({dy.numel() / out, in}, dy.dtype(), dy.device());
  backward_dgrad(dy, ctx, dx, 0.0f);
  return dx;
}

void Linear::backward_add(const Tensor& dy, Ctx& ctx, Tensor& dx_sum) const {
  MC_CHECK(dx_sum.ndim() == 2 && dx_sum.size(0) == dy.numel() / out && dx_sum.size(1) == in,
           "Linear::backward_add: the sum has shape ", shape_str(dx_sum.shape()), ", expected [", dy.numel() / out, ", ", in,
           "]");
  backward_dgrad(dy, ctx, dx_sum, 1.0f);
}

void Linear::backward_dgrad(const Tensor& dy, Ctx& ctx, Tensor& dx, float beta) const {
  const Tensor dy2 = dy.view({dy.numel() / out, out});
  wgrad(dy2, ctx.x);
  dgrad(dy2, dx, beta);
  ctx = {};
}

void Linear::wgrad(const Tensor& dy2, const Tensor& x2) const {
  // dW += dy^T x (accumulated in the master dtype; dW = when the step's first write)
  if (fp8.on()) {
    fp8.wgrad(dy2, x2, weight->grad, weight->grad_beta());
  } else {
    ops::gemm(dy2, x2, weight->grad, true, false, 1.0f, weight->grad_beta());
  }
  if (bias && adds_bias) {
    Tensor db = Tensor::empty({out}, bias->grad.dtype(), dy2.device());
    ops::sum_leading_dims(dy2, db);
    add_into(bias->grad_to_accumulate(), db);
  }
}

void Linear::dgrad(const Tensor& dy2, Tensor& dx, float beta) const {
  if (fp8.on()) {
    fp8.dgrad(dy2, weight->weight, dx, beta);
  } else {
    ops::gemm(dy2, weight->weight, dx, false, false, 1.0f, beta);
  }
}

// ---- Norm -----------------------------------------------------------------------------
Norm::Norm(ParamStore& store, const std::string& name, int64_t width, bool rms, double eps_)
    : rmsnorm(rms), eps(eps_) {
  weight = &store.add(name + ".weight", {width}, Init::Ones, 0.0, false);
  if (!rmsnorm) bias = &store.add(name + ".bias", {width}, Init::Zeros, 0.0, false);
}

Tensor Norm::forward(const Tensor& x, Ctx& ctx) const {
  const int64_t width = x.size(-1), rows = x.numel() / width;
  const DType stat = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  ctx.rstd = Tensor::empty({rows}, stat, x.device());
  if (rmsnorm) {
    ops::rmsnorm_forward(x, weight->weight, eps, y, ctx.rstd);
  } else {
    ctx.mean = Tensor::empty({rows}, stat, x.device());
    ops::layernorm_forward(x, weight->weight, bias->weight, eps, y, ctx.mean, ctx.rstd);
  }
  ctx.x = x;
  return y;
}

Tensor Norm::backward(const Tensor& dy, Ctx& ctx) const {
  Tensor dx = Tensor::empty(ctx.x.shape(), ctx.x.dtype(), ctx.x.device());
  if (rmsnorm) {
    ops::rmsnorm_backward(ctx.x, weight->weight, ctx.rstd, dy, dx, weight->grad_to_accumulate());
  } else {
    ops::layernorm_backward(ctx.x, weight->weight, ctx.mean, ctx.rstd, dy, dx, weight->grad_to_accumulate(),
                            bias->grad_to_accumulate());
  }
  ctx = {};
  return dx;
}

// ---- Mlp ------------------------------------------------------------------------------
Mlp::Mlp(ParamStore& store, const std::string& prefix, int64_t hidden, int64_t ffn, bool swiglu_, bool bias,
         double std, double out_std, const DenseParallel& par_)
    : swiglu(swiglu_), par(par_) {
  const int64_t n = par.tp_size(), r = par.tp_rank();
  const LinearSplit column{n > 1 ? LinearSplit::Column : LinearSplit::None, n, r, swiglu};
  const LinearSplit row{n > 1 ? LinearSplit::Row : LinearSplit::None, n, r, false};
  fc1 = Linear(store, prefix + ".linear_fc1", hidden, swiglu ? 2 * ffn : ffn, bias, std, nullptr, column);
  fc2 = Linear(store, prefix + ".linear_fc2", ffn, hidden, bias, out_std, nullptr, row);
}

Tensor Mlp::forward(const Tensor& x, Ctx& ctx, int64_t batch) const {
  ctx.batch = batch;
  ctx.fc1_out = column_parallel_forward(par, x, batch, {{&fc1, &ctx.fc1}})[0];
  const int64_t rows = ctx.fc1_out.size(0);
  Tensor act = Tensor::empty({rows, fc2.in}, x.dtype(), x.device());
  if (swiglu) {
    ops::swiglu_forward(ctx.fc1_out, act);
  } else {
    ops::gelu_forward(ctx.fc1_out, act);
  }
  return row_parallel_forward(par, fc2, act, batch, ctx.fc2);
}

Tensor Mlp::backward(const Tensor& dy, Ctx& ctx) const {
  Tensor dact = row_parallel_backward(par, fc2, dy, ctx.batch, ctx.fc2);
  Tensor dh = Tensor::empty(ctx.fc1_out.shape(), dy.dtype(), dy.device());
  if (swiglu) {
    ops::swiglu_backward(ctx.fc1_out, dact, dh);
  } else {
    ops::gelu_backward(ctx.fc1_out, dact, dh);
  }
  ctx.fc1_out = Tensor();
  return column_parallel_backward(par, ctx.batch, {{&fc1, dh, &ctx.fc1}});
}

}  // namespace moecore
