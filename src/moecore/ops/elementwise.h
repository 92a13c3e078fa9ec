// Elementwise ops: fill, cast, add, mul, axpby and the activations (SiLU, GELU, sigmoid) with their
// backward. Inputs and outputs have the same shape; out may alias an input (in place).
// Floating dtypes only; CUDA supports f32, bf16 and the fp8 formats (f64 is CPU-only).
// Low-precision types compute in fp32 and round once on store.
#pragma once

#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void fill(Tensor& t, double value);
// Converts every element of src to dst's dtype (round to nearest even; fp8 saturates).
void cast(const Tensor& src, Tensor& dst);
// t itself when it already has `dtype`, else a new tensor holding cast(t).
Tensor cast_to(const Tensor& t, DType dtype);
// dst = src in dst's dtype: a byte copy when the dtypes agree, cast otherwise.
void assign_cast(const Tensor& src, Tensor& dst);
// The first `parts` (1 to 3) bf16 parts of an f32 tensor, largest first: p0 = bf16(t),
// p1 = bf16(t - p0), p2 = bf16(t - p0 - p1). Each difference is exact in fp32 (at most 16
// significant bits), and three parts carry all of fp32's 24 mantissa bits, so p0 + p1 + p2 = t
// for values whose last part is not below bf16's smallest normal: bf16 GEMMs of the parts give
// fp32-exact products (the MoE router's fp32 GEMMs, moe/router.cpp).
std::vector<Tensor> bf16_parts(const Tensor& t, int parts);
void add(const Tensor& a, const Tensor& b, Tensor& out);                          // out = a + b
void mul(const Tensor& a, const Tensor& b, Tensor& out);                          // out = a * b
void axpby(float alpha, const Tensor& x, float beta, const Tensor& y, Tensor& out);  // out = alpha*x + beta*y

// y = x * sigmoid(x);  dx = dy * sigmoid(x) * (1 + x * (1 - sigmoid(x)))
void silu_forward(const Tensor& x, Tensor& y);
void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
// y = 0.5 x (1 + erf(x / sqrt 2)) (exact GELU, PyTorch's default);  dx = dy * (Phi(x) + x phi(x))
void gelu_forward(const Tensor& x, Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
// y = 1 / (1 + exp(-x));  dx = dy * y * (1 - y)  (computed from x)
void sigmoid_forward(const Tensor& x, Tensor& y);
void sigmoid_backward(const Tensor& x, const Tensor& dy, Tensor& dx);

enum class BinaryOp { Add, Mul, Axpby };
enum class Activation { Silu, Gelu, Sigmoid };

namespace cpu {
void fill(Tensor& t, double value);
void cast(const Tensor& src, Tensor& dst);
void binary(BinaryOp op, float alpha, const Tensor& a, float beta, const Tensor& b, Tensor& out);
void activation_forward(Activation act, const Tensor& x, Tensor& y);
void activation_backward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx);
}  // namespace cpu
namespace cuda {
void fill(Tensor& t, double value);
void cast(const Tensor& src, Tensor& dst);
void binary(BinaryOp op, float alpha, const Tensor& a, float beta, const Tensor& b, Tensor& out);
void activation_forward(Activation act, const Tensor& x, Tensor& y);
void activation_backward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx);
}  // namespace cuda

}  // namespace moecore::ops
