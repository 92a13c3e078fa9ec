#include "moecore/plan/step_time.h"

#include <algorithm>

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
// Ring all-gather / reduce-scatter time of `bytes` (the whole result) over n ranks.
double ring_s(double bytes, int64_t n, double bw) {
  return n <= 1 || bw <= 0 ? 0.0 : bytes * static_cast<double>(n - 1) / static_cast<double>(n) / bw;
}
}  // namespace

StepTime predict_step_time(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& hw, const Cluster& cl) {
  const ModelConfig& m = a.model;
  StepTime t;
  const double b = a.bf16 ? 2 : 4;
  // FP8 (blockwise): the GEMMs at the fp8 peak and its efficiency (grouped ones scaled alike);
  // attention stays in bf16.
  const bool fp8 = o.fp8 && hw.peak_fp8_tflops > 0;
  const double bf16_peak = hw.peak_bf16_tflops * 1e12;
  const double gemm = fp8 ? hw.peak_fp8_tflops * 1e12 * hw.fp8_gemm_efficiency : bf16_peak * hw.gemm_efficiency;
  const double grouped = gemm * hw.grouped_gemm_efficiency / hw.gemm_efficiency;
  const double attn = bf16_peak * hw.attention_efficiency;
  const double tp = static_cast<double>(a.tp), cp = static_cast<double>(a.cp);
  const double H = static_cast<double>(m.hidden_size), S = static_cast<double>(m.seq_length);
  const double T = static_cast<double>(a.micro_batch_size) * S / cp;  // tokens per rank in attention
  const double Tl = a.sequence_parallel && a.tp > 1 ? T / tp : T;
  const double k = static_cast<double>(m.moe.router.topk);
  const int64_t micro = a.num_microbatches() / a.data_parallel_size();
  const double heads = static_cast<double>(m.num_attention_heads) / tp;
  const double qk = m.mla.enabled ? static_cast<double>(m.mla.q_head_dim()) : static_cast<double>(m.head_dim());
  const double vd = m.mla.enabled ? static_cast<double>(m.mla.v_head_dim) : static_cast<double>(m.head_dim());
  // Per micro-batch and layer, forward seconds on one rank.
  const double attn_params = [&] {  // q/k/v/o weights per rank (MLA: the same count the model registers)
    if (m.mla.enabled) {
      const double ql = static_cast<double>(m.mla.q_lora_rank), kvl = static_cast<double>(m.mla.kv_lora_rank);
      const double hq = static_cast<double>(m.num_attention_heads);
      const double q = ql > 0 ? H * ql + ql * hq * qk : H * hq * qk;
      return (q + H * (kvl + static_cast<double>(m.mla.qk_pos_emb_head_dim)) + kvl * hq * (qk - static_cast<double>(m.mla.qk_pos_emb_head_dim) + vd) + hq * vd * H) / tp;
    }
    const double d = static_cast<double>(m.head_dim());
    return (2 * H * static_cast<double>(m.num_attention_heads) * d + 2 * H * static_cast<double>(m.kv_heads()) * d) / tp;
  }();
  const double attn_gemm_s = 2 * T * attn_params / gemm;
  const double attn_core_s = 2 * T * (S / cp) * heads * (qk + vd) * 0.5 / attn;  // causal: half the products
  const double F = static_cast<double>(m.moe.ffn_hidden_size), mats = m.swiglu ? 3 : 2;
  const double moe_s = 2 * Tl * k * mats * H * F / grouped + 2 * Tl * H * static_cast<double>(m.moe.num_experts) / gemm +
                       2 * Tl * mats * H * static_cast<double>(m.moe.shared_expert_size) / gemm;
  const double dense_s = 2 * T * mats * H * static_cast<double>(m.ffn_hidden_size) / tp / gemm;
  // Dispatch + combine: each rank's rows leave for the other EP ranks ((EP - 1) / EP of them).
  const double ep = static_cast<double>(a.ep);
  const double a2a_bytes = Tl * k * H * b * (ep - 1) / ep * static_cast<double>(a.etp);
  // The expert ranks of a group are consecutive (ETP varies fastest, then EP: Parallel Folding).
  const double a2a_s = 2 * all_to_all_s(cl, hw, a2a_bytes, a.ep, a.etp);  // dispatch and combine
  // TP with SP: an all-gather and a reduce-scatter around attention and each dense MLP / shared expert.
  const double tp_bw = group_bandwidth(cl, hw, a.tp, 1);
  const double tp_s = 2 * ring_s(T * H * b, a.tp, tp_bw);
  const double cp_bw = group_bandwidth(cl, hw, a.cp, a.tp);
  const double kv_bytes = T * cp * static_cast<double>(m.kv_heads()) / tp * (qk + vd) * b;
  const double cp_s = ring_s(kv_bytes, a.cp, cp_bw);

  // The busiest stage: the most layers (and the head).
  double stage_fwd = 0, stage_comm = 0, stage_a2a = 0, recompute = 0;
  for (int64_t s = 0; s < a.pp; ++s) {
    double fwd = 0, comm = 0, a2a = 0, rec = 0;
    for (const PipelineStage& c : stage_layers(m.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers,
                                                a.last_stage_layers, s)) {
      for (int64_t i = c.first_layer; i < c.end_layer; ++i) {
        const double layer = attn_gemm_s + attn_core_s + (m.is_moe(i) ? moe_s : dense_s);
        fwd += layer;
        comm += (m.is_moe(i) ? 1 : 2) * tp_s + cp_s;
        a2a += m.is_moe(i) ? a2a_s : 0;
        if (a.recompute_granularity == "full") rec += layer;
        else {
          if (m.recompute.core_attn) rec += attn_core_s;
          if (m.mla.enabled && m.mla.recompute_up_proj) {  // the up projections again
            const double hq = static_cast<double>(m.num_attention_heads), rope = static_cast<double>(m.mla.qk_pos_emb_head_dim);
            const double q_in = m.mla.q_lora_rank > 0 ? static_cast<double>(m.mla.q_lora_rank) : H;
            rec += 2 * T * (q_in * hq * qk + static_cast<double>(m.mla.kv_lora_rank) * hq * (qk - rope + vd)) / tp / gemm;
          }
          if (m.recompute.moe && m.is_moe(i)) rec += moe_s;
          if (m.recompute.mlp && !m.is_moe(i)) rec += dense_s;
          if (m.moe.recompute_act && m.is_moe(i) && hw.hbm_gbps > 0)  // the activation again: memory bound
            rec += Tl * k * F / static_cast<double>(a.etp) * (m.swiglu ? 3 : 2) * b / (hw.hbm_gbps * 1e9);
        }
      }
      if (c.has_head) fwd += 2 * T * H * static_cast<double>(m.vocab_size) / tp / gemm *
                             (1 + static_cast<double>(m.mtp_num_layers));
      if (c.has_embedding) fwd += 0;
    }
    if (fwd > stage_fwd) {
      stage_fwd = fwd;
      stage_comm = comm;
      stage_a2a = a2a;
      recompute = rec;
    }
  }
  // Backward = 2 x forward compute, the same collectives again (their transposes).
  const double per_micro = 3 * stage_fwd + recompute;
  const double comm_per_micro = 2 * stage_comm;
  double a2a_per_micro = 2 * stage_a2a * (a.recompute_granularity == "full" ? 1.5 : 1);
  // Overlapped with another micro-batch's computation: only what the computation cannot cover.
  if (o.ep_overlap) {
    a2a_per_micro = std::max(0.0, a2a_per_micro - per_micro);
    t.notes.push_back("--overlap-moe-expert-parallel-comm: a prediction; moecore does not overlap the dispatch yet");
  }
  const double pp_bw = group_bandwidth(cl, hw, a.pp, a.tp * a.cp * a.data_parallel_size());
  const double pp_s = a.pp > 1 && pp_bw > 0 ? 2 * Tl * H * b / pp_bw : 0;
  const double m_d = static_cast<double>(micro);
  const double v = static_cast<double>(a.virtual_stages());
  t.compute_s = m_d * per_micro;
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
  t.step_s = t.compute_s + t.tp_cp_comm_s + t.ep_comm_s + t.pp_comm_s + t.bubble_s + t.dp_comm_s + t.optimizer_s;
  const double tokens = static_cast<double>(a.global_batch_size) * S;
  t.model_flops = model_flops_per_step(m, a.global_batch_size * m.seq_length);
  t.tokens_per_s = t.step_s > 0 ? tokens / t.step_s : 0;
  t.tflops_per_gpu = t.step_s > 0 ? t.model_flops / t.step_s / static_cast<double>(cl.gpus) / 1e12 : 0;
  t.mfu = hw.peak_bf16_tflops > 0 ? t.tflops_per_gpu * 1e12 / (hw.peak_bf16_tflops * 1e12) : 0;
  if (o.fp8) t.notes.push_back("FP8 (blockwise): a prediction; moecore trains in FP8 on the CPU backend only so far");
  return t;
}

}  // namespace moecore::plan
