// GPTModel's side of --offload-modules (model/activation_offload.h): which saved tensors of a
// decoder layer belong to each offload module, and the calls around the layer's forward and
// backward.
#include "moecore/model/gpt.h"

namespace moecore {

std::vector<OffloadSlot> GPTModel::offload_slots(int64_t i, LayerCtx& lc) {
  std::vector<OffloadSlot> slots;
  // made_by: the module whose forward allocated the tensor (model/gpt.cpp's scopes); a layer's
  // input is the previous layer's residual (the embedding's before the first layer).
  auto add = [&](OffloadModule m, ActivationModule made_by, std::initializer_list<Tensor*> tensors) {
    if (!offload_.has(m)) return;
    for (Tensor* t : tensors) slots.push_back({t, m, made_by});
  };
  const ActivationModule input = i == 0 ? ActivationModule::kEmbedding : ActivationModule::kResidual;
  add(OffloadModule::kAttnNorm, input, {&lc.attn_norm.x});
  add(OffloadModule::kAttnNorm, ActivationModule::kAttnNorm, {&lc.attn_norm.mean, &lc.attn_norm.rstd});
  if (cfg_.mla.enabled) {
    CoreAttentionCtx& c = lc.mla.core;
    add(OffloadModule::kCoreAttn, ActivationModule::kCoreAttn,
        {&c.q, &c.k, &c.v, &c.out, &c.lse, &c.chunk_q[0], &c.chunk_q[1], &c.chunk_out[0], &c.chunk_out[1],
         &c.chunk_lse[0], &c.chunk_lse[1], &c.full_k, &c.full_v});
    add(OffloadModule::kAttnProj, ActivationModule::kCoreAttn, {&lc.mla.o.x});
  } else {
    AttentionBlock::Ctx& a = lc.attn;
    add(OffloadModule::kCoreAttn, ActivationModule::kCoreAttn,
        {&a.core_q, &a.core_k, &a.core_v, &a.core_out, &a.core_lse, &a.chunk_q[0], &a.chunk_q[1], &a.chunk_out[0],
         &a.chunk_out[1], &a.chunk_lse[0], &a.chunk_lse[1], &a.full_k, &a.full_v});
    add(OffloadModule::kAttnProj, ActivationModule::kCoreAttn, {&a.o.x});
  }
  add(OffloadModule::kMlpNorm, ActivationModule::kResidual, {&lc.mlp_norm.x});
  add(OffloadModule::kMlpNorm, ActivationModule::kMlpNorm, {&lc.mlp_norm.mean, &lc.mlp_norm.rstd});
  if (cfg_.is_moe(i)) {
    add(OffloadModule::kExpertFc1, ActivationModule::kMoeDispatch, {&lc.moe.experts.input});
    add(OffloadModule::kMoeAct, ActivationModule::kExpertFc1, {&lc.moe.experts.fc1_out});
    add(OffloadModule::kMoeAct, ActivationModule::kMoeDispatch, {&lc.moe.experts.row_probs});
  }
  return slots;
}

void GPTModel::offload_layer(int64_t i, Ctx& ctx, Device device) {
  if (!offloader_) offloader_ = std::make_shared<ActivationOffloader>(device);
  offloader_->offload(ctx.offload_stash, i, offload_slots(i, ctx.layers[static_cast<size_t>(i)]));
}

void GPTModel::reload_layer(int64_t i, Ctx& ctx) {
  if (!offloader_ || !ctx.offload_stash) return;
  offloader_->reload(ctx.offload_stash, i, offload_slots(i, ctx.layers[static_cast<size_t>(i)]));
}

}  // namespace moecore
