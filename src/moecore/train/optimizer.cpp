#include "moecore/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "moecore/core/memory_categories.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/master_split.h"
#include "moecore/ops/reduce.h"

namespace moecore {

namespace {

double squares(const Tensor& t) {
  if (t.numel() == 0) return 0.0;
  Tensor out = Tensor::empty({1}, t.dtype(), t.device());
  ops::sum_squares(t, out);
  return t.dtype() == DType::F64 ? out.to_vector<double>()[0] : out.to_vector<float>()[0];
}

// A host scalar summed over a group (f64 through MPI, f32 through NCCL).
double sum_over(comm::Communicator* c, double v) {
  if (!c) return v;
  std::vector<double> values = {v};
  comm::all_reduce_host(*c, values);
  return values[0];
}

void scale(Tensor& t, double factor) {
  if (t.numel() > 0 && factor != 1.0) ops::axpby(static_cast<float>(factor), t, 0.0f, t, t);
}

// The element range [lo, hi) of a parameter inside its flat buffer that falls in [begin, end).
struct Overlap {
  int64_t lo = 0, hi = 0;
  bool empty() const { return hi <= lo; }
};
Overlap overlap(int64_t offset, int64_t numel, int64_t begin, int64_t end) {
  return {std::max(offset, begin), std::min(offset + numel, end)};
}

}  // namespace

std::pair<int64_t, int64_t> Optimizer::shard_multiples(const OptimizerGroups& g, bool distributed) {
  if (!distributed) return {1, 1};
  return {g.dp ? g.dp->size() : 1, g.edp ? g.edp->size() : 1};
}

Optimizer::Optimizer(ParamStore& store, const OptimizerGroups& groups, bool distributed, bool overlap,
                     double offload_fraction)
    : store_(store), groups_(groups), distributed_(distributed), overlap_(overlap) {
  MC_CHECK(offload_fraction >= 0 && offload_fraction <= 1, "optimizer offload fraction ", offload_fraction,
           "; expected 0 (none) or 0 < F <= 1");
  offload_fraction_ = offload_fraction;
  MC_CHECK(!offloaded() || !store_.param_remainders(), "--optimizer-cpu-offload with split masters (bf16 "
           "compute keeps each fp32 master as its bf16 weight and a 16-bit remainder) is not available: "
           "the host keeps whole fp32 masters; add --no-store-param-remainders");
  sharded_ = distributed_ || offloaded();
  if (groups_.embedding) {
    const std::string name = "embedding.word_embeddings.weight";
    const Param* tied = nullptr;
    for (const auto& p : store_.all())
      if (p->name == name) tied = p.get();
    MC_CHECK(tied && !tied->expert, "tied embeddings: a stage of the embedding group lacks '", name, "'");
    tied_ = {store_.grad_offset(*tied), store_.grad_offset(*tied) + tied->grad.numel()};
    tied_counted_ = groups_.embedding->rank() == 0;
  }
  if (overlap_) {
    compute_layer_ranges();
    if (store_.device().is_cuda()) {
      comm_stream_ = Stream::create(store_.device());
      has_comm_stream_ = true;
    }
  }
  if (!sharded_) return;
  for (bool expert : {false, true}) {
    Shard& s = expert ? expert_ : dense_;
    s.group = !distributed_ ? nullptr : expert ? groups_.edp : groups_.dp;
    const Tensor& buffer = expert ? store_.expert_grad_buffer() : store_.grad_buffer();
    const int64_t n = s.group ? s.group->size() : 1, r = s.group ? s.group->rank() : 0;
    MC_CHECK(buffer.numel() % n == 0, "distributed optimizer: a gradient buffer of ", buffer.numel(),
             " elements does not split over ", n, " ranks (initialize the ParamStore with shard_multiples)");
    const int64_t size = buffer.numel() / n;
    s.begin = r * size;
    s.end = s.begin + size;
    // The shard's gradients are this rank's slice of the gradient buffer: the reduce-scatter runs
    // in place (no second copy of the shard; a group of one needs no communication at all).
    s.grad = buffer.slice(0, s.begin, s.end);
    s.split = offloaded() ? offload_split(s, expert) : s.begin;
    setup_offload(s, expert);
    const MemoryCategoryScope scope(MemoryCategory::kOptimizerState);
    s.exp_avg = Tensor::zeros({s.end - s.split}, store_.exp_avg_dtype(), store_.device());
    s.exp_avg_sq = Tensor::zeros({s.end - s.split}, store_.exp_avg_sq_dtype(), store_.device());
  }
  if (offloaded() && store_.device().is_cuda()) {
    offload_stream_ = Stream::create(store_.device());
    has_offload_stream_ = true;
  }
  if (offloaded()) downloaded_ = std::make_unique<Event>(store_.device());
  // The shards replace the per-parameter Adam state.
  for (const auto& p : store_.all())
    if (p->trainable) p->exp_avg = p->exp_avg_sq = Tensor();
  if (store_.compute_dtype() != store_.master_dtype()) shard_masters();
}

Tensor Optimizer::Shard::state(const Tensor& device_part, const Tensor& host_part, int64_t lo, int64_t hi) const {
  if (hi <= split) return host_part.slice(0, lo - begin, hi - begin);
  MC_CHECK(lo >= split, "optimizer offload: elements [", lo, ", ", hi, ") straddle the host part's end ", split);
  return device_part.slice(0, lo - split, hi - split);
}

int64_t Optimizer::offload_split(const Shard& s, bool expert) const {
  if (offload_fraction_ >= 1.0) return s.end;
  // The piece boundary (a parameter's end within the shard, or its start) nearest to the fraction.
  const double target = static_cast<double>(s.begin) + offload_fraction_ * static_cast<double>(s.end - s.begin);
  int64_t best = s.begin;
  auto consider = [&](int64_t b) {
    const double d = std::abs(static_cast<double>(b) - target), db = std::abs(static_cast<double>(best) - target);
    if (d < db || (d == db && b > best)) best = b;
  };
  for (const auto& p : store_.all()) {
    if (!p->trainable || p->expert != expert) continue;
    const Overlap o = overlap(store_.grad_offset(*p), numel(*p), s.begin, s.end);
    if (!o.empty()) consider(o.hi);
  }
  return best;
}

namespace {
Tensor host_zeros(int64_t n, DType dtype) {  // pinned with CUDA (core/allocator.h)
  Tensor t = Tensor::empty_pinned({n}, dtype);
  if (n > 0) std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

// assign_cast between a host and a device tensor (or within one device).
void assign_cast_across(const Tensor& src, Tensor& dst) {
  if (src.device() == dst.device()) {
    ops::assign_cast(src, dst);
    return;
  }
  Tensor tmp = Tensor::empty(dst.shape(), dst.dtype(), src.device());
  ops::assign_cast(src, tmp);
  dst.copy_from(tmp);
}
}  // namespace

void Optimizer::setup_offload(Shard& s, bool expert) {
  const int64_t n = s.split - s.begin;
  if (n == 0) return;
  {
    const MemoryCategoryScope scope(MemoryCategory::kOptimizerState);
    s.host_exp_avg = host_zeros(n, store_.exp_avg_dtype());
    s.host_exp_avg_sq = host_zeros(n, store_.exp_avg_sq_dtype());
  }
  {
    const MemoryCategoryScope scope(MemoryCategory::kGradients);
    s.host_grad = host_zeros(n, store_.master_dtype());
  }
  const MemoryCategoryScope scope(MemoryCategory::kWeights);
  s.host_master = host_zeros(n, store_.master_dtype());
  s.host_master.copy_from(master_buffer_of_kind(expert).slice(0, s.begin, s.split));
  if (store_.compute_dtype() != store_.master_dtype()) s.host_weights = host_zeros(n, store_.compute_dtype());
  synchronize(store_.device());  // the pinned copy has landed before the host reads it
}

void Optimizer::start_grad_download() {
  const Device dev = store_.device();
  std::optional<StreamGuard> on_side;
  if (has_offload_stream_) {  // after the reduction on the compute stream
    Event reduced(dev);
    reduced.record(current_stream(dev));
    reduced.wait(offload_stream_);
    on_side.emplace(offload_stream_);
  }
  for (Shard* s : {&dense_, &expert_})
    if (s->split > s->begin) s->host_grad.copy_from(s->grad.slice(0, 0, s->split - s->begin));
  downloaded_->record(current_stream(dev));
}

void Optimizer::step_host(std::vector<ops::HostAdamWPiece>& pieces, float clip_scale, const Tensor* device_step) {
  downloaded_->synchronize();
  if (device_step) {
    ops::adamw_step_host(pieces, device_step->to(Device::cpu()));
  } else {
    ops::adamw_step_host(pieces, clip_scale);
  }
  if (sharded_masters_) return;  // the bf16 weights go up with the shard's (shard_weights)
  for (bool expert : {false, true}) {  // fp32 compute: the masters are the weights
    Shard& s = expert ? expert_ : dense_;
    if (s.split == s.begin) continue;
    Tensor dst = master_buffer_of_kind(expert).slice(0, s.begin, s.split);
    dst.copy_from(s.host_master);
  }
}

void Optimizer::shard_weights(Shard& s, Tensor& dst) {
  const int64_t host = s.split - s.begin, n = s.end - s.begin;
  if (host < n) {
    Tensor device_part = dst.slice(0, host, n);
    ops::cast(s.master, device_part);
  }
  if (host > 0) {
    Tensor host_part = dst.slice(0, 0, host);
    if (host_part.data_ptr() != s.host_weights.data_ptr()) host_part.copy_from(s.host_weights);
  }
}

Tensor Optimizer::shard_master_values(Shard& s) {
  if (s.split == s.begin) return s.master;
  Tensor all = Tensor::empty({s.end - s.begin}, store_.master_dtype(), store_.device());
  all.slice(0, 0, s.split - s.begin).copy_from(s.host_master);
  if (s.split < s.end) all.slice(0, s.split - s.begin, s.end - s.begin).copy_from(s.master);
  return all;
}

void Optimizer::compute_layer_ranges() {
  if (!layer_dense_.empty() || !layer_expert_.empty()) return;
  // Each decoder layer's slice of both buffers: "decoder.layers.<i>." parameters are registered together.
  const std::string prefix = "decoder.layers.";
  for (const auto& p : store_.all()) {
    if (!p->trainable || p->name.rfind(prefix, 0) != 0) continue;
    const size_t layer = std::stoul(p->name.substr(prefix.size()));
    std::vector<Range>& ranges = p->expert ? layer_expert_ : layer_dense_;
    if (ranges.size() <= layer) ranges.resize(layer + 1, Range{-1, -1});
    const int64_t begin = store_.grad_offset(*p), end = begin + (numel(*p) + 63) / 64 * 64;
    Range& r = ranges[layer];
    if (r.begin < 0) r = {begin, end};
    MC_CHECK(r.end == begin || r.begin == end || (begin >= r.begin && end <= r.end),
             "--overlap-grad-reduce: the gradients of decoder layer ", layer, " are not contiguous (parameter '",
             p->name, "')");
    r = {std::min(r.begin, begin), std::max(r.end, end)};
  }
}

void Optimizer::set_overlap_param_gather(bool on) {
  overlap_param_gather_ = on;
  if (!on) return;
  MC_CHECK(distributed_, "--overlap-param-gather needs the distributed optimizer");
  compute_layer_ranges();
  // Units: 0 = every element of a buffer before its last decoder layer's end that belongs to no
  // layer (the embedding; with virtual pipeline stages a tied embedding copy registered between
  // two chunks' layers), gathered first so that any reader finds it; then each decoder layer in
  // order; last = everything after the last layer (final norm, output layer). Together the units
  // cover every element of both buffers once.
  const size_t layers = std::max(layer_dense_.size(), layer_expert_.size());
  std::vector<GatherUnit> units(layers + 2);
  for (bool expert : {false, true}) {
    const std::vector<Range>& ranges = expert ? layer_expert_ : layer_dense_;
    const int64_t size = (expert ? store_.expert_grad_buffer() : store_.grad_buffer()).numel();
    std::vector<std::pair<Range, size_t>> present;  // (range, layer), by position in the buffer
    for (size_t l = 0; l < ranges.size(); ++l)
      if (ranges[l].begin >= 0 && ranges[l].end > ranges[l].begin) present.push_back({ranges[l], l});
    std::sort(present.begin(), present.end(), [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
    int64_t cursor = 0;
    for (const auto& [r, l] : present) {
      MC_CHECK(r.begin >= cursor, "--overlap-param-gather: decoder layer ", l, "'s parameters overlap another layer's in the ",
               expert ? "expert" : "dense", " buffer");
      if (r.begin > cursor) (expert ? units.front().expert : units.front().dense).push_back({cursor, r.begin});
      (expert ? units[l + 1].expert : units[l + 1].dense).push_back(r);
      cursor = r.end;
    }
    // A buffer without decoder layers here (a chunk of none): all of it in unit 0, which every
    // wait covers (the units run in order), rather than in the last unit, which the embedding's
    // wait would not.
    GatherUnit& tail = present.empty() ? units.front() : units.back();
    if (size > cursor) (expert ? tail.expert : tail.dense).push_back({cursor, size});
  }
  gather_units_ = std::move(units);
  gather_events_.clear();
  if (has_comm_stream_)
    for (size_t u = 0; u < gather_units_.size(); ++u) gather_events_.push_back(std::make_unique<Event>(store_.device()));
}

Tensor& Optimizer::gathered_buffer(bool expert) {
  if (sharded_masters_) return (expert ? expert_ : dense_).weights;
  return expert ? store_.expert_master_buffer() : store_.master_buffer();
}

void Optimizer::gather_range(bool expert, Range r) {
  Shard& s = expert ? expert_ : dense_;
  comm::Communicator* group = expert ? groups_.edp_gather : groups_.dp_gather;
  if (!group) group = s.group;
  if (!group || r.end <= r.begin) return;
  MC_CHECK(group->size() == (s.group ? s.group->size() : 1), "--overlap-param-gather: the gather group has ",
           group->size(), " ranks, the shard group ", s.group ? s.group->size() : 1);
  Tensor& buffer = gathered_buffer(expert);
  const int64_t size = s.end - s.begin;
  group->group_start();
  for (int owner = 0; owner < group->size(); ++owner) {
    const int64_t lo = std::max(r.begin, owner * size), hi = std::min(r.end, (owner + 1) * size);
    if (lo >= hi) continue;
    Tensor piece = buffer.slice(0, lo, hi);
    group->broadcast(piece, owner);  // in place: the owner's updated piece everywhere
  }
  group->group_end();
}

void Optimizer::start_param_gather() {
  const Device dev = store_.device();
  std::optional<StreamGuard> on_comm;
  if (has_comm_stream_) {  // after the step's updates on the compute stream
    Event updated(dev);
    updated.record(current_stream(dev));
    updated.wait(comm_stream_);
    on_comm.emplace(comm_stream_);
  }
  for (size_t u = 0; u < gather_units_.size(); ++u) {
    for (const Range& r : gather_units_[u].dense) gather_range(false, r);
    for (const Range& r : gather_units_[u].expert) gather_range(true, r);
    if (has_comm_stream_) gather_events_[u]->record(comm_stream_);
  }
  gathers_pending_ = has_comm_stream_;
}

void Optimizer::wait_params(int64_t unit) {
  if (!gathers_pending_) return;
  // -1: the embedding's unit; a decoder layer past this rank's layers (or num_layers): the last unit.
  const int64_t last = static_cast<int64_t>(gather_units_.size()) - 1;
  const int64_t u = unit < 0 ? 0 : std::min(unit + 1, last);
  gather_events_[static_cast<size_t>(u)]->wait(current_stream(store_.device()));
}

void Optimizer::wait_all_params() {
  if (!gathers_pending_) return;
  gather_events_.back()->wait(current_stream(store_.device()));  // the units run in order
  gathers_pending_ = false;
}

void Optimizer::shard_masters() {
  sharded_masters_ = true;
  const MemoryCategoryScope scope(MemoryCategory::kWeights);  // this rank's masters, the gathered weights
  if (store_.param_remainders()) {
    // Split masters: the store's high halves are already the flat bf16 weights; this rank keeps
    // the remainders of its shard only.
    for (bool expert : {false, true}) {
      Shard& s = expert ? expert_ : dense_;
      s.weights = store_.high_buffer(expert);
      s.remainder = store_.remainder_buffer(expert).slice(0, s.begin, s.end).clone();
    }
    store_.release_remainder_buffers();
    return;
  }
  for (bool expert : {false, true}) {
    Shard& s = expert ? expert_ : dense_;
    const Tensor& masters = expert ? store_.expert_master_buffer() : store_.master_buffer();
    s.master = masters.slice(0, s.split, s.end).clone();  // [begin, split): host_master (CPU offload)
    s.weights = Tensor::zeros({masters.numel()}, store_.compute_dtype(), store_.device());
  }
  for (const auto& p : store_.all()) {
    if (!p->trainable) continue;
    // The router computes in fp32 (or, on the CPU, fp64): a whole master of its own, cast into its weight.
    if (p->compute_dtype != store_.compute_dtype()) {
      const bool aliased = p->weight.data_ptr() == p->master.data_ptr();
      p->master = p->master.clone();
      if (aliased) p->weight = p->master;
      continue;
    }
    // bf16 weights become views of the flat weight buffer; the whole fp32 master goes away.
    Shard& s = shard_of(*p);
    const int64_t offset = store_.grad_offset(*p);
    Tensor w = s.weights.slice(0, offset, offset + numel(*p)).view(p->shape);
    w.copy_from(p->weight);
    p->weight = w;
    p->master = Tensor();
  }
  store_.release_master_buffers();
}

Optimizer::~Optimizer() {
  if (gathers_pending_) comm_stream_.synchronize();  // no communicator goes away under a running gather
  if (has_comm_stream_) comm_stream_.destroy();
  if (has_offload_stream_) {
    offload_stream_.synchronize();
    offload_stream_.destroy();
  }
}

void Optimizer::reduce_range(bool expert, Range r) {
  if (r.end <= r.begin) return;
  std::vector<Range>& done = expert ? done_expert_ : done_dense_;
  for (const Range& d : done)
    MC_CHECK(r.end <= d.begin || r.begin >= d.end, "gradient range [", r.begin, ", ", r.end, ") reduced twice");
  done.push_back(r);
  Tensor& buffer = expert ? store_.expert_grad_buffer() : store_.grad_buffer();
  if (distributed_) {
    // Each element summed at the rank whose shard holds it: one reduce per owner of a piece of
    // the range, in one group (a reduce-scatter with uneven pieces, in place).
    Shard& s = expert ? expert_ : dense_;
    if (!s.group) return;
    const int64_t size = s.end - s.begin;
    s.group->group_start();
    for (int owner = 0; owner < s.group->size(); ++owner) {
      const int64_t lo = std::max(r.begin, owner * size), hi = std::min(r.end, (owner + 1) * size);
      if (lo >= hi) continue;
      Tensor piece = buffer.slice(0, lo, hi);
      s.group->reduce(piece, owner, comm::ReduceOp::Sum);
    }
    s.group->group_end();
    return;
  }
  Tensor slice = buffer.slice(0, r.begin, r.end);
  if (expert) {
    if (groups_.edp) groups_.edp->all_reduce(slice, comm::ReduceOp::Sum);
  } else if (groups_.dp) {
    groups_.dp->all_reduce(slice, dense_averages() ? comm::ReduceOp::Avg : comm::ReduceOp::Sum);
  }
}

void Optimizer::reduce_tensor_parallel(int64_t layer) {
  if (!groups_.tp) return;
  const auto& params = store_.all();
  tp_done_.resize(params.size(), false);
  const std::string prefix = layer >= 0 ? "decoder.layers." + std::to_string(layer) + "." : "";
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    if (!p.trainable || !p.tp_partial_grad || tp_done_[i] || p.name.rfind(prefix, 0) != 0) continue;
    groups_.tp->all_reduce(p.grad_to_accumulate(), comm::ReduceOp::Sum);  // zeroed first if nothing wrote it
    tp_done_[i] = true;
  }
}

void Optimizer::reduce_tied_embedding() {
  if (!groups_.embedding) return;
  Tensor slice = store_.grad_buffer().slice(0, tied_.begin, tied_.end);
  groups_.embedding->all_reduce(slice, comm::ReduceOp::Sum);
}

double Optimizer::dense_squares(const Tensor& t, int64_t t_begin) {
  if (groups_.tp) {
    // Per parameter: a TP part counts fully, a replicated parameter 1 / TP (every TP rank holds
    // it), the tied copy of the last stage not at all. One device result per parameter, read once.
    const int64_t n = t.numel(), end = t_begin + n;
    std::vector<double> weights;
    std::vector<Overlap> ranges;
    for (const auto& p : store_.all()) {
      if (!p->trainable || p->expert) continue;
      const int64_t offset = store_.grad_offset(*p);
      const Overlap o = overlap(offset, numel(*p), t_begin, end);
      if (o.empty() || (!tied_counted_ && offset == tied_.begin)) continue;
      ranges.push_back(o);
      weights.push_back(p->part_size > 1 ? 1.0 : 1.0 / static_cast<double>(groups_.tp->size()));
    }
    if (ranges.empty()) return 0.0;
    Tensor results = Tensor::zeros({static_cast<int64_t>(ranges.size())}, t.dtype(), t.device());
    for (size_t i = 0; i < ranges.size(); ++i) {
      Tensor out = results.slice(0, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
      ops::sum_squares(t.slice(0, ranges[i].lo - t_begin, ranges[i].hi - t_begin), out);
    }
    std::vector<double> v;
    if (t.dtype() == DType::F64) {
      v = results.to_vector<double>();
    } else {
      for (float f : results.to_vector<float>()) v.push_back(f);
    }
    double total = 0;
    for (size_t i = 0; i < v.size(); ++i) total += weights[i] * v[i];
    return total;
  }
  if (tied_counted_ || tied_.end <= tied_.begin) return squares(t);
  // Leave out the tied copy's elements (the first stage counts them).
  const int64_t n = t.numel();
  const int64_t lo = std::clamp<int64_t>(tied_.begin - t_begin, 0, n), hi = std::clamp<int64_t>(tied_.end - t_begin, 0, n);
  return squares(t.slice(0, 0, lo)) + squares(t.slice(0, hi, n));
}

void Optimizer::layer_ready(int64_t layer) {
  if (!overlap_) return;
  const MemoryCategoryScope scope(MemoryCategory::kCommunication);  // the overlapped reduction's buffers
  const size_t l = static_cast<size_t>(layer);
  const Range dense = l < layer_dense_.size() ? layer_dense_[l] : Range{};
  const Range expert = l < layer_expert_.size() ? layer_expert_[l] : Range{};
  store_.zero_stale_grads(false, dense.begin, dense.end);  // gradients the backward did not write
  store_.zero_stale_grads(true, expert.begin, expert.end);
  reduce_tensor_parallel(layer);  // on the compute stream, before the data-parallel reduction
  if (!has_comm_stream_) {  // CPU: MPI reduces at once
    reduce_range(false, dense);
    reduce_range(true, expert);
    return;
  }
  // The layer's gradients were produced on the compute stream: the communication stream waits for them.
  Event ready(store_.device());
  ready.record(current_stream(store_.device()));
  ready.wait(comm_stream_);
  StreamGuard on_comm(comm_stream_);
  reduce_range(false, dense);
  reduce_range(true, expert);
}

void Optimizer::reduce_gradients() {
  const double expert_scale = 1.0 / static_cast<double>(groups_.dp_size);
  // Dense: an average over DP; with CP a sum over DP x CP, then this factor.
  const double dense_scale = dense_averages() ? 1.0 : 1.0 / static_cast<double>(groups_.dp_size);
  store_.zero_stale_grads();  // gradients no producer wrote this step (ParamStore::mark_grads_stale)
  reduce_tensor_parallel(-1);
  tp_done_.assign(tp_done_.size(), false);
  if (overlap_) {
    // Everything not reduced during the backward: the complement of the done ranges.
    for (bool expert : {false, true}) {
      std::vector<Range> done = expert ? done_expert_ : done_dense_;
      std::sort(done.begin(), done.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
      const int64_t n = (expert ? store_.expert_grad_buffer() : store_.grad_buffer()).numel();
      std::vector<Range> rest;
      int64_t at = 0;
      for (const Range& d : done) {
        if (d.begin > at) rest.push_back({at, d.begin});
        at = std::max(at, d.end);
      }
      if (at < n) rest.push_back({at, n});
      if (!has_comm_stream_) {
        if (!expert) reduce_tied_embedding();
        for (const Range& r : rest) reduce_range(expert, r);
        continue;
      }
      // One communicator is never used on two streams at once: the rest goes on the
      // communication stream too, after the end of the backward.
      Event ready(store_.device());
      ready.record(current_stream(store_.device()));
      ready.wait(comm_stream_);
      StreamGuard on_comm(comm_stream_);
      if (!expert) reduce_tied_embedding();  // after the layers' reductions, in the same order on every rank
      for (const Range& r : rest) reduce_range(expert, r);
    }
    if (has_comm_stream_) {
      Event reduced(store_.device());
      reduced.record(comm_stream_);
      reduced.wait(current_stream(store_.device()));
    }
    done_dense_.clear();
    done_expert_.clear();
    if (distributed_) {  // the shards hold sums (the rest of the buffers partial sums, unused)
      scale(expert_.grad, expert_scale);
      scale(dense_.grad, 1.0 / static_cast<double>(groups_.dp_size));
      return;
    }
    scale(store_.expert_grad_buffer(), expert_scale);
    scale(store_.grad_buffer(), dense_scale);
    return;
  }
  reduce_tied_embedding();
  if (!distributed_) {
    if (groups_.dp && store_.grad_buffer().numel() > 0) {
      groups_.dp->all_reduce(store_.grad_buffer(), dense_averages() ? comm::ReduceOp::Avg : comm::ReduceOp::Sum);
      scale(store_.grad_buffer(), dense_scale);
    }
    if (store_.expert_grad_buffer().numel() > 0) {
      if (groups_.edp) groups_.edp->all_reduce(store_.expert_grad_buffer(), comm::ReduceOp::Sum);
      scale(store_.expert_grad_buffer(), expert_scale);
    }
    return;
  }
  for (bool expert : {false, true}) {
    Shard& s = expert ? expert_ : dense_;
    Tensor& buffer = expert ? store_.expert_grad_buffer() : store_.grad_buffer();
    if (buffer.numel() == 0) continue;
    // In place; the buffer outside the shard keeps partial sums until the next backward overwrites them.
    if (s.group) s.group->reduce_scatter(buffer, s.grad, comm::ReduceOp::Sum);
    scale(s.grad, expert ? expert_scale : 1.0 / static_cast<double>(groups_.dp_size));
  }
}

Tensor Optimizer::grad_norm_sq_parts() {
  const Tensor& dense_grads = store_.grad_buffer();
  const Tensor& expert_grads = store_.expert_grad_buffer();
  const bool one_rank = !groups_.tp && !groups_.pp && !groups_.ep && !groups_.etp;
  if (!distributed_ && one_rank && (tied_counted_ || tied_.end <= tied_.begin) && dense_grads.numel() > 0 &&
      (expert_grads.numel() == 0 || dense_grads.dtype() == expert_grads.dtype())) {
    // The usual one-GPU case: the sums of squares stay on the device.
    const int64_t parts = expert_grads.numel() > 0 ? 2 : 1;
    Tensor out = Tensor::empty({parts}, dense_grads.dtype(), dense_grads.device());
    Tensor first = out.slice(0, 0, 1);
    ops::sum_squares(dense_grads, first);
    if (parts == 2) {
      Tensor second = out.slice(0, 1, 2);
      ops::sum_squares(expert_grads, second);
    }
    return out;
  }
  return Tensor::from_vector(std::vector<double>{host_grad_norm_sq()}, {1}).to(store_.device());
}

double Optimizer::grad_norm_sq() {
  const Tensor parts = grad_norm_sq_parts().to(Device::cpu());
  double total = 0.0;  // as ops::decide_adamw_step sums them
  for (int64_t i = 0; i < parts.numel(); ++i)
    total = total + (parts.dtype() == DType::F64 ? parts.data<double>()[i] : static_cast<double>(parts.data<float>()[i]));
  return total;
}

double Optimizer::host_grad_norm_sq() {
  if (!distributed_)
    return sum_over(groups_.pp, sum_over(groups_.tp, dense_squares(store_.grad_buffer(), 0)) +
                                    sum_over(groups_.ep, sum_over(groups_.etp, squares(store_.expert_grad_buffer()))));
  const double dense = sum_over(groups_.tp, sum_over(dense_.group, dense_squares(dense_.grad, dense_.begin)));
  return sum_over(groups_.pp,
                  dense + sum_over(groups_.ep, sum_over(groups_.etp, sum_over(expert_.group, squares(expert_.grad)))));
}

double Optimizer::joined_squares(bool expert, const Tensor& high, const Tensor& remainder, int64_t begin) {
  // The fp32 masters a chunk at a time (a bounded temporary), summed as dense_squares / squares do.
  constexpr int64_t kChunk = int64_t{1} << 24;
  double total = 0;
  for (int64_t lo = 0; lo < high.numel(); lo += kChunk) {
    const int64_t hi = std::min(high.numel(), lo + kChunk);
    Tensor master = Tensor::empty({hi - lo}, DType::F32, high.device());
    ops::join_master(high.slice(0, lo, hi), remainder.slice(0, lo, hi), master);
    total += expert ? squares(master) : dense_squares(master, begin + lo);
  }
  return total;
}

double Optimizer::params_norm_sq() {
  wait_all_params();
  if (store_.param_remainders()) {
    auto part = [&](bool expert) {
      if (sharded_masters_) {
        const Shard& s = expert ? expert_ : dense_;
        return sum_over(s.group, joined_squares(expert, s.weights.slice(0, s.begin, s.end), s.remainder, s.begin));
      }
      return joined_squares(expert, store_.high_buffer(expert), store_.remainder_buffer(expert), 0);
    };
    // One statement each: every rank must issue the host collectives in the same order.
    const double dense = sum_over(groups_.tp, part(false));
    const double expert = sum_over(groups_.ep, sum_over(groups_.etp, part(true)));
    return sum_over(groups_.pp, dense + expert);
  }
  if (sharded_masters_) {
    const double dense =
        sum_over(groups_.tp, sum_over(dense_.group, dense_squares(shard_master_values(dense_), dense_.begin)));
    return sum_over(groups_.pp, dense + sum_over(groups_.ep, sum_over(groups_.etp, sum_over(expert_.group,
                                                                       squares(shard_master_values(expert_))))));
  }
  return sum_over(groups_.pp, sum_over(groups_.tp, dense_squares(store_.master_buffer(), 0)) +
                                  sum_over(groups_.ep, sum_over(groups_.etp, squares(store_.expert_master_buffer()))));
}

void Optimizer::step(const AdamHyper& h, double lr, float clip_scale, int64_t step) {
  step_with(h, lr, clip_scale, step, nullptr);
}

void Optimizer::step(const AdamHyper& h, const Tensor& device_step) {
  step_with(h, 0.0, 1.0f, 1, &device_step);  // lr and step: placeholders, the device step holds them
}

void Optimizer::step_with(const AdamHyper& h, double lr, float clip_scale, int64_t step, const Tensor* device_step) {
  // Replicated state: the AdamW kernel also writes the bf16 compute weight of an f32 master in
  // the same pass (no second read of the masters to refresh them).
  auto writes_weight = [&](const Param& p) {
    return !sharded_ && p.trainable && p.master.defined() && p.master.dtype() == DType::F32 &&
           p.weight.dtype() == DType::BF16 && p.weight.data_ptr() != p.master.data_ptr();
  };
  const bool split = store_.param_remainders();
  wait_all_params();  // the last step's gathers read the shards this step writes
  std::vector<ops::HostAdamWPiece> host_pieces;  // CPU offload: updated on the host after the device's
  if (offloaded()) start_grad_download();
  for (const auto& p : store_.all()) {
    if (!p->trainable) continue;
    const ops::AdamWConfig c{lr, h.beta1, h.beta2, h.eps, p->weight_decay ? h.weight_decay : 0.0, step};
    // With coefficients from the host (c, clip_scale) or from the device step.
    auto update = [&](Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, Tensor* weight) {
      if (device_step) {
        ops::adamw_step(master, grad, m, v, *device_step, p->weight_decay, weight);
      } else {
        ops::adamw_step(master, grad, m, v, c, clip_scale, weight);
      }
    };
    auto update_split = [&](Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& m, Tensor& v) {
      if (device_step) {
        ops::adamw_step_split(high, remainder, grad, m, v, *device_step, p->weight_decay);
      } else {
        ops::adamw_step_split(high, remainder, grad, m, v, c, clip_scale);
      }
    };
    if (!sharded_) {
      if (split) {  // the halves in place: the high half is the fresh bf16 weight
        update_split(p->high, p->remainder, p->grad, p->exp_avg, p->exp_avg_sq);
      } else {
        update(p->master, p->grad, p->exp_avg, p->exp_avg_sq, writes_weight(*p) ? &p->weight : nullptr);
      }
      continue;
    }
    Shard& s = shard_of(*p);
    const int64_t offset = store_.grad_offset(*p);
    const Overlap o = overlap(offset, numel(*p), s.begin, s.end);
    if (o.empty()) continue;
    if (o.hi <= s.split) {  // offloaded
      auto part = [&](const Tensor& t) { return t.slice(0, o.lo - s.begin, o.hi - s.begin); };
      host_pieces.push_back({part(s.host_master), part(s.host_grad), part(s.host_exp_avg), part(s.host_exp_avg_sq),
                             s.host_weights.defined() ? part(s.host_weights) : Tensor(), c});
      continue;
    }
    Tensor m = s.state(s.exp_avg, s.host_exp_avg, o.lo, o.hi);
    Tensor v = s.state(s.exp_avg_sq, s.host_exp_avg_sq, o.lo, o.hi);
    const Tensor grad = s.grad.slice(0, o.lo - s.begin, o.hi - s.begin);
    if (split) {
      Tensor high = s.weights.slice(0, o.lo, o.hi), remainder = s.remainder.slice(0, o.lo - s.begin, o.hi - s.begin);
      update_split(high, remainder, grad, m, v);
      continue;
    }
    Tensor master = sharded_masters_ ? s.state(s.master, s.host_master, o.lo, o.hi)
                                     : master_buffer_of(*p).slice(0, o.lo, o.hi);
    update(master, grad, m, v, nullptr);
  }
  if (offloaded()) step_host(host_pieces, clip_scale, device_step);
  if (overlap_param_gather_) {
    if (sharded_masters_ && !split)  // this shard's bf16 weights in place, where its owner broadcasts them
      for (bool expert : {false, true}) {
        Shard& s = expert ? expert_ : dense_;
        if (s.weights.numel() == 0) continue;
        Tensor mine = s.weights.slice(0, s.begin, s.end);
        shard_weights(s, mine);
      }
    start_param_gather();
  } else if (fp8_gather_) {
    gather_fp8_params(split);
  } else if (sharded_masters_) {
    for (bool expert : {false, true}) {
      Shard& s = expert ? expert_ : dense_;
      if (s.weights.numel() == 0) continue;
      if (!s.group) {  // one rank, one shard: the weights in place (split: the high halves already are)
        if (!split) {
          Tensor own = s.weights.slice(0, s.begin, s.end);
          shard_weights(s, own);
        }
        continue;
      }
      // This shard in bf16, then every rank's: the whole bf16 weights everywhere.
      Tensor mine = Tensor::empty({s.end - s.begin}, s.weights.dtype(), s.weights.device());
      if (split) {  // the updated high halves (a copy: MPI forbids overlapping buffers)
        mine.copy_from(s.weights.slice(0, s.begin, s.end));
      } else {
        shard_weights(s, mine);
      }
      s.group->all_gather(mine, s.weights);
    }
  } else if (distributed_) {
    for (bool expert : {false, true}) {
      Shard& s = expert ? expert_ : dense_;
      Tensor& masters = expert ? store_.expert_master_buffer() : store_.master_buffer();
      if (!s.group || masters.numel() == 0) continue;
      const Tensor mine = masters.slice(0, s.begin, s.end).clone();  // MPI forbids overlapping buffers
      s.group->all_gather(mine, masters);
    }
  }
  if (sharded_masters_) {
    for (const auto& p : store_.all()) {  // fp32-compute parameters: their whole master from the shards
      if (!p->trainable) continue;
      if (p->master.defined()) p->master.copy_from(shard_master(*p));
      else if (split && p->weight.data_ptr() != p->high.data_ptr()) ops::assign_cast(shard_master(*p), p->weight);
    }
  }
  store_.refresh_compute_weights(writes_weight);
  store_.mark_grads_stale();  // the next backward overwrites them (no zero-fill pass)
}

void Optimizer::set_fp8_param_gather() {
  MC_CHECK(store_.fp8() && store_.fp8()->param_gather(), "set_fp8_param_gather: the store's Fp8Context has no param gather");
  MC_CHECK(distributed_ && sharded_masters_, "--fp8-param-gather needs --use-distributed-optimizer with --bf16 (the bf16 "
           "weights it replaces; with fp32 parameters the fp32 masters are the weights and are gathered whole)");
  MC_CHECK(!overlap_param_gather_, "--fp8-param-gather with --overlap-param-gather is not supported yet: drop one of them");
  MC_CHECK(!offloaded(), "--fp8-param-gather with --optimizer-cpu-offload is not supported yet: drop one of them");
  const MemoryCategoryScope scope(MemoryCategory::kWeights);  // the FP8 codes and factors
  fp8_gather_ = std::make_unique<Fp8ParamGather>(store_, *store_.fp8());
}

Fp8ParamGather::Volume Optimizer::param_gather_volume() const {
  if (fp8_gather_) return fp8_gather_->volume();
  Fp8ParamGather::Volume v;
  if (sharded_masters_)
    for (const Shard* s : {&dense_, &expert_})
      if (s->group && s->group->size() > 1) v.bf16_elements += s->weights.numel();
  return v;
}

void Optimizer::gather_fp8_params(bool split) {
  // This rank's shard of the bf16 weights in place (split masters: the high halves already are),
  // the FP8 weights from it as codes, then the other weights in bf16, each owner broadcasting.
  for (bool expert : {false, true}) {
    Shard& s = expert ? expert_ : dense_;
    if (s.weights.numel() == 0) continue;
    if (!split) {
      Tensor own = s.weights.slice(0, s.begin, s.end);
      shard_weights(s, own);
    }
    fp8_gather_->gather(expert, s.group, s.weights, s.begin, s.end);
    for (const Fp8ParamGather::Range& r : fp8_gather_->other_ranges(expert)) gather_range(expert, {r.begin, r.end});
  }
}

Tensor Optimizer::full_rows(const Param& p, const Tensor& local) {
  Tensor mine = local.contiguous();
  if (p.part_size > 1) {  // this rank's experts (or dense tensor) whole: every ETP (TP) part, assembled
    Shape parts_shape = p.shape;
    parts_shape[0] *= p.part_size;
    Tensor parts = Tensor::empty(parts_shape, local.dtype(), local.device());
    comm::Communicator* group = p.expert ? groups_.etp : groups_.tp;
    MC_CHECK(group && group->size() == p.part_size, "'", p.name, "' is split in ", p.part_size,
             " parts but its group has ", group ? group->size() : 1, " ranks");
    group->all_gather(mine, parts);
    mine = part_assemble(p, parts).to(local.device());
  }
  if (!is_expert_group_split(p)) return mine;
  Tensor full = Tensor::empty(p.full_shape(), local.dtype(), local.device());
  groups_.ep->all_gather(mine, full);
  return full;
}

Tensor Optimizer::assemble(const Param& p, Shard& s, const std::function<void(Range part, Tensor& dst)>& fill) {
  // Zeros outside this rank's shard, then a sum over the group: each element has one owner.
  Tensor t = Tensor::zeros(p.shape, store_.master_dtype(), store_.device());
  const int64_t offset = store_.grad_offset(p), n = numel(p);
  const Overlap o = overlap(offset, n, s.begin, s.end);
  if (!o.empty()) {
    Tensor dst = t.view({n}).slice(0, o.lo - offset, o.hi - offset);
    fill({o.lo, o.hi}, dst);
  }
  if (s.group) s.group->all_reduce(t, comm::ReduceOp::Sum);
  return t;
}

Tensor Optimizer::param_state(const Param& p, Shard& s, const Tensor& device_part, const Tensor& host_part) {
  // In the master dtype (bf16 moments are widened exactly: checkpoints hold f32 moments).
  return assemble(p, s, [&](Range r, Tensor& dst) { assign_cast_across(s.state(device_part, host_part, r.begin, r.end), dst); });
}

Tensor Optimizer::shard_master(const Param& p) {
  Shard& s = shard_of(p);
  if (!store_.param_remainders()) return param_state(p, s, s.master, s.host_master);
  return assemble(p, s, [&](Range r, Tensor& dst) {  // the joined halves
    ops::join_master(s.weights.slice(0, r.begin, r.end), s.remainder.slice(0, r.begin - s.begin, r.end - s.begin), dst);
  });
}

void Optimizer::full_state(const std::function<void(const std::string& name, const Tensor& full)>& sink) {
  wait_all_params();
  for (const auto& p : store_.all()) {
    const bool from_shards = sharded_masters_ && p->trainable && !p->master.defined();
    sink(p->name, full_rows(*p, from_shards ? shard_master(*p) : store_.master_value(*p)));
    if (!p->trainable) continue;
    Tensor m = p->exp_avg, v = p->exp_avg_sq;
    if (sharded_) {
      Shard& s = shard_of(*p);
      m = param_state(*p, s, s.exp_avg, s.host_exp_avg);
      v = param_state(*p, s, s.exp_avg_sq, s.host_exp_avg_sq);
    }
    m = ops::cast_to(m, store_.master_dtype());  // bf16 moments are saved widened (exactly) to f32
    v = ops::cast_to(v, store_.master_dtype());
    sink(p->name + ".exp_avg", full_rows(*p, m));
    sink(p->name + ".exp_avg_sq", full_rows(*p, v));
  }
}

std::vector<NamedTensor> Optimizer::full_state(bool keep) {
  std::vector<NamedTensor> out;
  full_state([&](const std::string& name, const Tensor& full) {
    if (keep) out.push_back({name, full.to(Device::cpu())});
  });
  return out;
}

std::vector<TensorSpec> Optimizer::state_specs() const {
  std::vector<TensorSpec> out;
  const DType dt = store_.master_dtype();
  for (const auto& p : store_.all()) {
    out.push_back({p->name, dt, p->full_shape()});
    if (!p->trainable) continue;
    out.push_back({p->name + ".exp_avg", dt, p->full_shape()});
    out.push_back({p->name + ".exp_avg_sq", dt, p->full_shape()});
  }
  return out;
}

void Optimizer::load(const TensorFetch& fetch, bool model_only) {
  wait_all_params();
  // This rank's rows of a full tensor, on the model's device.
  auto local_rows = [&](const Param& p, const Tensor& full) {
    const Tensor rows = p.expert ? full.slice(0, p.row_offset, p.row_offset + p.shape[0]).contiguous() : full;
    return (p.part_size > 1 ? part_take(p, rows) : rows).to(store_.device());
  };
  for (const auto& p : store_.all()) {
    const DType dt = store_.master_dtype();
    const Tensor saved = fetch(p->name, p->full_shape(), dt);
    if (!saved.defined()) continue;  // FP8 delayed-scaling state not in the checkpoint: kept empty
    const Tensor master = local_rows(*p, saved);
    if (p->master.defined() || p->remainder.defined()) store_.set_master(*p, master);
    if (sharded_masters_ && p->trainable && store_.param_remainders()) {
      // Split masters: the whole high half (the weights), this rank's shard of the remainders.
      Shard& s = shard_of(*p);
      Tensor high = Tensor::empty(p->shape, DType::BF16, store_.device());
      Tensor remainder = Tensor::empty(p->shape, DType::I16, store_.device());
      ops::split_master(master.contiguous(), high, remainder);
      p->high.copy_from(high);
      if (p->weight.data_ptr() != p->high.data_ptr()) ops::assign_cast(master, p->weight);  // fp32 / fp64 compute
      const int64_t offset = store_.grad_offset(*p);
      const Overlap o = overlap(offset, numel(*p), s.begin, s.end);
      if (!o.empty())
        s.remainder.slice(0, o.lo - s.begin, o.hi - s.begin)
            .copy_from(remainder.view({numel(*p)}).slice(0, o.lo - offset, o.hi - offset));
    } else if (sharded_masters_ && p->trainable) {  // this rank's shard of the master, and the bf16 weight
      Shard& s = shard_of(*p);
      const int64_t offset = store_.grad_offset(*p);
      const Overlap o = overlap(offset, numel(*p), s.begin, s.end);
      if (!o.empty())
        s.state(s.master, s.host_master, o.lo, o.hi).copy_from(master.view({numel(*p)}).slice(0, o.lo - offset, o.hi - offset));
      if (!p->master.defined()) ops::cast(master, p->weight);
    } else if (offloaded() && p->trainable) {  // fp32 compute: the host copy of the offloaded masters
      Shard& s = shard_of(*p);
      const int64_t offset = store_.grad_offset(*p);
      const Overlap o = overlap(offset, numel(*p), s.begin, s.end);
      if (!o.empty() && o.hi <= s.split)
        s.state(Tensor(), s.host_master, o.lo, o.hi).copy_from(master.view({numel(*p)}).slice(0, o.lo - offset, o.hi - offset));
    }
    if (!p->trainable) continue;
    for (int which = 0; which < 2; ++which) {
      const std::string name = p->name + (which == 0 ? ".exp_avg" : ".exp_avg_sq");
      Tensor state = model_only ? Tensor::zeros(p->shape, dt, store_.device()) : local_rows(*p, fetch(name, p->full_shape(), dt));
      if (!sharded_) {  // (rounded to bf16 here with the precision-aware optimizer)
        ops::assign_cast(state, which == 0 ? p->exp_avg : p->exp_avg_sq);
        continue;
      }
      Shard& s = shard_of(*p);
      const int64_t offset = store_.grad_offset(*p);
      const Overlap o = overlap(offset, numel(*p), s.begin, s.end);
      if (o.empty()) continue;
      Tensor dst = which == 0 ? s.state(s.exp_avg, s.host_exp_avg, o.lo, o.hi) : s.state(s.exp_avg_sq, s.host_exp_avg_sq, o.lo, o.hi);
      assign_cast_across(state.view({numel(*p)}).slice(0, o.lo - offset, o.hi - offset), dst);
    }
  }
  store_.refresh_compute_weights();
  store_.zero_grad();
  if (fp8_gather_) store_.fp8()->invalidate_gathered_weights();  // the bf16 weights are whole again
  if (offloaded()) synchronize(store_.device());  // the host parts' copies have landed
}

}  // namespace moecore
