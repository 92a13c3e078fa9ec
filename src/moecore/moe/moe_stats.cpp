#include "moecore/moe/moe_stats.h"

#include <algorithm>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/moe_step_stats.h"

namespace moecore {

namespace {
using ops::cast_to;

double read_scalar(const Tensor& t) {
  const Tensor host = cast_to(t, t.dtype() == DType::F64 ? DType::F64 : DType::F32).to(Device::cpu());
  return host.dtype() == DType::F64 ? host.data<double>()[0] : host.data<float>()[0];
}
}  // namespace

MoeStats::MoeStats(std::string prefix, const MoeConfig& moe, Param* expert_bias)
    : prefix_(std::move(prefix)), aux_loss_coeff_(moe.aux_loss_coeff), z_loss_coeff_(moe.z_loss_coeff),
      bias_update_rate_(moe.bias_update_rate), expert_bias_(expert_bias) {
  stats_.tokens_per_expert.assign(static_cast<size_t>(moe.num_experts), 0.0);
}

// The balancing losses stay on the device over the micro-batches (no synchronisation per
// layer and micro-batch); the host values are read when the statistics are asked for.
void MoeStats::accumulate_loss(Tensor& acc, const Tensor& loss) {
  if (!acc.defined()) acc = Tensor::zeros({1}, loss.dtype(), loss.device());
  ops::add(acc, loss, acc);
}

void MoeStats::add_aux_loss(const Tensor& loss) { accumulate_loss(aux_acc_, loss); }
void MoeStats::add_z_loss(const Tensor& loss) { accumulate_loss(z_acc_, loss); }

void MoeStats::record_routing(const ops::MoeRouting& plan, const Tensor& indices, const Tensor& kept, int64_t pad,
                              bool training) {
  const int64_t tokens = indices.size(0), e = static_cast<int64_t>(stats_.tokens_per_expert.size());
  const Device dev = indices.device();
  if (training) {
    // Tokens per expert after capacity dropping: the expert-bias update and the per-layer log use
    // them. When the dispatcher's plan covers exactly this rank's tokens over all E experts, its
    // counts are these numbers: on the host when they were copied for the GEMM sizes (unpadded),
    // else summed on the device and read with the losses; otherwise count from the indices.
    // (Not with --moe-router-padding-for-fp8: the plan then also holds the added assignments.)
    const bool whole = plan.num_tokens == tokens && plan.topk == indices.size(1) && plan.num_experts == e;
    if (whole && pad == 0 && static_cast<int64_t>(plan.host_tokens_per_expert.size()) == e) {
      for (int64_t i = 0; i < e; ++i)
        stats_.tokens_per_expert[static_cast<size_t>(i)] +=
            static_cast<double>(plan.host_tokens_per_expert[static_cast<size_t>(i)]);
    } else if (whole && plan.kept_per_expert.device().is_cuda()) {
      // With the plan's deferred checks (a plan made without the host copy): read together.
      if (!counts_acc_.defined()) counts_acc_ = Tensor::zeros({e + 2}, DType::I64, dev);
      ops::accumulate_routing_counts(plan, counts_acc_);
    } else {
      const std::vector<int32_t> idx = indices.to_vector<int32_t>();
      const std::vector<uint8_t> keep = kept.defined() ? kept.to_vector<uint8_t>() : std::vector<uint8_t>();
      for (size_t i = 0; i < idx.size(); ++i)
        if (keep.empty() || keep[i]) stats_.tokens_per_expert[static_cast<size_t>(idx[i])] += 1.0;
    }
    stats_.micro_batches++;
  } else if (plan.status.defined()) {
    // Evaluation: only the plan's deferred checks (flags), read with the next statistics or by
    // check_evaluation_routing after the evaluation.
    if (!eval_checks_.defined()) eval_checks_ = Tensor::zeros({e + 2}, DType::I64, dev);
    ops::accumulate_routing_counts(plan, eval_checks_);
  }
}

void MoeStats::prefetch() {
  const Tensor* any = counts_acc_.defined() ? &counts_acc_ : aux_acc_.defined() ? &aux_acc_
                      : z_acc_.defined()    ? &z_acc_
                      : eval_checks_.defined() ? &eval_checks_ : nullptr;
  if (!any || !any->device().is_cuda()) return;  // nothing to read, or host tensors already
  auto to_pinned = [](Tensor& on_device, Tensor& host, bool as_float) {
    if (!on_device.defined()) return;
    const Tensor src = as_float ? cast_to(on_device, on_device.dtype() == DType::F64 ? DType::F64 : DType::F32)
                                : on_device;
    host = Tensor::empty_pinned(src.shape(), src.dtype());
    host.copy_from(src);  // asynchronous: the destination is pinned
    on_device = Tensor();
  };
  const Device dev = any->device();
  to_pinned(eval_checks_, host_eval_checks_, false);
  to_pinned(counts_acc_, host_counts_, false);
  to_pinned(aux_acc_, host_aux_, true);
  to_pinned(z_acc_, host_z_, true);
  prefetched_ = std::make_shared<Event>(dev);
  prefetched_->record();
}

// The router's top-k cannot produce these; they guard the plans' deferred checks.
void MoeStats::check_routing_flags(const std::vector<int64_t>& c, size_t at) const {
  const size_t e = stats_.tokens_per_expert.size();
  if (at == SIZE_MAX) at = e;
  MC_CHECK(c[at] == 0, prefix_, ": an expert index outside [0, ", e, ") reached the token dispatch");
  MC_CHECK(c[at + 1] == 0, prefix_, ": an expert received more assignments than its padded capacity");
}

void MoeStats::check_evaluation_routing() const {
  // A prefetched host copy is read only once its copy has arrived.
  if (host_eval_checks_.defined() && prefetched_ && !prefetched_->ready()) prefetched_->synchronize();
  for (Tensor* t : {&host_eval_checks_, &eval_checks_}) {
    if (!t->defined()) continue;
    const std::vector<int64_t> c = t->to_vector<int64_t>();
    *t = Tensor();
    check_routing_flags(c);
  }
}

void MoeStats::sync_stats() const {
  const size_t e = stats_.tokens_per_expert.size();
  if (prefetched_) {  // the copies of prefetch(): wait only if they have not arrived yet
    if (!prefetched_->ready()) prefetched_->synchronize();
    prefetched_.reset();
  }
  // Each statistic from its prefetched host copy, then from the device (what accumulated since,
  // or everything when nothing was prefetched).
  check_evaluation_routing();
  for (Tensor* t : {&host_counts_, &counts_acc_}) {
    if (!t->defined()) continue;
    const std::vector<int64_t> c = t->to_vector<int64_t>();
    *t = Tensor();
    check_routing_flags(c);
    for (size_t i = 0; i < e; ++i) stats_.tokens_per_expert[i] += static_cast<double>(c[i]);
  }
  for (Tensor* t : {&host_aux_, &aux_acc_}) {
    if (!t->defined()) continue;
    stats_.aux_loss += read_scalar(*t) / aux_loss_coeff_;
    *t = Tensor();
  }
  for (Tensor* t : {&host_z_, &z_acc_}) {
    if (!t->defined()) continue;
    stats_.z_loss += read_scalar(*t) / z_loss_coeff_;
    *t = Tensor();
  }
}

const MoeStepStats& MoeStats::stats() const {
  sync_stats();
  return stats_;
}

MoeStepStats& MoeStats::mutable_stats() {
  sync_stats();
  return stats_;
}

MoeStepStats MoeStats::finish_step() {
  sync_stats();
  if (expert_bias_ && stats_.micro_batches > 0 && bias_update_rate_ > 0) {
    // Aux-loss-free balancing: b_e += u * sign(mean(c) - c_e) over this step's selections.
    const std::vector<double>& c = stats_.tokens_per_expert;
    double mean = 0;
    for (double v : c) mean += v;
    mean /= static_cast<double>(c.size());
    // Read on the host (f64 casts are CPU-only); the master may live on a GPU.
    std::vector<double> bias = cast_to(expert_bias_->master.to(Device::cpu()), DType::F64).to_vector<double>();
    for (size_t i = 0; i < c.size(); ++i) {
      const double d = mean - c[i];
      bias[i] += bias_update_rate_ * (d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0));
    }
    expert_bias_->master.copy_from(cast_to(Tensor::from_vector(bias, expert_bias_->shape), expert_bias_->master.dtype())
                                       .to(expert_bias_->master.device()));
  }
  MoeStepStats out = stats_;
  stats_ = MoeStepStats{};
  stats_.tokens_per_expert.assign(out.tokens_per_expert.size(), 0.0);
  return out;
}

