// Generation benchmark: moecore::generate_tokens (train/generation.h, the loop of `moecore
// generate`) with the KV cache at mixtral-small's shapes (configs/mixtral-small.yaml: 4 layers,
// hidden 2048, 16 heads of 128, 8 experts top-2 of width 5632, vocabulary 32768, untied output
// layer), random weights (Philox initialisation, no checkpoint), bf16 compute, on GPU 0.
// Greedy decoding of --new-tokens tokens (default 512) after a --prompt-len token prompt
// (default 128), for one prompt and for --batch prompts (default 16) decoded together; no eod.
// Each decoding step replays a CUDA graph (train/decode_step.h) unless --no-cuda-graph. Each run
// generates --repeats times (default 3) and reports the median generation.
// Prints tokens/s of the decode (prefill separately) and, for one prompt, the memory bound:
//   weight bytes one token reads = per layer (q, k, v, o projections + router + top-k experts'
//   three matrices) + the output layer, bf16 (norms, the embedding row and the KV cache left out)
//   bound tokens/s = copy bandwidth / those bytes
// where the copy bandwidth is a device-to-device copy of 1 GiB timed with CUDA events in the same
// run (bytes read + bytes written per second, the median of 5). Targets: one prompt >= 40% of
// the bound, the batch >= 8x one prompt's tokens/s. JSON lines, then a table. Without a CUDA
// device it prints one line.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "moecore/cli/flags.h"
#include "moecore/core/system_info.h"
#include "moecore/model/config.h"
#include "moecore/train/generation.h"
#include <nlohmann/json.hpp>

using namespace moecore;

namespace {

ModelConfig mixtral_small() {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 2048;
  c.ffn_hidden_size = 5632;
  c.num_attention_heads = 16;
  c.kv_channels = 128;
  c.seq_length = 2048;
  c.max_position_embeddings = 2048;
  c.vocab_size = 32768;
  c.rmsnorm = true;
  c.position_embedding_type = "rope";
  c.swiglu = true;
  c.add_bias_linear = false;
  c.untie_embeddings = true;
  c.moe.num_experts = 8;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 5632;
  finalize_model_config(c, "1");
  return c;
}

// Weight bytes (bf16) one decoded token reads: see the header comment.
double weight_bytes_per_token(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size), q = static_cast<double>(c.num_attention_heads * c.head_dim()),
               kv = static_cast<double>(c.kv_heads() * c.head_dim());
  const double attention = h * q * 2 + h * kv * 2;  // q and o; k and v
  const double router = h * static_cast<double>(c.moe.num_experts);
  const double experts = static_cast<double>(c.moe.router.topk) * 3 * h * static_cast<double>(c.moe.ffn_hidden_size);
  const double layers = static_cast<double>(c.num_layers) * (attention + router + experts);
  return 2 * (layers + h * static_cast<double>(c.vocab_size));
}

struct Run {
  int64_t prompts;
  GenerationOutput out;
  double decode_tps() const { return out.decode_seconds > 0 ? out.decode_tokens / out.decode_seconds : 0; }
  double prefill_tps() const { return out.prefill_seconds > 0 ? out.prefill_tokens / out.prefill_seconds : 0; }
};

