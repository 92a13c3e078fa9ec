// MoE token dispatch on one rank: capacity dropping, the routing plan, permute and unpermute.
//
// Notation: T tokens, k assignments per token (top-k), E experts, H hidden size, C capacity.
// indices [T, k] i32 gives the expert of assignment (t, j); probs [T, k] its router probability.
//
// Capacity (Megatron): C = ceil(T * k / E * capacity_factor), capped at T (then nothing drops).
// capacity_mask -> kept [T, k] u8 (1 kept, 0 dropped), per expert:
//   Probs:    the C assignments with the highest probs (ties: lower token index, then lower j).
//   Position: the first C assignments in token order (t ascending, then j).
//
// Routing plan (MoeRouting, the "handle" of DeepEP's dispatch/combine): built once per forward
// and reused by the backward. The permuted buffer has num_rows rows grouped by expert in
// ascending expert order; within an expert, its kept assignments in token order (t, then j).
//   row_map [T, k] i32: the permuted row of assignment (t, j), -1 if dropped.
//   tokens_per_expert [E] i32 (device) and host_tokens_per_expert (host copy, for GEMM sizes).
//   row_offsets [E + 1] i32 (device): expert e's rows are [row_offsets[e], row_offsets[e + 1]),
//   row_offsets[E] = num_rows (what the Hopper grouped GEMM reads: no host copy needed).
//   kept_per_expert [E] i32 (device): kept assignments per expert (= tokens_per_expert unpadded;
//   the real counts, not C, when padded).
//   Unpadded: num_rows = number of kept assignments; expert e owns the rows after experts < e.
//   Padded (pad_to_capacity = C > 0): expert e owns rows [e*C, (e+1)*C); its kept assignments fill
//   the first rows, the rest are padding rows (zero inputs, no output contribution, zero
//   gradient); tokens_per_expert = C for every expert (static shapes); num_rows = E * C.
//   An expert with more than C kept assignments is an Error (drop with capacity_mask first).
//
// Ops (outputs allocated by the caller; dtypes f32/bf16, f64 on the CPU; probs f32, or f64 on the CPU):
//   permute_forward     out [num_rows, H] = x[t] at row row_map[t, j]; padding rows 0.
//   permute_backward    dx [T, H] = sum over kept j of dout[row_map[t, j]]   (dx overwritten)
//   unpermute_forward   out [T, H] = sum over kept j of probs[t, j] * y[row_map[t, j]]
//                       (fp32 accumulation, f64 for f64; a token with every assignment dropped gets 0)
//   unpermute_backward  dy [num_rows, H] : dy[row_map[t, j]] = probs[t, j] * dout[t]; padding rows 0
//                       dprobs [T, k]    : <dout[t], y[row_map[t, j]]>, 0 for dropped assignments
//   permute_probs_forward   out [num_rows, 1] = probs[t, j] at row row_map[t, j]; padding rows 0
//                           (each expert row's own probability, for experts that apply it)
//   permute_probs_backward  dprobs [T, k] = dout[row_map[t, j]], 0 for dropped assignments
// Sums run over j in ascending order on both backends: deterministic, no atomics.
//
// CUDA: make_moe_routing runs kernels (per-expert counts, then positions in token order by a
// block-wide prefix sum per expert) and then makes ONE device->host copy of the per-expert counts
// (with a validation word): that copy synchronises the stream. With copy_counts = false and the
// row count known without the counts (no capacity dropping: num_rows = T k; or padded:
// num_rows = E C) it makes no copy: host_tokens_per_expert stays empty, nothing waits for the
// GPU, and the checks (expert ids in [0, E), no expert over capacity) are deferred: to
// check_moe_routing (it reads the status word: call it where the host synchronises anyway), or
// to accumulate_routing_counts' flags (the MoE layer reads them with its statistics). A bad id then leaves its
// assignment out of the plan (row_map -1) until that check raises; with capacity dropping and no
// padding the copy is made anyway (num_rows is the kept count). capacity_mask on CUDA runs on the
// device (Probs: a stable segmented radix sort per expert) after a 4-byte index check that also
// synchronises.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::ops {

enum class DropPolicy { Probs, Position };

int64_t expert_capacity(int64_t num_tokens, int64_t topk, int64_t num_experts, double capacity_factor);

void capacity_mask(const Tensor& indices, const Tensor& probs, int64_t num_experts, int64_t capacity,
                   DropPolicy policy, Tensor& kept);

