#include "moecore/model/attention_block.h"

#include <cmath>

#include "moecore/core/memory_categories.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/decode_attention.h"
#include "moecore/ops/rope.h"
#include "moecore/model/tensor_parallel.h"

namespace moecore {

AttentionBlock::AttentionBlock(ParamStore& store, const std::string& prefix, const ModelConfig& cfg,
                               const DenseParallel& par)
    : par_(par),
      heads_(cfg.num_attention_heads / par.tp_size()),
      kv_heads_(cfg.kv_heads() / par.tp_size()),
      head_dim_(cfg.head_dim()),
      qk_norm_(cfg.qk_layernorm),
      rope_(cfg.position_embedding_type == "rope"),
      rotary_base_(cfg.rotary_base) {
  const int64_t tp = par.tp_size(), h = cfg.hidden_size;
  recompute_core_ = cfg.recompute.core_attn;
  MC_CHECK(cfg.num_attention_heads % tp == 0 && cfg.kv_heads() % tp == 0, "--num-attention-heads ",
           cfg.num_attention_heads, " and the ", cfg.kv_heads(),
           " query groups (--num-query-groups) must divide by --tensor-model-parallel-size ", tp);
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  const bool qkv_bias = cfg.add_bias_linear || cfg.add_qkv_bias;  // --add-qkv-bias: q/k/v only
  const LinearSplit column{tp > 1 ? LinearSplit::Column : LinearSplit::None, tp, par.tp_rank(), false};
  const LinearSplit row{tp > 1 ? LinearSplit::Row : LinearSplit::None, tp, par.tp_rank(), false};
  const int64_t q_width = cfg.num_attention_heads * head_dim_, kv_width = cfg.kv_heads() * head_dim_;
  q_proj_ = Linear(store, prefix + ".linear_q", h, q_width, qkv_bias, std, nullptr, column);
  k_proj_ = Linear(store, prefix + ".linear_k", h, kv_width, qkv_bias, std, nullptr, column);
  v_proj_ = Linear(store, prefix + ".linear_v", h, kv_width, qkv_bias, std, nullptr, column);
  o_proj_ = Linear(store, prefix + ".linear_proj", q_width, h, cfg.add_bias_linear, out_std, nullptr, row);
  if (qk_norm_) {
    q_norm_ = Norm(store, prefix + ".q_layernorm", head_dim_, cfg.rmsnorm, cfg.norm_epsilon);
    k_norm_ = Norm(store, prefix + ".k_layernorm", head_dim_, cfg.rmsnorm, cfg.norm_epsilon);
    for (Norm* n : {&q_norm_, &k_norm_})
      for (Param* p : {n->weight, n->bias})
        if (p && tp > 1) p->tp_partial_grad = true;  // each rank normalises its own heads
  }
}

double AttentionBlock::scale() const { return 1.0 / std::sqrt(static_cast<double>(head_dim_)); }

Tensor AttentionBlock::forward(const Tensor& x_local, int64_t batch, Ctx& ctx) const {
  const std::vector<Tensor> qkv =
      column_parallel_forward(par_, x_local, batch, {{&q_proj_, &ctx.q}, {&k_proj_, &ctx.k}, {&v_proj_, &ctx.v}});
  const Tensor x = ctx.q.x;  // the gathered input
  const int64_t tokens = x.size(0), seq = tokens / batch;
  Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  if (qk_norm_) {
    q = q_norm_.forward(q.view({tokens * heads_, head_dim_}), ctx.q_norm);
    k = k_norm_.forward(k.view({tokens * kv_heads_, head_dim_}), ctx.k_norm);
  }
  q = q.view({batch, seq, heads_, head_dim_});
  k = k.view({batch, seq, kv_heads_, head_dim_});
  v = v.view({batch, seq, kv_heads_, head_dim_});
  Tensor out;
  if (par_.cp) {
    out = context_parallel_forward(q, k, v, ctx);
  } else {
    if (rope_) {
      ops::rope_forward(q, q, rotary_base_);
      ops::rope_forward(k, k, rotary_base_);
    }
    out = Tensor::empty(q.shape(), x.dtype(), x.device());
    Tensor lse = Tensor::empty({batch, heads_, seq}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, x.device());
    ops::attention_forward(q, k, v, scale(), out, lse);
    ctx.core_q = q;
    ctx.core_k = k;
    ctx.core_v = v;
    ctx.core_out = out;
    ctx.core_lse = lse;
  }
  const MemoryCategoryScope module(ActivationModule::kAttnProj);
  Tensor y = row_parallel_forward(par_, o_proj_, out.view({tokens, heads_ * head_dim_}), batch, ctx.o);
  if (recompute_core_) {  // rebuilt in the backward (CP: from the kept query chunks and gathered K / V)
    ctx.core_out = ctx.core_lse = ctx.o.x = Tensor();
    ctx.chunk_out[0] = ctx.chunk_out[1] = ctx.chunk_lse[0] = ctx.chunk_lse[1] = Tensor();
  }
  return y;
}

Tensor AttentionBlock::backward(const Tensor& dy_local, int64_t batch, Ctx& ctx) const {
  const int64_t tokens = dy_local.size(0) * (par_.sp() ? par_.tp_size() : 1), seq = tokens / batch;
  if (recompute_core_ && par_.cp) {  // --recompute-modules core_attn: the same chunk forwards again
    const MemoryCategoryScope module(ActivationModule::kCoreAttn);
    ctx.o.x = context_parallel_rerun(ctx).view({tokens, heads_ * head_dim_});
  } else if (recompute_core_) {  // --recompute-modules core_attn: the same forward again
    MC_CHECK(ctx.core_q.defined(), "AttentionBlock::backward without a forward");
    const MemoryCategoryScope module(ActivationModule::kCoreAttn);
    ctx.core_out = Tensor::empty(ctx.core_q.shape(), ctx.core_q.dtype(), ctx.core_q.device());
    ctx.core_lse = Tensor::empty({batch, heads_, seq}, ctx.core_q.dtype() == DType::F64 ? DType::F64 : DType::F32,
                                 ctx.core_q.device());
    ops::attention_forward(ctx.core_q, ctx.core_k, ctx.core_v, scale(), ctx.core_out, ctx.core_lse);
    ctx.o.x = ctx.core_out.view({tokens, heads_ * head_dim_});
  }
  Tensor dout = row_parallel_backward(par_, o_proj_, dy_local, batch, ctx.o).view({batch, seq, heads_, head_dim_});
  Tensor dq, dk, dv;
  if (par_.cp) {
    context_parallel_backward(dout, ctx, dq, dk, dv);
  } else {
    dq = Tensor::empty(ctx.core_q.shape(), dout.dtype(), dout.device());
    dk = Tensor::empty(ctx.core_k.shape(), dout.dtype(), dout.device());
    dv = Tensor::empty(ctx.core_v.shape(), dout.dtype(), dout.device());
    ops::attention_backward(ctx.core_q, ctx.core_k, ctx.core_v, ctx.core_out, ctx.core_lse, dout, scale(), dq, dk, dv);
    ctx.core_q = ctx.core_k = ctx.core_v = ctx.core_out = ctx.core_lse = Tensor();
    if (rope_) {
      ops::rope_backward(dq, dq, rotary_base_);
      ops::rope_backward(dk, dk, rotary_base_);
    }
  }
  Tensor dq2 = dq.view({tokens * heads_, head_dim_}), dk2 = dk.view({tokens * kv_heads_, head_dim_});
  if (qk_norm_) {
    dq2 = q_norm_.backward(dq2, ctx.q_norm);
    dk2 = k_norm_.backward(dk2, ctx.k_norm);
  }
  return column_parallel_backward(par_, batch,
                                  {{&q_proj_, dq2.view({tokens, heads_ * head_dim_}), &ctx.q},
                                   {&k_proj_, dk2.view({tokens, kv_heads_ * head_dim_}), &ctx.k},
                                   {&v_proj_, dv.view({tokens, kv_heads_ * head_dim_}), &ctx.v}});
}

Tensor AttentionBlock::forward_cached(const Tensor& x, int64_t first_row, const std::vector<int64_t>& start,
                                      const Tensor& positions, Tensor& k_cache, Tensor& v_cache) const {
  MC_CHECK(!par_.cp && par_.tp_size() == 1, "cached attention (generation) runs on one rank: no tensor or context parallelism");
  const int64_t rows = static_cast<int64_t>(start.size()), tokens = x.size(0), seq = tokens / rows;
  const int64_t max_len = k_cache.size(1);
  MC_CHECK(rows > 0 && seq * rows == tokens && first_row >= 0 && first_row + rows <= k_cache.size(0),
           "forward_cached: ", tokens, " tokens for rows [", first_row, ", ", first_row + rows, ") of a cache of ",
           k_cache.size(0), " rows");
  if (seq == 1 && first_row == 0 && rows == k_cache.size(0) && x.dtype() != DType::F64)
    return forward_decode(x, positions, k_cache, v_cache);
  Linear::Ctx qc, kc, vc, oc;
  Norm::Ctx qn, kn;
  Tensor q = q_proj_.forward(x, qc), k = k_proj_.forward(x, kc), v = v_proj_.forward(x, vc);
  if (qk_norm_) {
    q = q_norm_.forward(q.view({tokens * heads_, head_dim_}), qn);
    k = k_norm_.forward(k.view({tokens * kv_heads_, head_dim_}), kn);
  }
  q = q.view({rows, seq, heads_, head_dim_});
  k = k.view({rows, seq, kv_heads_, head_dim_});
  v = v.view({rows, seq, kv_heads_, head_dim_});
  Tensor out = Tensor::empty(q.shape(), x.dtype(), x.device());
  Tensor lse = Tensor::empty({rows, heads_, seq}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, x.device());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = start[static_cast<size_t>(r)], keys = pos + seq;
    MC_CHECK(pos >= 0 && keys <= max_len, "forward_cached: positions [", pos, ", ", keys, ") beyond the cache's ", max_len);
    Tensor qr = q.slice(0, r, r + 1), kr = k.slice(0, r, r + 1);
    if (rope_) {
      ops::rope_forward(qr, qr, rotary_base_, pos);
      ops::rope_forward(kr, kr, rotary_base_, pos);
    }
    const Shape row_shape{max_len, kv_heads_, head_dim_};
    const Tensor k_row = k_cache.slice(0, first_row + r, first_row + r + 1).view(row_shape);
    const Tensor v_row = v_cache.slice(0, first_row + r, first_row + r + 1).view(row_shape);
    k_row.slice(0, pos, keys).view(kr.shape()).copy_from(kr);
    v_row.slice(0, pos, keys).view(kr.shape()).copy_from(v.slice(0, r, r + 1));
    Tensor out_r = out.slice(0, r, r + 1), lse_r = lse.slice(0, r, r + 1);
    const Shape key_shape{1, keys, kv_heads_, head_dim_};
    ops::attention_forward(qr, k_row.slice(0, 0, keys).view(key_shape), v_row.slice(0, 0, keys).view(key_shape), scale(),
                           out_r, lse_r);
  }
  return o_proj_.forward(out.view({tokens, heads_ * head_dim_}), oc);
}

