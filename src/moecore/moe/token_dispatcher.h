// The token dispatcher interface (Megatron's MoETokenDispatcher): moves each token's hidden state
// and routing probability to the ranks and rows of its experts, and the expert outputs back.
//
// Notation: T local tokens, k = top-k, E experts in all, EP ranks in the expert-parallel group,
// L = E / EP local experts; rank r owns experts [r*L, (r+1)*L). The router runs on every rank for
// its own T tokens; indices [T, k] hold GLOBAL expert ids.
//
// Phases, each a virtual of the dispatcher (Megatron's names):
//   dispatch_preprocess   local work before the collective: the permutation plan, tokens and
//                         probabilities grouped by destination, the collective's sizes (which
//                         may take a small exchange of per-expert counts and one host read)
//   token_dispatch        ONLY the collective that moves the rows (all-to-all / all-gather)
//   dispatch_postprocess  local work after it: rows sorted by local expert (and, with expert
//                         tensor parallelism in the alltoall dispatcher, the ETP stage, which
//                         needs the sorted rows, as in Megatron's dispatch_postprocess)
//   combine_preprocess -> token_combine -> combine_postprocess: the reverse, expert outputs
//                         [rows, H] -> [T, H]
// and the backward of each: dispatch's backward is a combine and combine's a dispatch. The plan
// made in dispatch_preprocess is kept in the Ctx (the handle) for the combine and both backwards:
// nothing is recomputed, no routing is repeated. A scheduler may run one micro-batch's
// token_dispatch / token_combine (or their backwards) while another micro-batch computes; the
// one-call forms dispatch(), combine(), combine_backward() and dispatch_backward() run the three
// phases back to back.
//
// The probabilities travel with the tokens: dispatch takes x [T, H] and probs [T, k] together.
//   probs_to_rows  each expert row gets its probability ([rows, 1]: the experts apply it, e.g.
//                  the weighted SwiGLU) and the combine is a plain sum of each token's rows;
//                  dispatch_backward takes the rows' probability gradient and returns dprobs [T, k]
//   otherwise      the Ctx keeps probs for the combine, which weights each token's rows by them
//                  (GELU experts); the combine's backward leaves their gradient in the Ctx and
//                  dispatch_backward returns it (reduced over the ranks that the probabilities
//                  were gathered from, for the allgather dispatcher)
// Capacity: kept [T, k] is decided on each rank for its own tokens before dispatch. pad > 0
// (--moe-pad-expert-input-to-capacity) gives every (source rank, expert) chunk exactly pad rows,
// so a local expert receives EP * pad rows. A rank may send or receive no rows at all.
//
// Implementations, one per file (Megatron's --moe-token-dispatcher-type):
//   moe/alltoall_dispatcher.h   all-to-all-v over EP (+ the ETP stage); also the EP = 1 dispatcher
//                               (local permutation only: its collective is skipped)
//   moe/allgather_dispatcher.h  all-gather over EP (or ETP x EP), reduce-scatter back
// make_token_dispatcher picks one. The helpers both use (the timed row collectives, the
// unpermute) are declared at the end of this file.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/moe/dispatch_load.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/permute.h"

