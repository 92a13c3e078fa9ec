#include "moecore/model/mtp.h"

#include <cmath>

#include "moecore/core/error.h"

namespace moecore {

MtpBatch make_mtp_batch(const Tensor& tokens, const Tensor& labels, int64_t depths) {
  MC_CHECK(tokens.device().is_cpu() && labels.device().is_cpu() && tokens.is_contiguous() && labels.is_contiguous() &&
               tokens.dtype() == DType::I32 && labels.dtype() == DType::I32 && tokens.ndim() == 2 &&
               labels.shape() == tokens.shape() && depths >= 0,
           "make_mtp_batch: tokens and labels must be [batch, seq] i32 on the host, got ", tokens.describe(), " and ",
           labels.describe());
  const int64_t batch = tokens.size(0), seq = tokens.size(1);
  const int32_t* t = tokens.data<int32_t>();
  const int32_t* l = labels.data<int32_t>();
  MtpBatch out;
  for (int64_t k = 1; k <= depths; ++k) {
    std::vector<int32_t> tk(static_cast<size_t>(batch * seq), 0), lk(static_cast<size_t>(batch * seq), -1);
    int64_t count = 0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t s = 0; s + k < seq; ++s) {
        const size_t at = static_cast<size_t>(b * seq + s), from = static_cast<size_t>(b * seq + s + k);
        tk[at] = t[from];
        lk[at] = l[from];
        count += l[from] >= 0 ? 1 : 0;
      }
    out.tokens.push_back(Tensor::from_vector(tk, {batch, seq}));
    out.labels.push_back(Tensor::from_vector(lk, {batch, seq}));
    out.num_labels.push_back(count);
  }
  return out;
}

MtpLayer::MtpLayer(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par,
                   const DenseParallel& dense)
    : hidden_(cfg.hidden_size) {
  const int64_t h = cfg.hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  const std::string layer = prefix + ".transformer_layer";
  enorm_ = Norm(store, prefix + ".enorm", h, cfg.rmsnorm, cfg.norm_epsilon);
  hnorm_ = Norm(store, prefix + ".hnorm", h, cfg.rmsnorm, cfg.norm_epsilon);
  eh_proj_ = Linear(store, prefix + ".eh_proj", 2 * h, h, false, std);
  attn_norm_ = Norm(store, layer + ".input_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
  use_mla_ = cfg.mla.enabled;  // the same attention as the decoder layers
  if (use_mla_)
    mla_ = MlaAttention(store, layer + ".self_attention", cfg, dense);
  else
    attention_ = AttentionBlock(store, layer + ".self_attention", cfg, dense);
  mlp_norm_ = Norm(store, layer + ".pre_mlp_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
  // Megatron builds the MTP layer from the last decoder layer's spec: MoE if that layer is.
  is_moe_ = cfg.is_moe(cfg.num_layers - 1);
  if (is_moe_) {
    MoeParallel moe_par = par;
    moe_par.dense = dense;
    moe_ = MoeLayer(store, layer + ".mlp", cfg, moe_par);
  } else {
    mlp_ = Mlp(store, layer + ".mlp", h, cfg.ffn_hidden_size, cfg.swiglu, cfg.add_bias_linear, std, out_std, dense);
  }
  final_norm = Norm(store, prefix + ".final_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
  // Replicated weights that see only this rank's tokens under sequence parallelism: their
  // gradients are partial sums over TP (eh_proj too: it runs on this rank's tokens).
  if (dense.sp())
    for (Param* p : {enorm_.weight, enorm_.bias, hnorm_.weight, hnorm_.bias, eh_proj_.weight, attn_norm_.weight,
                     attn_norm_.bias, mlp_norm_.weight, mlp_norm_.bias, final_norm.weight, final_norm.bias})
      if (p) p->tp_partial_grad = true;
}

Tensor MtpLayer::forward(const Tensor& h, const Tensor& emb, int64_t batch, bool training, uint64_t rng_seed,
                         Ctx& ctx) {
  MC_CHECK(h.ndim() == 2 && h.size(1) == hidden_ && emb.shape() == h.shape(), "MtpLayer::forward: hidden states ",
           h.describe(), " and embeddings ", emb.describe(), " must both be [tokens, ", hidden_, "]");
  ctx.batch = batch;
  const int64_t n = h.size(0);
  // [enorm(emb), hnorm(h)]: embedding first, as Megatron concatenates them.
  Tensor cat = Tensor::empty({n, 2 * hidden_}, h.dtype(), h.device());
  Tensor left = cat.slice(1, 0, hidden_), right = cat.slice(1, hidden_, 2 * hidden_);
  left.copy_from(enorm_.forward(emb, ctx.enorm));
  right.copy_from(hnorm_.forward(h, ctx.hnorm));
  Tensor x = eh_proj_.forward(cat, ctx.eh_proj);
  const Tensor attn_in = attn_norm_.forward(x, ctx.attn_norm);
  x = add_tensors(x, use_mla_ ? mla_.forward(attn_in, batch, ctx.mla) : attention_.forward(attn_in, batch, ctx.attn));
  const Tensor normed = mlp_norm_.forward(x, ctx.mlp_norm);
  return add_tensors(x, is_moe_ ? moe_.forward(normed, batch, training, rng_seed, ctx.moe)
                                : mlp_.forward(normed, ctx.mlp, batch));
}

void MtpLayer::backward(Tensor dy, double loss_grad_scale, Ctx& ctx, Tensor& dh, Tensor& demb) {
  const Tensor d_normed = is_moe_ ? moe_.backward(dy, loss_grad_scale, ctx.moe) : mlp_.backward(dy, ctx.mlp);
  add_into(dy, mlp_norm_.backward(d_normed, ctx.mlp_norm));
  const Tensor d_attn_in =
      use_mla_ ? mla_.backward(dy, ctx.batch, ctx.mla) : attention_.backward(dy, ctx.batch, ctx.attn);
  add_into(dy, attn_norm_.backward(d_attn_in, ctx.attn_norm));
  const Tensor dcat = eh_proj_.backward(dy, ctx.eh_proj);
  demb = enorm_.backward(dcat.slice(1, 0, hidden_).contiguous(), ctx.enorm);
  dh = hnorm_.backward(dcat.slice(1, hidden_, 2 * hidden_).contiguous(), ctx.hnorm);
  ctx = Ctx{};
}

}  // namespace moecore
