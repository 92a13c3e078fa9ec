#include "moecore/moe/allgather_dispatcher.h"

#include "moecore/comm/emulated_communicator.h"

namespace moecore {

using dispatch_detail::CommTimer;
using dispatch_detail::with_rows;

AllGatherDispatcher::AllGatherDispatcher(comm::Communicator* ep, int64_t num_experts, comm::Communicator* gather)
    : TokenDispatcher(ep, num_experts), gather_(gather), gather_size_(gather->size()) {}

Tensor AllGatherDispatcher::gather_rows(const Tensor& in) const {
  Tensor out = Tensor::empty(with_rows(in, in.size(0) * gather_size_), in.dtype(), in.device());
  CommTimer timer(*gather_, gather_ == ep_);
  gather_->all_gather(in, out);
  return out;
}

Tensor AllGatherDispatcher::reduce_scatter_rows(const Tensor& in) const {
  Tensor out = Tensor::empty(with_rows(in, in.size(0) / gather_size_), in.dtype(), in.device());
  CommTimer timer(*gather_, gather_ == ep_);
  gather_->reduce_scatter(in, out, comm::ReduceOp::Sum);
  return out;
}

TokenRows AllGatherDispatcher::dispatch_preprocess(const DispatchInput& in, Ctx& ctx) const {
  ctx.tokens = in.x.size(0);
  ctx.topk = in.indices.size(1);
  ctx.pad = in.pad;
  ctx.indices = in.indices;
  ctx.kept = in.kept;
  ctx.probs_to_rows = in.probs_to_rows;
  ctx.fp8 = in.fp8;
  ctx.probs = ctx.dprobs = Tensor();
  return {in.x, in.probs};
}

TokenRows AllGatherDispatcher::token_dispatch(const TokenRows& local, Ctx& ctx) const {
  TokenRows out;
  int64_t bytes = static_cast<int64_t>(ctx.indices.nbytes());
  if (ctx.fp8 == Fp8Dispatch::Off) {
    out.rows = gather_rows(local.rows);
    bytes += static_cast<int64_t>(local.rows.nbytes());
  } else {
    // FP8: the codes and their factors ([T, tiles] or [1]) gathered alike.
    const dispatch_detail::Fp8Rows q = dispatch_detail::quantize_dispatch_rows(local.rows, ctx.fp8);
    const Tensor codes = gather_rows(q.codes), factors = gather_rows(q.scale_inv);
    bytes += static_cast<int64_t>(q.codes.nbytes() + q.scale_inv.nbytes());
    out.rows = dispatch_detail::dequantize_dispatch_rows(
        codes, factors, ctx.fp8, std::vector<int64_t>(static_cast<size_t>(gather_size_), local.rows.size(0)),
        local.rows.dtype());
  }
  ctx.indices = gather_rows(ctx.indices);
  if (ctx.kept.defined()) {
    bytes += static_cast<int64_t>(ctx.kept.nbytes());
    ctx.kept = gather_rows(ctx.kept);
  }
  if (local.probs.defined()) {
    out.probs = gather_rows(local.probs);
    bytes += static_cast<int64_t>(local.probs.nbytes());
  }
  dispatch_detail::count_dispatch(local.rows.size(0), bytes);
  return out;
}

// An emulated group (comm/emulated_communicator.h) gathers this rank's expert ids into every
// rank's rows. Emulation assumes symmetry instead: the rows gathered from EP rank e go to this
// rank's experts as this rank's own rows go to e's experts, so the local experts get the rows of
// this rank's tokens routed anywhere, once per ETP rank (EP rank of slot g: g / ETP, the order
// tp-cp-ep-dp-pp's tp_ep groups).
void AllGatherDispatcher::symmetric_ids(std::vector<int32_t>& ids) const {
  const int64_t per_slot = static_cast<int64_t>(ids.size()) / gather_size_, etp = gather_size_ / ep_size_;
  const int64_t mine = first_expert_;
  for (int64_t g = 0; g < gather_size_; ++g) {
    const int64_t theirs = g / etp * local_experts_;
    if (theirs == mine) continue;
    for (int64_t i = g * per_slot; i < (g + 1) * per_slot; ++i) {
      int32_t& id = ids[static_cast<size_t>(i)];
      if (id >= theirs && id < theirs + local_experts_) {
        id = static_cast<int32_t>(id - theirs + mine);
      } else if (id >= mine && id < mine + local_experts_) {
        id = static_cast<int32_t>(id - mine + theirs);
      }
    }
  }
}

TokenRows AllGatherDispatcher::dispatch_postprocess(const TokenRows& received, Ctx& ctx) const {
  const Device dev = received.rows.device();
  std::vector<int32_t> ids = ctx.indices.to_vector<int32_t>();
  if (comm::is_emulated(gather_)) symmetric_ids(ids);
  std::vector<uint8_t> keep(ids.size(), 1);
  if (ctx.kept.defined()) keep = ctx.kept.to_vector<uint8_t>();
  // Only this rank's experts, renumbered 0..L-1; every other assignment is "dropped" here.
  std::vector<int32_t> local(ids.size(), 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t l = ids[i] - first_expert_;
    if (l >= 0 && l < local_experts_) {
      local[i] = static_cast<int32_t>(l);
    } else {
      keep[i] = 0;
    }
  }
  const Shape s = ctx.indices.shape();
  ctx.indices = ctx.kept = Tensor();
  ctx.routing = ops::make_moe_routing(Tensor::from_vector(local, s).to(dev), Tensor::from_vector(keep, s).to(dev),
                                      local_experts_, ctx.pad * gather_size_);
  TokenRows out;
  out.rows = Tensor::empty({ctx.routing.num_rows, received.rows.size(1)}, received.rows.dtype(), dev);
  ops::moe_permute_forward(received.rows, ctx.routing, out.rows);
  ctx.local_rows = {ctx.routing.host_tokens_per_expert, ctx.routing.row_offsets};
  if (received.probs.defined()) {
    if (ctx.probs_to_rows) {
      out.probs = Tensor::empty({ctx.routing.num_rows, 1}, received.probs.dtype(), dev);
      ops::moe_permute_probs_forward(received.probs, ctx.routing, out.probs);
    } else {
      ctx.probs = received.probs;  // the combine's, gathered [G*T, k]
    }
  }
  return out;
}

Tensor AllGatherDispatcher::combine_preprocess(const Tensor& expert_out, Ctx& ctx) const {
  // The backward reads the rows only for the probabilities' gradient: without probs they are
  // not kept (an activation buffer fewer).
  if (ctx.probs.defined()) ctx.unpermute_in = expert_out;
  Tensor partial = Tensor::empty({ctx.tokens * gather_size_, expert_out.size(1)}, expert_out.dtype(), expert_out.device());
  dispatch_detail::unpermute(expert_out, ctx.probs, ctx.routing, partial);
  return partial;
}

Tensor AllGatherDispatcher::token_combine(const Tensor& rows, Ctx&) const { return reduce_scatter_rows(rows); }

Tensor AllGatherDispatcher::combine_postprocess(const Tensor& rows, Ctx&) const { return rows; }

Tensor AllGatherDispatcher::combine_postprocess_backward(const Tensor& dout, Ctx& ctx) const {
  ctx.dprobs = Tensor();
  return dout;
}

Tensor AllGatherDispatcher::token_combine_backward(const Tensor& d_rows, Ctx&) const { return gather_rows(d_rows); }

Tensor AllGatherDispatcher::combine_preprocess_backward(const Tensor& dout_all, Ctx& ctx) const {
  const Device dev = dout_all.device();
  Tensor d_expert_out = Tensor::empty({ctx.routing.num_rows, dout_all.size(1)}, dout_all.dtype(), dev);
  if (!ctx.probs.defined()) {
    ops::moe_permute_forward(dout_all, ctx.routing, d_expert_out);
    return d_expert_out;
  }
  ctx.dprobs = Tensor::empty({ctx.tokens * gather_size_, ctx.topk}, ctx.probs.dtype(), dev);
  ops::moe_unpermute_backward(ctx.unpermute_in, ctx.probs, ctx.routing, dout_all, d_expert_out, ctx.dprobs);
  return d_expert_out;
}

TokenRows AllGatherDispatcher::dispatch_postprocess_backward(const TokenRows& d_expert_in, Ctx& ctx) const {
  const Device dev = d_expert_in.rows.device();
  TokenRows out;
  out.rows = Tensor::empty({ctx.tokens * gather_size_, d_expert_in.rows.size(1)}, d_expert_in.rows.dtype(), dev);
  ops::moe_permute_backward(d_expert_in.rows, ctx.routing, out.rows);
  if (d_expert_in.probs.defined()) {
    out.probs = Tensor::empty({ctx.tokens * gather_size_, ctx.topk}, d_expert_in.probs.dtype(), dev);
    ops::moe_permute_probs_backward(d_expert_in.probs, ctx.routing, out.probs);
  } else {
    out.probs = ctx.dprobs;  // the combine's, for the gathered probabilities (undefined without)
  }
  return out;
}

TokenRows AllGatherDispatcher::token_dispatch_backward(const TokenRows& d_rows, Ctx&) const {
  TokenRows out;
  out.rows = reduce_scatter_rows(d_rows.rows);
  if (d_rows.probs.defined()) out.probs = reduce_scatter_rows(d_rows.probs);
  return out;
}

TokenRows AllGatherDispatcher::dispatch_preprocess_backward(const TokenRows& d_rows, Ctx&) const { return d_rows; }

}  // namespace moecore
