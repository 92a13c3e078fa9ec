#include "moecore/model/mla_attention.h"

#include <cmath>

#include "moecore/core/memory_categories.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/rope.h"

namespace moecore {

MlaAttention::MlaAttention(ParamStore& store, const std::string& prefix, const ModelConfig& cfg,
                           const DenseParallel& par)
    : par_(par),
      mla_(cfg.mla),
      heads_(cfg.num_attention_heads / par.tp_size()),
      latent_norms_(cfg.qk_layernorm),
      recompute_(cfg.mla.recompute_up_proj),
      recompute_core_(cfg.recompute.core_attn),
      rotary_base_(cfg.rotary_base),
      rope_scaling_(cfg.rope_scaling) {
  const int64_t tp = par.tp_size(), h = cfg.hidden_size, n = cfg.num_attention_heads;
  MC_CHECK(n % tp == 0, "--num-attention-heads ", n, " must divide by --tensor-model-parallel-size ", tp);
  MC_CHECK(!par.overlap(), "--tp-comm-overlap with --multi-latent-attention is not available in this version");
  MC_CHECK(!recompute_ || !par.cp, "--recompute-modules mla_up_proj with --context-parallel-size ", par.cp_size(),
           " is not available in this version");
  if (cfg.rope_yarn) mscale_ = ops::yarn_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim);
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  const bool bias = cfg.add_bias_linear;
  const LinearSplit column{tp > 1 ? LinearSplit::Column : LinearSplit::None, tp, par.tp_rank(), false};
  const LinearSplit row{tp > 1 ? LinearSplit::Row : LinearSplit::None, tp, par.tp_rank(), false};
  const int64_t d = mla_.q_head_dim(), kv_width = mla_.qk_head_dim + mla_.v_head_dim;
  std::vector<Param*> replicated;
  if (mla_.q_lora_rank > 0) {
    q_down_ = Linear(store, prefix + ".linear_q_down_proj", h, mla_.q_lora_rank, bias, std);
    if (latent_norms_) q_norm_ = Norm(store, prefix + ".q_layernorm", mla_.q_lora_rank, cfg.rmsnorm, cfg.norm_epsilon);
    q_up_ = Linear(store, prefix + ".linear_q_up_proj", mla_.q_lora_rank, n * d, bias, std, nullptr, column);
    replicated = {q_down_.weight, q_down_.bias, q_norm_.weight, q_norm_.bias};
  } else {
    q_up_ = Linear(store, prefix + ".linear_q_proj", h, n * d, bias, std, nullptr, column);
  }
  kv_down_ = Linear(store, prefix + ".linear_kv_down_proj", h, mla_.kv_lora_rank + mla_.qk_pos_emb_head_dim, bias, std);
  if (latent_norms_) kv_norm_ = Norm(store, prefix + ".kv_layernorm", mla_.kv_lora_rank, cfg.rmsnorm, cfg.norm_epsilon);
  kv_up_ = Linear(store, prefix + ".linear_kv_up_proj", mla_.kv_lora_rank, n * kv_width, bias, std, nullptr, column);
  o_proj_ = Linear(store, prefix + ".linear_proj", n * mla_.v_head_dim, h, bias, out_std, nullptr, row);
  // Replicated over TP, back-propagated from this rank's heads only: gradients summed over TP.
  for (Param* p : {kv_down_.weight, kv_down_.bias, kv_norm_.weight, kv_norm_.bias}) replicated.push_back(p);
  for (Param* p : replicated)
    if (p && tp > 1) p->tp_partial_grad = true;
}

double MlaAttention::scale() const {
  return mscale_ * mscale_ / std::sqrt(static_cast<double>(mla_.q_head_dim()));
}

