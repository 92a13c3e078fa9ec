// MoE layer benchmark: MoeLayer (src/moecore/moe/moe_layer.h) forward + backward, router ->
// permutation -> grouped experts (SwiGLU) -> combine, at the two configurations:
//   mixtral  h4096 f14336 E8   k2  8192 tokens   target <= 0.7x PyTorch's grouped MoE layer
//   qwen3    h2048 f768   E128 k8  16384 tokens  target <= 0.42x PyTorch's
// (the targets and figures: docs/performance.md)
// bf16 compute weights with fp32 masters and gradients, fp32 router, aux loss on (coefficient
// 1e-2, softmax top-k), training mode, no shared experts, sequences of 4096 tokens.
// The router is a real one over random weights and inputs, so the expert loads are those of an
// untrained router (printed as the max/min tokens per expert).
//
// Timing: `iters` iterations (forward + backward) enqueued back to back between two CUDA events,
// the mean per iteration, median of three such runs (as in training, where the host runs ahead of
// the GPU); also each iteration alone between two events with the host waiting after it (median
// and min of `iters` after `warmup`), which adds the GPU's wait for the host to enqueue the
// iteration's first kernels. Two gradient modes, each its own run: "accumulate" (the weight
// gradients are added to, as in every micro-batch after a step's first: the expert wgrads read
// and write their fp32 gradients) and "step" (each iteration is a step's first micro-batch, as
// in every step with one micro-batch: the gradients are written, not read; the store marks them
// stale before each iteration, a flag on the host). The grouped GEMM implementation is the
// process default (MOECORE_GROUPED_GEMM=loop|grouped|hopper|mixed selects it). Without a CUDA
// device it prints one line.
// Flags: --iters N (default 10), --warmup N (default 3), --quick (qwen3 only),
// --breakdown: also time each op of one forward + backward separately (the same ops, shapes and
// dtypes MoeLayer runs, on random data routed by a real router), each op between two CUDA events,
// median of `iters` after `warmup`; one table per configuration.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "moecore/cli/flags.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/core/tensor.h"
#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/moe_loss.h"
#include "moecore/ops/permute.h"
#include "moecore/ops/router.h"
#include "moecore/ops/swiglu.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/random.h"

using namespace moecore;

