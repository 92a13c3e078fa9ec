// The attention core shared by the attention blocks: causal attention of this rank's queries
// over the keys, with context parallelism (the CP all-gather of K and V and the reduce-scatter of
// their gradients), for any value head dim Dv (Multi-Latent Attention: D = 192, Dv = 128).
//   q [B, s, Hq, D], k [B, s, Hkv, D], v [B, s, Hkv, Dv]: this rank's tokens (under CP its two
//   chunks of every sequence, tensor_parallel.h), already rotated (RoPE) by the caller.
// Without CP it is ops::attention_forward / backward. With CP each query chunk attends the keys
// before it, gathered from the CP group; dK and dV reduce-scatter back to their owners.
// Saved ("core_attn"): q, k, v, the output and its logsumexp (CP: per query chunk, and the
// gathered K/V).
#pragma once

#include "moecore/model/tensor_parallel.h"

namespace moecore {

struct CoreAttentionCtx {
  Tensor q, k, v, out, lse;
  Tensor chunk_q[2], chunk_out[2], chunk_lse[2], full_k, full_v;  // context parallelism
};

// cp: the context-parallel group (null: one rank). Returns out [B, s, Hq, Dv].
Tensor core_attention_forward(comm::Communicator* cp, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                              CoreAttentionCtx& ctx);
// dout [B, s, Hq, Dv] -> dq, dk, dv of this rank's tokens (before the caller's RoPE backward).
void core_attention_backward(comm::Communicator* cp, const Tensor& dout, double scale, CoreAttentionCtx& ctx,
                             Tensor& dq, Tensor& dk, Tensor& dv);

// --recompute-modules core_attn: drop the output and logsumexp after the forward (q, k, v and, with
// CP, the query chunks and gathered K / V stay) and rebuild them in the backward with the same
// attention ops on the same inputs (the same bits); the rerun returns the output.
void core_attention_drop_output(CoreAttentionCtx& ctx);
Tensor core_attention_rerun(comm::Communicator* cp, double scale, CoreAttentionCtx& ctx);

}  // namespace moecore
