// The index of each row's largest value, for greedy decoding on the device (train/generation.cpp):
//   x [R, C] f32 contiguous   out [R] i32: out[r] = the first c with x[r, c] = max_c x[r, c]
// The first index among equal maxima, as std::max_element (the host's greedy sampler). Rows with
// a NaN: the CPU is std::max_element, CUDA ranks NaN below every number (an all-NaN row: 0).
// CPU and CUDA (one block per row, no host synchronisation).
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void argmax_rows(const Tensor& x, Tensor& out);

namespace cuda {
void argmax_rows(const Tensor& x, Tensor& out);
}  // namespace cuda

}  // namespace moecore::ops
