// ProcessGroups: every communicator of a training run, built once from the world communicator,
// the parallel sizes and the rank generators (rank_generator.h), and owned here.
//
// The groups of this rank (null: a group of one rank, so the collective is skipped):
//   tp, cp, pp            dense tensor-, context- and pipeline-parallel groups
//   dp                    dense data-parallel group (the MoE aux-loss group, the loss average)
//   dp_cp                 DP x CP: the dense gradients' group (dp itself when CP = 1)
//   token_group           the ranks sharing each sequence (MoE balancing counts): TP x CP, or
//                         tp / cp when only one of them is > 1
//   ep, etp, edp          expert-parallel, expert-tensor-parallel and expert-data-parallel
//   tp_ep                 ETP x EP (the allgather dispatcher with ETP; only when ETP > 1)
//   embedding             tied embeddings with PP > 1: the first and last stage of this pipeline
//                         (Megatron's embedding group; null on a middle stage)
//   dp_gather, edp_gather --overlap-param-gather: the parameter all-gathers' own communicators
//                         (the ranks of dp_cp and edp)
// A group that is not owned ("own" false below) is the world itself when it spans every rank;
// the others always get a communicator of their own: EP all-to-alls run on the compute stream
// while --overlap-grad-reduce uses the world on the communication stream, pipeline transfers
// interleave with both, and sequence-parallel / attention collectives run on the compute stream.
//
// Split order. NCCL splits are collective (over TCP, ncclCommSplit over all ranks of the parent),
// so every rank creates its groups in the same order; the constructor keeps this one:
//   dp (shared), pp, tp, cp, dp_cp (shared; CP > 1 only), tp_cp (TP > 1 and CP > 1 only),
//   ep, edp (shared), etp, tp_ep (ETP > 1 only), [dp_gather, edp_gather] (overlap_param_gather),
//   [embedding] (tied_embeddings with PP > 1: every rank splits, a middle stage into a group of
//   its own, unused).
//
// The model, the optimizer and the MoE layers take views of these groups: plain structs of
// borrowed pointers (DenseParallel, MoeParallel, OptimizerGroups), valid while this object lives.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/parallel/parallel_config.h"
#include "moecore/parallel/rank_generator.h"

namespace moecore {
struct DenseParallel;    // model/tensor_parallel.h
struct MoeParallel;      // moe/moe_layer.h
struct OptimizerGroups;  // train/optimizer.h
enum class DispatcherType;  // moe/token_dispatcher.h
}  // namespace moecore

namespace moecore::parallel {

struct ProcessGroupOptions {
  bool tied_embeddings = false;       // the last stage holds a word-embedding copy (tied output layer or MTP)
  bool overlap_param_gather = false;  // --overlap-param-gather: dp_gather and edp_gather
};

class ProcessGroups {
 public:
  // world: null for one rank (then every group is null). rank: this rank in the world (the
  // layout's, layout_for_rank(config, rank)). Collective over the world (see the split order).
  ProcessGroups(std::unique_ptr<comm::Communicator> world, const ParallelConfig& config, int64_t rank,
                const ProcessGroupOptions& options = {});
  ~ProcessGroups();
  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;

  comm::Communicator* world() const { return world_.get(); }
  comm::Communicator* tp() const { return tp_; }
  comm::Communicator* cp() const { return cp_; }
  comm::Communicator* dp() const { return dp_; }
  comm::Communicator* dp_cp() const { return dp_cp_; }
  comm::Communicator* pp() const { return pp_; }
  comm::Communicator* token_group() const { return token_group_; }
  comm::Communicator* ep() const { return ep_; }
  comm::Communicator* etp() const { return etp_; }
  comm::Communicator* edp() const { return edp_; }
  comm::Communicator* tp_ep() const { return tp_ep_; }
  comm::Communicator* embedding() const { return embedding_; }
  comm::Communicator* dp_gather() const { return dp_gather_; }
  comm::Communicator* edp_gather() const { return edp_gather_; }

  // This rank's groups as lists of global ranks, and its coordinates.
  const ProcessGroupLayout& layout() const { return layout_; }
  int64_t dp_size() const { return dp_size_; }  // world / (TP x CP x PP)

  // The views. dense_parallel: tp, cp. moe_parallel: token_group, ep, etp, tp_ep, aux_group = dp,
  // dense = dense_parallel(sequence_parallel). optimizer_groups: dp = dp_cp, tp, ep, edp, pp, etp,
  // embedding, dp_gather, edp_gather, dp_size.
  DenseParallel dense_parallel(bool sequence_parallel) const;
  MoeParallel moe_parallel(DispatcherType dispatcher, bool sequence_parallel) const;
  OptimizerGroups optimizer_groups() const;

 private:
  // A communicator for `ranks` (null for one rank); not `own`: the world when it spans it.
  // own: a communicator of its own even when the group is the whole world (EP all-to-alls run on
  // the compute stream while --overlap-grad-reduce uses the world on the communication stream;
  // pipeline transfers interleave with both).
  comm::Communicator* group(const std::vector<int64_t>& ranks, bool own, const char* role);  // role: "dp", ... (messages)

  std::unique_ptr<comm::Communicator> world_;
  std::vector<std::unique_ptr<comm::Communicator>> owned_;  // destroyed before world_
  ProcessGroupLayout layout_;
  int64_t world_size_ = 1, dp_size_ = 1;
  comm::Communicator *tp_ = nullptr, *cp_ = nullptr, *dp_ = nullptr, *dp_cp_ = nullptr, *pp_ = nullptr;
  comm::Communicator *token_group_ = nullptr, *ep_ = nullptr, *etp_ = nullptr, *edp_ = nullptr, *tp_ep_ = nullptr;
  comm::Communicator *embedding_ = nullptr, *dp_gather_ = nullptr, *edp_gather_ = nullptr;
};

}  // namespace moecore::parallel