namespace moecore {

enum class DispatcherType { AllGather, AllToAll };
const char* dispatcher_name(DispatcherType t);

// FP8 dispatch (FP8 training under EP; issue 28): the hidden-state rows cross the forward
// dispatch's EP collective (the all-to-all, or the all-gather) as E4M3 codes with fp32
// dequantisation factors (ops/fp8_quant.h), about half of bf16's bytes, and are dequantised to
// their dtype on arrival (exactly: every E4M3 value times a factor is a bf16 / f32 value):
//   Tiles      1x128 tiles per row, power-of-two factors [rows, ceil(H/128)] (blockwise recipe).
//              The experts' FP8 input quantiser then finds the same values (codes and factors
//              at most a power of two apart), so their forward GEMMs equal quantising after the
//              dispatch; their wgrad's 128x1 tiles read the dequantised rows (as Transformer
//              Engine's do when FP8 tokens arrive).
//   PerTensor  one factor per sending rank from the current amax of the rows it sends
//              (tensorwise and delayed recipes); the experts' quantiser scales them again.
// Only the forward dispatch travels in FP8: the combine and the backward keep the rows' dtype.
// On one rank (no collective) nothing is quantised.
enum class Fp8Dispatch { Off, Tiles, PerTensor };

// The forward token dispatch's volume on this rank since the last call (then reset): the rows
// (tokens, for allgather) it sent and the bytes of everything its token_dispatch collectives
// sent (rows or FP8 codes and factors, probabilities; allgather: also the routing), its own
// share included. Counted always; the log shows it with MOECORE_COMM_TIMERS=1.
struct DispatchVolume {
  int64_t rows = 0, bytes = 0;
};
DispatchVolume take_dispatch_volume();

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

// Rows and their probabilities as they pass from phase to phase: forward, hidden rows [n, H] and
// probabilities (dispatch's input [T, k], its rows [n, 1]; undefined where none travel);
// backward, their gradients.
struct TokenRows {
  Tensor rows;
  Tensor probs;
};

struct DispatchInput {
  Tensor x;        // [T, H]
  Tensor probs;    // [T, k] f32 (f64 on the CPU); may be undefined (a plain-sum combine)
  Tensor indices;  // [T, k] i32, global expert ids
  Tensor kept;     // [T, k] u8, or undefined: all kept
  int64_t pad = 0;
  bool probs_to_rows = false;  // see the header comment
  // The caller's expert GEMMs take device offsets (ops::grouped_gemm_device_rows): on one rank
  // without ETP the plan's counts then stay on the device (Ctx::local_rows.host empty).
  bool device_rows = false;
  Fp8Dispatch fp8 = Fp8Dispatch::Off;  // see Fp8Dispatch (used where a collective moves the rows)
};

class TokenDispatcher {
 public:
  // The handle: the plan made in dispatch and what the later phases and backwards need.
  struct Ctx {
    ops::MoeRouting routing;         // the permutation on this rank (local or gathered tokens)
    ops::MoeRouting sort;            // alltoall: received rows -> local-expert order
    std::vector<int64_t> send_rows, recv_rows;  // alltoall: rows per EP rank
    std::vector<int64_t> chunk_rows;  // alltoall: received rows per (source rank, local expert), [EP * L]
    std::vector<int64_t> local_counts;  // alltoall: received rows per local expert
    Tensor probs;                    // the combine's probs (allgather: gathered, [EP*T, k]); may be undefined
    Tensor unpermute_in;             // with probs: the rows the unpermute read (for dprobs)
    Tensor dprobs;                   // combine_backward -> dispatch_backward: the combine probs' gradient
    Tensor indices, kept;            // allgather: the routing, gathered by token_dispatch
    int64_t pad = 0;
    bool probs_to_rows = false;
    ops::ExpertRows local_rows;      // rows per local expert of expert_in (host counts may be absent)
    int64_t tokens = 0, topk = 0;
    ops::MoeRouting etp_sort;           // ETP: gathered rows (ETP rank-major) -> local-expert order
    std::vector<int64_t> etp_rows;      // ETP: rows each ETP rank contributed
    Fp8Dispatch fp8 = Fp8Dispatch::Off;
  };

  TokenDispatcher() = default;
  virtual ~TokenDispatcher() = default;

  // Forward phases (see the header comment).
  virtual TokenRows dispatch_preprocess(const DispatchInput& in, Ctx& ctx) const = 0;
  virtual TokenRows token_dispatch(const TokenRows& local, Ctx& ctx) const = 0;
  // -> expert_in [rows, H] grouped by local expert (Ctx::local_rows) and, with probs_to_rows,
  // each row's probability [rows, 1].
  virtual TokenRows dispatch_postprocess(const TokenRows& received, Ctx& ctx) const = 0;
  virtual Tensor combine_preprocess(const Tensor& expert_out, Ctx& ctx) const = 0;
  virtual Tensor token_combine(const Tensor& rows, Ctx& ctx) const = 0;
  virtual Tensor combine_postprocess(const Tensor& rows, Ctx& ctx) const = 0;  // -> [T, H]

