#include "moecore/moe/token_dispatcher.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <numeric>

#include "moecore/ops/elementwise.h"

namespace moecore {

const char* dispatcher_name(DispatcherType t) { return t == DispatcherType::AllGather ? "allgather" : "alltoall"; }

namespace {
double g_comm_seconds = 0, g_wait_seconds = 0;

// Accumulates the wall time of one collective when MOECORE_COMM_TIMERS=1: the device is
// synchronised, then the group meets at a barrier (the time until its slowest rank arrives is
// the wait), then the collective runs from a common start until this device has finished it.
// Every rank of the group constructs one at the same point (the dispatch collectives are matched
// across the group), so the barriers pair up.
class CommTimer {
 public:
  explicit CommTimer(comm::Communicator& group) : dev_(group.device()), on_(dispatch_timers_enabled()) {
    if (!on_) return;
    synchronize(dev_);
    const auto arrived = std::chrono::steady_clock::now();
    group.barrier();
    t0_ = std::chrono::steady_clock::now();
    g_wait_seconds += std::chrono::duration<double>(t0_ - arrived).count();
  }
  ~CommTimer() {
    if (!on_) return;
    synchronize(dev_);
    g_comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  Device dev_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};
}  // namespace

bool dispatch_timers_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOECORE_COMM_TIMERS");
    return v && std::strcmp(v, "0") != 0 && *v;
  }();
  return on;
}

DispatchCommTime take_dispatch_comm_time() {
  const DispatchCommTime t{g_comm_seconds + g_wait_seconds, g_wait_seconds};
  g_comm_seconds = g_wait_seconds = 0;
  return t;
}

TokenDispatcher::TokenDispatcher(comm::Communicator* ep, DispatcherType type, int64_t num_experts,
                                 comm::Communicator* etp, comm::Communicator* tp_ep)
    : ep_(ep), etp_(etp), type_(type), num_experts_(num_experts) {
  ep_size_ = ep ? ep->size() : 1;
  ep_rank_ = ep ? ep->rank() : 0;
  gather_ = etp ? tp_ep : ep;
  gather_size_ = gather_ ? gather_->size() : 1;
  MC_CHECK(!etp || (tp_ep && tp_ep->size() == etp->size() * ep_size_), "TokenDispatcher: the ETP x EP group must have ",
           "|ETP| x |EP| ranks");
  MC_CHECK(num_experts % ep_size_ == 0, "--num-experts ", num_experts, " is not divisible by ",
           "--expert-model-parallel-size ", ep_size_);
  local_experts_ = num_experts / ep_size_;
  first_expert_ = ep_rank_ * local_experts_;
}

namespace {
Shape with_rows(const Tensor& t, int64_t rows) {
  Shape s = t.shape();
  s[0] = rows;
  return s;
}
int64_t total(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }
}  // namespace

Tensor TokenDispatcher::all_to_all_rows(const Tensor& in, const std::vector<int64_t>& send,
                                        const std::vector<int64_t>& recv) const {
  Tensor out = Tensor::empty(with_rows(in, total(recv)), in.dtype(), in.device());
  CommTimer timer(*ep_);
  ep_->all_to_all(in, send, out, recv);
  return out;
}

Tensor TokenDispatcher::gather_rows(const Tensor& in) const {
  Tensor out = Tensor::empty(with_rows(in, in.size(0) * gather_size_), in.dtype(), in.device());
  CommTimer timer(*gather_);
  gather_->all_gather(in, out);
  return out;
}

Tensor TokenDispatcher::reduce_scatter_rows(const Tensor& in) const {
  Tensor out = Tensor::empty(with_rows(in, in.size(0) / gather_size_), in.dtype(), in.device());
  CommTimer timer(*gather_);
  gather_->reduce_scatter(in, out, comm::ReduceOp::Sum);
  return out;
}

