#include "moecore/moe/alltoall_dispatcher.h"

#include <algorithm>

#include "moecore/comm/emulated_communicator.h"
#include "moecore/ops/elementwise.h"

namespace moecore {

using dispatch_detail::CommTimer;
using dispatch_detail::total;
using dispatch_detail::with_rows;

AllToAllDispatcher::AllToAllDispatcher(comm::Communicator* ep, int64_t num_experts, comm::Communicator* etp)
    : TokenDispatcher(ep, num_experts), etp_(etp) {}

Tensor AllToAllDispatcher::all_to_all_rows(const Tensor& in, const std::vector<int64_t>& send,
                                           const std::vector<int64_t>& recv) const {
  Tensor out = Tensor::empty(with_rows(in, total(recv)), in.dtype(), in.device());
  CommTimer timer(*ep_, true);
  ep_->all_to_all(in, send, out, recv);
  return out;
}

Tensor AllToAllDispatcher::sort_rows(const Tensor& received, Ctx& ctx) const {
  Tensor sorted = Tensor::empty(with_rows(received, ctx.sort.num_rows), received.dtype(), received.device());
  ops::moe_permute_forward(received, ctx.sort, sorted);
  return sorted;
}

Tensor AllToAllDispatcher::unsort_rows(const Tensor& sorted, Ctx& ctx) const {
  Tensor arrival = Tensor::empty(with_rows(sorted, ctx.sort.num_tokens), sorted.dtype(), sorted.device());
  ops::moe_permute_backward(sorted, ctx.sort, arrival);  // unsort: a gather by the sort plan
  return arrival;
}

// An emulated EP group (comm/emulated_communicator.h) gathers this rank's counts into every row,
// which says nothing of what the others send here. Emulation assumes symmetry instead: rank s
// sends this rank's local expert l what this rank sends s's local expert l, so this rank receives
// from each rank as many rows as it sends there (its rows in all: its own T x k kept rows).
void AllToAllDispatcher::symmetric_counts(std::vector<int32_t>& all) const {
  const auto at = [&](int64_t src, int64_t expert) -> int32_t& {
    return all[static_cast<size_t>(src * num_experts_ + expert)];
  };
  for (int64_t s = 0; s < ep_size_; ++s)
    for (int64_t l = 0; l < local_experts_; ++l)
      if (s != ep_rank_) at(s, first_expert_ + l) = at(ep_rank_, s * local_experts_ + l);
}

TokenRows AllToAllDispatcher::dispatch_preprocess(const DispatchInput& in, Ctx& ctx) const {
  const Device dev = in.x.device();
  const int64_t hidden = in.x.size(1);
  ctx.tokens = in.x.size(0);
  ctx.topk = in.indices.size(1);
  ctx.fp8 = in.fp8;
  ctx.dprobs = Tensor();
  // One rank without ETP: the plan's counts need not come to the host when the expert GEMMs
  // read the device offsets (device_rows). Over EP they come through the all-gather below
  // instead of a copy of their own (on CUDA; the CPU plan has them anyway).
  ctx.routing = ops::make_moe_routing(in.indices, in.kept, num_experts_, in.pad, !ep_ && !(in.device_rows && !etp_));
  TokenRows out;
  out.rows = Tensor::empty({ctx.routing.num_rows, hidden}, in.x.dtype(), dev);
  ops::moe_permute_forward(in.x, ctx.routing, out.rows);
  // The probabilities travel the tokens' way: scattered to the permuted rows ([rows, 1]), then
  // the same all-to-all, sort and ETP gather; or kept here for the combine.
  ctx.probs_to_rows = in.probs_to_rows;
  const bool to_rows = in.probs_to_rows && in.probs.defined();
  ctx.probs = to_rows ? Tensor() : in.probs;
  if (to_rows) {
    out.probs = Tensor::empty({ctx.routing.num_rows, 1}, in.probs.dtype(), dev);
    ops::moe_permute_probs_forward(in.probs, ctx.routing, out.probs);
  }
  if (!ep_) {
    ctx.local_rows = {ctx.routing.host_tokens_per_expert, ctx.routing.row_offsets};
    return out;
  }

  // Every rank learns every rank's per-expert row counts ([EP, E]: an all-gather of the plan's
  // device counts, then one copy to the host: the dispatch's only wait without ETP, capacity
  // dropping or padding). An id outside [0, E) is left out of the counts, so this rank's counts
  // then sum to fewer than the plan's rows: the plan's deferred check raises it here, before the
  // all-to-all would fail on the sizes. (Padded, each expert's count is the capacity whatever the
  // ids: the check then comes with the layer's statistics.)
  Tensor counts_all = Tensor::empty({ep_size_, num_experts_}, DType::I32, ep_->device());
  {
    CommTimer timer(*ep_, true);
    ep_->all_gather(ctx.routing.tokens_per_expert.view({1, num_experts_}), counts_all);
  }
  std::vector<int32_t> all = counts_all.to_vector<int32_t>();
  if (comm::is_emulated(ep_)) symmetric_counts(all);
  auto count = [&](int64_t src, int64_t expert) {
    return static_cast<int64_t>(all[static_cast<size_t>(src * num_experts_ + expert)]);
  };
  int64_t my_rows = 0;
  for (int64_t e = 0; e < num_experts_; ++e) my_rows += count(ep_rank_, e);
  if (my_rows != ctx.routing.num_rows) ops::check_moe_routing(ctx.routing, in.indices);
  ctx.send_rows.assign(static_cast<size_t>(ep_size_), 0);
  ctx.recv_rows.assign(static_cast<size_t>(ep_size_), 0);
  ctx.local_counts.assign(static_cast<size_t>(local_experts_), 0);  // received rows per local expert
  ctx.chunk_rows.assign(static_cast<size_t>(ep_size_ * local_experts_), 0);
  for (int64_t s = 0; s < ep_size_; ++s)
    for (int64_t l = 0; l < local_experts_; ++l) {
      ctx.send_rows[static_cast<size_t>(s)] += count(ep_rank_, s * local_experts_ + l);
      const int64_t c = count(s, first_expert_ + l);
      ctx.recv_rows[static_cast<size_t>(s)] += c;
      ctx.local_counts[static_cast<size_t>(l)] += c;
      ctx.chunk_rows[static_cast<size_t>(s * local_experts_ + l)] = c;
    }
  return out;
}

TokenRows AllToAllDispatcher::token_dispatch(const TokenRows& local, Ctx& ctx) const {
  if (!ep_) return local;
  TokenRows out;
  int64_t bytes = 0;
  if (ctx.fp8 == Fp8Dispatch::Off) {
    out.rows = all_to_all_rows(local.rows, ctx.send_rows, ctx.recv_rows);
    bytes += static_cast<int64_t>(local.rows.nbytes());
  } else {
    // FP8: the codes with their factors (1x128 tiles: per row; per tensor: one to every rank).
    const dispatch_detail::Fp8Rows q = dispatch_detail::quantize_dispatch_rows(local.rows, ctx.fp8);
    const Tensor codes = all_to_all_rows(q.codes, ctx.send_rows, ctx.recv_rows);
    Tensor factors;
    if (ctx.fp8 == Fp8Dispatch::Tiles) {
      factors = all_to_all_rows(q.scale_inv, ctx.send_rows, ctx.recv_rows);
      bytes += static_cast<int64_t>(q.scale_inv.nbytes());
    } else {
      const std::vector<int64_t> one(static_cast<size_t>(ep_size_), 1);
      Tensor each = Tensor::empty({ep_size_}, DType::F32, q.scale_inv.device());  // copied on the device
      for (int64_t r = 0; r < ep_size_; ++r) {
        Tensor slot = each.slice(0, r, r + 1);
        slot.copy_from(q.scale_inv);
      }
      factors = all_to_all_rows(each, one, one);
      bytes += ep_size_ * static_cast<int64_t>(sizeof(float));
    }
    bytes += static_cast<int64_t>(q.codes.nbytes());
    out.rows = dispatch_detail::dequantize_dispatch_rows(codes, factors, ctx.fp8, ctx.recv_rows, local.rows.dtype());
  }
  if (local.probs.defined()) {
    out.probs = all_to_all_rows(local.probs, ctx.send_rows, ctx.recv_rows);
    bytes += static_cast<int64_t>(local.probs.nbytes());
  }
  dispatch_detail::count_dispatch(local.rows.size(0), bytes);
  return out;
}

TokenRows AllToAllDispatcher::dispatch_postprocess(const TokenRows& received, Ctx& ctx) const {
  TokenRows out = received;
  if (ep_) {
    // (source, local expert) chunks -> (local expert, source): a stable permutation by local
    // expert, planned from each received row's local expert (uploaded through pinned staging: no
    // wait). Built after token_dispatch has enqueued the transfer, so the GPU runs it meanwhile.
    const Device dev = received.rows.device();
    const int64_t rows = total(ctx.recv_rows);
    Tensor local_ids = Tensor::empty({rows, 1}, DType::I32, Device::cpu());
    int32_t* id = local_ids.data<int32_t>();
    for (int64_t s = 0; s < ep_size_; ++s)
      for (int64_t l = 0; l < local_experts_; ++l)
        id = std::fill_n(id, ctx.chunk_rows[static_cast<size_t>(s * local_experts_ + l)], static_cast<int32_t>(l));
    ctx.sort = ops::make_moe_routing(uploader_->upload(local_ids, dev), Tensor(), local_experts_, 0, false);
    // The ids are ours and all in range, so the plan's deferred check has nothing to find; its
    // counts are the ones summed in dispatch_preprocess.
    ctx.sort.host_tokens_per_expert = ctx.local_counts;
    out.rows = sort_rows(received.rows, ctx);
    ctx.local_rows = {ctx.sort.host_tokens_per_expert, ctx.sort.row_offsets};
    if (received.probs.defined()) out.probs = sort_rows(received.probs, ctx);
  }
  if (etp_) {
    out.rows = etp_gather(out.rows, ctx, true);
    if (out.probs.defined()) out.probs = etp_gather(out.probs, ctx, false);
  }
  return out;
}

Tensor AllToAllDispatcher::etp_gather(const Tensor& rows, Ctx& ctx, bool plan) const {
  const Device dev = rows.device();
  const int64_t n = etp_->size(), hidden = rows.size(1);
  if (plan) {
    // Every ETP rank's rows per local expert ([ETP, L], one small all-gather).
    Tensor mine = Tensor::from_vector(ctx.local_rows.host, {1, local_experts_}).to(etp_->device());
    Tensor all = Tensor::empty({n, local_experts_}, DType::I64, etp_->device());
    {
      CommTimer timer(*etp_, false);
      etp_->all_gather(mine, all);
    }
    const std::vector<int64_t> counts = all.to_vector<int64_t>();
    ctx.etp_rows.assign(static_cast<size_t>(n), 0);
    std::vector<int32_t> ids;  // local expert of each gathered row, ETP rank-major
    for (int64_t r = 0; r < n; ++r)
      for (int64_t l = 0; l < local_experts_; ++l) {
        const int64_t c = counts[static_cast<size_t>(r * local_experts_ + l)];
        ctx.etp_rows[static_cast<size_t>(r)] += c;
        ids.insert(ids.end(), static_cast<size_t>(c), static_cast<int32_t>(l));
      }
    const int64_t total_rows = static_cast<int64_t>(ids.size());
    ctx.etp_sort = ops::make_moe_routing(Tensor::from_vector(ids, {total_rows, 1}).to(dev), Tensor(), local_experts_);
    ctx.local_rows = {ctx.etp_sort.host_tokens_per_expert, ctx.etp_sort.row_offsets};
  }
  // all-gather with per-rank row counts: a send to every ETP rank (itself too) and a receive from each.
  Tensor gathered = Tensor::empty({ctx.etp_sort.num_tokens, hidden}, rows.dtype(), dev);
  {
    CommTimer timer(*etp_, false);
    etp_->group_start();
    int64_t at = 0;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t c = ctx.etp_rows[static_cast<size_t>(r)];
      if (rows.size(0) > 0) etp_->send(rows, static_cast<int>(r));
      if (c > 0) {
        Tensor part = gathered.slice(0, at, at + c);
        etp_->recv(part, static_cast<int>(r));
      }
      at += c;
    }
    etp_->group_end();
  }
  Tensor sorted = Tensor::empty({ctx.etp_sort.num_rows, hidden}, rows.dtype(), dev);
  ops::moe_permute_forward(gathered, ctx.etp_sort, sorted);
  return sorted;
}