  // Backward phases, in the order they run: the combine's (a dispatch of dout [T, H] to the
  // expert rows), then the dispatch's (a combine of the expert rows' gradients to [T, H]).
  virtual Tensor combine_postprocess_backward(const Tensor& dout, Ctx& ctx) const = 0;
  virtual Tensor token_combine_backward(const Tensor& d_rows, Ctx& ctx) const = 0;
  virtual Tensor combine_preprocess_backward(const Tensor& d_rows, Ctx& ctx) const = 0;  // -> d_expert_out
  // d_expert_in: the rows' gradient and (probs_to_rows) the row probabilities' gradient, which
  // may be left undefined to skip the probabilities' backward.
  virtual TokenRows dispatch_postprocess_backward(const TokenRows& d_expert_in, Ctx& ctx) const = 0;
  virtual TokenRows token_dispatch_backward(const TokenRows& d_rows, Ctx& ctx) const = 0;
  virtual TokenRows dispatch_preprocess_backward(const TokenRows& d_rows, Ctx& ctx) const = 0;  // -> dx, dprobs

  // The three phases of each, back to back.
  TokenRows dispatch(const DispatchInput& in, Ctx& ctx) const;
  Tensor combine(const Tensor& expert_out, Ctx& ctx) const;
  // -> d_expert_out; a probability gradient of the combine waits in the Ctx for dispatch_backward.
  Tensor combine_backward(const Tensor& dout, Ctx& ctx) const;
  // -> dx [T, H] and dprobs [T, k] (undefined when no probability took part).
  TokenRows dispatch_backward(const TokenRows& d_expert_in, Ctx& ctx) const;

  int64_t num_experts() const { return num_experts_; }
  int64_t ep_size() const { return ep_size_; }
  int64_t local_experts() const { return local_experts_; }
  int64_t first_expert() const { return first_expert_; }

 protected:
  // ep: the expert-parallel communicator, or null for one rank.
  TokenDispatcher(comm::Communicator* ep, int64_t num_experts);
  comm::Communicator* ep_ = nullptr;
  int64_t num_experts_ = 0, ep_size_ = 1, ep_rank_ = 0, local_experts_ = 0, first_expert_ = 0;
};

// The dispatcher for a layer: allgather when asked for and there is a group to gather over
// (EP, or ETP x EP with expert tensor parallelism), else alltoall (which on one rank is the local
// permutation). etp: the expert-tensor-parallel group and tp_ep the ETP x EP group (both null
// without ETP).
std::shared_ptr<const TokenDispatcher> make_token_dispatcher(DispatcherType type, int64_t num_experts,
                                                             comm::Communicator* ep, comm::Communicator* etp = nullptr,
                                                             comm::Communicator* tp_ep = nullptr);

// Helpers shared by the dispatchers.
namespace dispatch_detail {

// Accumulates the wall time of one collective when MOECORE_COMM_TIMERS=1: the device is
// synchronised, then the group meets at a barrier (the time until its slowest rank arrives is
// the wait), then the collective runs from a common start until this device has finished it.
// Every rank of the group constructs one at the same point (the dispatch collectives are matched
// across the group), so the barriers pair up. ep_collective: the collective is over the EP group,
// so that on a step with armed clocks (moe/dispatch_load.h) its device time is recorded too.
class CommTimer {
 public:
  CommTimer(comm::Communicator& group, bool ep_collective);
  ~CommTimer();
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

 private:
  Device dev_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
  std::optional<CollectiveClock> clock_;  // after the barrier: the collective alone
};

Shape with_rows(const Tensor& t, int64_t rows);
int64_t total(const std::vector<int64_t>& v);
// The combine's last step: each token's rows weighted by probs and summed; without probs (the
// experts applied them) a plain sum of each token's rows, which is permute's backward.
void unpermute(const Tensor& rows, const Tensor& probs, const ops::MoeRouting& r, Tensor& out);
// Adds to the forward dispatch's volume (take_dispatch_volume).
void count_dispatch(int64_t rows, int64_t bytes);
// FP8 dispatch: rows [n, H] (f32 / bf16) -> E4M3 codes [n, H] and factors (Tiles: [n, tiles];
// PerTensor: [1]).
struct Fp8Rows {
  Tensor codes, scale_inv;
};
Fp8Rows quantize_dispatch_rows(const Tensor& rows, Fp8Dispatch mode);
// The arrival: codes [m, H] and factors (Tiles: [m, tiles]; PerTensor: one per chunk, the
// chunks' rows in chunk_rows) -> [m, H] in dtype.
Tensor dequantize_dispatch_rows(const Tensor& codes, const Tensor& scale_inv, Fp8Dispatch mode,
                                const std::vector<int64_t>& chunk_rows, DType dtype);

}  // namespace dispatch_detail

}  // namespace moecore
