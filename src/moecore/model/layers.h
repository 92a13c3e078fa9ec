// Building blocks with explicit forward and backward: Linear, Norm, Mlp.
//
// Conventions: activations are row-major [T, features] with T = tokens of the micro-batch;
// forward(x, ctx) returns its output and fills ctx with what backward needs; backward(dy, ctx)
// returns dx and ACCUMULATES parameter gradients (so micro-batches add up). Saved tensors are
// named by the struct fields (Megatron's names where they exist), so recomputation and offload
// can later act on them by name.
#pragma once

#include <string>

#include "moecore/model/config.h"
#include "moecore/model/params.h"

namespace moecore {

// y = x W^T (+ b); W [out, in].
class Linear {
 public:
  Linear() = default;
  Linear(ParamStore& store, const std::string& name, int64_t in, int64_t out, bool bias, double std,
         Param* shared_weight = nullptr);
  struct Ctx {
    Tensor x;  // the input (for dW)
  };
  Tensor forward(const Tensor& x, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, Ctx& ctx) const;
  Param* weight = nullptr;
  Param* bias = nullptr;
  int64_t in = 0, out = 0;
};

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

// fc1 -> SwiGLU (fc1 width 2F: [gate | up]) or GELU -> fc2.
class Mlp {
 public:
  Mlp() = default;
  Mlp(ParamStore& store, const std::string& prefix, int64_t hidden, int64_t ffn, bool swiglu, bool bias,
      double std, double out_std);
  struct Ctx {
    Linear::Ctx fc1, fc2;
    Tensor fc1_out;  // "mlp" pre-activation, for the activation backward
  };
  Tensor forward(const Tensor& x, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, Ctx& ctx) const;
  Linear fc1, fc2;
  bool swiglu = true;
};

// y = a + b (new tensor); used for residual connections.
Tensor add_tensors(const Tensor& a, const Tensor& b);
// a += b
void add_into(Tensor& a, const Tensor& b);

}  // namespace moecore
