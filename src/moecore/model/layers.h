// Building blocks with explicit forward and backward: Linear, Norm, Mlp.
//
// Conventions: activations are row-major [T, features] with T = tokens of the micro-batch;
// forward(x, ctx) returns its output and fills ctx with what backward needs; backward(dy, ctx)
// returns dx and ACCUMULATES parameter gradients (so micro-batches add up). Saved tensors are
// named by the struct fields (Megatron's names where they exist), so recomputation and offload
// can later act on them by name.
#pragma once

#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/model/fp8_linear.h"
#include "moecore/model/params.h"
#include "moecore/model/tensor_parallel.h"

namespace moecore {

// Tensor-parallel split of a Linear (Megatron's ColumnParallelLinear / RowParallelLinear):
//   Column  W [out/n, in]: this rank's output features (glu: of each GLU half); the bias split
//           alike. The input is the whole x (DenseParallel::enter_* around it).
//   Row     W [out, in/n]: this rank's input features; the output is a partial sum over the
//           group (DenseParallel::exit_*). The bias is replicated and added on rank 0 only, so
//           the sum holds it once; its gradient is marked tp_partial_grad (rank 0's, summed).
struct LinearSplit {
  enum Kind { None, Column, Row };
  Kind kind = None;
  int64_t size = 1, rank = 0;
  bool glu = false;
};

// y = x W^T (+ b); W [out, in] (this rank's part under a split: in and out are the local sizes).
// With FP8 training (store.fp8() set) its three GEMMs run through an Fp8Linear
// (model/fp8_linear.h) unless fp8_eligible is false (the output layer, the shared-expert gate).
class Linear {
 public:
  Linear() = default;
  // in_full, out_full: the whole layer's sizes. shared_weight: a parameter to reuse as W (tied
  // output layer; already split like this layer).
  Linear(ParamStore& store, const std::string& name, int64_t in_full, int64_t out_full, bool bias, double std,
         Param* shared_weight = nullptr, const LinearSplit& split = {}, bool fp8_eligible = true);
  struct Ctx {
    Tensor x;  // the input (for dW)
  };
  Tensor forward(const Tensor& x, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, Ctx& ctx) const;
  // As backward, but dx is added to `dx_sum` [rows, in] in the dgrad GEMM itself (beta 1: one
  // pass, one rounding) instead of being returned.
  void backward_add(const Tensor& dy, Ctx& ctx, Tensor& dx_sum) const;
  // The pieces of forward and backward, on 2-D rows (the chunked forms of the parallel linears
  // below call them per row chunk): y [rows, out] = x W^T (+ b); the weight (and bias)
  // gradients of dy [rows, out] and x [rows, in]; dx [rows, in] = beta dx + dy W.
  void forward_rows(const Tensor& x2, Tensor& y) const;
  void wgrad(const Tensor& dy2, const Tensor& x2) const;
  void dgrad(const Tensor& dy2, Tensor& dx, float beta) const;
  Param* weight = nullptr;
  Param* bias = nullptr;
  int64_t in = 0, out = 0;
  bool adds_bias = true;  // false on ranks > 0 of a row-parallel split
  Fp8Linear fp8;          // on() with FP8 training

 private:
  void backward_dgrad(const Tensor& dy, Ctx& ctx, Tensor& dx, float beta) const;  // dx = beta dx + dy W
};

// ---- Column- and row-parallel linears with their sequence-parallel collectives -----------
// Without DenseParallel::overlap() these are exactly enter_forward then each forward; forward
// then exit_forward; exit_backward then backward; the backwards summed (backward_add) then
// enter_backward. With it (--tp-comm-overlap) the collectives go in row chunks overlapped with
// the GEMMs (tensor_parallel.h): the forward and dgrad GEMMs run per chunk, each wgrad stays one
// GEMM over all the gathered rows (the same accumulation order as without the flag, so the same
// numbers). The ctx keep the whole gathered inputs either way.
struct ColumnLinear {
  const Linear* linear;
  Linear::Ctx* ctx;
};
// Linears reading one gathered input (q, k, v; fc1): their outputs over all the gathered rows.
std::vector<Tensor> column_parallel_forward(const DenseParallel& par, const Tensor& x_local, int64_t batch,
                                            const std::vector<ColumnLinear>& linears);
struct ColumnGrad {
  const Linear* linear;
  Tensor dy;  // [gathered rows, linear->out]
  Linear::Ctx* ctx;
};
// dx of the input the linears read (their dgrads summed in order), reduced back to this rank's rows.
Tensor column_parallel_backward(const DenseParallel& par, int64_t batch, const std::vector<ColumnGrad>& grads);
// A row-parallel linear and the sum over the group (this rank's rows under SP).
Tensor row_parallel_forward(const DenseParallel& par, const Linear& linear, const Tensor& x, int64_t batch,
                            Linear::Ctx& ctx);
Tensor row_parallel_backward(const DenseParallel& par, const Linear& linear, const Tensor& dy_local, int64_t batch,
                             Linear::Ctx& ctx);

// RMSNorm or LayerNorm over the last dimension.
class Norm {
 public:
  Norm() = default;
  Norm(ParamStore& store, const std::string& name, int64_t width, bool rmsnorm, double eps);
  struct Ctx {
    Tensor x, mean, rstd;
  };
  Tensor forward(const Tensor& x, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, Ctx& ctx) const;
  Param* weight = nullptr;
  Param* bias = nullptr;
  bool rmsnorm = true;
  double eps = 1e-5;
};

// fc1 -> SwiGLU (fc1 width 2F: [gate | up]) or GELU -> fc2. With tensor parallelism fc1 is
// column-parallel and fc2 row-parallel (each rank F / TP features), inside enter/exit regions.
class Mlp {
 public:
  Mlp() = default;
  Mlp(ParamStore& store, const std::string& prefix, int64_t hidden, int64_t ffn, bool swiglu, bool bias,
      double std, double out_std, const DenseParallel& par = {});
  struct Ctx {
    Linear::Ctx fc1, fc2;
    Tensor fc1_out;  // "mlp" pre-activation, for the activation backward
    int64_t batch = 1;
  };
  // batch: sequences in x (sequence-parallel gathers keep each sequence's order).
  Tensor forward(const Tensor& x, Ctx& ctx, int64_t batch = 1) const;
  Tensor backward(const Tensor& dy, Ctx& ctx) const;
  Linear fc1, fc2;
  bool swiglu = true;
  DenseParallel par;
};

// y = a + b (new tensor); used for residual connections.
Tensor add_tensors(const Tensor& a, const Tensor& b);
// a += b
void add_into(Tensor& a, const Tensor& b);

}  // namespace moecore