Tensor AllToAllDispatcher::etp_reduce(const Tensor& sorted, Ctx& ctx) const {
  const Device dev = sorted.device();
  const int64_t n = etp_->size(), hidden = sorted.size(1), me = etp_->rank();
  Tensor rank_major = Tensor::empty({ctx.etp_sort.num_tokens, hidden}, sorted.dtype(), dev);
  ops::moe_permute_backward(sorted, ctx.etp_sort, rank_major);
  // reduce-scatter with per-rank row counts: rank r's segment goes to r; this rank's partials
  // from every ETP rank are summed in rank order.
  const int64_t mine = ctx.etp_rows[static_cast<size_t>(me)];
  std::vector<Tensor> parts;
  {
    CommTimer timer(*etp_, false);
    etp_->group_start();
    int64_t at = 0;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t c = ctx.etp_rows[static_cast<size_t>(r)];
      if (c > 0) etp_->send(rank_major.slice(0, at, at + c), static_cast<int>(r));
      at += c;
      parts.push_back(Tensor::empty({mine, hidden}, sorted.dtype(), dev));
      if (mine > 0) etp_->recv(parts.back(), static_cast<int>(r));
    }
    etp_->group_end();
  }
  Tensor out = parts[0];
  for (int64_t r = 1; r < n; ++r) ops::add(out, parts[static_cast<size_t>(r)], out);
  return out;
}

