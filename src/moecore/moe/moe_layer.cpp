#include "moecore/moe/moe_layer.h"

#include <optional>

#include "moecore/core/step_timers.h"
#include "moecore/core/memory_categories.h"
#include "moecore/moe/dispatch_load.h"
#include "moecore/moe/side_stream.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/router_padding.h"

namespace moecore {

MoeLayer::MoeLayer(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par)
    : swiglu_(cfg.swiglu),
      recompute_shared_(cfg.recompute.shared_experts),
      shared_overlap_(cfg.moe.shared_expert_overlap && cfg.moe.shared_expert_size > 0),
      router_pad_multiple_(cfg.fp8.enabled && cfg.fp8.router_padding ? ops::kFp8RouterPadMultiple : 0),
      fp8_dispatch_(!cfg.fp8.enabled                                    ? Fp8Dispatch::Off
                    : cfg.fp8.recipe == Fp8Config::Recipe::Blockwise ? Fp8Dispatch::Tiles
                                                                     : Fp8Dispatch::PerTensor),
      dispatcher_(make_token_dispatcher(par.dispatcher, cfg.moe.num_experts, par.ep, par.etp, par.tp_ep)) {
  MC_CHECK(!cfg.add_bias_linear, "MoE experts have no biases yet: add --disable-bias-linear to use --num-experts");
  router_ = TopKRouter(store, prefix, cfg, par);
  experts_ = GroupedExperts(store, prefix, cfg, dispatcher_->local_experts(), dispatcher_->first_expert(), par.etp);
  shared_ = SharedExperts(store, prefix, cfg, par.dense);
  stats_ = MoeStats(prefix, cfg.moe, router_.expert_bias());
}

Tensor MoeLayer::forward(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx) {
  Flight f;
  forward_route(x, batch, training, rng_seed, ctx, f);
  forward_dispatch(ctx, f);
  forward_experts(ctx, f);
  forward_combine(ctx, f);
  return forward_finish(ctx, f);
}

void MoeLayer::forward_route(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx, Flight& f) {
  {
    // --timing-log-level 2: the layer's phases, one after the other.
    const TimedRegion phase("moe-router", 2, x.device());
    // Memory accounting: each phase's saved tensors under its module's name.
    const MemoryCategoryScope module(ActivationModule::kRouter);
    ctx.x = x;
    ctx.batch = batch;
    ctx.routing = router_.forward(x, batch, training, rng_seed, stats_, ctx.router);
  }
  f.record = true;
  f.training = training;
  f.drop_shared = training && recompute_shared_ && shared_.enabled();
  route_begin(x, ctx, f);  // names the later phases' parts
}

Tensor MoeLayer::route_and_compute(const Tensor& x, bool record, bool training, Ctx& ctx) {
  Flight f;
  f.record = record;
  f.training = training;
  route_begin(x, ctx, f);
  forward_dispatch(ctx, f);
  forward_experts(ctx, f);
  forward_combine(ctx, f);
  return forward_finish(ctx, f);
}

void MoeLayer::route_begin(const Tensor& x, Ctx& ctx, Flight& f) {
  const Device dev = x.device();
  f.dev = dev;
  const TopKRouter::Routing& routing = ctx.routing;
  DispatchInput in;
  in.x = x;
  in.probs = ops::cast_to(routing.probs, x.dtype() == DType::F64 ? DType::F64 : DType::F32);
  in.indices = routing.indices;
  in.kept = routing.kept;
  in.pad = routing.pad;
  if (router_pad_multiple_ > 0) {
    MC_CHECK(routing.pad == 0, "--moe-router-padding-for-fp8 with padding to capacity: refused at the flags");
    ops::PaddedRouting padded =
        ops::pad_routing_map(in.indices, in.probs, in.kept, dispatcher_->num_experts(), router_pad_multiple_);
    in.indices = padded.indices;
    in.probs = padded.probs;
    in.kept = padded.kept;
  }
  // SwiGLU experts apply each row's probability in the activation (Megatron's weighted SwiGLU):
  // the probabilities go to the rows, the combine is a plain sum, and their gradient comes from
  // the activation's backward, which reads the rows anyway (the combine's backward would read
  // every expert output row once more for it). GELU experts leave them to the combine.
  in.probs_to_rows = swiglu_;
  // Expert GEMMs that read device offsets (the Hopper kernel for all three) let the plan's
  // counts stay on the device: nothing in this layer then waits for the GPU.
  in.device_rows = experts_.device_rows();
  in.fp8 = fp8_dispatch_;

  // --moe-shared-expert-overlap: the shared expert first, on the side stream (a GPU), so that it
  // computes while the routed tokens travel; its output joins the sum after the combine.
  f.side = std::make_unique<SideStream>();
  if (shared_overlap_) {
    f.side->fork(dev, true);
    const TimedRegion shared_phase("moe-shared-expert", 2, dev);  // the side stream's interval
    const MemoryCategoryScope shared_module(ActivationModule::kSharedExperts);
    f.shared_out = shared_.compute(x, ctx.batch, ctx.shared);
  }
  f.side->leave();

  const TimedRegion phase("moe-dispatch", 2, dev);
  const MemoryCategoryScope module(ActivationModule::kMoeDispatch);
  f.rows = dispatcher_->dispatch_preprocess(in, ctx.dispatch);
}

void MoeLayer::forward_dispatch(Ctx& ctx, Flight& f) const {
  const TimedRegion phase("moe-dispatch", 2, f.dev);
  const MemoryCategoryScope module(ActivationModule::kMoeDispatch);
  f.comm_in = f.rows;
  f.rows = dispatcher_->token_dispatch(f.comm_in, ctx.dispatch);
}

void MoeLayer::forward_experts(Ctx& ctx, Flight& f) {
  const Device dev = f.dev;
  std::optional<TimedRegion> phase(std::in_place, "moe-dispatch", 2, dev);
  std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kMoeDispatch);
  const TokenRows expert_in = dispatcher_->dispatch_postprocess(f.rows, ctx.dispatch);
  f.rows = TokenRows{};
  f.comm_in = TokenRows{};
  const TopKRouter::Routing& routing = ctx.routing;
  if (f.record) stats_.record_routing(ctx.dispatch.routing, routing.indices, routing.kept, routing.pad, f.training);
  // The load-imbalance report (moe/dispatch_load.h): the rows this rank's experts received (over
  // EP the plan's counts are on the host).
  if (f.record && f.training && dispatcher_->ep_size() > 1) {
    int64_t received = 0;
    for (const int64_t c : ctx.dispatch.local_rows.host) received += c;
    add_received_rows(received);
  }

