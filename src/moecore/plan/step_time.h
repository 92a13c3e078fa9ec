// The planner's step-time model: one training step of a layout on a cluster, from
//   GEMMs (dense and grouped)   FLOPs / (peak x efficiency), bf16 or fp8 peak
//   attention                   4 B S^2 heads d / 2 (causal) per layer, at the attention efficiency
//   dispatch / combine          the rows each rank sends over EP (x ETP), at NVLink inside a node,
//                               the network across nodes
//   TP / SP, CP                 all-gathers and reduce-scatters of the activations (exposed)
//   DP                          the gradient reduction (all-reduce, or reduce-scatter + all-gather
//                               with the distributed optimizer); --overlap-grad-reduce hides all
//                               but the last layer's share behind the backward
//   PP                          send/receive per micro-batch, bubble (P - 1) / V micro-batch times
//   recomputation               the recomputed forwards again
//   optimizer                   AdamW reads and writes the state at HBM bandwidth
// and MFU = the model's FLOPs per step (6 x active matmul parameters x tokens + attention, as
// the train log counts them) / (step time x peak x GPUs).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/plan/hardware.h"
#include "moecore/plan/memory_model.h"

namespace moecore::plan {

struct Cluster {
  int64_t gpus = 1;
  int64_t gpus_per_node = 8;
  double nvlink_gbps = 0, network_gbps = 0;  // per GPU and direction
};

struct StepTime {
  double compute_s = 0;     // GEMMs + attention + recomputation, per step on the busiest stage
  double ep_comm_s = 0;     // dispatch + combine (exposed)
  double tp_cp_comm_s = 0;  // TP / SP and CP collectives (exposed)
  double dp_comm_s = 0;     // exposed gradient reduction / parameter gather
  double pp_comm_s = 0;     // stage-to-stage transfers
  double bubble_s = 0;      // pipeline fill and drain
  double optimizer_s = 0;
  double step_s = 0;
  double model_flops = 0;   // per step, the whole model
  double tokens_per_s = 0;
  double tflops_per_gpu = 0;
  double mfu = 0;
  std::vector<std::string> notes;
};

StepTime predict_step_time(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& hw, const Cluster& cl);

}  // namespace moecore::plan