// combine: the ETP partials reduced, unsorted, sent back, and unpermuted into [T, H]. The
// backward reads the rows only for the probabilities' gradient: without probs they are not kept
// (an activation buffer fewer).
Tensor AllToAllDispatcher::combine_preprocess(const Tensor& expert_out, Ctx& ctx) const {
  const Tensor local_out = etp_ ? etp_reduce(expert_out, ctx) : expert_out;
  return ep_ ? unsort_rows(local_out, ctx) : local_out;
}

Tensor AllToAllDispatcher::token_combine(const Tensor& rows, Ctx& ctx) const {
  return ep_ ? all_to_all_rows(rows, ctx.recv_rows, ctx.send_rows) : rows;
}

Tensor AllToAllDispatcher::combine_postprocess(const Tensor& rows, Ctx& ctx) const {
  Tensor out = Tensor::empty({ctx.tokens, rows.size(1)}, rows.dtype(), rows.device());
  dispatch_detail::unpermute(rows, ctx.probs, ctx.routing, out);
  if (ctx.probs.defined()) ctx.unpermute_in = rows;
  return out;
}

// The combine's backward: dout to the rows (with dprobs when the combine applied probs), sent to
// the experts' ranks, sorted, ETP-gathered.
Tensor AllToAllDispatcher::combine_postprocess_backward(const Tensor& dout, Ctx& ctx) const {
  ctx.dprobs = Tensor();
  Tensor d_local = Tensor::empty({ctx.routing.num_rows, dout.size(1)}, dout.dtype(), dout.device());
  if (ctx.probs.defined()) {
    ctx.dprobs = Tensor::empty({ctx.tokens, ctx.topk}, ctx.probs.dtype(), dout.device());
    ops::moe_unpermute_backward(ctx.unpermute_in, ctx.probs, ctx.routing, dout, d_local, ctx.dprobs);
  } else {
    ops::moe_permute_forward(dout, ctx.routing, d_local);
  }
  return d_local;
}

