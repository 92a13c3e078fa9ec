// Token dispatch and combine for the MoE layer, on one rank or over an expert-parallel group.
//
// Notation: T local tokens, k = top-k, E experts in all, EP ranks in the expert-parallel group,
// L = E / EP local experts; rank r owns experts [r*L, (r+1)*L) (MOE-REFERENCE.md). The router
// runs on every rank for its own T tokens; indices [T, k] hold GLOBAL expert ids.
//
//   dispatch(x, indices, kept, pad)   x [T, H] -> expert_in [rows, H], grouped by local expert
//                                     (Ctx::local_rows gives the L experts' rows)
//   combine(expert_out, probs)        expert_out [rows, H] -> out [T, H]: each token's kept
//                                     assignments weighted by probs [T, k] and summed (probs
//                                     undefined: the experts applied them, a plain sum)
//   combine_backward(dout)            -> d_expert_out [rows, H] and dprobs [T, k] (undefined
//                                     when combine had no probs)
//   dispatch_probs(probs)             probs [T, k] -> [rows, 1]: each expert_in row's probability
//                                     (for experts that apply it, e.g. the weighted SwiGLU)
//   dispatch_probs_backward(d_rows)   [rows, 1] -> dprobs [T, k] (ETP partials summed)
//   dispatch_backward(d_expert_in)    -> dx [T, H]
// Dispatch's backward is a combine and combine's a dispatch: the plan made in dispatch() is kept
// in the Ctx for the backward (nothing is recomputed, no routing is repeated).
//
// Types (Megatron's --moe-token-dispatcher-type):
//   none (EP = 1)  permute by expert (ops::moe_permute_forward), unpermute with probs.
//   alltoall       permute locally by global expert -> all-to-all-v over EP (rank r sends the
//                  rows of rank s's experts to s; per-(source, expert) counts come from an
//                  all-gather of every rank's [E] device counts, read back once: the
//                  dispatch's one host wait without ETP, capacity dropping or padding)
//                  -> sort the received chunks from
//                  (source, local expert) order to (local expert, source) order. Combine is
//                  the exact reverse: unsort, all-to-all-v back, unpermute with probs.
//                  The sort is itself a permutation plan (ops::make_moe_routing over the L local
//                  experts with one assignment per received row), so it runs on either device.
//   allgather      all-gather x, indices, probs and kept over EP -> permute the EP*T gathered
//                  tokens for the L local experts only -> experts -> unpermute with probs into
//                  [EP*T, H] partial sums -> reduce-scatter (sum) back to [T, H]. Backward:
//                  all-gather dout; dx and dprobs reduce-scatter (each entry is non-zero on the
//                  rank that owns its expert).
// Expert tensor parallelism (ETP ranks share the same experts, each holding a slice of every
// expert's FFN): alltoall runs as above over EP, then all-gathers the received rows over ETP
// (variable counts: every ETP rank computes its slice for all of them) and sorts them by local
// expert again; combine reduce-scatters the partial outputs back over ETP (summed in ETP rank
// order), then continues as above. allgather gathers over the ETP x EP group instead of EP and
// its reduce-scatter sums the ETP partials with the other experts' outputs.
// Capacity: kept [T, k] is decided on each rank for its own tokens before dispatch. pad > 0
// (--moe-pad-expert-input-to-capacity) gives every (source rank, expert) chunk exactly pad rows,
// so a local expert receives EP * pad rows.
// A rank may send or receive no rows at all; that works (zero-count all-to-all entries).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/core/host_transfer.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/permute.h"

