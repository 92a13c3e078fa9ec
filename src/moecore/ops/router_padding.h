// --moe-router-padding-for-fp8 (Megatron's pad_routing_map): the routing map is padded, not the
// tokens, so that every expert's row count is a multiple of the FP8 GEMM's alignment.
//
// Megatron pads the [T, E] routing map (after capacity dropping) column by column: an expert
// with c routed tokens gets the first (-c mod multiple) tokens in token order that are not
// routed to it, with probability 0 (their rows pass through the expert and add nothing to the
// output; their probability gradient is discarded). moecore's routing is [T, k] indices, so the
// padding becomes extra assignments: indices / probs / kept widen to [T, k + p], p the most
// extra assignments any token got, the unused extra slots not kept (kept 0, expert 0). Within an
// expert the rows stay in token order, as in Megatron's mask-based permutation. When a rank has
// fewer unrouted tokens than an expert needs (fewer tokens than the multiple), all of them are
// added and that count stays unaligned, as in Megatron.
// Runs on the host (the tensors are copied where they live on a device).
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

// The FP8 GEMM's row alignment for the padding (Megatron's get_fp8_align_size: 16 for the
// tensorwise, delayed and blockwise recipes; 32 for MXFP8, which moecore refuses).
constexpr int64_t kFp8RouterPadMultiple = 16;

struct PaddedRouting {
  Tensor indices;  // [T, k + p] i32
  Tensor probs;    // [T, k + p], the probs' dtype; 0 for the added assignments
  Tensor kept;     // [T, k + p] u8, or undefined when nothing was added and none was given
  int64_t topk = 0;  // the k of the input: the router's probabilities are columns [0, k)
};

// indices [T, k] i32 (global expert ids in [0, num_experts)), probs [T, k] f32/f64, kept
// [T, k] u8 or undefined (all kept). multiple >= 1.
PaddedRouting pad_routing_map(const Tensor& indices, const Tensor& probs, const Tensor& kept, int64_t num_experts,
                              int64_t multiple);

}  // namespace moecore::ops