void MlaAttention::rotate(Tensor& t, bool inverse, int64_t position_offset) const {
  auto apply = [&](Tensor& part, int64_t start) {
    if (inverse) {
      ops::rope_backward(part, part, rotary_base_, rope_scaling_, start);
    } else {
      ops::rope_forward(part, part, rotary_base_, rope_scaling_, start);
    }
  };
  if (!par_.cp) {
    apply(t, position_offset);
    return;
  }
  const int64_t c = t.size(1) / 2;
  for (int i = 0; i < 2; ++i) {  // this rank's two chunks at their global positions
    Tensor chunk = seq_range(t, i * c, (i + 1) * c);
    apply(chunk, cp_chunk_start(c, par_.cp_size(), par_.cp_rank(), i));
    seq_assign(t, i * c, chunk);
  }
}

void MlaAttention::up_project(const Tensor& q_latent, const Tensor& kv_latent, const Tensor& k_pe, int64_t batch,
                              Linear::Ctx& q_ctx, Linear::Ctx& kv_ctx, Tensor& q, Tensor& k, Tensor& v) const {
  q = q_up_.forward(q_latent, q_ctx);
  assemble(q, kv_up_.forward(kv_latent, kv_ctx), k_pe, batch, 0, k, v);
}

void MlaAttention::assemble(Tensor& q, const Tensor& kv, const Tensor& k_pe, int64_t batch, int64_t position_offset,
                            Tensor& k, Tensor& v) const {
  const int64_t tokens = kv.size(0), seq = tokens / batch, qk = mla_.qk_head_dim, r = mla_.qk_pos_emb_head_dim;
  const int64_t d = qk + r, dv = mla_.v_head_dim;
  // RoPE on each head's last r query channels, in place.
  Tensor q_rows = q.view({tokens * heads_, d});
  Tensor q_pe = q_rows.slice(1, qk, d).contiguous().view({batch, seq, heads_, r});
  rotate(q_pe, false, position_offset);
  q_rows.slice(1, qk, d).copy_from(q_pe.view({tokens * heads_, r}));
  q = q.view({batch, seq, heads_, d});
  // k = [k_nope_h, k_pe] per head; v_h.
  const Tensor kv3 = kv.view({tokens, heads_, qk + dv});
  k = Tensor::empty({batch, seq, heads_, d}, kv.dtype(), kv.device());
  Tensor k3 = k.view({tokens, heads_, d});
  k3.slice(2, 0, qk).copy_from(kv3.slice(2, 0, qk));
  const Tensor pe = k_pe.view({tokens, 1, r});
  for (int64_t j = 0; j < heads_; ++j) k3.slice(1, j, j + 1).slice(2, qk, d).copy_from(pe);
  v = kv3.slice(2, qk, qk + dv).contiguous().view({batch, seq, heads_, dv});
}

