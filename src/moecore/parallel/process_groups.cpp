#include "moecore/parallel/process_groups.h"

#include "moecore/core/error.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/train/optimizer.h"

namespace moecore::parallel {

ProcessGroups::ProcessGroups(std::unique_ptr<comm::Communicator> world, const ParallelConfig& config, int64_t rank,
                             const ProcessGroupOptions& options)
    : world_(std::move(world)), layout_(layout_for_rank(config, rank)), world_size_(config.world), dp_size_(config.dp()) {
  MC_CHECK(world_ || config.world == 1, "ProcessGroups: a world of ", config.world,
           " ranks needs a world communicator");
  const ProcessGroupLayout& layout = layout_;
  // Every rank creates its groups in the same order (NCCL bootstraps them collectively).
  dp_ = group(layout.dp, false, "dp");
  pp_ = group(layout.pp, true, "pp");
  // Tensor and context parallelism: their own communicators (sequence-parallel and attention
  // collectives run on the compute stream); dense gradients reduce over DP x CP.
  tp_ = group(layout.tp, true, "tp");
  cp_ = group(layout.cp, true, "cp");
  dp_cp_ = config.cp > 1 ? group(layout.dp_cp, false, "dp_cp") : dp_;
  // The ranks sharing each sequence (MoE balancing counts): TP x CP.
  token_group_ = config.tp > 1 && config.cp > 1 ? group(layout.tp_cp, true, "tp_cp") : (tp_ ? tp_ : cp_);
  ep_ = group(layout.ep, true, "ep");
  edp_ = group(layout.expt_dp, false, "edp");
  etp_ = group(layout.expt_tp, true, "etp");
  tp_ep_ = config.etp > 1 ? group(layout.tp_ep, true, "tp_ep") : nullptr;
  if (options.overlap_param_gather) {  // the parameter gathers' own communicators (optimizer.h)
    dp_gather_ = group(config.cp > 1 ? layout.dp_cp : layout.dp, true, "dp_gather");
    edp_gather_ = group(layout.expt_dp, true, "edp_gather");
  }
  // Tied embeddings across pipeline stages: the first and last stage of each pipeline group sum
  // their word-embedding gradients (Megatron's embedding group). Every rank splits (NCCL over TCP
  // splits collectively over the world); a middle stage gets a group of its own, unused.
  if (config.pp > 1 && options.tied_embeddings) {
    const int64_t first_rank = layout.pp.front(), last_rank = layout.pp.back();
    const bool member = rank == first_rank || rank == last_rank;
    owned_.push_back(world_->split(member ? std::vector<int64_t>{first_rank, last_rank} : std::vector<int64_t>{rank}));
    if (member) {
      embedding_ = owned_.back().get();
      embedding_->add_role("embedding");
    }
  }
}

ProcessGroups::~ProcessGroups() = default;

comm::Communicator* ProcessGroups::group(const std::vector<int64_t>& ranks, bool own, const char* role) {
  if (ranks.size() <= 1) return nullptr;
  if (!own && static_cast<int64_t>(ranks.size()) == world_size_) {
    world_->add_role(role);
    return world_.get();
  }
  owned_.push_back(world_->split(ranks));
  owned_.back()->add_role(role);
  return owned_.back().get();
}

DenseParallel ProcessGroups::dense_parallel(bool sequence_parallel) const {
  DenseParallel d;
  d.tp = tp_;
  d.cp = cp_;
  d.sequence_parallel = sequence_parallel;
  return d;
}

MoeParallel ProcessGroups::moe_parallel(DispatcherType dispatcher, bool sequence_parallel) const {
  MoeParallel m;
  m.token_group = token_group_;
  m.dense = dense_parallel(sequence_parallel);
  m.ep = ep_;
  m.etp = etp_;
  m.tp_ep = tp_ep_;
  m.dispatcher = dispatcher;
  m.aux_group = dp_;
  return m;
}

OptimizerGroups ProcessGroups::optimizer_groups() const {
  OptimizerGroups g;
  g.dp = dp_cp_;
  g.tp = tp_;
  g.edp = edp_;
  g.ep = ep_;
  g.pp = pp_;
  g.etp = etp_;
  g.embedding = embedding_;
  g.dp_gather = dp_gather_;
  g.edp_gather = edp_gather_;
  g.dp_size = dp_size_;
  return g;
}

}  // namespace moecore::parallel
