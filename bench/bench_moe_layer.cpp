// MoE layer benchmark: MoeLayer (src/moecore/moe/moe_layer.h) forward + backward, router ->
// permutation -> grouped experts (SwiGLU) -> combine, at the two configurations:
//   mixtral  h4096 f14336 E8   k2  8192 tokens   target <= 28 ms on an H200 (PyTorch grouped: 39.7 ms)
//   qwen3    h2048 f768   E128 k8  16384 tokens  target <= 8 ms              (PyTorch: 19.2 ms)
// bf16 compute weights with fp32 masters and gradients, fp32 router, aux loss on (coefficient
// 1e-2, softmax top-k), training mode, no shared experts, sequences of 4096 tokens.
// The router is a real one over random weights and inputs, so the expert loads are those of an
// untrained router (printed as the max/min tokens per expert).
//
// Timing: each iteration (forward + backward) between two CUDA events, `iters` iterations after
// `warmup`; the median is reported. The grouped GEMM implementation is the process default
// (MOECORE_GROUPED_GEMM=loop|grouped selects it). Without a CUDA device it prints one line.
// Flags: --iters N (default 10), --warmup N (default 3), --quick (qwen3 only).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/cli/flags.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/core/tensor.h"
#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/moe/moe_layer.h"
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
  double median_ms, min_ms;
  double max_tokens, min_tokens;  // assignments per expert in the last iteration
};

Result run(const LayerCase& lc, int warmup, int iters) {
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
  std::vector<double> times;
  for (int i = 0; i < warmup + iters; ++i) {
    Event start(dev), stop(dev);
    start.record();
    MoeLayer::Ctx ctx;
    layer.forward(x, batch, true, static_cast<uint64_t>(i), ctx);
    layer.backward(dy, 1.0, ctx);
    stop.record();
    stop.synchronize();
    if (i >= warmup) times.push_back(stop.elapsed_ms_since(start));
  }
  Result r{};
  std::sort(times.begin(), times.end());
  r.median_ms = times[times.size() / 2];
  r.min_ms = times.front();
  const MoeStepStats st = layer.finish_step();
  if (!st.tokens_per_expert.empty()) {
    r.max_tokens = *std::max_element(st.tokens_per_expert.begin(), st.tokens_per_expert.end());
    r.min_tokens = *std::min_element(st.tokens_per_expert.begin(), st.tokens_per_expert.end());
    const double steps = static_cast<double>(warmup + iters);  // the stats sum every micro-batch
    r.max_tokens /= steps, r.min_tokens /= steps;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t iters = 10, warmup = 3;
    bool quick = false;
    cli::FlagSet flags("bench_moe_layer", "MoE layer forward+backward time at the issue's two configurations.");
    flags.add_int("iters", &iters, "timed iterations (median reported)");
    flags.add_int("warmup", &warmup, "untimed iterations first");
    flags.add_bool("quick", &quick, "only the qwen3 configuration");
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
    std::vector<std::pair<LayerCase, Result>> results;
    for (const LayerCase& lc : cases) {
      const Result r = run(lc, static_cast<int>(warmup), static_cast<int>(iters));
      results.push_back({lc, r});
      const nlohmann::json j = {{"bench", "moe_layer"}, {"case", lc.name}, {"device", card},
                                {"grouped_gemm", impl}, {"median_ms", r.median_ms}, {"min_ms", r.min_ms},
                                {"target_ms", lc.target_ms}, {"pytorch_ms", lc.pytorch_ms},
                                {"max_tokens_per_expert", r.max_tokens}, {"min_tokens_per_expert", r.min_tokens}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
    std::printf("\nMoE layer forward+backward on %s (bf16, fp32 router, aux loss; grouped GEMM: %s)\n", card.c_str(),
                impl.c_str());
    std::printf("%-34s %10s %10s %10s %11s %12s %14s\n", "case", "median ms", "min ms", "target ms", "vs target",
                "PyTorch ms", "tokens/expert");
    for (const auto& [lc, r] : results)
      std::printf("%-34s %10.2f %10.2f %10.1f %10.2fx %12.1f %7.0f-%-6.0f\n", lc.name.c_str(), r.median_ms, r.min_ms,
                  lc.target_ms, r.median_ms / lc.target_ms, lc.pytorch_ms, r.min_tokens, r.max_tokens);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_layer: error: %s\n", e.what());
    return 1;
  }
}