  phase.emplace("moe-experts", 2, dev);
  module.reset();  // the experts name their parts
  const Tensor expert_out = experts_.forward(expert_in.rows, expert_in.probs, ctx.dispatch.local_rows, ctx.experts);

  phase.emplace("moe-combine", 2, dev);
  module.emplace(ActivationModule::kMoeCombine);
  // The expert output outlives the forward only where the combine's probability gradient needs
  // it (the dispatcher's Ctx keeps it then: GELU experts).
  f.rows.rows = dispatcher_->combine_preprocess(expert_out, ctx.dispatch);
}

void MoeLayer::forward_combine(Ctx& ctx, Flight& f) const {
  const TimedRegion phase("moe-combine", 2, f.dev);
  const MemoryCategoryScope module(ActivationModule::kMoeCombine);
  f.comm_in = f.rows;
  f.out = dispatcher_->token_combine(f.comm_in.rows, ctx.dispatch);
}

Tensor MoeLayer::forward_finish(Ctx& ctx, Flight& f) const {
  const Device dev = f.dev;
  std::optional<TimedRegion> phase(std::in_place, "moe-combine", 2, dev);
  std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kMoeCombine);
  Tensor out = dispatcher_->combine_postprocess(f.out, ctx.dispatch);
  f.out = Tensor();
  f.rows = f.comm_in = TokenRows{};
  if (shared_overlap_) {
    f.side->join();
    add_into(out, f.shared_out);  // the sum shared_.forward makes
    f.shared_out = Tensor();
  } else if (shared_.enabled()) {
    phase.emplace("moe-shared-expert", 2, dev);
    module.emplace(ActivationModule::kSharedExperts);
    shared_.forward(ctx.x, ctx.batch, out, ctx.shared);
  }
  if (f.drop_shared) {
    ctx.shared = SharedExperts::Ctx{};
    ctx.shared_dropped = true;
  }
  return out;
}

void MoeLayer::drop_for_recompute(Ctx& ctx, bool keep_input) const {
  if (!keep_input) ctx.x = Tensor();
  ctx.dispatch = TokenDispatcher::Ctx{};
  ctx.experts = GroupedExperts::Ctx{};
  ctx.shared = SharedExperts::Ctx{};
  ctx.shared_dropped = false;  // recompute() rebuilds them with the rest
}

Tensor MoeLayer::recompute(const Tensor& x, Ctx& ctx) {
  if (x.defined()) ctx.x = x;
  MC_CHECK(ctx.x.defined() && ctx.routing.indices.defined(), "MoeLayer::recompute without a forward");
  return route_and_compute(ctx.x, false, true, ctx);
}

