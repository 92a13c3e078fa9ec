// GPTModel's training pass in phases (the phased_* and *_layer_phase members of model/gpt.h) for
// the expert-parallel overlap schedule (train/ep_overlap_schedule.h): the operations of
// forward_loss_sum and backward in the same order, cut where an MoE layer's expert-parallel
// collectives start and end, so that another micro-batch's work can run between the pieces.
#include <optional>

#include "moecore/core/memory_categories.h"
#include "moecore/core/step_timers.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/elementwise.h"

namespace moecore {

void GPTModel::phased_forward_begin(const Tensor& tokens, const Tensor& labels, PhasedPass& pass, Ctx& ctx) {
  MC_CHECK(stage_.has_embedding && stage_.has_head && mtp_.empty() && !offload_.any(),
           "the phased training pass (--overlap-moe-expert-parallel-comm) needs the whole model on one pipeline "
           "stage, without MTP or activation offloading");
  const MemoryCategoryScope activations(MemoryCategory::kActivations);
  ctx.layers.resize(static_cast<size_t>(cfg_.num_layers));
  pass.h = forward_input(tokens, labels, ctx, Tensor());
}

void GPTModel::forward_layer_phase(int64_t i, int phase, PhasedPass& pass, Ctx& ctx) {
  const size_t li = static_cast<size_t>(i);
  LayerCtx& lc = ctx.layers[li];
  const MemoryCategoryScope activations(MemoryCategory::kActivations);
  if (phase == 0) {  // decoder_forward's per-layer start
    wait_params(i);
    MC_CHECK(!pass.training || full_recompute_first(i) < 0, "the phased training pass does not recompute whole layers");
    lc.recompute_first = -1;
    lc.recompute_input = lc.mlp_input = Tensor();
    lc.moe_dropped = false;
  }
  if (!cfg_.is_moe(i)) {  // a dense layer: all of it in phase 0
    if (phase == 0) pass.h = layer_forward(i, pass.h, pass.training, pass.rng_seed, ctx.batch, lc, false);
    return;
  }
  MC_CHECK(!releases_norm_outputs(pass.training, false, lc) && !(pass.training && cfg_.recompute.moe),
           "the phased training pass does not recompute the MoE layer or the norms' outputs");
  MoeLayer& moe = moe_[li];
  if (phase == 0) pass.h = layer_attention_forward(li, pass.h, pass.training, ctx.batch, lc, false);
  const TimedRegion timed("moe-forward", 2, pass.h.device());
  switch (phase) {
    case 0: {  // (after attention) the pre-MLP norm, the router and the dispatch's preprocess
      std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kMlpNorm);
      const Tensor normed = mlp_norm_[li].forward(pass.h, lc.mlp_norm);
      module.reset();  // the MoE layer names its parts
      moe.forward_route(normed, ctx.batch, pass.training, pass.rng_seed + 0x9E3779B97F4A7C15ull * (li + 1), lc.moe,
                        pass.moe);
      break;
    }
    case 1:
      moe.forward_dispatch(lc.moe, pass.moe);
      break;
    case 2:
      moe.forward_experts(lc.moe, pass.moe);
      break;
    case 3:
      moe.forward_combine(lc.moe, pass.moe);
      break;
    default: {
      const Tensor out = moe.forward_finish(lc.moe, pass.moe);
      const MemoryCategoryScope module(ActivationModule::kResidual);
      pass.h = add_tensors(pass.h, out);
    }
  }
}

Tensor GPTModel::phased_forward_end(const Tensor& tokens, const Tensor& labels, PhasedPass& pass, Ctx& ctx) {
  const MemoryCategoryScope activations(MemoryCategory::kActivations);
  const Tensor sum = forward_output(pass.h, tokens, labels, pass.training, pass.rng_seed, ctx);
  pass.h = Tensor();
  return sum;
}

void GPTModel::phased_backward_begin(PhasedPass& pass, Ctx& ctx) {
  const MemoryCategoryScope workspace(MemoryCategory::kWorkspace);  // activation gradients, temporaries
  pass.h = backward_output(pass.grad_scale, ctx, Tensor());
}

void GPTModel::backward_layer_phase(int64_t i, int phase, PhasedPass& pass, Ctx& ctx) {
  const size_t li = static_cast<size_t>(i);
  LayerCtx& lc = ctx.layers[li];
  const MemoryCategoryScope workspace(MemoryCategory::kWorkspace);
  Tensor& dh = pass.h;
  if (phase == 0) {
    reload_layer(i, ctx);
    recompute_before_backward(i, ctx);
  }
  if (!cfg_.is_moe(i)) {  // a dense layer: all of it in phase 0
    if (phase != 0) return;
    {
      const TimedRegion timed("mlp-backward", 2, dh.device());
      add_into(dh, mlp_norm_[li].backward(mlp_[li].backward(dh, lc.mlp), lc.mlp_norm));
    }
    layer_attention_backward(li, dh, ctx);
    if (pass.layer_done) pass.layer_done(i);
    return;
  }
  MoeLayer& moe = moe_[li];
  std::optional<TimedRegion> timed(std::in_place, "moe-backward", 2, dh.device());
  switch (phase) {
    case 0:  // the shared expert, the combine's postprocess
      moe.backward_start(dh, lc.moe, pass.moe);
      break;
    case 1:
      moe.backward_combine(lc.moe, pass.moe);
      break;
    case 2:
      moe.backward_experts(lc.moe, pass.moe, pass.delay_wgrad);
      break;
    case 3:
      moe.backward_dispatch(lc.moe, pass.moe);
      break;
    default: {  // the dispatch's preprocess, the router, the pre-MLP norm, then attention
      const Tensor d_normed = moe.backward_finish(pass.grad_scale, lc.moe, pass.moe);
      add_into(dh, mlp_norm_[li].backward(d_normed, lc.mlp_norm));
      timed.reset();
      layer_attention_backward(li, dh, ctx);
      if (pass.layer_done) pass.layer_done(i);
    }
  }
}

void GPTModel::backward_layer_wgrad(int64_t i, Ctx& ctx) {
  if (!cfg_.is_moe(i)) return;
  const MemoryCategoryScope workspace(MemoryCategory::kWorkspace);
  const TimedRegion timed("moe-backward", 2, ctx.layers[static_cast<size_t>(i)].moe.x.device());
  moe_[static_cast<size_t>(i)].backward_wgrad(ctx.layers[static_cast<size_t>(i)].moe);
}

void GPTModel::phased_backward_end(PhasedPass& pass, Ctx& ctx) {
  const MemoryCategoryScope workspace(MemoryCategory::kWorkspace);
  backward_input(pass.h, ctx);
  pass.h = Tensor();
}

}  // namespace moecore