Tensor MlaAttention::forward_cached(const Tensor& x, int64_t first_row, const std::vector<int64_t>& start,
                                    Tensor& k_cache, Tensor& v_cache) const {
  MC_CHECK(!par_.cp && par_.tp_size() == 1, "cached attention (generation) runs on one rank: no tensor or context parallelism");
  const int64_t rows = static_cast<int64_t>(start.size()), tokens = x.size(0), seq = tokens / rows;
  const int64_t max_len = k_cache.size(1), kl = mla_.kv_lora_rank, r = mla_.qk_pos_emb_head_dim;
  const int64_t d = mla_.q_head_dim(), dv = mla_.v_head_dim;
  MC_CHECK(rows > 0 && seq * rows == tokens && first_row >= 0 && first_row + rows <= k_cache.size(0),
           "forward_cached: ", tokens, " tokens for rows [", first_row, ", ", first_row + rows, ") of a cache of ",
           k_cache.size(0), " rows");
  Linear::Ctx lc;
  Norm::Ctx nc;
  Tensor q_latent = x;
  if (mla_.q_lora_rank > 0) {
    q_latent = q_down_.forward(x, lc);
    if (latent_norms_) q_latent = q_norm_.forward(q_latent, nc);
  }
  const Tensor kv_a = kv_down_.forward(x, lc);
  Tensor kv_latent = kv_a.slice(1, 0, kl).contiguous();
  if (latent_norms_) kv_latent = kv_norm_.forward(kv_latent, nc);
  const Tensor q_all = q_up_.forward(q_latent, lc), kv_all = kv_up_.forward(kv_latent, lc);
  Tensor out = Tensor::empty({rows, seq, heads_, dv}, x.dtype(), x.device());
  const DType lse_dt = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  for (int64_t i = 0; i < rows; ++i) {  // each row at its own positions
    const int64_t pos = start[static_cast<size_t>(i)], keys = pos + seq;
    MC_CHECK(pos >= 0 && keys <= max_len, "forward_cached: positions [", pos, ", ", keys, ") beyond the cache's ", max_len);
    Tensor q = q_all.slice(0, i * seq, (i + 1) * seq), k, v;
    Tensor k_pe = kv_a.slice(0, i * seq, (i + 1) * seq).slice(1, kl, kl + r).contiguous().view({1, seq, 1, r});
    rotate(k_pe, false, pos);
    assemble(q, kv_all.slice(0, i * seq, (i + 1) * seq), k_pe, 1, pos, k, v);
    const Tensor k_row = k_cache.slice(0, first_row + i, first_row + i + 1).view({max_len, heads_, d});
    const Tensor v_row = v_cache.slice(0, first_row + i, first_row + i + 1).view({max_len, heads_, dv});
    k_row.slice(0, pos, keys).view(k.shape()).copy_from(k);
    v_row.slice(0, pos, keys).view(v.shape()).copy_from(v);
    Tensor out_i = out.slice(0, i, i + 1), lse = Tensor::empty({1, heads_, seq}, lse_dt, x.device());
    ops::attention_forward(q, k_row.slice(0, 0, keys).view({1, keys, heads_, d}),
                                    v_row.slice(0, 0, keys).view({1, keys, heads_, dv}), scale(), out_i, lse);
  }
  return o_proj_.forward(out.view({tokens, heads_ * dv}), lc);
}

Tensor MlaAttention::forward(const Tensor& x_local, int64_t batch, Ctx& ctx) const {
  const Tensor x = par_.enter_forward(x_local, batch);
  const int64_t tokens = x.size(0), seq = tokens / batch, kl = mla_.kv_lora_rank, r = mla_.qk_pos_emb_head_dim;
  Tensor q_latent = x;
  if (mla_.q_lora_rank > 0) {
    q_latent = q_down_.forward(x, ctx.q_down);
    if (latent_norms_) q_latent = q_norm_.forward(q_latent, ctx.q_norm);
  }
  const Tensor kv_a = kv_down_.forward(x, ctx.kv_down);
  Tensor kv_latent = kv_a.slice(1, 0, kl).contiguous();
  if (latent_norms_) kv_latent = kv_norm_.forward(kv_latent, ctx.kv_norm);
  Tensor k_pe = kv_a.slice(1, kl, kl + r).contiguous().view({batch, seq, 1, r});
  rotate(k_pe, false, 0);
  Tensor q, k, v;
  up_project(q_latent, kv_latent, k_pe, batch, ctx.q_up, ctx.kv_up, q, k, v);
  const Tensor out = core_attention_forward(par_.cp, q, k, v, scale(), ctx.core);
  if (recompute_) {  // rebuilt in the backward from the latents (kept by the up projections' ctx)
    ctx.k_pe = k_pe;
    ctx.core.q = ctx.core.k = ctx.core.v = Tensor();
  }
  const MemoryCategoryScope module(ActivationModule::kAttnProj);
  const Tensor y = o_proj_.forward(out.view({tokens, heads_ * mla_.v_head_dim}), ctx.o);
  if (recompute_core_) {  // --recompute-modules core_attn: rebuilt in the backward
    core_attention_drop_output(ctx.core);
    ctx.o.x = Tensor();
  }
  return par_.exit_forward(y, batch);
}

