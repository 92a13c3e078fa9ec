#include "moecore/model/attention_block.h"

#include <cmath>

#include "moecore/ops/attention.h"
#include "moecore/ops/rope.h"

namespace moecore {

AttentionBlock::AttentionBlock(ParamStore& store, const std::string& prefix, const ModelConfig& cfg)
    : heads_(cfg.num_attention_heads),
      kv_heads_(cfg.kv_heads()),
      head_dim_(cfg.head_dim()),
      qk_norm_(cfg.qk_layernorm),
      rope_(cfg.position_embedding_type == "rope"),
      rotary_base_(cfg.rotary_base) {
  const int64_t h = cfg.hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  const bool qkv_bias = cfg.add_bias_linear || cfg.add_qkv_bias;  // --add-qkv-bias: q/k/v only
  q_proj_ = Linear(store, prefix + ".linear_q", h, heads_ * head_dim_, qkv_bias, std);
  k_proj_ = Linear(store, prefix + ".linear_k", h, kv_heads_ * head_dim_, qkv_bias, std);
  v_proj_ = Linear(store, prefix + ".linear_v", h, kv_heads_ * head_dim_, qkv_bias, std);
  o_proj_ = Linear(store, prefix + ".linear_proj", heads_ * head_dim_, h, cfg.add_bias_linear, out_std);
  if (qk_norm_) {
    q_norm_ = Norm(store, prefix + ".q_layernorm", head_dim_, cfg.rmsnorm, cfg.norm_epsilon);
    k_norm_ = Norm(store, prefix + ".k_layernorm", head_dim_, cfg.rmsnorm, cfg.norm_epsilon);
  }
}

Tensor AttentionBlock::forward(const Tensor& x, int64_t batch, Ctx& ctx) const {
  const int64_t tokens = x.size(0), seq = tokens / batch;
  Tensor q = q_proj_.forward(x, ctx.q), k = k_proj_.forward(x, ctx.k), v = v_proj_.forward(x, ctx.v);
  if (qk_norm_) {
    q = q_norm_.forward(q.view({tokens * heads_, head_dim_}), ctx.q_norm);
    k = k_norm_.forward(k.view({tokens * kv_heads_, head_dim_}), ctx.k_norm);
  }
  q = q.view({batch, seq, heads_, head_dim_});
  k = k.view({batch, seq, kv_heads_, head_dim_});
  v = v.view({batch, seq, kv_heads_, head_dim_});
  if (rope_) {
    ops::rope_forward(q, q, rotary_base_);
    ops::rope_forward(k, k, rotary_base_);
  }
  Tensor out = Tensor::empty(q.shape(), x.dtype(), x.device());
  Tensor lse = Tensor::empty({batch, heads_, seq}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, x.device());
  ops::attention_forward(q, k, v, 1.0 / std::sqrt(static_cast<double>(head_dim_)), out, lse);
  ctx.core_q = q;
  ctx.core_k = k;
  ctx.core_v = v;
  ctx.core_out = out;
  ctx.core_lse = lse;
  return o_proj_.forward(out.view({tokens, heads_ * head_dim_}), ctx.o);
}

Tensor AttentionBlock::backward(const Tensor& dy, int64_t batch, Ctx& ctx) const {
  const int64_t tokens = dy.size(0);
  Tensor dout = o_proj_.backward(dy, ctx.o).view(ctx.core_out.shape());
  Tensor dq = Tensor::empty(ctx.core_q.shape(), dy.dtype(), dy.device());
  Tensor dk = Tensor::empty(ctx.core_k.shape(), dy.dtype(), dy.device());
  Tensor dv = Tensor::empty(ctx.core_v.shape(), dy.dtype(), dy.device());
  ops::attention_backward(ctx.core_q, ctx.core_k, ctx.core_v, ctx.core_out, ctx.core_lse, dout,
                          1.0 / std::sqrt(static_cast<double>(head_dim_)), dq, dk, dv);
  ctx.core_q = ctx.core_k = ctx.core_v = ctx.core_out = ctx.core_lse = Tensor();
  if (rope_) {
    ops::rope_backward(dq, dq, rotary_base_);
    ops::rope_backward(dk, dk, rotary_base_);
  }
  Tensor dq2 = dq.view({tokens * heads_, head_dim_}), dk2 = dk.view({tokens * kv_heads_, head_dim_});
  if (qk_norm_) {
    dq2 = q_norm_.backward(dq2, ctx.q_norm);
    dk2 = k_norm_.backward(dk2, ctx.k_norm);
  }
  Tensor dx = q_proj_.backward(dq2.view({tokens, heads_ * head_dim_}), ctx.q);
  add_into(dx, k_proj_.backward(dk2.view({tokens, kv_heads_ * head_dim_}), ctx.k));
  add_into(dx, v_proj_.backward(dv.view({tokens, kv_heads_ * head_dim_}), ctx.v));
  (void)batch;
  return dx;
}

}  // namespace moecore