Tensor AttentionBlock::forward_decode(const Tensor& x, const Tensor& positions, Tensor& k_cache, Tensor& v_cache) const {
  MC_CHECK(!par_.cp && par_.tp_size() == 1, "cached attention (generation) runs on one rank: no tensor or context parallelism");
  const int64_t rows = x.size(0);
  MC_CHECK(x.ndim() == 2 && rows == k_cache.size(0) && positions.shape() == Shape({rows}), "forward_decode: ",
           x.describe(), " for a cache of ", k_cache.size(0), " rows with positions ", positions.describe());
  if (x.dtype() == DType::F64) {  // the row-by-row path (the CPU's f64)
    const std::vector<int32_t> pos = positions.to_vector<int32_t>();
    return forward_cached(x, 0, std::vector<int64_t>(pos.begin(), pos.end()), positions, k_cache, v_cache);
  }
  Linear::Ctx qc, kc, vc, oc;
  Norm::Ctx qn, kn;
  Tensor q = q_proj_.forward(x, qc), k = k_proj_.forward(x, kc), v = v_proj_.forward(x, vc);
  if (qk_norm_) {
    q = q_norm_.forward(q.view({rows * heads_, head_dim_}), qn);
    k = k_norm_.forward(k.view({rows * kv_heads_, head_dim_}), kn);
  }
  q = q.view({rows, 1, heads_, head_dim_});
  k = k.view({rows, 1, kv_heads_, head_dim_});
  v = v.view({rows, 1, kv_heads_, head_dim_});
  Tensor out = Tensor::empty(q.shape(), x.dtype(), x.device());
  Tensor lse = Tensor::empty({rows, heads_, 1}, DType::F32, x.device());
  ops::decode_attention(q, k, v, k_cache, v_cache, positions, rope_, rotary_base_, scale(), out, lse);
  return o_proj_.forward(out.view({rows, heads_ * head_dim_}), oc);
}

