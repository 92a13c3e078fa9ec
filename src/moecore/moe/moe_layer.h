// The MoE layer (Megatron's MoELayer): the wiring of router -> token dispatch -> grouped experts
// -> combine, plus optional shared experts. x [T, H] (the normalised hidden states) -> [T, H].
//
//   router:   moe/router.h (TopKRouter): logits, top-k, balancing losses, capacity
//   dispatch: moe/token_dispatcher.h: the tokens and their probabilities to the rows of this
//             rank's experts (over EP / ETP when parallel); the plan is kept for the backward
//   experts:  moe/experts.h (GroupedExperts): grouped GEMMs, weighted SwiGLU or GELU
//   combine:  the rows summed back to their tokens (for GELU experts weighted by the routing
//             probabilities there)
//   shared:   moe/shared_experts.h; with --moe-shared-expert-overlap computed before the dispatch
//             (on a GPU on a side stream, moe/side_stream.h, while the routed tokens travel) and
//             added after the combine, its backward likewise beside the routed backward: the same
//             arithmetic, so the same numbers as without the flag
//   stats:    moe/moe_stats.h (MoeStats): losses, tokens per expert, routing checks, expert bias
//   FP8 dispatch: with FP8 training the tokens cross the EP collective in FP8 (Fp8Dispatch).
//   FP8 padding: with --moe-router-padding-for-fp8 the router's decision is widened before the
//             dispatch (ops/router_padding.h) so every expert's rows are a multiple of 16; the
//             statistics count the router's own assignments, the router's backward reads the
//             probability gradient of its k columns only.
#pragma once

#include <memory>
#include <string>

#include "moecore/moe/side_stream.h"

#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/moe/experts.h"
#include "moecore/moe/moe_parallel.h"
#include "moecore/moe/moe_stats.h"
#include "moecore/moe/router.h"
#include "moecore/moe/shared_experts.h"
#include "moecore/moe/token_dispatcher.h"

namespace moecore {

class MoeLayer {
 public:
  MoeLayer() = default;
  MoeLayer(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par = {});

  struct Ctx {
    Tensor x;  // "moe" input
    TopKRouter::Ctx router;
    // The router's decision, kept for a recomputation (recompute()); batch: the sequences in x.
    TopKRouter::Routing routing;
    int64_t batch = 1;
    TokenDispatcher::Ctx dispatch;
    GroupedExperts::Ctx experts;
    SharedExperts::Ctx shared;
    bool shared_dropped = false;  // --recompute-modules shared_experts: `shared` rebuilt in the backward
  };

  // rng_seed keys the input jitter; batch gives the sequences (seq_aux_loss).
  Tensor forward(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx);
  // Recomputation (--recompute-modules moe, --moe-layer-recompute, --recompute-granularity full):
  // drop_for_recompute frees what the dispatch, the experts and the shared experts saved, and with
  // keep_input false the layer's input too; the router's saved tensors and its decision stay, so
  // the recomputation routes identically and counts no statistics (balancing losses, tokens per
  // expert, global_aux_loss counts) twice. recompute(x) reruns the dispatch (its communication
  // included), the experts, the combine and the shared experts from x (the same input, bit for
  // bit; undefined: the kept one) before backward, and returns the layer's output again.
  void drop_for_recompute(Ctx& ctx, bool keep_input) const;
  Tensor recompute(const Tensor& x, Ctx& ctx);
  // loss_grad_scale: d(total loss)/d(balancing loss), i.e. 1 / num_microbatches.
  Tensor backward(const Tensor& dy, double loss_grad_scale, Ctx& ctx);