Tensor MlaAttention::backward(const Tensor& dy_local, int64_t batch, Ctx& ctx) const {
  const Tensor dy = par_.exit_backward(dy_local, batch);
  const int64_t tokens = dy.size(0), seq = tokens / batch, qk = mla_.qk_head_dim, r = mla_.qk_pos_emb_head_dim;
  const int64_t d = qk + r, dv_dim = mla_.v_head_dim, kl = mla_.kv_lora_rank;
  if (recompute_) {  // q, k, v first: the core_attn rerun below reads them
    Linear::Ctx q_ctx, kv_ctx;
    up_project(ctx.q_up.x, ctx.kv_up.x, ctx.k_pe, batch, q_ctx, kv_ctx, ctx.core.q, ctx.core.k, ctx.core.v);
    ctx.k_pe = Tensor();
  }
  if (recompute_core_) {
    const MemoryCategoryScope module(ActivationModule::kCoreAttn);
    ctx.o.x = core_attention_rerun(par_.cp, scale(), ctx.core).view({tokens, heads_ * dv_dim});
  }
  const Tensor dout = o_proj_.backward(dy, ctx.o).view({batch, seq, heads_, dv_dim});
  Tensor dq, dk, dv;
  core_attention_backward(par_.cp, dout, scale(), ctx.core, dq, dk, dv);
  const Device dev = dy.device();
  const DType dt = dy.dtype();
  // Queries: RoPE backward on each head's last r channels, then the projections.
  Tensor dq_rows = dq.view({tokens * heads_, d});
  Tensor dq_pe = dq_rows.slice(1, qk, d).contiguous().view({batch, seq, heads_, r});
  rotate(dq_pe, true, 0);
  dq_rows.slice(1, qk, d).copy_from(dq_pe.view({tokens * heads_, r}));
  Tensor dx = q_up_.backward(dq.view({tokens, heads_ * d}), ctx.q_up);
  if (mla_.q_lora_rank > 0) {
    if (latent_norms_) dx = q_norm_.backward(dx, ctx.q_norm);
    dx = q_down_.backward(dx, ctx.q_down);
  }
  // Keys and values: [dk_nope_h, dv_h] per head into the up projection; the shared RoPE key's
  // gradient sums over the heads (in fp32 for bf16).
  const Tensor dk3 = dk.view({tokens, heads_, d});
  Tensor dkv = Tensor::empty({tokens, heads_, qk + dv_dim}, dt, dev);
  dkv.slice(2, 0, qk).copy_from(dk3.slice(2, 0, qk));
  dkv.slice(2, qk, qk + dv_dim).copy_from(dv.view({tokens, heads_, dv_dim}));
  const DType sum_dt = dt == DType::BF16 ? DType::F32 : dt;
  Tensor dk_pe = Tensor::zeros({tokens, r}, sum_dt, dev);
  for (int64_t j = 0; j < heads_; ++j) {
    Tensor part = dk3.slice(1, j, j + 1).slice(2, qk, d).contiguous().view({tokens, r});
    ops::add(dk_pe, sum_dt == dt ? part : ops::cast_to(part, sum_dt), dk_pe);
  }
  if (sum_dt != dt) dk_pe = ops::cast_to(dk_pe, dt);
  dk_pe = dk_pe.view({batch, seq, 1, r});
  rotate(dk_pe, true, 0);
  Tensor dkv_latent = kv_up_.backward(dkv.view({tokens, heads_ * (qk + dv_dim)}), ctx.kv_up);
  if (latent_norms_) dkv_latent = kv_norm_.backward(dkv_latent, ctx.kv_norm);
  Tensor dkv_a = Tensor::empty({tokens, kl + r}, dt, dev);
  dkv_a.slice(1, 0, kl).copy_from(dkv_latent);
  dkv_a.slice(1, kl, kl + r).copy_from(dk_pe.view({tokens, r}));
  kv_down_.backward_add(dkv_a, ctx.kv_down, dx);
  return par_.enter_backward(dx, batch);
}

}  // namespace moecore