namespace moecore {

enum class DispatcherType { AllGather, AllToAll };
const char* dispatcher_name(DispatcherType t);

// Timers for the share of a step spent in dispatch communication (issue: scaling runs). With
// MOECORE_COMM_TIMERS=1 in the environment every dispatcher collective is bracketed by device
// synchronisations and its wall time accumulated (which serialises the step: for measurement
// runs only); a barrier of the collective's group before it separates the time spent waiting
// for the group's slowest rank to arrive from the collective itself.
bool dispatch_timers_enabled();
struct DispatchCommTime {
  double seconds = 0;       // waiting + the collectives
  // Of which waiting for the group's slowest rank: an upper bound, as it includes the barrier's
  // own latency (on NCCL a one-element all-reduce, some microseconds per collective).
  double wait_seconds = 0;
};
// The time since the last call (then reset); zeros when the timers are off.
DispatchCommTime take_dispatch_comm_time();

class TokenDispatcher {
 public:
  TokenDispatcher() = default;
  // ep: the expert-parallel communicator, or null for one rank; etp: the expert-tensor-parallel
  // group and tp_ep the ETP x EP group (both null without ETP).
  TokenDispatcher(comm::Communicator* ep, DispatcherType type, int64_t num_experts, comm::Communicator* etp = nullptr,
                  comm::Communicator* tp_ep = nullptr);

  struct Ctx {
    ops::MoeRouting routing;         // the permutation on this rank (local or gathered tokens)
    ops::MoeRouting sort;            // alltoall: received rows -> local-expert order
    std::vector<int64_t> send_rows, recv_rows;  // alltoall: rows per EP rank
    Tensor probs;                    // the combine's probs (allgather: gathered, [EP*T, k]); may be undefined
    Tensor unpermute_in;             // with probs: the rows the unpermute read (for dprobs)
    ops::ExpertRows local_rows;      // rows per local expert of expert_in (host counts may be absent)
    int64_t tokens = 0, topk = 0;
    ops::MoeRouting etp_sort;           // ETP: gathered rows (ETP rank-major) -> local-expert order
    std::vector<int64_t> etp_rows;      // ETP: rows each ETP rank contributed
  };

  // device_rows: the caller's expert GEMMs take device offsets (ops::grouped_gemm_device_rows);
  // on one rank without ETP the plan's counts then stay on the device (ctx.local_rows.host empty).
  Tensor dispatch(const Tensor& x, const Tensor& indices, const Tensor& kept, int64_t pad, Ctx& ctx,
                  bool device_rows = false) const;
  Tensor combine(const Tensor& expert_out, const Tensor& probs, Ctx& ctx) const;
  void combine_backward(const Tensor& dout, Ctx& ctx, Tensor& d_expert_out, Tensor& dprobs) const;
  // After dispatch(), on the same Ctx; probs f32 (f64 on the CPU).
  Tensor dispatch_probs(const Tensor& probs, Ctx& ctx) const;
  Tensor dispatch_probs_backward(const Tensor& d_rows, Ctx& ctx) const;
  Tensor dispatch_backward(const Tensor& d_expert_in, Ctx& ctx) const;

  int64_t local_experts() const { return local_experts_; }
  int64_t first_expert() const { return first_expert_; }

 private:
  Tensor all_to_all_rows(const Tensor& in, const std::vector<int64_t>& send, const std::vector<int64_t>& recv) const;
  Tensor gather_rows(const Tensor& in) const;          // [T, ...] -> [EP*T, ...]
  Tensor reduce_scatter_rows(const Tensor& in) const;  // [EP*T, ...] -> [T, ...], summed
  bool allgather_path() const { return type_ == DispatcherType::AllGather && gather_ != nullptr; }
  // ETP stage: rows of every ETP rank, sorted by local expert (first call plans, Ctx keeps it).
  Tensor etp_gather(const Tensor& rows, Ctx& ctx, bool plan) const;
  // Its reverse: partial results back to the ranks that own the rows, summed over ETP.
  Tensor etp_reduce(const Tensor& sorted, Ctx& ctx) const;

  comm::Communicator* ep_ = nullptr;
  comm::Communicator* etp_ = nullptr;
  comm::Communicator* gather_ = nullptr;  // allgather's group: ETP x EP (or EP)
  DispatcherType type_ = DispatcherType::AllToAll;
  int64_t num_experts_ = 0, ep_size_ = 1, ep_rank_ = 0, local_experts_ = 0, first_expert_ = 0, gather_size_ = 1;
  // alltoall: the sort plan's ids go to the device through it (shared: the dispatcher is copied).
  std::shared_ptr<PinnedUploader> uploader_ = std::make_shared<PinnedUploader>();
};

}  // namespace moecore
