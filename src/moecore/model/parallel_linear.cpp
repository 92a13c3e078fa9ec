// Column- and row-parallel linears with their sequence-parallel collectives (model/layers.h):
// the plain order, or with --tp-comm-overlap the chunked collectives of model/tensor_parallel.h.
// On a GPU each chunk's GEMMs run per RowChunks::Run, reading and writing the sequence-order
// tensors in place, while other chunks travel. On the CPU the collectives go in the same chunks
// but the GEMMs run once over all the rows, as without the flag: MPI's collectives return when
// done, so there is nothing to overlap, and OpenBLAS picks its kernels by matrix size (a chunk's
// rows can round differently from the same rows in the whole GEMM), so this keeps the run
// bit-identical to the plain one. The weight gradients sum over every row: they stay one GEMM
// over all the gathered rows (the plain order of their sums) on both.
#include <string>

#include "moecore/core/env_switches.h"
#include "moecore/model/layers.h"

namespace moecore {

namespace {

Tensor rows_of(const Tensor& t, int64_t first, int64_t count) { return t.slice(0, first, first + count); }

// MOECORE_TP_OVERLAP_GEMMS=chunks: per chunk on the CPU too (the GPU's row placement, tested on MPI ranks).
bool gemms_per_chunk(Device device) {
  static const bool forced = [] {
    const char* v = env_switch("MOECORE_TP_OVERLAP_GEMMS");
    const std::string value = v ? v : "auto";
    MC_CHECK(value == "auto" || value == "chunks", "MOECORE_TP_OVERLAP_GEMMS '", value, "': expected auto or chunks");
    return value == "chunks";
  }();
  return forced || device.is_cuda();
}

void check_overlappable(const Linear& l) {
  MC_CHECK(!l.fp8.on(), "--tp-comm-overlap with FP8 training is not available in this version (each row chunk would "
           "get its own scaling); drop one of them");
}

}  // namespace

std::vector<Tensor> column_parallel_forward(const DenseParallel& par, const Tensor& x_local, int64_t batch,
                                            const std::vector<ColumnLinear>& linears) {
  std::vector<Tensor> ys;
  if (!par.overlap()) {
    const Tensor x = par.enter_forward(x_local, batch);
    for (const ColumnLinear& l : linears) ys.push_back(l.linear->forward(x, *l.ctx));
    return ys;
  }
  const int64_t in = linears.front().linear->in, local_rows = x_local.numel() / in;
  const int64_t rows = local_rows * par.tp_size();
  const RowChunks chunks(par.tp_size(), batch, local_rows);
  for (const ColumnLinear& l : linears) {
    check_overlappable(*l.linear);
    ys.push_back(Tensor::empty({rows, l.linear->out}, x_local.dtype(), x_local.device()));
  }
  const bool per_chunk = gemms_per_chunk(x_local.device());
  auto chunk_gemms = [&](int64_t c, const Tensor& x_rows) {
    if (!per_chunk) return;
    for (const RowChunks::Run& run : chunks.runs(c))
      for (size_t i = 0; i < linears.size(); ++i) {
        Tensor y = rows_of(ys[i], run.full, run.rows);
        linears[i].linear->forward_rows(rows_of(x_rows, run.at, run.rows), y);
      }
  };
  const Tensor x = gather_sequence_chunked(*par.tp, x_local.contiguous().view({local_rows, in}), batch, chunk_gemms);
  for (size_t i = 0; i < linears.size(); ++i) {
    if (!per_chunk) linears[i].linear->forward_rows(x, ys[i]);
    linears[i].ctx->x = x;
  }
  return ys;
}

Tensor column_parallel_backward(const DenseParallel& par, int64_t batch, const std::vector<ColumnGrad>& grads) {
  if (!par.overlap()) {
    Tensor dx = grads.front().linear->backward(grads.front().dy, *grads.front().ctx);
    for (size_t i = 1; i < grads.size(); ++i) grads[i].linear->backward_add(grads[i].dy, *grads[i].ctx, dx);
    return par.enter_backward(dx, batch);
  }
  const Linear& first = *grads.front().linear;
  const int64_t in = first.in, rows = grads.front().dy.numel() / first.out;
  const RowChunks chunks(par.tp_size(), batch, rows / par.tp_size());
  std::vector<Tensor> dys;
  for (const ColumnGrad& g : grads) dys.push_back(g.dy.contiguous().view({rows, g.linear->out}));
  const Tensor& dy0 = dys.front();
  // Each chunk's dx rows: the dgrads summed in the plain order (the first written, the rest added).
  const bool per_chunk = gemms_per_chunk(dy0.device());
  Tensor dx_all;  // the CPU: every row at once (the first chunk computes it)
  auto chunk_dx = [&](int64_t c) {
    if (!per_chunk) {
      if (c == 0) {
        dx_all = Tensor::empty({rows, in}, dy0.dtype(), dy0.device());
        for (size_t i = 0; i < grads.size(); ++i) grads[i].linear->dgrad(dys[i], dx_all, i == 0 ? 0.0f : 1.0f);
      }
      return chunks.take(dx_all, c);
    }
    Tensor dx = Tensor::empty({par.tp_size() * chunks.len(c), in}, dy0.dtype(), dy0.device());
    for (const RowChunks::Run& run : chunks.runs(c)) {
      Tensor dx_run = rows_of(dx, run.at, run.rows);
      for (size_t i = 0; i < grads.size(); ++i)
        grads[i].linear->dgrad(rows_of(dys[i], run.full, run.rows), dx_run, i == 0 ? 0.0f : 1.0f);
    }
    return dx;
  };
  // The weight gradients while the last chunk is reduce-scattered.
  auto wgrads = [&] {
    for (size_t i = 0; i < grads.size(); ++i) {
      grads[i].linear->wgrad(dys[i], grads[i].ctx->x);
      *grads[i].ctx = {};
    }
  };
  return reduce_scatter_sequence_chunked(*par.tp, rows / par.tp_size(), in, batch, dy0.dtype(), dy0.device(), chunk_dx,
                                         wgrads);
}

Tensor row_parallel_forward(const DenseParallel& par, const Linear& linear, const Tensor& x, int64_t batch,
                            Linear::Ctx& ctx) {
  if (!par.overlap()) return par.exit_forward(linear.forward(x, ctx), batch);
  check_overlappable(linear);
  const int64_t rows = x.numel() / linear.in;
  const Tensor x2 = x.contiguous().view({rows, linear.in});
  const RowChunks chunks(par.tp_size(), batch, rows / par.tp_size());
  const bool per_chunk = gemms_per_chunk(x2.device());
  Tensor y_all;  // the CPU: every row at once (the first chunk computes it)
  auto chunk_y = [&](int64_t c) {
    if (!per_chunk) {
      if (c == 0) {
        y_all = Tensor::empty({rows, linear.out}, x2.dtype(), x2.device());
        linear.forward_rows(x2, y_all);
      }
      return chunks.take(y_all, c);
    }
    Tensor y = Tensor::empty({par.tp_size() * chunks.len(c), linear.out}, x2.dtype(), x2.device());
    for (const RowChunks::Run& run : chunks.runs(c)) {
      Tensor y_run = rows_of(y, run.at, run.rows);
      linear.forward_rows(rows_of(x2, run.full, run.rows), y_run);
    }
    return y;
  };
  ctx.x = x2;
  return reduce_scatter_sequence_chunked(*par.tp, rows / par.tp_size(), linear.out, batch, x2.dtype(), x2.device(),
                                         chunk_y, {});
}

Tensor row_parallel_backward(const DenseParallel& par, const Linear& linear, const Tensor& dy_local, int64_t batch,
                             Linear::Ctx& ctx) {
  if (!par.overlap()) return linear.backward(par.exit_backward(dy_local, batch), ctx);
  const int64_t local_rows = dy_local.numel() / linear.out, rows = local_rows * par.tp_size();
  const RowChunks chunks(par.tp_size(), batch, local_rows);
  Tensor dx = Tensor::empty({rows, linear.in}, dy_local.dtype(), dy_local.device());
  const bool per_chunk = gemms_per_chunk(dy_local.device());
  auto chunk_dgrad = [&](int64_t c, const Tensor& dy_rows) {
    if (!per_chunk) return;
    for (const RowChunks::Run& run : chunks.runs(c)) {
      Tensor dx_run = rows_of(dx, run.full, run.rows);
      linear.dgrad(rows_of(dy_rows, run.at, run.rows), dx_run, 0.0f);
    }
  };
  const Tensor dy =
      gather_sequence_chunked(*par.tp, dy_local.contiguous().view({local_rows, linear.out}), batch, chunk_dgrad);
  if (!per_chunk) linear.dgrad(dy, dx, 0.0f);
  linear.wgrad(dy, ctx.x);
  ctx = {};
  return dx;
}

}  // namespace moecore