Tensor TokenDispatcher::dispatch(const Tensor& x, const Tensor& indices, const Tensor& kept, int64_t pad,
                                 Ctx& ctx, bool device_rows) const {
  const Device dev = x.device();
  const int64_t hidden = x.size(1);
  ctx.tokens = x.size(0);
  ctx.topk = indices.size(1);
  if (allgather_path()) {
    const Tensor xg = gather_rows(x);
    const std::vector<int32_t> ids = gather_rows(indices).to_vector<int32_t>();
    std::vector<uint8_t> keep(ids.size(), 1);
    if (kept.defined()) keep = gather_rows(kept).to_vector<uint8_t>();
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
    const Shape s = with_rows(indices, indices.size(0) * gather_size_);
    ctx.routing = ops::make_moe_routing(Tensor::from_vector(local, s).to(dev), Tensor::from_vector(keep, s).to(dev),
                                        local_experts_, pad * gather_size_);
    Tensor expert_in = Tensor::empty({ctx.routing.num_rows, hidden}, x.dtype(), dev);
    ops::moe_permute_forward(xg, ctx.routing, expert_in);
    ctx.local_rows = {ctx.routing.host_tokens_per_expert, ctx.routing.row_offsets};
    return expert_in;
  }

  // One rank without ETP: the plan's counts need not come to the host when the expert GEMMs
  // read the device offsets (device_rows). Over EP they come through the all-gather below
  // instead of a copy of their own (on CUDA; the CPU plan has them anyway).
  ctx.routing = ops::make_moe_routing(indices, kept, num_experts_, pad, !ep_ && !(device_rows && !etp_));
  Tensor permuted = Tensor::empty({ctx.routing.num_rows, hidden}, x.dtype(), dev);
  ops::moe_permute_forward(x, ctx.routing, permuted);
  if (!ep_) {
    ctx.local_rows = {ctx.routing.host_tokens_per_expert, ctx.routing.row_offsets};
    return etp_ ? etp_gather(permuted, ctx, true) : permuted;
  }

  // alltoall: every rank learns every rank's per-expert row counts ([EP, E]: an all-gather of the
  // plan's device counts, then one copy to the host: the dispatch's only wait without ETP,
  // capacity dropping or padding). An id outside [0, E) is left out of the counts, so this
  // rank's counts then sum to fewer than the plan's rows: the plan's deferred check raises it
  // here, before the all-to-all would fail on the sizes. (Padded, each expert's count is the
  // capacity whatever the ids: the check then comes with the layer's statistics.)
  Tensor counts_all = Tensor::empty({ep_size_, num_experts_}, DType::I32, ep_->device());
  {
    CommTimer timer(*ep_);
    ep_->all_gather(ctx.routing.tokens_per_expert.view({1, num_experts_}), counts_all);
  }
  const std::vector<int32_t> all = counts_all.to_vector<int32_t>();
  auto count = [&](int64_t src, int64_t expert) {
    return static_cast<int64_t>(all[static_cast<size_t>(src * num_experts_ + expert)]);
  };
  int64_t my_rows = 0;
  for (int64_t e = 0; e < num_experts_; ++e) my_rows += count(ep_rank_, e);
  if (my_rows != ctx.routing.num_rows) ops::check_moe_routing(ctx.routing, indices);
  ctx.send_rows.assign(static_cast<size_t>(ep_size_), 0);
  ctx.recv_rows.assign(static_cast<size_t>(ep_size_), 0);
  std::vector<int64_t> local_counts(static_cast<size_t>(local_experts_), 0);  // received rows per local expert
  for (int64_t s = 0; s < ep_size_; ++s)
    for (int64_t l = 0; l < local_experts_; ++l) {
      ctx.send_rows[static_cast<size_t>(s)] += count(ep_rank_, s * local_experts_ + l);
      const int64_t c = count(s, first_expert_ + l);
      ctx.recv_rows[static_cast<size_t>(s)] += c;
      local_counts[static_cast<size_t>(l)] += c;
    }
  // Enqueued before the sort plan is built on the host, so the GPU has the transfer to run meanwhile.
  const Tensor received = all_to_all_rows(permuted, ctx.send_rows, ctx.recv_rows);
  // (source, local expert) chunks -> (local expert, source): a stable permutation by local expert,
  // planned from each received row's local expert (uploaded through pinned staging: no wait).
  const int64_t rows = total(ctx.recv_rows);
  Tensor local_ids = Tensor::empty({rows, 1}, DType::I32, Device::cpu());
  int32_t* id = local_ids.data<int32_t>();
  for (int64_t s = 0; s < ep_size_; ++s)
    for (int64_t l = 0; l < local_experts_; ++l) id = std::fill_n(id, count(s, first_expert_ + l), static_cast<int32_t>(l));
  ctx.sort = ops::make_moe_routing(uploader_->upload(local_ids, dev), Tensor(), local_experts_, 0, false);
  // The ids are ours and all in range, so the plan's deferred check has nothing to find; its
  // counts are the ones just summed.
  ctx.sort.host_tokens_per_expert = local_counts;
  Tensor expert_in = Tensor::empty({rows, hidden}, x.dtype(), dev);
  ops::moe_permute_forward(received, ctx.sort, expert_in);
  ctx.local_rows = {ctx.sort.host_tokens_per_expert, ctx.sort.row_offsets};
  return etp_ ? etp_gather(expert_in, ctx, true) : expert_in;
}