// Context parallelism. Rank r of n holds chunks g0 = r and g1 = 2n - 1 - r (c tokens each) of
// every sequence; query chunk g attends keys [0, (g + 1) c): the attention op's bottom-right
// causal alignment (Sk >= Sq) gives exactly that. K and V travel as one all-gather of
// [4, B, c, Hkv, D] (k chunk 0, k chunk 1, v chunk 0, v chunk 1) per rank.
Tensor AttentionBlock::context_parallel_forward(const Tensor& q, const Tensor& k, const Tensor& v, Ctx& ctx) const {
  comm::Communicator& cp = *par_.cp;
  const int64_t batch = q.size(0), c = q.size(1) / 2, n = cp.size(), r = cp.rank(), seq = 2 * n * c;
  const Device dev = q.device();
  const DType dt = q.dtype();
  Tensor kv = Tensor::empty({4, batch, c, kv_heads_, head_dim_}, dt, dev);
  Tensor qc[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t start = cp_chunk_start(c, n, r, i);
    qc[i] = seq_range(q, i * c, (i + 1) * c);
    Tensor kc = seq_range(k, i * c, (i + 1) * c);
    if (rope_) {
      ops::rope_forward(qc[i], qc[i], rotary_base_, start);
      ops::rope_forward(kc, kc, rotary_base_, start);
    }
    kv.slice(0, i, i + 1).view(kc.shape()).copy_from(kc);
    kv.slice(0, 2 + i, 3 + i).view(kc.shape()).copy_from(seq_range(v, i * c, (i + 1) * c));
  }
  Tensor gathered = Tensor::empty({4 * n, batch, c, kv_heads_, head_dim_}, dt, dev);
  cp.all_gather(kv, gathered);
  ctx.full_k = Tensor::empty({batch, seq, kv_heads_, head_dim_}, dt, dev);
  ctx.full_v = Tensor::empty({batch, seq, kv_heads_, head_dim_}, dt, dev);
  const Shape chunk_shape{batch, c, kv_heads_, head_dim_};
  for (int64_t p = 0; p < n; ++p)
    for (int i = 0; i < 2; ++i) {
      const int64_t start = cp_chunk_start(c, n, p, i);
      seq_assign(ctx.full_k, start, gathered.slice(0, 4 * p + i, 4 * p + i + 1).view(chunk_shape));
      seq_assign(ctx.full_v, start, gathered.slice(0, 4 * p + 2 + i, 4 * p + 3 + i).view(chunk_shape));
    }
  Tensor out = Tensor::empty(q.shape(), dt, dev);
  for (int i = 0; i < 2; ++i) {
    const int64_t keys = cp_chunk_start(c, n, r, i) + c;
    ctx.chunk_out[i] = Tensor::empty(qc[i].shape(), dt, dev);
    ctx.chunk_lse[i] = Tensor::empty({batch, heads_, c}, dt == DType::F64 ? DType::F64 : DType::F32, dev);
    ops::attention_forward(qc[i], seq_range(ctx.full_k, 0, keys), seq_range(ctx.full_v, 0, keys), scale(),
                           ctx.chunk_out[i], ctx.chunk_lse[i]);
    seq_assign(out, i * c, ctx.chunk_out[i]);
    ctx.chunk_q[i] = qc[i];
  }
  return out;
}