Tensor MoeLayer::backward(const Tensor& dy, double loss_grad_scale, Ctx& ctx) {
  Flight f;
  backward_start(dy, ctx, f);
  backward_combine(ctx, f);
  backward_experts(ctx, f, false);
  backward_dispatch(ctx, f);
  return backward_finish(loss_grad_scale, ctx, f);
}

void MoeLayer::backward_start(const Tensor& dy, Ctx& ctx, Flight& f) const {
  const Device dev = dy.device();
  std::optional<TimedRegion> phase;  // --timing-log-level 2: the layer's phases
  f.dev = dev;
  f.dy = dy;
  // --moe-shared-expert-overlap: the shared expert's backward (and its recomputation) on the side
  // stream (a GPU) beside the routed backward's communication; dx joins after the router's.
  f.side = std::make_unique<SideStream>();
  f.side->fork(dev, shared_overlap_);
  if (ctx.shared_dropped) {  // --recompute-modules shared_experts: their forward again (output not needed)
    phase.emplace("moe-shared-expert", 2, dev);
    const MemoryCategoryScope module(ActivationModule::kSharedExperts);  // saved again, under its name
    shared_.compute(ctx.x, ctx.batch, ctx.shared);
    ctx.shared_dropped = false;
  }
  if (shared_.enabled()) {
    phase.emplace("moe-shared-expert-backward", 2, dev);
    f.dx_shared = shared_.backward(dy, ctx.shared);
  }
  phase.reset();
  f.side->leave();

  phase.emplace("moe-combine-backward", 2, dev);
  f.rows.rows = dispatcher_->combine_postprocess_backward(dy, ctx.dispatch);
}

void MoeLayer::backward_combine(Ctx& ctx, Flight& f) const {
  const TimedRegion phase("moe-combine-backward", 2, f.dev);
  f.comm_in = f.rows;
  f.out = dispatcher_->token_combine_backward(f.comm_in.rows, ctx.dispatch);
}

void MoeLayer::backward_experts(Ctx& ctx, Flight& f, bool delay_wgrad) const {
  const Device dev = f.dev;
  std::optional<TimedRegion> phase(std::in_place, "moe-combine-backward", 2, dev);
  const Tensor d_expert_out = dispatcher_->combine_preprocess_backward(f.out, ctx.dispatch);
  f.out = Tensor();
  f.rows = f.comm_in = TokenRows{};

  phase.emplace("moe-experts-backward", 2, dev);
  TokenRows d_expert_in;
  d_expert_in.rows =
      experts_.backward(d_expert_out, ctx.dispatch.local_rows, ctx.experts, d_expert_in.probs, delay_wgrad);
  // Force-balanced routing has no router gradient: the row probabilities' gradient stays here.
  if (ctx.router.forced) d_expert_in.probs = Tensor();

  phase.emplace("moe-dispatch-backward", 2, dev);
  f.rows = dispatcher_->dispatch_postprocess_backward(d_expert_in, ctx.dispatch);
}

void MoeLayer::backward_dispatch(Ctx& ctx, Flight& f) const {
  const TimedRegion phase("moe-dispatch-backward", 2, f.dev);
  f.comm_in = f.rows;
  f.rows = dispatcher_->token_dispatch_backward(f.comm_in, ctx.dispatch);
}

Tensor MoeLayer::backward_finish(double loss_grad_scale, Ctx& ctx, Flight& f) {
  const Device dev = f.dev;
  std::optional<TimedRegion> phase(std::in_place, "moe-dispatch-backward", 2, dev);
  TokenRows d_tokens = dispatcher_->dispatch_preprocess_backward(f.rows, ctx.dispatch);
  f.rows = f.comm_in = TokenRows{};
  // --moe-router-padding-for-fp8: the added assignments' probability gradient is discarded.
  const int64_t topk = ctx.routing.indices.size(1);
  if (d_tokens.probs.defined() && d_tokens.probs.size(1) != topk)
    d_tokens.probs = d_tokens.probs.slice(1, 0, topk).contiguous();

  phase.emplace("moe-router-backward", 2, dev);
  router_.backward(d_tokens.probs, loss_grad_scale, ctx.router, d_tokens.rows);
  f.side->join();
  if (f.dx_shared.defined()) add_into(d_tokens.rows, f.dx_shared);
  f.dx_shared = f.dy = Tensor();
  ctx = Ctx{};
  return d_tokens.rows;
}

MoeStepStats MoeLayer::finish_step() {
  MoeStepStats out = stats_.finish_step();
  router_.start_step();
  return out;
}

}  // namespace moecore
