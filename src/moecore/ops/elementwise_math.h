// The scalar formulas of the elementwise ops, shared by the CPU and CUDA backends so that
// both evaluate the same expression. C is the compute type (float or double).
#pragma once

#include <cmath>

#include "moecore/core/float_formats.h"
#include "moecore/ops/elementwise.h"

namespace moecore::ops::math {

MC_HD float m_exp(float x) { return expf(x); }
MC_HD double m_exp(double x) { return exp(x); }
MC_HD float m_erf(float x) { return erff(x); }
MC_HD double m_erf(double x) { return erf(x); }

template <typename C>
MC_HD C sigmoid(C x) {
  return C(1) / (C(1) + m_exp(-x));
}

template <typename C>
MC_HD C binary(BinaryOp op, C alpha, C a, C beta, C b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Mul: return a * b;
    default: return alpha * a + beta * b;
  }
}

template <typename C>
MC_HD C activation(Activation act, C x) {
  if (act == Activation::Silu) return x * sigmoid(x);
  if (act == Activation::Sigmoid) return sigmoid(x);
  return C(0.5) * x * (C(1) + m_erf(x * C(0.70710678118654752440)));
}

// d activation / dx
template <typename C>
MC_HD C activation_grad(Activation act, C x) {
  if (act == Activation::Silu) {
    const C s = sigmoid(x);
    return s * (C(1) + x * (C(1) - s));
  }
  if (act == Activation::Sigmoid) {
    const C s = sigmoid(x);
    return s * (C(1) - s);
  }
  const C cdf = C(0.5) * (C(1) + m_erf(x * C(0.70710678118654752440)));
  const C pdf = C(0.39894228040143267794) * m_exp(C(-0.5) * x * x);
  return cdf + x * pdf;
}

}  // namespace moecore::ops::math
