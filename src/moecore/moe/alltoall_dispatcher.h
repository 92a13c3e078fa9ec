// The alltoall token dispatcher (Megatron's MoEAlltoAllTokenDispatcher), and the dispatcher for
// one rank (no expert-parallel group: the all-to-all is skipped, what remains is the local
// permutation by expert and, with expert tensor parallelism, the ETP stage).
//
//   dispatch_preprocess   permute locally by global expert (ops::moe_permute_forward; the
//                         probabilities likewise, ops::moe_permute_probs_forward, when they go to
//                         the rows); over EP, the per-(source, expert) counts come from an
//                         all-gather of every rank's [E] device counts, read back once (the
//                         dispatch's one host wait without ETP, capacity dropping or padding):
//                         they give the all-to-all's send and receive sizes
//   token_dispatch        all-to-all-v over EP (rank r sends the rows of rank s's experts to s)
//   dispatch_postprocess  sort the received chunks from (source, local expert) order to (local
//                         expert, source) order. The sort is itself a permutation plan
//                         (ops::make_moe_routing over the L local experts with one assignment per
//                         received row), so it runs on either device. Then the ETP stage.
//   combine_*             the exact reverse: ETP stage, unsort, all-to-all-v back, unpermute
//                         (with the probabilities when the combine applies them).
// Expert tensor parallelism (ETP ranks share the same experts, each holding a slice of every
// expert's FFN): after the sort the received rows are all-gathered over ETP (variable counts:
// every ETP rank computes its slice for all of them) and sorted by local expert again; the
// combine reduce-scatters the partial outputs back over ETP (summed in ETP rank order) before the
// unsort. As in Megatron, this ETP exchange belongs to the post/pre-processing (it needs the
// sorted rows): token_dispatch / token_combine carry the EP all-to-all only.
#pragma once

#include <memory>

#include "moecore/core/host_transfer.h"
#include "moecore/moe/token_dispatcher.h"

namespace moecore {

class AllToAllDispatcher final : public TokenDispatcher {
 public:
  // ep: null on one rank; etp: the expert-tensor-parallel group, or null.
  AllToAllDispatcher(comm::Communicator* ep, int64_t num_experts, comm::Communicator* etp);

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
  Tensor all_to_all_rows(const Tensor& in, const std::vector<int64_t>& send, const std::vector<int64_t>& recv) const;
  // Emulation: the gathered [EP, E] counts made symmetric (what rank s sends here = what this rank sends s).
  void symmetric_counts(std::vector<int32_t>& all) const;
  // The received rows (source, local expert) -> (local expert, source), by the Ctx's sort plan.
  Tensor sort_rows(const Tensor& received, Ctx& ctx) const;
  Tensor unsort_rows(const Tensor& sorted, Ctx& ctx) const;
  // ETP stage: rows of every ETP rank, sorted by local expert (first call plans, Ctx keeps it).
  Tensor etp_gather(const Tensor& rows, Ctx& ctx, bool plan) const;
  // Its reverse: partial results back to the ranks that own the rows, summed over ETP.
  Tensor etp_reduce(const Tensor& sorted, Ctx& ctx) const;

  comm::Communicator* etp_ = nullptr;
  // The sort plan's ids go to the device through it (shared: the dispatcher may be copied).
  std::shared_ptr<PinnedUploader> uploader_ = std::make_shared<PinnedUploader>();
};

}  // namespace moecore