Tensor TokenDispatcher::etp_gather(const Tensor& rows, Ctx& ctx, bool plan) const {
  const Device dev = rows.device();
  const int64_t n = etp_->size(), hidden = rows.size(1);
  if (plan) {
    // Every ETP rank's rows per local expert ([ETP, L], one small all-gather).
    Tensor mine = Tensor::from_vector(ctx.local_rows.host, {1, local_experts_}).to(etp_->device());
    Tensor all = Tensor::empty({n, local_experts_}, DType::I64, etp_->device());
    {
      CommTimer timer(*etp_);
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
    CommTimer timer(*etp_);
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

Tensor TokenDispatcher::etp_reduce(const Tensor& sorted, Ctx& ctx) const {
  const Device dev = sorted.device();
  const int64_t n = etp_->size(), hidden = sorted.size(1), me = etp_->rank();
  Tensor rank_major = Tensor::empty({ctx.etp_sort.num_tokens, hidden}, sorted.dtype(), dev);
  ops::moe_permute_backward(sorted, ctx.etp_sort, rank_major);
  // reduce-scatter with per-rank row counts: rank r's segment goes to r; this rank's partials
  // from every ETP rank are summed in rank order.
  const int64_t mine = ctx.etp_rows[static_cast<size_t>(me)];
  std::vector<Tensor> parts;
  {
    CommTimer timer(*etp_);
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

// Without probs (the experts applied them) the combine is a plain sum of each token's rows, which
// is permute's backward, and its backward a copy of dout to the rows, permute's forward.
namespace {
void unpermute(const Tensor& rows, const Tensor& probs, const ops::MoeRouting& r, Tensor& out) {
  if (probs.defined()) {
    ops::moe_unpermute_forward(rows, probs, r, out);
  } else {
    ops::moe_permute_backward(rows, r, out);
  }
}
}  // namespace

Tensor TokenDispatcher::combine(const Tensor& expert_out, const Tensor& probs, Ctx& ctx) const {
  const Device dev = expert_out.device();
  const int64_t hidden = expert_out.size(1);
  Tensor out = Tensor::empty({ctx.tokens, hidden}, expert_out.dtype(), dev);
  // The backward reads the rows only for the probabilities' gradient: without probs they are
  // not kept (an activation buffer fewer).
  if (allgather_path()) {
    ctx.probs = probs.defined() ? gather_rows(probs) : Tensor();
    if (probs.defined()) ctx.unpermute_in = expert_out;
    Tensor partial = Tensor::empty({ctx.tokens * gather_size_, hidden}, expert_out.dtype(), dev);
    unpermute(expert_out, ctx.probs, ctx.routing, partial);
    return reduce_scatter_rows(partial);
  }
  ctx.probs = probs;
  const Tensor local_out = etp_ ? etp_reduce(expert_out, ctx) : expert_out;
  Tensor rows = local_out;
  if (ep_) {
    Tensor arrival = Tensor::empty({ctx.sort.num_tokens, hidden}, expert_out.dtype(), dev);
    ops::moe_permute_backward(local_out, ctx.sort, arrival);  // unsort: a gather by the sort plan
    rows = all_to_all_rows(arrival, ctx.recv_rows, ctx.send_rows);
  }
  unpermute(rows, ctx.probs, ctx.routing, out);
  if (probs.defined()) ctx.unpermute_in = rows;
  return out;
}

void TokenDispatcher::combine_backward(const Tensor& dout, Ctx& ctx, Tensor& d_expert_out, Tensor& dprobs) const {
  const Device dev = dout.device();
  const int64_t hidden = dout.size(1);
  dprobs = Tensor();
  if (allgather_path()) {
    const Tensor dout_all = gather_rows(dout);
    d_expert_out = Tensor::empty({ctx.routing.num_rows, hidden}, dout.dtype(), dev);
    if (!ctx.probs.defined()) {
      ops::moe_permute_forward(dout_all, ctx.routing, d_expert_out);
      return;
    }
    Tensor dprobs_all = Tensor::empty({ctx.tokens * gather_size_, ctx.topk}, ctx.probs.dtype(), dev);
    ops::moe_unpermute_backward(ctx.unpermute_in, ctx.probs, ctx.routing, dout_all, d_expert_out, dprobs_all);
    dprobs = reduce_scatter_rows(dprobs_all);
    return;
  }
  Tensor d_local = Tensor::empty({ctx.routing.num_rows, hidden}, dout.dtype(), dev);
  if (ctx.probs.defined()) {
    dprobs = Tensor::empty({ctx.tokens, ctx.topk}, ctx.probs.dtype(), dev);
    ops::moe_unpermute_backward(ctx.unpermute_in, ctx.probs, ctx.routing, dout, d_local, dprobs);
  } else {
    ops::moe_permute_forward(dout, ctx.routing, d_local);
  }
  if (!ep_) {
    d_expert_out = etp_ ? etp_gather(d_local, ctx, false) : d_local;
    return;
  }
  const Tensor d_arrival = all_to_all_rows(d_local, ctx.send_rows, ctx.recv_rows);
  d_expert_out = Tensor::empty({ctx.sort.num_rows, hidden}, dout.dtype(), dev);
  ops::moe_permute_forward(d_arrival, ctx.sort, d_expert_out);
  if (etp_) d_expert_out = etp_gather(d_expert_out, ctx, false);
}

// The probabilities travel the tokens' way: scattered to the permuted rows, then the same
// all-to-all, sort and ETP gather as dispatch() (each a [rows, 1] tensor).
Tensor TokenDispatcher::dispatch_probs(const Tensor& probs, Ctx& ctx) const {
  const Device dev = probs.device();
  Tensor rows = Tensor::empty({ctx.routing.num_rows, 1}, probs.dtype(), dev);
  ops::moe_permute_probs_forward(allgather_path() ? gather_rows(probs) : probs, ctx.routing, rows);
  if (allgather_path()) return rows;
  if (ep_) {
    const Tensor received = all_to_all_rows(rows, ctx.send_rows, ctx.recv_rows);
    rows = Tensor::empty({ctx.sort.num_rows, 1}, probs.dtype(), dev);
    ops::moe_permute_forward(received, ctx.sort, rows);
  }
  return etp_ ? etp_gather(rows, ctx, false) : rows;
}

// The reverse: ETP partial sums reduced (each ETP rank's gradient covers its slice of the FFN),
// unsorted, sent back, and gathered into [T, k]. allgather: zero for other ranks' experts, then
// summed by the reduce-scatter.
Tensor TokenDispatcher::dispatch_probs_backward(const Tensor& d_rows, Ctx& ctx) const {
  const Device dev = d_rows.device();
  if (allgather_path()) {
    Tensor all = Tensor::empty({ctx.tokens * gather_size_, ctx.topk}, d_rows.dtype(), dev);
    ops::moe_permute_probs_backward(d_rows, ctx.routing, all);
    return reduce_scatter_rows(all);
  }
  Tensor local = etp_ ? etp_reduce(d_rows, ctx) : d_rows;
  if (ep_) {
    Tensor arrival = Tensor::empty({ctx.sort.num_tokens, 1}, d_rows.dtype(), dev);
    ops::moe_permute_backward(local, ctx.sort, arrival);
    local = all_to_all_rows(arrival, ctx.recv_rows, ctx.send_rows);
  }
  Tensor dprobs = Tensor::empty({ctx.tokens, ctx.topk}, d_rows.dtype(), dev);
  ops::moe_permute_probs_backward(local, ctx.routing, dprobs);
  return dprobs;
}

Tensor TokenDispatcher::dispatch_backward(const Tensor& d_expert_in, Ctx& ctx) const {
  const Device dev = d_expert_in.device();
  const int64_t hidden = d_expert_in.size(1);
  if (allgather_path()) {
    Tensor dx_all = Tensor::empty({ctx.tokens * gather_size_, hidden}, d_expert_in.dtype(), dev);
    ops::moe_permute_backward(d_expert_in, ctx.routing, dx_all);
    return reduce_scatter_rows(dx_all);
  }
  const Tensor d_local_in = etp_ ? etp_reduce(d_expert_in, ctx) : d_expert_in;
  Tensor d_permuted = d_local_in;
  if (ep_) {
    Tensor d_arrival = Tensor::empty({ctx.sort.num_tokens, hidden}, d_expert_in.dtype(), dev);
    ops::moe_permute_backward(d_local_in, ctx.sort, d_arrival);
    d_permuted = all_to_all_rows(d_arrival, ctx.recv_rows, ctx.send_rows);
  }
  Tensor dx = Tensor::empty({ctx.tokens, hidden}, d_expert_in.dtype(), dev);
  ops::moe_permute_backward(d_permuted, ctx.routing, dx);
  return dx;
}

}  // namespace moecore