Tensor AttentionBlock::context_parallel_rerun(Ctx& ctx) const {
  // The forward's attention of each query chunk over its keys, on the same (kept) inputs.
  comm::Communicator& cp = *par_.cp;
  MC_CHECK(ctx.chunk_q[0].defined() && ctx.full_k.defined(), "AttentionBlock::backward without a forward");
  const int64_t batch = ctx.chunk_q[0].size(0), c = ctx.chunk_q[0].size(1), n = cp.size(), r = cp.rank();
  const Device dev = ctx.chunk_q[0].device();
  const DType dt = ctx.chunk_q[0].dtype();
  Tensor out = Tensor::empty({batch, 2 * c, heads_, head_dim_}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    const int64_t keys = cp_chunk_start(c, n, r, i) + c;
    ctx.chunk_out[i] = Tensor::empty(ctx.chunk_q[i].shape(), dt, dev);
    ctx.chunk_lse[i] = Tensor::empty({batch, heads_, c}, dt == DType::F64 ? DType::F64 : DType::F32, dev);
    ops::attention_forward(ctx.chunk_q[i], seq_range(ctx.full_k, 0, keys), seq_range(ctx.full_v, 0, keys), scale(),
                           ctx.chunk_out[i], ctx.chunk_lse[i]);
    seq_assign(out, i * c, ctx.chunk_out[i]);
  }
  return out;
}