// The median (by decode tokens/s) of `repeats` generations after a warm-up.
Run run(GPTModel& model, Device dev, int64_t prompts, int64_t prompt_len, int64_t new_tokens, bool cuda_graph,
        int64_t repeats) {
  std::vector<std::vector<int32_t>> p(static_cast<size_t>(prompts));
  for (int64_t r = 0; r < prompts; ++r)
    for (int64_t i = 0; i < prompt_len; ++i) p[static_cast<size_t>(r)].push_back(static_cast<int32_t>((r * 7919 + i * 104729) % 32768));
  GenerationOptions opt;
  opt.temperature = 0;
  opt.max_new_tokens = new_tokens;
  opt.cuda_graph = cuda_graph;
  generate_tokens(model, dev, p, [&] { GenerationOptions w = opt; w.max_new_tokens = 8; return w; }());  // warm-up
  std::vector<Run> runs;
  for (int64_t i = 0; i < std::max<int64_t>(1, repeats); ++i) runs.push_back({prompts, generate_tokens(model, dev, p, opt)});
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.decode_tps() < b.decode_tps(); });
  return runs[runs.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t prompt_len = 128, new_tokens = 512, batch = 16, repeats = 3;
    bool no_cuda_graph = false;
    cli::FlagSet flags("bench_generate", "Decoding tokens/s with the KV cache at mixtral-small's shapes.");
    flags.add_int("prompt-len", &prompt_len, "prompt tokens");
    flags.add_int("new-tokens", &new_tokens, "tokens decoded per prompt");
    flags.add_int("batch", &batch, "prompts decoded together in the batched run");
    flags.add_int("repeats", &repeats, "generations per run; the median one (by decode tokens/s) is reported");
    flags.add_bool("no-cuda-graph", &no_cuda_graph, "launch each decoding step's kernels one by one (no CUDA graph)");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    if (cuda_device_count() == 0) {
      std::printf("%s\n", nlohmann::json{{"bench", "generate"}, {"skipped", "no CUDA device"}}.dump().c_str());
      return 0;
    }
    const std::string card = system_info()["cuda_devices"][0]["name"].get<std::string>();
    const Device dev = Device::cuda(0);
    const ModelConfig cfg = mixtral_small();
    ParamStore store(dev, DType::F32, DType::BF16, 1234);
    GPTModel model(cfg, store);
    store.initialize();
    const double bandwidth = bench::copy_bandwidth(dev), bytes = weight_bytes_per_token(cfg), bound = bandwidth / bytes;
    std::printf("%s\n", nlohmann::json{{"bench", "generate_bound"}, {"copy_bandwidth_gb_s", bandwidth / 1e9},
                                       {"weight_bytes_per_token", bytes}, {"bound_tokens_per_s", bound}}
                            .dump()
                            .c_str());
    std::vector<Run> runs = {run(model, dev, 1, prompt_len, new_tokens, !no_cuda_graph, repeats),
                             run(model, dev, batch, prompt_len, new_tokens, !no_cuda_graph, repeats)};
    for (const Run& r : runs)
      std::printf("%s\n", nlohmann::json{{"bench", "generate"}, {"prompts", r.prompts}, {"prompt_len", prompt_len},
                                         {"new_tokens", new_tokens}, {"prefill_tokens_per_s", r.prefill_tps()},
                                         {"decode_tokens_per_s", r.decode_tps()},
                                         {"decode_ms_per_step", r.out.decode_seconds * 1e3 * r.prompts /
                                                                    std::max<int64_t>(1, r.out.decode_tokens)},
                                         {"decode_path", r.out.decode_path}}
                              .dump()
                              .c_str());
    const double one = runs[0].decode_tps(), many = runs[1].decode_tps();
    std::printf("\nGeneration, mixtral-small shapes, bf16, greedy, prompt %lld + %lld new tokens, on %s\n",
                static_cast<long long>(prompt_len), static_cast<long long>(new_tokens), card.c_str());
    std::printf("decoding steps: %s\n", runs[1].out.decode_path.c_str());
    std::printf("copy bandwidth %.0f GB/s; weights per token %.1f MB -> bound %.0f tokens/s\n", bandwidth / 1e9, bytes / 1e6, bound);
    std::printf("%-10s %14s %14s %14s %14s\n", "prompts", "prefill tok/s", "decode tok/s", "vs bound", "vs 1 prompt");
    for (const Run& r : runs)
      std::printf("%-10lld %14.0f %14.1f %13.1f%% %13.2fx\n", static_cast<long long>(r.prompts), r.prefill_tps(),
                  r.decode_tps(), 100 * r.decode_tps() / bound, one > 0 ? r.decode_tps() / one : 0);
    std::printf("targets: 1 prompt >= 40%% of the bound (now %.1f%%), %lld prompts >= 8x 1 prompt (now %.2fx)\n",
                100 * one / bound, static_cast<long long>(batch), one > 0 ? many / one : 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_generate: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
