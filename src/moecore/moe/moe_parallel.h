// The process groups an MoE layer talks over (null: one rank), shared by its parts (router,
// dispatcher, experts, shared experts).
#pragma once

#include "moecore/comm/communicator.h"
#include "moecore/model/layers.h"
#include "moecore/moe/token_dispatcher.h"

namespace moecore {

// token_group (TP x CP): the ranks that share each sequence (sequence and context parallelism
// give each a part of its tokens). Balancing-loss counts are summed over it and the losses use
// its total token count, so they equal the single-rank losses; each rank's loss value (and
// gradient) is its share: its tokens' terms, summed over the group by the trainer for the log.
struct MoeParallel {
  comm::Communicator* token_group = nullptr;
  DenseParallel dense;                      // the shared expert's tensor parallelism
  comm::Communicator* ep = nullptr;         // expert-parallel group (this rank holds E / |ep| experts)
  comm::Communicator* etp = nullptr;        // expert-tensor-parallel group (a 1 / |etp| slice of each FFN)
  comm::Communicator* tp_ep = nullptr;      // the ETP x EP group (allgather dispatcher with ETP)
  DispatcherType dispatcher = DispatcherType::AllToAll;
  comm::Communicator* aux_group = nullptr;  // global_aux_loss: counts averaged over TP x DP x CP
};

}  // namespace moecore
