#include "moecore/model/core_attention.h"

#include "moecore/ops/attention.h"

namespace moecore {

namespace {

DType lse_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

}  // namespace

Tensor core_attention_forward(comm::Communicator* cp, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                              CoreAttentionCtx& ctx) {
  const int64_t batch = q.size(0), heads = q.size(2), dv = v.size(3);
  const Device dev = q.device();
  const DType dt = q.dtype();
  if (!cp) {
    Tensor out = Tensor::empty({batch, q.size(1), heads, dv}, dt, dev);
    Tensor lse = Tensor::empty({batch, heads, q.size(1)}, lse_dtype(dt), dev);
    ops::attention_forward(q, k, v, scale, out, lse);
    ctx.q = q, ctx.k = k, ctx.v = v, ctx.out = out, ctx.lse = lse;
    return out;
  }
  // Rank r of n holds chunks r and 2n - 1 - r (c tokens each) of every sequence; query chunk g
  // attends keys [0, (g + 1) c): the attention op's bottom-right causal alignment (Sk >= Sq).
  // K and V travel as one all-gather of [B, c, (2 Hkv D + 2 Hkv Dv)] rows per rank: k chunk 0,
  // k chunk 1, v chunk 0, v chunk 1, each flattened per token.
  const int64_t c = q.size(1) / 2, n = cp->size(), r = cp->rank(), seq = 2 * n * c;
  const int64_t kvh = k.size(2), d = k.size(3), kw = kvh * d, vw = kvh * dv, width = 2 * kw + 2 * vw;
  const int64_t piece[4] = {0, kw, 2 * kw, 2 * kw + vw};
  Tensor kv = Tensor::empty({batch * c, width}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    kv.slice(1, piece[i], piece[i] + kw).copy_from(seq_range(k, i * c, (i + 1) * c).view({batch * c, kw}));
    kv.slice(1, piece[2 + i], piece[2 + i] + vw).copy_from(seq_range(v, i * c, (i + 1) * c).view({batch * c, vw}));
  }
  Tensor gathered = Tensor::empty({n * batch * c, width}, dt, dev);
  cp->all_gather(kv, gathered);
  ctx.full_k = Tensor::empty({batch, seq, kvh, d}, dt, dev);
  ctx.full_v = Tensor::empty({batch, seq, kvh, dv}, dt, dev);
  for (int64_t p = 0; p < n; ++p) {
    const Tensor rows = gathered.slice(0, p * batch * c, (p + 1) * batch * c);
    for (int i = 0; i < 2; ++i) {
      const int64_t start = cp_chunk_start(c, n, p, i);
      seq_assign(ctx.full_k, start, rows.slice(1, piece[i], piece[i] + kw).contiguous().view({batch, c, kvh, d}));
      seq_assign(ctx.full_v, start,
                 rows.slice(1, piece[2 + i], piece[2 + i] + vw).contiguous().view({batch, c, kvh, dv}));
    }
  }
  Tensor out = Tensor::empty({batch, 2 * c, heads, dv}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    const int64_t keys = cp_chunk_start(c, n, r, i) + c;
    ctx.chunk_q[i] = seq_range(q, i * c, (i + 1) * c);
    ctx.chunk_out[i] = Tensor::empty({batch, c, heads, dv}, dt, dev);
    ctx.chunk_lse[i] = Tensor::empty({batch, heads, c}, lse_dtype(dt), dev);
    ops::attention_forward(ctx.chunk_q[i], seq_range(ctx.full_k, 0, keys), seq_range(ctx.full_v, 0, keys),
                                    scale, ctx.chunk_out[i], ctx.chunk_lse[i]);
    seq_assign(out, i * c, ctx.chunk_out[i]);
  }
  return out;
}

void core_attention_drop_output(CoreAttentionCtx& ctx) {
  ctx.out = ctx.lse = Tensor();
  ctx.chunk_out[0] = ctx.chunk_out[1] = ctx.chunk_lse[0] = ctx.chunk_lse[1] = Tensor();
}

Tensor core_attention_rerun(comm::Communicator* cp, double scale, CoreAttentionCtx& ctx) {
  if (!cp) {
    MC_CHECK(ctx.q.defined() && ctx.v.defined(), "core attention rerun without the forward's q, k, v");
    const Tensor& q = ctx.q;
    ctx.out = Tensor::empty({q.size(0), q.size(1), q.size(2), ctx.v.size(3)}, q.dtype(), q.device());
    ctx.lse = Tensor::empty({q.size(0), q.size(2), q.size(1)}, lse_dtype(q.dtype()), q.device());
    ops::attention_forward(q, ctx.k, ctx.v, scale, ctx.out, ctx.lse);
    return ctx.out;
  }
  MC_CHECK(ctx.chunk_q[0].defined() && ctx.full_k.defined(), "core attention rerun without the forward's chunks");
  const Tensor& q0 = ctx.chunk_q[0];
  const int64_t batch = q0.size(0), c = q0.size(1), heads = q0.size(2), dv = ctx.full_v.size(3);
  const int64_t n = cp->size(), r = cp->rank();
  const Device dev = q0.device();
  const DType dt = q0.dtype();
  Tensor out = Tensor::empty({batch, 2 * c, heads, dv}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    const int64_t keys = cp_chunk_start(c, n, r, i) + c;
    ctx.chunk_out[i] = Tensor::empty({batch, c, heads, dv}, dt, dev);
    ctx.chunk_lse[i] = Tensor::empty({batch, heads, c}, lse_dtype(dt), dev);
    ops::attention_forward(ctx.chunk_q[i], seq_range(ctx.full_k, 0, keys), seq_range(ctx.full_v, 0, keys), scale,
                           ctx.chunk_out[i], ctx.chunk_lse[i]);
    seq_assign(out, i * c, ctx.chunk_out[i]);
  }
  return out;
}

void core_attention_backward(comm::Communicator* cp, const Tensor& dout, double scale, CoreAttentionCtx& ctx,
                             Tensor& dq, Tensor& dk, Tensor& dv) {
  const Device dev = dout.device();
  const DType dt = dout.dtype();
  if (!cp) {
    dq = Tensor::empty(ctx.q.shape(), dt, dev);
    dk = Tensor::empty(ctx.k.shape(), dt, dev);
    dv = Tensor::empty(ctx.v.shape(), dt, dev);
    ops::attention_backward(ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse, dout, scale, dq, dk, dv);
    ctx = CoreAttentionCtx{};
    return;
  }
  const int64_t batch = dout.size(0), c = dout.size(1) / 2, n = cp->size(), r = cp->rank(), seq = 2 * n * c;
  const int64_t kvh = ctx.full_k.size(2), d = ctx.full_k.size(3), dvw = ctx.full_v.size(3);
  const int64_t kw = kvh * d, vw = kvh * dvw, width = 2 * kw + 2 * vw;
  const int64_t piece[4] = {0, kw, 2 * kw, 2 * kw + vw};
  Tensor full_dk = Tensor::zeros({batch, seq, kvh, d}, dt, dev);
  Tensor full_dv = Tensor::zeros({batch, seq, kvh, dvw}, dt, dev);
  dq = Tensor::empty({batch, 2 * c, ctx.chunk_q[0].size(2), d}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    const int64_t keys = cp_chunk_start(c, n, r, i) + c;
    Tensor dqi = Tensor::empty(ctx.chunk_q[i].shape(), dt, dev);
    Tensor dki = Tensor::empty({batch, keys, kvh, d}, dt, dev);
    Tensor dvi = Tensor::empty({batch, keys, kvh, dvw}, dt, dev);
    ops::attention_backward(ctx.chunk_q[i], seq_range(ctx.full_k, 0, keys), seq_range(ctx.full_v, 0, keys),
                                     ctx.chunk_out[i], ctx.chunk_lse[i], seq_range(dout, i * c, (i + 1) * c), scale,
                                     dqi, dki, dvi);
    seq_assign(dq, i * c, dqi);
    seq_accumulate(full_dk, 0, dki);
    seq_accumulate(full_dv, 0, dvi);
  }
  ctx = CoreAttentionCtx{};
  // Every rank's partial dK/dV of the whole sequence -> each owner's chunks, summed.
  Tensor send = Tensor::empty({n * batch * c, width}, dt, dev);
  for (int64_t p = 0; p < n; ++p) {
    Tensor rows = send.slice(0, p * batch * c, (p + 1) * batch * c);
    for (int i = 0; i < 2; ++i) {
      const int64_t start = cp_chunk_start(c, n, p, i);
      rows.slice(1, piece[i], piece[i] + kw).copy_from(seq_range(full_dk, start, start + c).view({batch * c, kw}));
      rows.slice(1, piece[2 + i], piece[2 + i] + vw)
          .copy_from(seq_range(full_dv, start, start + c).view({batch * c, vw}));
    }
  }
  Tensor mine = Tensor::empty({batch * c, width}, dt, dev);
  cp->reduce_scatter(send, mine, comm::ReduceOp::Sum);
  dk = Tensor::empty({batch, 2 * c, kvh, d}, dt, dev);
  dv = Tensor::empty({batch, 2 * c, kvh, dvw}, dt, dev);
  for (int i = 0; i < 2; ++i) {
    seq_assign(dk, i * c, mine.slice(1, piece[i], piece[i] + kw).contiguous().view({batch, c, kvh, d}));
    seq_assign(dv, i * c, mine.slice(1, piece[2 + i], piece[2 + i] + vw).contiguous().view({batch, c, kvh, dvw}));
  }
}

}  // namespace moecore