  // The forward and the backward in phases (--overlap-moe-expert-parallel-comm: a scheduler runs
  // another micro-batch's work between them, train/ep_overlap_schedule.h). The phases named
  // *_dispatch and *_combine carry the expert-parallel collective only (the dispatcher's
  // token_dispatch / token_combine and their backwards); the others compute. forward() and
  // backward() are these phases back to back: the same operations in the same order.
  //   forward:  forward_route (router, dispatch preprocess) -> forward_dispatch -> forward_experts
  //             (dispatch postprocess, experts, combine preprocess) -> forward_combine ->
  //             forward_finish (combine postprocess, shared expert) = the output
  //   backward: backward_start (shared expert, combine postprocess) -> backward_combine ->
  //             backward_experts (the experts' backward; delay_wgrad: without their weight
  //             gradients, which backward_wgrad adds later) -> backward_dispatch ->
  //             backward_finish (dispatch preprocess, router) = the input gradient
  // Flight holds what passes between the phases; the communicating phases' input stays in it
  // until the next phase (a collective on another stream may still read it).
  struct Flight {
    TokenRows rows;      // the rows between the phases (forward) or their gradients (backward)
    TokenRows comm_in;   // the last collective's input, kept until the next phase
    Tensor out;          // forward_combine's result / backward_combine's
    Tensor shared_out, dx_shared, dy;
    Device dev;
    bool record = true, training = true, drop_shared = false;
    std::unique_ptr<SideStream> side;  // --moe-shared-expert-overlap
  };
  void forward_route(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx, Flight& f);
  void forward_dispatch(Ctx& ctx, Flight& f) const;
  void forward_experts(Ctx& ctx, Flight& f);
  void forward_combine(Ctx& ctx, Flight& f) const;
  Tensor forward_finish(Ctx& ctx, Flight& f) const;
  void backward_start(const Tensor& dy, Ctx& ctx, Flight& f) const;
  void backward_combine(Ctx& ctx, Flight& f) const;
  void backward_experts(Ctx& ctx, Flight& f, bool delay_wgrad) const;
  void backward_dispatch(Ctx& ctx, Flight& f) const;
  void backward_wgrad(Ctx& ctx) const { experts_.backward_wgrad(ctx.dispatch.local_rows, ctx.experts); }
  Tensor backward_finish(double loss_grad_scale, Ctx& ctx, Flight& f);

  // The step's statistics (see MoeStats): finish_step once per optimizer step (expert-bias update,
  // global_aux_loss counts reset) returns them and clears them.
  MoeStepStats finish_step();
  const MoeStepStats& stats() const { return stats_.stats(); }
  void prefetch_stats() { stats_.prefetch(); }
  MoeStepStats& mutable_stats() { return stats_.mutable_stats(); }
  // The device path of the same (MoeStats::pack_step_stats and the rest): no host read.
  Tensor pack_step_stats(comm::Communicator* token_group, comm::Communicator* dp, Device dev) {
    return stats_.pack_step_stats(token_group, dp, dev);
  }
  void finish_step_on_device(Tensor& packed, comm::Communicator* dp) {
    stats_.finish_step_on_device(packed, dp);
    router_.start_step();
  }
  MoeStepStats unpack_step_stats(const std::vector<double>& packed, int64_t micro_batches) const {
    return stats_.unpack_step_stats(packed, micro_batches);
  }
  int64_t step_micro_batches() const { return stats_.micro_batches(); }
  void check_evaluation_routing() const { stats_.check_evaluation_routing(); }

 private:
  // Dispatch, experts, combine and shared experts for the routing in ctx.routing; record: count
  // the routing in the step's statistics (not when recomputing).
  Tensor route_and_compute(const Tensor& x, bool record, bool training, Ctx& ctx);
  // route_and_compute's first phase: the shared expert (overlapped: forked) and the dispatch's
  // preprocess, for the routing in ctx.routing.
  void route_begin(const Tensor& x, Ctx& ctx, Flight& f);
  bool swiglu_ = true, recompute_shared_ = false, shared_overlap_ = false;
  int64_t router_pad_multiple_ = 0;  // > 0: --moe-router-padding-for-fp8
  Fp8Dispatch fp8_dispatch_ = Fp8Dispatch::Off;  // FP8 training: the tokens cross EP in FP8
  std::shared_ptr<const TokenDispatcher> dispatcher_;
  TopKRouter router_;
  GroupedExperts experts_;
  SharedExperts shared_;
  MoeStats stats_;
};

}  // namespace moecore
