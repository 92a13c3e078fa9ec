// The planner's step-time model: one training step of a layout on a cluster, from
//   GEMMs (dense and grouped)   FLOPs / (peak x efficiency), bf16 or fp8 peak; the grouped GEMMs'
//                               efficiency falls with fewer rows per expert (row tiles, weight reads)
//   attention                   4 B S^2 heads d / 2 (causal) per layer, at the attention efficiency
//   small kernels               norms, router, permutation, SwiGLU, residuals, RoPE: the bytes they
//                               move at the HBM bandwidth x small_kernel_efficiency
//   dispatch / combine          the rows each rank sends over EP (x ETP), at NVLink inside a node,
//                               the network across nodes; the flex dispatcher (a prediction) sends
//                               a token once per node, at most group-topk nodes with group-limited
//                               routing; overlapped: hidden only behind the paired micro-batch's
//                               layer, and not in the pipeline's warm-up and cool-down
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
  double small_kernels_s = 0;  // norms, router, permutation, SwiGLU, residuals, RoPE (forward + backward)
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

// One layer of one micro-batch on one rank: forward seconds of the GEMMs and attention, and the
// bytes the small kernels move in forward + backward.
struct LayerCosts {
  double attn_gemm_s = 0, attn_core_s = 0;  // q/k/v/o (MLA: its projections), causal attention
  double expert_gemm_s = 0;                 // the routed experts' grouped GEMMs
  double moe_other_gemm_s = 0;              // the router and the shared experts
  double dense_mlp_s = 0;                   // a dense layer's MLP
  double attn_small_bytes = 0, moe_small_bytes = 0, dense_small_bytes = 0;
  double rows_per_expert = 0;               // balanced routing
  double grouped_efficiency = 0;            // at rows_per_expert
};
LayerCosts layer_costs(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& hw);
// The small kernels' seconds for `bytes`.
double small_kernel_s(const HardwareProfile& hw, double bytes);
// The grouped GEMMs' fraction of the bf16 peak at `rows` per expert for experts of `weights`
// elements whose rows have `row_elems` input + output elements (bytes per element `b`):
// hw.grouped_gemm_efficiency at hw.grouped_gemm_reference_rows, scaled by the share of each
// expert's row tiles (64 or 128 rows) that is filled and by the roofline of the expert's weight reads (a
// GPU profile; the CPU profile's is flat).
double grouped_gemm_efficiency_at(const HardwareProfile& hw, double rows, double weights, double row_elems, double b);
// The expected number of nodes a token's top-k experts lie on, for E experts evenly over `nodes`
// nodes, with group-limited routing (G groups, the best g kept; 0: none).
double expected_token_nodes(int64_t experts, int64_t topk, int64_t groups, int64_t group_topk, int64_t nodes);

StepTime predict_step_time(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& hw, const Cluster& cl);

}  // namespace moecore::plan