struct MoeRouting {
  int64_t num_tokens = 0, topk = 0, num_experts = 0;
  int64_t num_rows = 0;                         // rows of the permuted buffer
  int64_t capacity = 0;                         // > 0 when padded to capacity (num_rows = E * capacity)
  Tensor row_map;                               // [T, k] i32 on the device: permuted row, -1 if dropped
  Tensor tokens_per_expert;                     // [E] i32 on the device
  std::vector<int64_t> host_tokens_per_expert;  // the same on the host (GEMM sizes); empty if not copied
  Tensor row_offsets;                           // [E + 1] i32 on the device
  Tensor kept_per_expert;                       // [E] i32 on the device (real counts, also when padded)
  Tensor status;  // CUDA without the host copy: [E + 1] i32, the word check_moe_routing reads
};

// kept: an undefined Tensor (all kept) or [T, k] u8 on the indices' device.
MoeRouting make_moe_routing(const Tensor& indices, const Tensor& kept, int64_t num_experts,
                            int64_t pad_to_capacity = 0, bool copy_counts = true);
// The deferred checks of a plan made without the host copy (synchronises; a no-op otherwise):
// the same errors make_moe_routing raises. `indices` are the ones the plan was made from, or
// undefined (the message then names the position without the value).
void check_moe_routing(const MoeRouting& r, const Tensor& indices);

void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out);
void moe_permute_backward(const Tensor& dout, const MoeRouting& r, Tensor& dx);
void moe_unpermute_forward(const Tensor& y, const Tensor& probs, const MoeRouting& r, Tensor& out);
void moe_unpermute_backward(const Tensor& y, const Tensor& probs, const MoeRouting& r, const Tensor& dout,
                            Tensor& dy, Tensor& dprobs);
void moe_permute_probs_forward(const Tensor& probs, const MoeRouting& r, Tensor& out);
void moe_permute_probs_backward(const Tensor& dout, const MoeRouting& r, Tensor& dprobs);
// Per-expert statistics kept on the plan's device, read once when wanted: acc [E + 2] i64 gets
// acc[e] += kept_per_expert[e]; acc[E] += 1 when the plan's deferred check would find an expert
// id outside [0, E), acc[E + 1] += 1 when it would find an expert over its padded capacity
// (both stay 0 for plans checked when they were made).
void accumulate_routing_counts(const MoeRouting& r, Tensor& acc);

namespace detail {
// The one message for an expert index outside [0, E), raised by every backend.
[[noreturn]] void fail_bad_expert_index(const char* op, int64_t t, int64_t j, int64_t value, int64_t num_experts);
// An expert with more kept assignments than the padded capacity.
[[noreturn]] void fail_over_capacity(int64_t expert, int64_t count, int64_t capacity);
}  // namespace detail

// Backends. kept may be undefined (all kept). Sizes come from the tensors and the routing.
namespace cpu {
void capacity_mask(const Tensor& indices, const Tensor& probs, int64_t num_experts, int64_t capacity,
                   DropPolicy policy, Tensor& kept);
void make_moe_routing(const Tensor& indices, const Tensor& kept, MoeRouting& r);
void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out);
void moe_permute_backward(const Tensor& dout, const MoeRouting& r, Tensor& dx);
void moe_unpermute_forward(const Tensor& y, const Tensor& probs, const MoeRouting& r, Tensor& out);
void moe_unpermute_backward(const Tensor& y, const Tensor& probs, const MoeRouting& r, const Tensor& dout,
                            Tensor& dy, Tensor& dprobs);
void moe_permute_probs_forward(const Tensor& probs, const MoeRouting& r, Tensor& out);
void moe_permute_probs_backward(const Tensor& dout, const MoeRouting& r, Tensor& dprobs);
}  // namespace cpu
namespace cuda {
void capacity_mask(const Tensor& indices, const Tensor& probs, int64_t num_experts, int64_t capacity,
                   DropPolicy policy, Tensor& kept);
// copy_counts false: no host copy (the caller made sure num_rows is known without it).
void make_moe_routing(const Tensor& indices, const Tensor& kept, MoeRouting& r, bool copy_counts);
void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out);
void moe_permute_backward(const Tensor& dout, const MoeRouting& r, Tensor& dx);
void moe_unpermute_forward(const Tensor& y, const Tensor& probs, const MoeRouting& r, Tensor& out);
void moe_unpermute_backward(const Tensor& y, const Tensor& probs, const MoeRouting& r, const Tensor& dout,
                            Tensor& dy, Tensor& dprobs);
void moe_permute_probs_forward(const Tensor& probs, const MoeRouting& r, Tensor& out);
void moe_permute_probs_backward(const Tensor& dout, const MoeRouting& r, Tensor& dprobs);
void accumulate_routing_counts(const MoeRouting& r, Tensor& acc);
}  // namespace cuda

}  // namespace moecore::ops
