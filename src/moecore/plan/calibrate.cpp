#include "moecore/plan/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/error.h"
#include "moecore/core/philox.h"
#include "moecore/core/tensor.h"
#include "moecore/model/attention_block.h"
#include "moecore/model/layers.h"
#include "moecore/model/mla_attention.h"
#include "moecore/model/params.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/random.h"
#include "moecore/plan/step_time.h"

namespace moecore::plan {

namespace {

// Median milliseconds of fn() over 5 runs of `iters` calls after untimed ones: 2 on the CPU; on a
// GPU as many as take a second, because a GPU that has been idle runs its first second of work at
// a higher clock than it can hold under a training step's sustained power draw, and the profile
// must describe the training step.
double time_ms(Device dev, int iters, const std::function<void()>& fn) {
  const auto warm_start = std::chrono::steady_clock::now();
  for (int w = 0; w < 2 || (!dev.is_cpu() && std::chrono::steady_clock::now() - warm_start < std::chrono::seconds(1)); ++w) {
    fn();
    synchronize(dev);
  }
  std::vector<double> times;
  for (int r = 0; r < 5; ++r) {
    Event start(dev), stop(dev);
    start.record();
    for (int i = 0; i < iters; ++i) fn();
    stop.record();
    stop.synchronize();
    times.push_back(static_cast<double>(stop.elapsed_ms_since(start)) / iters);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

Tensor randn(const Shape& shape, DType t, Device dev, const char* name, double std = 1.0) {
  Tensor x = Tensor::empty(shape, t, dev);
  ops::fill_normal(x, 1234, rng_key(name), 0.0, std);
  return x;
}

// One rank's layer: heads and dense widths over TP, the rank's experts
// (top-k at most their count, so that the rows per expert stay the layout's), balanced routing.
ModelConfig rank_layer_config(const TrainArgs& a) {
  ModelConfig c = a.model;
  c.num_layers = 1;
  c.num_attention_heads /= a.tp;
  c.num_query_groups = std::max<int64_t>(1, c.num_query_groups / a.tp);
  c.ffn_hidden_size /= a.tp;
  if (c.moe.num_experts > 0) {
    c.moe.num_experts = std::max<int64_t>(1, c.moe.num_experts / a.ep);
    c.moe.router.num_experts = c.moe.num_experts;
    c.moe.router.topk = std::min(c.moe.router.topk, c.moe.num_experts);
    c.moe.router.num_groups = c.moe.router.group_topk = 0;
    c.moe.force_load_balancing = true;
    c.moe.ffn_hidden_size /= a.etp;
  }
  return c;
}

}  // namespace

Calibration calibrate(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& base) {
  MC_CHECK(!o.fp8, "moecore plan --calibrate: --fp8-recipe is a prediction only; calibrate in bf16");
  MC_CHECK(a.cp == 1, "moecore plan --calibrate: --context-parallel-size ", a.cp, " is not calibrated (a CP rank's "
           "attention runs over chunks of the gathered keys); calibrate the layout with --context-parallel-size 1 and "
           "plan the CP layout with that profile");
  MC_CHECK(base.peak_bf16_tflops > 0, "moecore plan --calibrate: the profile '", base.name, "' has no bf16 peak");
  const Device dev = a.device;
  const DType cdt = a.bf16 ? DType::BF16 : DType::F32;
  const ModelConfig& m = a.model;
  Calibration cal;
  cal.profile = base;
  HardwareProfile& p = cal.profile;
  p.name = base.name + "-calibrated";
  const double peak = base.peak_bf16_tflops * 1e12;
  const int64_t T = a.micro_batch_size * m.seq_length, H = m.hidden_size;
  const int64_t Tl = a.sequence_parallel && a.tp > 1 ? T / a.tp : T;
  nlohmann::json& meas = cal.measured;
  meas["device"] = dev.str();
  meas["tokens"] = T;

  // Dense GEMMs: the q projection, forward + dgrad + wgrad (fp32 gradient, accumulated).
  const int64_t qk = m.mla.enabled ? m.mla.q_head_dim() : m.head_dim(), vd = m.mla.enabled ? m.mla.v_head_dim : m.head_dim();
  const int64_t N = m.num_attention_heads / a.tp * qk;
  {
    Tensor x = randn({T, H}, cdt, dev, "cal-x"), w = randn({N, H}, cdt, dev, "cal-w"), dy = randn({T, N}, cdt, dev, "cal-dy");
    Tensor y = Tensor::empty({T, N}, cdt, dev), dx = Tensor::empty({T, H}, cdt, dev), dw = Tensor::zeros({N, H}, DType::F32, dev);
    const double ms = time_ms(dev, 3, [&] {
      ops::gemm(x, w, y, false, true);
      ops::gemm(dy, w, dx, false, false);
      ops::gemm(dy, x, dw, true, false, 1.0f, 1.0f);
    });
    p.gemm_efficiency = 3 * 2.0 * T * N * H / (ms * 1e-3) / peak;
    meas["gemm"] = {{"m", T}, {"n", N}, {"k", H}, {"fwd_dgrad_wgrad_ms", ms}};
  }
  // Causal attention, forward + backward.
  {
    const int64_t B = a.micro_batch_size, S = m.seq_length, hq = m.num_attention_heads / a.tp;
    const int64_t hkv = m.mla.enabled ? hq : std::max<int64_t>(1, m.kv_heads() / a.tp);
    Tensor q = randn({B, S, hq, qk}, cdt, dev, "cal-q"), k = randn({B, S, hkv, qk}, cdt, dev, "cal-k");
    Tensor v = randn({B, S, hkv, vd}, cdt, dev, "cal-v"), dout = randn({B, S, hq, vd}, cdt, dev, "cal-do");
    Tensor out = Tensor::empty(dout.shape(), cdt, dev), lse = Tensor::empty({B, hq, S}, DType::F32, dev);
    Tensor dq = Tensor::empty(q.shape(), cdt, dev), dk = Tensor::empty(k.shape(), cdt, dev), dv = Tensor::empty(v.shape(), cdt, dev);
    const double scale = 1.0 / std::sqrt(static_cast<double>(qk));
    const double ms = time_ms(dev, 1, [&] {
      ops::attention_forward(q, k, v, scale, out, lse);
      ops::attention_backward(q, k, v, out, lse, dout, scale, dq, dk, dv);
    });
    const double fwd_flops = 2.0 * B * hq * static_cast<double>(S) * S / 2 * static_cast<double>(qk + vd);
    p.attention_efficiency = 3 * fwd_flops / (ms * 1e-3) / peak;
    meas["attention"] = {{"batch", B}, {"seq", S}, {"heads", hq}, {"kv_heads", hkv}, {"qk_dim", qk}, {"v_dim", vd},
                         {"fwd_bwd_ms", ms}};
  }
  // The experts' grouped GEMMs at the layout's rows per expert.
  const bool moe = m.moe.num_experts > 0;
  if (moe) {
    const LayerCosts lc = layer_costs(a, o, p);
    const int64_t experts = std::max<int64_t>(1, m.moe.num_experts / a.ep);
    const int64_t r = std::max<int64_t>(1, std::llround(lc.rows_per_expert)), M = r * experts;
    const int64_t F = m.moe.ffn_hidden_size / a.etp, F1 = m.swiglu ? 2 * F : F;
    const std::vector<int64_t> rows(static_cast<size_t>(experts), r);
    Tensor x = randn({M, H}, cdt, dev, "cal-gx"), w1 = randn({experts, F1, H}, cdt, dev, "cal-w1");
    Tensor w2 = randn({experts, H, F}, cdt, dev, "cal-w2"), h1 = Tensor::empty({M, F1}, cdt, dev);
    Tensor act = randn({M, F}, cdt, dev, "cal-act"), y = Tensor::empty({M, H}, cdt, dev), dy = randn({M, H}, cdt, dev, "cal-gdy");
    Tensor dact = Tensor::empty({M, F}, cdt, dev), dh1 = randn({M, F1}, cdt, dev, "cal-dh1"), dx = Tensor::empty({M, H}, cdt, dev);
    Tensor dw1 = Tensor::zeros({experts, F1, H}, DType::F32, dev), dw2 = Tensor::zeros({experts, H, F}, DType::F32, dev);
    const double ms = time_ms(dev, 1, [&] {
      ops::grouped_gemm_forward(x, w1, rows, h1);
      ops::grouped_gemm_forward(act, w2, rows, y);
      ops::grouped_gemm_dgrad(dy, w2, rows, dact);
      ops::grouped_gemm_wgrad(dy, act, rows, dw2);
      ops::grouped_gemm_dgrad(dh1, w1, rows, dx);
      ops::grouped_gemm_wgrad(dh1, x, rows, dw1);
    });
    const double flops = 3 * 2.0 * static_cast<double>(M) * H * static_cast<double>(F1 + F);
    p.grouped_gemm_efficiency = flops / (ms * 1e-3) / peak;
    p.grouped_gemm_reference_rows = static_cast<double>(r);
    meas["grouped_gemm"] = {{"experts", experts}, {"rows_per_expert", r}, {"hidden", H}, {"ffn", F},
                            {"fwd_dgrad_wgrad_ms", ms}};
  }
  // One layer through its own classes; what the model's GEMMs and attention do not explain is
  // the small kernels'.
  {
    const ModelConfig c = rank_layer_config(a);
    ParamStore store(dev, DType::F32, cdt, 1234);
    Norm norm1(store, "norm1", H, c.rmsnorm, c.norm_epsilon), norm2(store, "norm2", H, c.rmsnorm, c.norm_epsilon);
    std::unique_ptr<AttentionBlock> mha;
    std::unique_ptr<MlaAttention> mla;
    if (c.mla.enabled) mla = std::make_unique<MlaAttention>(store, "attn", c);
    else mha = std::make_unique<AttentionBlock>(store, "attn", c);
    std::unique_ptr<MoeLayer> moe_layer;
    std::unique_ptr<Mlp> mlp;
    if (moe) moe_layer = std::make_unique<MoeLayer>(store, "moe", c);
    else mlp = std::make_unique<Mlp>(store, "mlp", H, c.ffn_hidden_size, c.swiglu, c.add_bias_linear,
                                     c.init_method_std, c.init_method_std);
    store.initialize();
    const int64_t moe_tokens = moe ? Tl * m.moe.router.topk / c.moe.router.topk : T;
    const int64_t moe_batch = moe_tokens % a.micro_batch_size == 0 ? a.micro_batch_size : 1;
    Tensor x = randn({T, H}, cdt, dev, "cal-lx"), dy = randn({T, H}, cdt, dev, "cal-ldy", 1e-3);
    Tensor xm = randn({moe_tokens, H}, cdt, dev, "cal-mx"), dym = randn({moe_tokens, H}, cdt, dev, "cal-mdy", 1e-3);
    uint64_t seed = 0;
    const double ms = time_ms(dev, 1, [&] {
      Norm::Ctx n1, n2;
      (void)norm1.forward(x, n1);
      (void)norm2.forward(x, n2);
      if (c.mla.enabled) {
        MlaAttention::Ctx ac;
        (void)mla->forward(x, a.micro_batch_size, ac);
        (void)mla->backward(dy, a.micro_batch_size, ac);
      } else {
        AttentionBlock::Ctx ac;
        (void)mha->forward(x, a.micro_batch_size, ac);
        (void)mha->backward(dy, a.micro_batch_size, ac);
      }
      if (moe) {
        MoeLayer::Ctx mc;
        (void)moe_layer->forward(xm, moe_batch, true, seed++, mc);
        (void)moe_layer->backward(dym, 1.0, mc);
      } else {
        Mlp::Ctx mc;
        (void)mlp->forward(xm, mc, a.micro_batch_size);
        (void)mlp->backward(dym, mc);
      }
      (void)norm2.backward(dy, n2);
      (void)norm1.backward(dy, n1);
    });
    if (moe) (void)moe_layer->finish_step();
    const LayerCosts lc = layer_costs(a, o, p);
    const double priced = 3 * (lc.attn_gemm_s + lc.attn_core_s + (moe ? lc.expert_gemm_s + lc.moe_other_gemm_s : lc.dense_mlp_s));
    const double bytes = lc.attn_small_bytes + (moe ? lc.moe_small_bytes : lc.dense_small_bytes);
    // The GEMMs timed alone may run slower than inside the layer; the rest is kept at >= 5% of
    // the layer so that the efficiency stays finite (the measured record says when).
    const double rest = std::max(ms * 1e-3 - priced, 0.05 * ms * 1e-3);
    MC_CHECK(base.hbm_gbps > 0, "moecore plan --calibrate: the profile '", base.name, "' has no hbm_gbps");
    p.small_kernel_efficiency = bytes / (rest * base.hbm_gbps * 1e9);
    meas["layer"] = {{"kind", moe ? "moe" : "dense"}, {"fwd_bwd_ms", ms}, {"gemm_attention_priced_ms", priced * 1e3},
                     {"small_kernels_ms", rest * 1e3}, {"small_kernel_bytes", bytes},
                     {"rest_clamped", ms * 1e-3 - priced < 0.05 * ms * 1e-3}};
  }
  return cal;
}

}  // namespace moecore::plan