namespace {

struct LayerCase {
  std::string name;
  int64_t h, f, experts, topk, tokens;
  double target_ms, pytorch_ms;
};

struct Result {
  double median_ms, min_ms;  // iterations timed one by one (the host waits after each)
  double back_to_back_ms;    // iterations enqueued back to back (the median of 3 runs' means)
  double max_tokens, min_tokens;  // assignments per expert in the last iteration
};

Result run(const LayerCase& lc, int warmup, int iters, bool first_micro_batch) {
  const Device dev = Device::cuda(0);
  ModelConfig c;
  c.num_layers = 1;
  c.hidden_size = lc.h;
  c.num_attention_heads = lc.h / 128;
  c.seq_length = 4096;
  c.vocab_size = 1024;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.moe.num_experts = lc.experts;
  c.moe.router.topk = lc.topk;
  c.moe.ffn_hidden_size = lc.f;
  c.moe.load_balancing = LoadBalancing::AuxLoss;
  c.moe.aux_loss_coeff = 1e-2;
  finalize_model_config(c, "1");
  ParamStore store(dev, DType::F32, DType::BF16, 1234);
  MoeLayer layer(store, "moe", c);
  store.initialize();
  const int64_t batch = lc.tokens / c.seq_length;
  Tensor x = Tensor::empty({lc.tokens, lc.h}, DType::BF16, dev);
  Tensor dy = Tensor::empty({lc.tokens, lc.h}, DType::BF16, dev);
  ops::fill_normal(x, 7, rng_key("bench-moe-x"), 0.0, 1.0);
  ops::fill_normal(dy, 7, rng_key("bench-moe-dy"), 0.0, 1e-3);
  int64_t micro_batches = 0;
  auto forward_backward = [&] {
    if (first_micro_batch) store.mark_grads_stale();
    MoeLayer::Ctx ctx;
    layer.forward(x, batch, true, static_cast<uint64_t>(micro_batches++), ctx);
    layer.backward(dy, 1.0, ctx);
  };
  std::vector<double> times;
  for (int i = 0; i < warmup + iters; ++i) {
    Event start(dev), stop(dev);
    start.record();
    forward_backward();
    stop.record();
    stop.synchronize();
    if (i >= warmup) times.push_back(stop.elapsed_ms_since(start));
  }
  Result r{};
  std::sort(times.begin(), times.end());
  r.median_ms = times[times.size() / 2];
  r.min_ms = times.front();
  // Back to back, as in training, where the host runs ahead of the GPU: the one-by-one timing
  // above also counts the GPU waiting for the host to enqueue each iteration's first kernels.
  r.back_to_back_ms = bench::time_ms(dev, iters, 3, forward_backward, 0);  // warmed up above
  const MoeStepStats st = layer.finish_step();
  if (!st.tokens_per_expert.empty()) {
    r.max_tokens = *std::max_element(st.tokens_per_expert.begin(), st.tokens_per_expert.end());
    r.min_tokens = *std::min_element(st.tokens_per_expert.begin(), st.tokens_per_expert.end());
    const double steps = static_cast<double>(micro_batches);  // the stats sum every micro-batch
    r.max_tokens /= steps, r.min_tokens /= steps;
  }
  return r;
}

// Median ms of fn() between two CUDA events (warmup untimed calls first).
template <typename F>
double time_op(const Device& dev, int warmup, int iters, F&& fn) {
  std::vector<double> t;
  for (int i = 0; i < warmup + iters; ++i) {
    Event start(dev), stop(dev);
    start.record();
    fn();
    stop.record();
    stop.synchronize();
    if (i >= warmup) t.push_back(stop.elapsed_ms_since(start));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The ops of MoeLayer::forward + backward (moe/, one rank, aux loss, fp32 router, bf16
// experts), each timed alone. Rows marked "not in layer" are not in the sum: they run only with
// other settings (z-loss, sinkhorn) or are what the layer ran before (the separate router ops,
// the host copy of the indices for the per-expert counts, now taken from the routing plan).
void breakdown(const LayerCase& lc, int warmup, int iters, const std::string& card) {
  const Device dev = Device::cuda(0);
  const int64_t T = lc.tokens, H = lc.h, E = lc.experts, k = lc.topk, F = lc.f;
  const int64_t batch = lc.tokens / 4096;
  (void)batch;
  Tensor x = Tensor::empty({T, H}, DType::BF16, dev), dy = Tensor::empty({T, H}, DType::BF16, dev);
  Tensor wg = Tensor::empty({E, H}, DType::F32, dev), dwg = Tensor::zeros({E, H}, DType::F32, dev);
  ops::fill_normal(x, 7, rng_key("bd-x"), 0.0, 1.0);
  ops::fill_normal(dy, 7, rng_key("bd-dy"), 0.0, 1e-3);
  ops::fill_normal(wg, 7, rng_key("bd-wg"), 0.0, 0.02);
  ops::RouterConfig rc;
  rc.num_experts = E;
  rc.topk = k;
  Tensor router_in = Tensor::empty({T, H}, DType::F32, dev), logits = Tensor::empty({T, E}, DType::F32, dev);
  Tensor probs = Tensor::empty({T, k}, DType::F32, dev), indices = Tensor::empty({T, k}, DType::I32, dev);
  Tensor aux = Tensor::empty({T, E}, DType::F32, dev), counts = Tensor::empty({1, E}, DType::F32, dev);
  Tensor loss = Tensor::empty({1}, DType::F32, dev);
  std::vector<std::pair<std::string, double>> rows;
  auto add = [&](const std::string& name, auto&& fn) { rows.push_back({name, time_op(dev, warmup, iters, fn)}); };
  // The layer's router GEMMs (moe/router.cpp): fp32 operands as three bf16 parts, bf16 GEMMs into
  // fp32 (ops::bf16_parts). The fp32 GEMMs they replace (MOECORE_ROUTER_GEMM=fp32) are timed
  // outside the sum.
  std::vector<Tensor> w_parts = ops::bf16_parts(wg, 3);
  // forward
  add("router input cast bf16->f32 (not in layer)", [&] { ops::cast(x, router_in); });
  add("router gate GEMM fwd f32 (not in layer)", [&] { ops::gemm(router_in, wg, logits, false, true); });
  add("router weight bf16 parts (3)", [&] { w_parts = ops::bf16_parts(wg, 3); });
  add("router gate GEMMs fwd (3 bf16)", [&] {
    ops::gemm(x, w_parts[2], logits, false, true);
    ops::gemm(x, w_parts[1], logits, false, true, 1.0f, 1.0f);
    ops::gemm(x, w_parts[0], logits, false, true, 1.0f, 1.0f);
  });
  // The layer runs the fused op and the counts of its aux top-k; the three separate ops it
  // replaces (still used for sinkhorn) are timed for comparison, outside the sum.
  Tensor aux_idx = Tensor::empty({T, k}, DType::I32, dev);
  add("router_topk_aux_forward (fused)", [&] {
    ops::router_topk_aux_forward(logits, Tensor(), rc, probs, indices, aux, aux_idx);
  });
  add("topk_counts_from_indices", [&] { ops::topk_counts_from_indices(aux_idx, 1, counts); });
  add("router_topk_forward (not in layer)", [&] { ops::router_topk_forward(logits, Tensor(), rc, probs, indices); });
  add("aux_scores_forward (not in layer)", [&] { ops::aux_scores_forward(logits, rc.score, aux); });
  add("topk_counts (not in layer)", [&] { ops::topk_counts(aux, k, 1, counts); });
  add("switch_aux_loss_forward", [&] { ops::switch_aux_loss_forward(aux, counts, k, 1e-2, loss); });
  add("aux loss host read (not in layer: once a step)", [&] { (void)loss.to_vector<float>(); });
  add("z_loss_forward (not in layer)", [&] { ops::z_loss_forward(logits, 1e-3, loss); });
  add("indices host copy + count (not in layer)", [&] {
    const std::vector<int32_t> idx = indices.to_vector<int32_t>();
    std::vector<double> c(static_cast<size_t>(E), 0.0);
    for (int32_t v : idx) c[static_cast<size_t>(v)] += 1.0;
  });
  ops::MoeRouting r = ops::make_moe_routing(indices, Tensor(), E);
  add("make_moe_routing (+ host copy)", [&] { r = ops::make_moe_routing(indices, Tensor(), E); });
  const int64_t R = r.num_rows;
  Tensor permuted = Tensor::empty({R, H}, DType::BF16, dev);
  add("moe_permute_forward", [&] { ops::moe_permute_forward(x, r, permuted); });
  Tensor fc1_out = Tensor::empty({R, 2 * F}, DType::BF16, dev), act = Tensor::empty({R, F}, DType::BF16, dev);
  ops::fill_normal(fc1_out, 7, rng_key("bd-fc1"), 0.0, 1.0);
  // The layer applies the probabilities in the activation (weighted SwiGLU) and sums in the
  // combine; the probability-weighted unpermute and plain SwiGLU it replaced are timed outside.
  Tensor row_probs = Tensor::empty({R, 1}, DType::F32, dev);
  add("moe_permute_probs_forward", [&] { ops::moe_permute_probs_forward(probs, r, row_probs); });
  add("swiglu_forward (not in layer)", [&] { ops::swiglu_forward(fc1_out, act); });
  add("weighted_swiglu_forward", [&] { ops::weighted_swiglu_forward(fc1_out, row_probs, act); });
  Tensor expert_out = Tensor::empty({R, H}, DType::BF16, dev), out = Tensor::empty({T, H}, DType::BF16, dev);
  ops::fill_normal(expert_out, 7, rng_key("bd-eo"), 0.0, 1.0);
  add("moe_unpermute_forward with probs (not in layer)", [&] { ops::moe_unpermute_forward(expert_out, probs, r, out); });
  add("combine: moe_permute_backward (sum)", [&] { ops::moe_permute_backward(expert_out, r, out); });
  // backward
  Tensor d_eo = Tensor::empty({R, H}, DType::BF16, dev), dprobs = Tensor::empty({T, k}, DType::F32, dev);
  add("moe_unpermute_backward with probs (not in layer)",
      [&] { ops::moe_unpermute_backward(expert_out, probs, r, dy, d_eo, dprobs); });
  add("combine backward: moe_permute_forward", [&] { ops::moe_permute_forward(dy, r, d_eo); });
  Tensor d_fc1 = Tensor::empty({R, 2 * F}, DType::BF16, dev), d_row_probs = Tensor::empty({R, 1}, DType::F32, dev);
  ops::fill_normal(act, 7, rng_key("bd-da"), 0.0, 1.0);
  add("swiglu_backward (not in layer)", [&] { ops::swiglu_backward(fc1_out, act, d_fc1); });
  add("weighted_swiglu_backward", [&] { ops::weighted_swiglu_backward(fc1_out, row_probs, act, d_fc1, d_row_probs); });
  add("moe_permute_probs_backward", [&] { ops::moe_permute_probs_backward(d_row_probs, r, dprobs); });
  Tensor dx = Tensor::empty({T, H}, DType::BF16, dev);
  add("moe_permute_backward", [&] { ops::moe_permute_backward(d_eo, r, dx); });
  Tensor dlogits = Tensor::empty({T, E}, DType::F32, dev), daux = Tensor::empty({T, E}, DType::F32, dev);
  add("router_topk_backward", [&] { ops::router_topk_backward(logits, indices, dprobs, rc, dlogits); });
  add("switch_aux_loss_backward", [&] { ops::switch_aux_loss_backward(counts, k, 1e-2, 1.0, T, daux); });
  add("aux_scores_backward", [&] { ops::aux_scores_backward(logits, rc.score, daux, dlogits); });
  add("z_loss_backward (not in layer)", [&] { ops::z_loss_backward(logits, 1e-3, 1.0, dlogits); });
  add("router gate GEMM wgrad f32 (not in layer)", [&] { ops::gemm(dlogits, router_in, dwg, true, false, 1.0f, 1.0f); });
  Tensor d_router_in = Tensor::empty({T, H}, DType::F32, dev);
  add("router gate GEMM dgrad f32 (not in layer)", [&] { ops::gemm(dlogits, wg, d_router_in, false, false); });
  std::vector<Tensor> d_parts = ops::bf16_parts(dlogits, 3);
  add("router dlogits bf16 parts (3) + weight (2)", [&] {
    d_parts = ops::bf16_parts(dlogits, 3);
    w_parts = ops::bf16_parts(wg, 2);
  });
  add("router gate GEMMs wgrad (3 bf16)", [&] {
    ops::gemm(d_parts[2], x, dwg, true, false, 1.0f, 1.0f);
    ops::gemm(d_parts[1], x, dwg, true, false, 1.0f, 1.0f);
    ops::gemm(d_parts[0], x, dwg, true, false, 1.0f, 1.0f);
  });
  Tensor a_cat = Tensor::empty({T, 3 * E}, DType::BF16, dev), b_cat = Tensor::empty({3 * E, H}, DType::BF16, dev);
  add("router dgrad operands [d_mid|d_hi|d_hi], [w_hi;w_mid;w_hi]", [&] {
    const Tensor* a_parts[3] = {&d_parts[1], &d_parts[0], &d_parts[0]};
    const Tensor* b_parts[3] = {&w_parts[0], &w_parts[1], &w_parts[0]};
    for (int64_t i = 0; i < 3; ++i) {
      a_cat.slice(1, i * E, (i + 1) * E).copy_from(*a_parts[i]);
      b_cat.slice(0, i * E, (i + 1) * E).copy_from(*b_parts[i]);
    }
  });
  add("router gate GEMM dgrad into dx (bf16, K = 3E)", [&] { ops::gemm(a_cat, b_cat, dx, false, false, 1.0f, 1.0f); });
  add("router dx cast f32->bf16 + add (not in layer)", [&] {
    Tensor c = Tensor::empty({T, H}, DType::BF16, dev);
    ops::cast(d_router_in, c);
    ops::add(dx, c, dx);
  });
  double non_gemm = 0;
  std::printf("\nNon-GEMM breakdown, %s on %s (median of %d, ms)\n", lc.name.c_str(), card.c_str(), iters);
  for (const auto& [name, ms] : rows) {
    std::printf("  %-48s %8.3f\n", name.c_str(), ms);
    if (name.find("not in layer") == std::string::npos) non_gemm += ms;
    std::printf("%s\n", nlohmann::json{{"bench", "moe_layer_breakdown"}, {"case", lc.name}, {"op", name}, {"ms", ms}}
                             .dump().c_str());
  }
  std::printf("  %-48s %8.3f\n", "sum (layer ops, router GEMMs included)", non_gemm);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t iters = 10, warmup = 3;
    bool quick = false, want_breakdown = false;
    cli::FlagSet flags("bench_moe_layer", "MoE layer forward+backward time at the issue's two configurations.");
    flags.add_int("iters", &iters, "timed iterations (median reported)");
    flags.add_int("warmup", &warmup, "untimed iterations first");
    flags.add_bool("quick", &quick, "only the qwen3 configuration");
    flags.add_bool("breakdown", &want_breakdown, "also time each non-GEMM op of the layer separately");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    if (cuda_device_count() == 0) {
      std::printf("%s\n", nlohmann::json{{"bench", "moe_layer"}, {"skipped", "no CUDA device"}}.dump().c_str());
      return 0;
    }
    const nlohmann::json info = system_info();
    const std::string card = info["cuda_devices"][0]["name"].get<std::string>();
    const std::string impl = ops::grouped_gemm_impl_name(ops::grouped_gemm_impl());
    std::vector<LayerCase> cases = {{"mixtral h4096 f14336 E8 k2 T8192", 4096, 14336, 8, 2, 8192, 28.0, 39.7},
                                    {"qwen3 h2048 f768 E128 k8 T16384", 2048, 768, 128, 8, 16384, 8.0, 19.2}};
    if (quick) cases.erase(cases.begin());
    if (want_breakdown)
      for (const LayerCase& lc : cases) breakdown(lc, static_cast<int>(warmup), static_cast<int>(iters), card);
    struct Row {
      LayerCase lc;
      std::string grads;
      Result r;
    };
    std::vector<Row> results;
    for (const LayerCase& lc : cases) {
      for (const bool step : {false, true}) {
        const Result r = run(lc, static_cast<int>(warmup), static_cast<int>(iters), step);
        const std::string grads = step ? "step" : "accumulate";
        results.push_back({lc, grads, r});
        const nlohmann::json j = {{"bench", "moe_layer"}, {"case", lc.name}, {"device", card},
                                  {"grouped_gemm", impl}, {"weight_grads", grads}, {"back_to_back_ms", r.back_to_back_ms},
                                  {"median_ms", r.median_ms}, {"min_ms", r.min_ms},
                                  {"target_ms", lc.target_ms}, {"pytorch_ms", lc.pytorch_ms},
                                  {"max_tokens_per_expert", r.max_tokens}, {"min_tokens_per_expert", r.min_tokens}};
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
      }
    }
    std::printf("\nMoE layer forward+backward on %s (bf16, fp32 router, aux loss; grouped GEMM: %s)\n", card.c_str(),
                impl.c_str());
    std::printf("weight gradients: accumulate = added to (a later micro-batch); step = written (a step's first)\n");
    std::printf("ms: back to back (as in training) / one by one, median and min (the host waits after each)\n");
    std::printf("%-34s %-11s %8s %10s %10s %10s %10s %12s %14s\n", "case", "grads", "ms", "1-by-1 med", "1-by-1 min",
                "target ms", "vs target", "PyTorch ms", "tokens/expert");
    for (const Row& row : results)
      std::printf("%-34s %-11s %8.2f %10.2f %10.2f %10.1f %9.2fx %12.1f %7.0f-%-6.0f\n", row.lc.name.c_str(),
                  row.grads.c_str(), row.r.back_to_back_ms, row.r.median_ms, row.r.min_ms, row.lc.target_ms,
                  row.r.back_to_back_ms / row.lc.target_ms, row.lc.pytorch_ms, row.r.min_tokens, row.r.max_tokens);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_layer: error: %s\n", e.what());
    return 1;
  }
}