Tensor AllToAllDispatcher::token_combine_backward(const Tensor& d_rows, Ctx& ctx) const {
  return ep_ ? all_to_all_rows(d_rows, ctx.send_rows, ctx.recv_rows) : d_rows;
}

Tensor AllToAllDispatcher::combine_preprocess_backward(const Tensor& d_rows, Ctx& ctx) const {
  const Tensor d_expert_out = ep_ ? sort_rows(d_rows, ctx) : d_rows;
  return etp_ ? etp_gather(d_expert_out, ctx, false) : d_expert_out;
}

// The dispatch's backward: ETP partial sums reduced (each ETP rank's gradient covers its slice of
// the FFN), unsorted, sent back, and gathered into [T, H] (and [T, k] for the row probabilities).
TokenRows AllToAllDispatcher::dispatch_postprocess_backward(const TokenRows& d_expert_in, Ctx& ctx) const {
  TokenRows out;
  out.rows = etp_ ? etp_reduce(d_expert_in.rows, ctx) : d_expert_in.rows;
  if (ep_) out.rows = unsort_rows(out.rows, ctx);
  if (d_expert_in.probs.defined()) {
    out.probs = etp_ ? etp_reduce(d_expert_in.probs, ctx) : d_expert_in.probs;
    if (ep_) out.probs = unsort_rows(out.probs, ctx);
  }
  return out;
}

TokenRows AllToAllDispatcher::token_dispatch_backward(const TokenRows& d_rows, Ctx& ctx) const {
  if (!ep_) return d_rows;
  TokenRows out;
  out.rows = all_to_all_rows(d_rows.rows, ctx.recv_rows, ctx.send_rows);
  if (d_rows.probs.defined()) out.probs = all_to_all_rows(d_rows.probs, ctx.recv_rows, ctx.send_rows);
  return out;
}

TokenRows AllToAllDispatcher::dispatch_preprocess_backward(const TokenRows& d_rows, Ctx& ctx) const {
  const Device dev = d_rows.rows.device();
  TokenRows out;
  out.rows = Tensor::empty({ctx.tokens, d_rows.rows.size(1)}, d_rows.rows.dtype(), dev);
  ops::moe_permute_backward(d_rows.rows, ctx.routing, out.rows);
  if (d_rows.probs.defined()) {
    out.probs = Tensor::empty({ctx.tokens, ctx.topk}, d_rows.probs.dtype(), dev);
    ops::moe_permute_probs_backward(d_rows.probs, ctx.routing, out.probs);
  } else {
    out.probs = ctx.dprobs;  // the combine's, when it applied the probabilities (undefined otherwise)
  }
  return out;
}

}  // namespace moecore
