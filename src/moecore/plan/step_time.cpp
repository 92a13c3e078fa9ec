#include "moecore/plan/step_time.h"

#include <algorithm>
#include <cmath>

#include "moecore/train/pipeline.h"
#include "moecore/train/trainer.h"

namespace moecore::plan {

namespace {
// Bytes per second of a collective over a group of n ranks placed `span` ranks apart: inside a
// node when the group fits in one, else over the network.
double group_bandwidth(const Cluster& cl, const HardwareProfile& hw, int64_t n, int64_t span) {
  const bool inside = n * span <= cl.gpus_per_node;
  return (inside ? cl.nvlink_gbps : cl.network_gbps) * 1e9 * hw.collective_efficiency;
}
// An all-to-all over n ranks `span` apart: the share of each rank's data for peers in its own
// node crosses NVLink, the rest the network, both at once; returns the time of `bytes` (what the
// rank sends to the other ranks).
double all_to_all_s(const Cluster& cl, const HardwareProfile& hw, double bytes, int64_t n, int64_t span) {
  if (n <= 1) return 0;
  const int64_t in_node = std::max<int64_t>(1, std::min(n, cl.gpus_per_node / std::max<int64_t>(1, span)));
  const double local = static_cast<double>(in_node - 1) / static_cast<double>(n - 1);
  const double nv = cl.nvlink_gbps * 1e9 * hw.collective_efficiency, net = cl.network_gbps * 1e9 * hw.collective_efficiency;
  const double t_local = nv > 0 ? bytes * local / nv : 0, t_remote = net > 0 ? bytes * (1 - local) / net : 0;
  return std::max(t_local, t_remote);
}
// One direction (dispatch or combine) of the flex dispatcher (DeepEP-style): each token crosses
// the network once per remote node its experts lie on, then NVLink inside the node to its
// experts' GPUs. tokens_bytes: the rank's tokens x H x b (x ETP).
double flex_dispatch_s(const Cluster& cl, const HardwareProfile& hw, const ModelConfig& m, double token_bytes,
                       int64_t ep, int64_t etp) {
  const int64_t ranks = ep * etp;
  if (ep <= 1) return 0;
  const int64_t per_node = std::max<int64_t>(1, std::min(ranks, cl.gpus_per_node));
  const int64_t nodes = (ranks + per_node - 1) / per_node;
  const double k = static_cast<double>(m.moe.router.topk);
  const double d = expected_token_nodes(m.moe.num_experts, m.moe.router.topk, m.moe.router.num_groups,
                                         m.moe.router.group_topk, nodes);
  const double remote = d * static_cast<double>(nodes - 1) / static_cast<double>(nodes);
  const double nv_bytes = token_bytes * k * static_cast<double>(per_node - 1) / static_cast<double>(per_node);
  const double nv = cl.nvlink_gbps * 1e9 * hw.collective_efficiency, net = cl.network_gbps * 1e9 * hw.collective_efficiency;
  return std::max(nv > 0 ? nv_bytes / nv : 0.0, net > 0 ? token_bytes * remote / net : 0.0);
}
// Ring all-gather / reduce-scatter time of `bytes` (the whole result) over n ranks.
double ring_s(double bytes, int64_t n, double bw) {
  return n <= 1 || bw <= 0 ? 0.0 : bytes * static_cast<double>(n - 1) / static_cast<double>(n) / bw;
}
// log C(n, r)
double log_choose(double n, double r) { return std::lgamma(n + 1) - std::lgamma(r + 1) - std::lgamma(n - r + 1); }
// The chance that `draws` of `total` items, drawn without replacement, miss a given `marked` of them.
double miss_all(double total, double marked, double draws) {
  if (total - marked < draws) return 0;
  return std::exp(log_choose(total - marked, draws) - log_choose(total, draws));
}
// The share of a grouped GEMM's time at `rows` per expert that is multiply-adds at full speed:
// the filled share of its row tiles (the Hopper kernel's: 64 rows up to 64 per expert, else 128)
// x the roofline of reading the expert's weights once (compute / max(compute, memory)).
double grouped_shape_factor(const HardwareProfile& hw, double rows, double weights, double row_elems, double b) {
  if (rows <= 0) return 1e-3;
  const double tile = rows <= 64 ? 64.0 : 128.0;
  const double tiles = std::ceil(rows / tile) * tile;
  const double compute = 2 * rows * weights / (hw.peak_bf16_tflops * 1e12 * hw.grouped_gemm_efficiency);
  const double memory = hw.hbm_gbps > 0 ? (weights + rows * row_elems) * b / (hw.hbm_gbps * 1e9) : 0;
  return rows / tiles * compute / std::max(compute, memory);
}
}  // namespace

double expected_token_nodes(int64_t experts, int64_t topk, int64_t groups, int64_t group_topk, int64_t nodes) {
  if (nodes <= 1) return 1;
  const double E = static_cast<double>(experts), k = static_cast<double>(topk), N = static_cast<double>(nodes);
  double d;
  if (groups > 0 && group_topk > 0 && groups % nodes == 0)  // each node holds whole groups
    d = N * (1 - miss_all(static_cast<double>(groups), static_cast<double>(groups / nodes), static_cast<double>(group_topk)));
  else if (groups > 0 && group_topk > 0 && nodes % groups == 0) {  // a group spans nodes / groups nodes
    const double reach = static_cast<double>(group_topk) * N / static_cast<double>(groups);
    d = reach * (1 - miss_all(static_cast<double>(group_topk) * E / static_cast<double>(groups), E / N, k));
  } else
    d = N * (1 - miss_all(E, E / N, k));
  return std::clamp(d, 1.0, std::min(N, k));
}

double grouped_gemm_efficiency_at(const HardwareProfile& hw, double rows, double weights, double row_elems, double b) {
  if (hw.cpu || hw.grouped_gemm_reference_rows <= 0) return hw.grouped_gemm_efficiency;
  const double f = grouped_shape_factor(hw, rows, weights, row_elems, b);
  const double f_ref = grouped_shape_factor(hw, hw.grouped_gemm_reference_rows, weights, row_elems, b);
  // Above the reference rows: no better than the larger of the measured and the dense efficiency.
  return std::min(hw.grouped_gemm_efficiency * f / f_ref, std::max(hw.grouped_gemm_efficiency, hw.gemm_efficiency));
}

double small_kernel_s(const HardwareProfile& hw, double bytes) {
  return hw.hbm_gbps > 0 ? bytes / (hw.hbm_gbps * 1e9 * hw.small_kernel_efficiency) : 0;
}

LayerCosts layer_costs(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& hw) {
  const ModelConfig& m = a.model;
  LayerCosts c;
  const double b = a.bf16 ? 2 : 4;
  // FP8 (blockwise): the GEMMs at the fp8 peak and its efficiency (grouped ones scaled alike);
  // attention stays in bf16.
  const bool fp8 = o.fp8 && hw.peak_fp8_tflops > 0;
  const double bf16_peak = hw.peak_bf16_tflops * 1e12;
  const double gemm = fp8 ? hw.peak_fp8_tflops * 1e12 * hw.fp8_gemm_efficiency : bf16_peak * hw.gemm_efficiency;
  const double attn = bf16_peak * hw.attention_efficiency;
  const double tp = static_cast<double>(a.tp), cp = static_cast<double>(a.cp);
  const double H = static_cast<double>(m.hidden_size), S = static_cast<double>(m.seq_length);
  const double T = static_cast<double>(a.micro_batch_size) * S / cp;  // tokens per rank in attention
  const double Tl = a.sequence_parallel && a.tp > 1 ? T / tp : T;
  const double k = static_cast<double>(m.moe.router.topk);
  const double hq = static_cast<double>(m.num_attention_heads), heads = hq / tp;
  const double qk = m.mla.enabled ? static_cast<double>(m.mla.q_head_dim()) : static_cast<double>(m.head_dim());
  const double vd = m.mla.enabled ? static_cast<double>(m.mla.v_head_dim) : static_cast<double>(m.head_dim());
  const double attn_params = [&] {  // q/k/v/o weights per rank (MLA: the same count the model registers)
    if (m.mla.enabled) {
      const double ql = static_cast<double>(m.mla.q_lora_rank), kvl = static_cast<double>(m.mla.kv_lora_rank);
      const double q = ql > 0 ? H * ql + ql * hq * qk : H * hq * qk;
      return (q + H * (kvl + static_cast<double>(m.mla.qk_pos_emb_head_dim)) + kvl * hq * (qk - static_cast<double>(m.mla.qk_pos_emb_head_dim) + vd) + hq * vd * H) / tp;
    }
    const double d = static_cast<double>(m.head_dim());
    return (2 * H * hq * d + 2 * H * static_cast<double>(m.kv_heads()) * d) / tp;
  }();
  c.attn_gemm_s = 2 * T * attn_params / gemm;
  // Causal: half the products. With CP each rank's T = S / CP queries (two load-balanced chunks)
  // meet half of the sequence's keys on average: T x S / 2, 1 / CP of the sequence's work.
  c.attn_core_s = 2 * T * S * heads * (qk + vd) * 0.5 / attn;
  const double F = static_cast<double>(m.moe.ffn_hidden_size), mats = m.swiglu ? 3 : 2;
  const double etp = static_cast<double>(a.etp), Fl = F / etp;
  // Balanced routing: the rank's experts get T' x k rows of each of the ETP group's ranks.
  const double local_experts = static_cast<double>(std::max<int64_t>(1, m.moe.num_experts / a.ep));
  c.rows_per_expert = Tl * k * etp / local_experts;
  const double gb = fp8 ? 1 : b;
  c.grouped_efficiency = grouped_gemm_efficiency_at(hw, c.rows_per_expert, mats * H * Fl, 2 * H + mats * Fl, gb);
  const double grouped = gemm * c.grouped_efficiency / hw.gemm_efficiency;
  c.expert_gemm_s = 2 * Tl * k * mats * H * F / grouped;
  const double Fs = static_cast<double>(m.moe.shared_expert_size);
  c.moe_other_gemm_s = 2 * Tl * H * static_cast<double>(m.moe.num_experts) / gemm + 2 * Tl * mats * H * Fs / gemm;
  const double Fd = static_cast<double>(m.ffn_hidden_size);
  c.dense_mlp_s = 2 * T * mats * H * Fd / tp / gemm;
  // Small kernels, forward + backward bytes: two norms (5 T' H each: x and y, then x, dy, dx),
  // two residual adds (3 T' H forward, 3 backward), RoPE on q and k (read + write, twice), MLA's
  // latent norms and the assembled q / k heads; the MoE layer's permutation (2 R H forward,
  // (R + T') H backward), combine ((R + T') H forward, (2 R + T') H backward), SwiGLU (3 R F
  // forward, 5 R F backward), the router's fp32 logits and scores (3 T' E x 4 B each way); a
  // dense layer's SwiGLU alike on T x F / TP.
  const double R = Tl * k * etp;
  const double rope = m.mla.enabled ? static_cast<double>(m.mla.qk_pos_emb_head_dim) * (heads + 1)
                                    : (heads + static_cast<double>(m.kv_heads()) / tp) * qk;
  c.attn_small_bytes = (10 + 12) * Tl * H * b + 4 * T * rope * b;
  if (m.mla.enabled)
    c.attn_small_bytes += 5 * T * static_cast<double>(m.mla.q_lora_rank + m.mla.kv_lora_rank) * b +
                          4 * T * heads * (qk + vd) * b;
  const double swiglu = m.swiglu ? 8 : 4;  // GELU: read and write F each way
  c.moe_small_bytes = (6 * R + 3 * Tl) * H * b + swiglu * R * Fl * b + 6 * Tl * static_cast<double>(m.moe.num_experts) * 4 +
                      swiglu * Tl * Fs * b;
  c.dense_small_bytes = swiglu * T * Fd / tp * b;
  return c;
}

StepTime predict_step_time(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& hw, const Cluster& cl) {
  const ModelConfig& m = a.model;
  StepTime t;
  const double b = a.bf16 ? 2 : 4;
  const bool fp8 = o.fp8 && hw.peak_fp8_tflops > 0;
  const double gemm = fp8 ? hw.peak_fp8_tflops * 1e12 * hw.fp8_gemm_efficiency : hw.peak_bf16_tflops * 1e12 * hw.gemm_efficiency;
  const LayerCosts lc = layer_costs(a, o, hw);
  const double tp = static_cast<double>(a.tp), cp = static_cast<double>(a.cp);
  const double H = static_cast<double>(m.hidden_size), S = static_cast<double>(m.seq_length);
  const double T = static_cast<double>(a.micro_batch_size) * S / cp;  // tokens per rank in attention
  const double Tl = a.sequence_parallel && a.tp > 1 ? T / tp : T;
  const double k = static_cast<double>(m.moe.router.topk);
  const int64_t micro = a.num_microbatches() / a.data_parallel_size();
  const double qk = m.mla.enabled ? static_cast<double>(m.mla.q_head_dim()) : static_cast<double>(m.head_dim());
  const double vd = m.mla.enabled ? static_cast<double>(m.mla.v_head_dim) : static_cast<double>(m.head_dim());
  const double F = static_cast<double>(m.moe.ffn_hidden_size);
  const double moe_s = lc.expert_gemm_s + lc.moe_other_gemm_s;
  const double attn_small_s = small_kernel_s(hw, lc.attn_small_bytes);
  const double moe_small_s = small_kernel_s(hw, lc.moe_small_bytes), dense_small_s = small_kernel_s(hw, lc.dense_small_bytes);
  // Dispatch + combine: each rank's rows leave for the other EP ranks ((EP - 1) / EP of them);
  // the flex dispatcher sends a token once per node.
  const double ep = static_cast<double>(a.ep);
  const double a2a_bytes = Tl * k * H * b * (ep - 1) / ep * static_cast<double>(a.etp);
  // The expert ranks of a group are consecutive (ETP varies fastest, then EP: Parallel Folding).
  const double a2a_s = 2 * (o.flex_dispatch ? flex_dispatch_s(cl, hw, m, Tl * H * b * static_cast<double>(a.etp), a.ep, a.etp)
                                            : all_to_all_s(cl, hw, a2a_bytes, a.ep, a.etp));  // dispatch and combine
  // TP with SP: an all-gather and a reduce-scatter around attention and each dense MLP / shared expert.
  const double tp_bw = group_bandwidth(cl, hw, a.tp, 1);
  const double tp_s = 2 * ring_s(T * H * b, a.tp, tp_bw);
  const double cp_bw = group_bandwidth(cl, hw, a.cp, a.tp);
  const double kv_bytes = T * cp * static_cast<double>(m.kv_heads()) / tp * (qk + vd) * b;
  const double cp_s = ring_s(kv_bytes, a.cp, cp_bw);
  const double a2a_factor = 2 * (a.recompute_granularity == "full" ? 1.5 : 1);  // forward and backward

  // The busiest stage: the most layers (and the head). Per micro-batch: forward, backward (2 x
  // forward), recomputation, small kernels; each MoE layer's dispatch / combine and, overlapped,
  // what its own computation (the paired micro-batch's same layer) cannot cover.
  double stage_total = -1, per_micro = 0, stage_small = 0, stage_comm = 0, stage_a2a = 0, stage_a2a_uncovered = 0;
  for (int64_t s = 0; s < a.pp; ++s) {
    double fwd = 0, comm = 0, a2a = 0, uncovered = 0, rec = 0, small = 0;
    for (const PipelineStage& c : stage_layers(m.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers,
                                                a.last_stage_layers, s)) {
      for (int64_t i = c.first_layer; i < c.end_layer; ++i) {
        // The embedding's and the loss's slots (the head is counted with the stage's head below).
        if ((o.embedding_slot && i == 0) || (o.loss_slot && i == m.num_layers - 1)) continue;
        const bool moe = m.is_moe(i);
        const double layer = lc.attn_gemm_s + lc.attn_core_s + (moe ? moe_s : lc.dense_mlp_s);
        double layer_rec = 0;
        if (a.recompute_granularity == "full") layer_rec = layer;
        else {
          if (m.recompute.core_attn) layer_rec += lc.attn_core_s;
          if (m.mla.enabled && m.mla.recompute_up_proj) {  // the up projections again
            const double hq = static_cast<double>(m.num_attention_heads), rope = static_cast<double>(m.mla.qk_pos_emb_head_dim);
            const double q_in = m.mla.q_lora_rank > 0 ? static_cast<double>(m.mla.q_lora_rank) : H;
            layer_rec += 2 * T * (q_in * hq * qk + static_cast<double>(m.mla.kv_lora_rank) * hq * (qk - rope + vd)) / tp / gemm;
          }
          if (m.recompute.moe && moe) layer_rec += moe_s;
          if (m.recompute.mlp && !moe) layer_rec += lc.dense_mlp_s;
          if (m.moe.recompute_act && moe && hw.hbm_gbps > 0)  // the activation again: memory bound
            layer_rec += Tl * k * F / static_cast<double>(a.etp) * (m.swiglu ? 3 : 2) * b / (hw.hbm_gbps * 1e9);
        }
        const double layer_small = attn_small_s + (moe ? moe_small_s : dense_small_s);
        fwd += layer;
        rec += layer_rec;
        small += layer_small;
        comm += (moe ? 1 : 2) * tp_s + cp_s;
        if (moe) {
          a2a += a2a_factor * a2a_s;
          uncovered += std::max(0.0, a2a_factor * a2a_s - (3 * layer + layer_rec + layer_small));
        }
      }
      if (c.has_head) fwd += 2 * T * H * static_cast<double>(m.vocab_size) / tp / gemm *
                             (1 + static_cast<double>(m.mtp_num_layers));
    }
    const double total = 3 * fwd + rec + small;
    if (total > stage_total) {
      stage_total = total;
      per_micro = total;
      stage_small = small;
      stage_comm = comm;
      stage_a2a = a2a;
      stage_a2a_uncovered = uncovered;
    }
  }
  const double comm_per_micro = 2 * stage_comm;
  const double m_d = static_cast<double>(micro);
  const double v = static_cast<double>(a.virtual_stages());
  double a2a_per_micro = stage_a2a;
  // Overlapped with another micro-batch's computation (the forward of one with the backward of
  // the next, layer by layer): only what the paired layer's computation cannot cover, and none
  // of it in the micro-batches without a partner (the first stage's warm-up forwards and the
  // cool-down backwards: Megatron's warm-up depth, + 1).
  if (o.ep_overlap) {
    const double p = static_cast<double>(a.pp);
    const double warmup = a.pp == 1 ? 0 : v > 1 ? 2 * (p - 1) + (v - 1) * p : p - 1;
    const double unpaired = std::min(1.0, (warmup + 1) / (m_d * v));
    a2a_per_micro = unpaired * stage_a2a + (1 - unpaired) * stage_a2a_uncovered;
    t.notes.push_back("--overlap-moe-expert-parallel-comm: a prediction (moecore trains it without pipeline stages)");
  }
  if (o.flex_dispatch)
    t.notes.push_back("--moe-token-dispatcher-type flex: a prediction (a token crosses the network once per node); "
                      "moecore has no flex dispatcher yet");
  const double pp_bw = group_bandwidth(cl, hw, a.pp, a.tp * a.cp * a.data_parallel_size());
  const double pp_s = a.pp > 1 && pp_bw > 0 ? 2 * Tl * H * b / pp_bw : 0;
  t.compute_s = m_d * (per_micro - stage_small);
  t.small_kernels_s = m_d * stage_small;
  t.tp_cp_comm_s = m_d * comm_per_micro;
  t.ep_comm_s = m_d * a2a_per_micro;
  t.pp_comm_s = m_d * pp_s * v;
  const double micro_time = per_micro + comm_per_micro + a2a_per_micro + pp_s;
  t.bubble_s = static_cast<double>(a.pp - 1) / v * micro_time;
  // Gradients (fp32) over DP x CP (dense) and EDP (experts).
  double params = 0;
  for (int64_t s = 0; s < a.pp; ++s) params = std::max(params, rank_params(a, s).total());
  const RankParams rp = rank_params(a, 0);
  const int64_t dp = a.data_parallel_size() * a.cp, edp = a.world / (a.pp * a.ep * a.etp);
  const double dp_bw = group_bandwidth(cl, hw, dp, a.tp), edp_bw = group_bandwidth(cl, hw, edp, a.ep * a.etp);
  const double reduce = (a.use_distributed_optimizer ? 1.0 : 2.0) *
                            (ring_s(rp.dense * 4, dp, dp_bw) + ring_s(rp.expert * 4, edp, edp_bw)) +
                        (a.use_distributed_optimizer ? ring_s(rp.dense * b, dp, dp_bw) + ring_s(rp.expert * b, edp, edp_bw) : 0);
  const double layers_per_stage = static_cast<double>(m.num_layers) / static_cast<double>(a.pp);
  t.dp_comm_s = a.overlap_grad_reduce ? reduce / std::max(1.0, layers_per_stage) : reduce;
  if (a.overlap_grad_reduce) t.notes.push_back("--overlap-grad-reduce: all but the last layer's reduction hidden");
  // AdamW: the state read and written once (masters, moments, gradients, weights).
  const double state_bytes = params * (4 + 4 + 8 + b) * 2 /
                             (a.use_distributed_optimizer ? static_cast<double>(std::max<int64_t>(1, dp)) : 1);
  t.optimizer_s = hw.hbm_gbps > 0 ? state_bytes / (hw.hbm_gbps * 1e9) : 0;
  t.step_s = t.compute_s + t.small_kernels_s + t.tp_cp_comm_s + t.ep_comm_s + t.pp_comm_s + t.bubble_s + t.dp_comm_s + t.optimizer_s;
  const double tokens = static_cast<double>(a.global_batch_size) * S;
  ModelConfig real = m;  // without the pipeline slots
  if (o.loss_slot) real.moe_layer.pop_back(), --real.num_layers;
  if (o.embedding_slot) real.moe_layer.erase(real.moe_layer.begin()), --real.num_layers;
  t.model_flops = model_flops_per_step(real, a.global_batch_size * m.seq_length);
  t.tokens_per_s = t.step_s > 0 ? tokens / t.step_s : 0;
  t.tflops_per_gpu = t.step_s > 0 ? t.model_flops / t.step_s / static_cast<double>(cl.gpus) / 1e12 : 0;
  t.mfu = hw.peak_bf16_tflops > 0 ? t.tflops_per_gpu * 1e12 / (hw.peak_bf16_tflops * 1e12) : 0;
  if (o.fp8) t.notes.push_back("FP8 (blockwise): a prediction; moecore trains in FP8 on the CPU backend only so far");
  return t;
}

}  // namespace moecore::plan