Tensor MoeStats::pack_step_stats(comm::Communicator* token_group, comm::Communicator* dp, Device dev) {
  const int64_t e = static_cast<int64_t>(stats_.tokens_per_expert.size());
  Tensor packed = Tensor::empty({e + 4}, DType::F64, dev);
  Tensor host_counts;  // counts the host already has (plans copied for the GEMM sizes, or the index path)
  for (double c : stats_.tokens_per_expert)
    if (c != 0) {
      host_counts = Tensor::from_vector(stats_.tokens_per_expert, {e}).to(dev);
      break;
    }
  ops::pack_moe_step_stats(aux_acc_, z_acc_, counts_acc_, host_counts, aux_loss_coeff_, z_loss_coeff_, packed);
  // The losses and counts over the ranks, as reduce_moe_step_stats sums them (the flags stay this rank's).
  Tensor sums = packed.slice(0, 0, e + 2);
  if (token_group) token_group->all_reduce(sums, comm::ReduceOp::Sum);
  if (dp) dp->all_reduce(sums, comm::ReduceOp::Sum);
  return packed;
}

void MoeStats::finish_step_on_device(Tensor& packed, comm::Communicator* dp) {
  Tensor bias;
  if (expert_bias_ && stats_.micro_batches > 0 && bias_update_rate_ > 0) bias = expert_bias_->master;
  ops::finish_moe_step_stats(packed, dp ? static_cast<double>(dp->size()) : 1.0, bias, bias_update_rate_);
  aux_acc_ = z_acc_ = counts_acc_ = Tensor();
  const size_t e = stats_.tokens_per_expert.size();
  stats_ = MoeStepStats{};
  stats_.tokens_per_expert.assign(e, 0.0);
}