void AttentionBlock::context_parallel_backward(const Tensor& dout, Ctx& ctx, Tensor& dq, Tensor& dk, Tensor& dv) const {
  comm::Communicator& cp = *par_.cp;
  const int64_t batch = dout.size(0), c = dout.size(1) / 2, n = cp.size(), r = cp.rank(), seq = 2 * n * c;
  const Device dev = dout.device();
  const DType dt = dout.dtype();
  Tensor full_dk = Tensor::zeros({batch, seq, kv_heads_, head_dim_}, dt, dev);
  Tensor full_dv = Tensor::zeros({batch, seq, kv_heads_, head_dim_}, dt, dev);
  dq = Tensor::empty(dout.shape(), dt, dev);
  for (int i = 0; i < 2; ++i) {
    const int64_t start = cp_chunk_start(c, n, r, i), keys = start + c;
    Tensor dqi = Tensor::empty(ctx.chunk_q[i].shape(), dt, dev);
    Tensor dki = Tensor::empty({batch, keys, kv_heads_, head_dim_}, dt, dev);
    Tensor dvi = Tensor::empty({batch, keys, kv_heads_, head_dim_}, dt, dev);
    ops::attention_backward(ctx.chunk_q[i], seq_range(ctx.full_k, 0, keys), seq_range(ctx.full_v, 0, keys),
                            ctx.chunk_out[i], ctx.chunk_lse[i], seq_range(dout, i * c, (i + 1) * c), scale(), dqi, dki,
                            dvi);
    if (rope_) ops::rope_backward(dqi, dqi, rotary_base_, start);
    seq_assign(dq, i * c, dqi);
    seq_accumulate(full_dk, 0, dki);
    seq_accumulate(full_dv, 0, dvi);
  }
  for (int i = 0; i < 2; ++i) ctx.chunk_q[i] = ctx.chunk_out[i] = ctx.chunk_lse[i] = Tensor();
  ctx.full_k = ctx.full_v = Tensor();
  // Every rank's partial dK/dV of the whole sequence -> each owner's chunks, summed.
  Tensor send = Tensor::empty({4 * n, batch, c, kv_heads_, head_dim_}, dt, dev);
  const Shape chunk_shape{batch, c, kv_heads_, head_dim_};
  for (int64_t p = 0; p < n; ++p)
    for (int i = 0; i < 2; ++i) {
      const int64_t start = cp_chunk_start(c, n, p, i);
      send.slice(0, 4 * p + i, 4 * p + i + 1).view(chunk_shape).copy_from(seq_range(full_dk, start, start + c));
      send.slice(0, 4 * p + 2 + i, 4 * p + 3 + i).view(chunk_shape).copy_from(seq_range(full_dv, start, start + c));
    }
  Tensor mine = Tensor::empty({4, batch, c, kv_heads_, head_dim_}, dt, dev);
  cp.reduce_scatter(send, mine, comm::ReduceOp::Sum);
  dk = Tensor::empty({batch, 2 * c, kv_heads_, head_dim_}, dt, dev);
  dv = Tensor::empty({batch, 2 * c, kv_heads_, head_dim_}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    Tensor dki = mine.slice(0, i, i + 1).view(chunk_shape);
    if (rope_) ops::rope_backward(dki, dki, rotary_base_, cp_chunk_start(c, n, r, i));
    seq_assign(dk, i * c, dki);
    seq_assign(dv, i * c, mine.slice(0, 2 + i, 3 + i).view(chunk_shape));
  }
}

}  // namespace moecore
