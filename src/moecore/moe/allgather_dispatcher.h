// The allgather token dispatcher (Megatron's MoEAllGatherTokenDispatcher).
//
//   dispatch_preprocess   nothing to compute: the routing is kept for the gather
//   token_dispatch        all-gather x, indices, kept and probs over the group (EP, or ETP x EP
//                         with expert tensor parallelism: every ETP rank then computes its slice
//                         of the FFN for all the gathered tokens)
//   dispatch_postprocess  permute the EP*T gathered tokens for the L local experts only (every
//                         other assignment is "dropped" here); the probabilities to the rows too
//                         when the experts apply them
//   combine_preprocess    unpermute (with probs when the combine applies them) into [EP*T, H]
//                         partial sums
//   token_combine         reduce-scatter (sum) back to [T, H]: each token's outputs from the
//                         ranks that own its experts (and the ETP partials) are summed
// Backward: all-gather dout; dx and dprobs reduce-scatter (each entry is non-zero on the rank
// that owns its expert). The combine's probability gradient (probs applied in the combine) is for
// the gathered probabilities: dispatch_backward reduce-scatters it with dx.
#pragma once

#include "moecore/moe/token_dispatcher.h"

namespace moecore {

class AllGatherDispatcher final : public TokenDispatcher {
 public:
  // ep: the expert-parallel group (null on one rank); gather: EP, or ETP x EP with expert tensor
  // parallelism (not null).
  AllGatherDispatcher(comm::Communicator* ep, int64_t num_experts, comm::Communicator* gather);

  TokenRows dispatch_preprocess(const DispatchInput& in, Ctx& ctx) const override;
  TokenRows token_dispatch(const TokenRows& local, Ctx& ctx) const override;
  TokenRows dispatch_postprocess(const TokenRows& received, Ctx& ctx) const override;
  Tensor combine_preprocess(const Tensor& expert_out, Ctx& ctx) const override;
  Tensor token_combine(const Tensor& rows, Ctx& ctx) const override;
  Tensor combine_postprocess(const Tensor& rows, Ctx& ctx) const override;
  Tensor combine_postprocess_backward(const Tensor& dout, Ctx& ctx) const override;
  Tensor token_combine_backward(const Tensor& d_rows, Ctx& ctx) const override;
  Tensor combine_preprocess_backward(const Tensor& d_rows, Ctx& ctx) const override;
  TokenRows dispatch_postprocess_backward(const TokenRows& d_expert_in, Ctx& ctx) const override;
  TokenRows token_dispatch_backward(const TokenRows& d_rows, Ctx& ctx) const override;
  TokenRows dispatch_preprocess_backward(const TokenRows& d_rows, Ctx& ctx) const override;

 private:
  Tensor gather_rows(const Tensor& in) const;          // [T, ...] -> [G*T, ...]
  Tensor reduce_scatter_rows(const Tensor& in) const;  // [G*T, ...] -> [T, ...], summed
  // Emulation: the gathered expert ids of the other ranks made symmetric to this rank's.
  void symmetric_ids(std::vector<int32_t>& ids) const;

  comm::Communicator* gather_ = nullptr;
  int64_t gather_size_ = 1;
};

}  // namespace moecore