MoeStepStats MoeStats::unpack_step_stats(const std::vector<double>& packed, int64_t micro_batches) const {
  const size_t e = stats_.tokens_per_expert.size();
  MC_CHECK(packed.size() == e + 4, prefix_, ": packed step statistics of ", packed.size(), " numbers; expected ", e + 4);
  check_routing_flags({0, static_cast<int64_t>(packed[e + 2]), static_cast<int64_t>(packed[e + 3])}, 1);
  MoeStepStats s;
  s.aux_loss = packed[0];
  s.z_loss = packed[1];
  s.micro_batches = micro_batches;
  s.tokens_per_expert.assign(packed.begin() + 2, packed.begin() + 2 + static_cast<std::ptrdiff_t>(e));
  return s;
}

void reduce_moe_step_stats(MoeStepStats& s, comm::Communicator* token_group, comm::Communicator* dp) {
  std::vector<double> packed = {s.aux_loss, s.z_loss};
  packed.insert(packed.end(), s.tokens_per_expert.begin(), s.tokens_per_expert.end());
  if (token_group) comm::all_reduce_host(*token_group, packed);
  if (dp) {
    comm::all_reduce_host(*dp, packed);
    packed[0] /= static_cast<double>(dp->size());
    packed[1] /= static_cast<double>(dp->size());
  }
  s.aux_loss = packed[0];
  s.z_loss = packed[1];
  std::copy(packed.begin() + 2, packed.end(), s.tokens_per_expert.begin());
}

}  // namespace moecore
