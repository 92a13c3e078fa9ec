#include "moecore/train/generation.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "moecore/core/philox.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/decode_step.h"

namespace moecore {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// logits [R, V] (any float dtype) -> the f32 rows of `host`.
void read_logits(const Tensor& logits, Tensor& f32, std::vector<float>& host) {
  if (logits.dtype() == DType::F32) {
    host = logits.to_vector<float>();
    return;
  }
  if (!f32.defined() || f32.shape() != logits.shape()) f32 = Tensor::empty(logits.shape(), DType::F32, logits.device());
  ops::cast(logits, f32);
  host = f32.to_vector<float>();
}

uint64_t row_counter(size_t prompt, int64_t step) { return static_cast<uint64_t>(step) + (uint64_t{prompt} << 32); }

// The reference: every new token re-runs the model over the last seq-length tokens of one prompt.
GenerationOutput generate_full_recompute(GPTModel& model, Device device, const std::vector<std::vector<int32_t>>& prompts,
                                         const GenerationOptions& opt) {
  const ModelConfig& cfg = model.config();
  GenerationOutput out;
  out.new_tokens.resize(prompts.size());
  Tensor f32;
  std::vector<float> host;
  for (size_t p = 0; p < prompts.size(); ++p) {
    std::vector<int32_t> ids = prompts[p];
    for (int64_t step = 0; step < opt.max_new_tokens; ++step) {
      const auto t0 = Clock::now();
      const size_t len = std::min(ids.size(), static_cast<size_t>(cfg.seq_length));
      std::vector<int32_t> window(ids.end() - static_cast<std::ptrdiff_t>(len), ids.end());
      const Tensor logits = model.logits(Tensor::from_vector(window, {1, static_cast<int64_t>(len)}, device));
      read_logits(logits.slice(0, static_cast<int64_t>(len) - 1, static_cast<int64_t>(len)), f32, host);
      const int32_t token = sample_token(host.data(), cfg.vocab_size, opt, row_counter(p, step));
      ids.push_back(token);
      out.new_tokens[p].push_back(token);
      (step == 0 ? out.prefill_seconds : out.decode_seconds) += seconds_since(t0);
      (step == 0 ? out.prefill_tokens : out.decode_tokens) += step == 0 ? static_cast<int64_t>(len) : 1;
      if (token == opt.eod) break;
    }
  }
  return out;
}

}  // namespace

int32_t sample_token(const float* logits, int64_t vocab, const GenerationOptions& opt, uint64_t counter) {
  if (opt.temperature <= 0) return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  const int64_t keep = opt.top_k > 0 ? std::min(opt.top_k, vocab) : vocab;
  auto larger = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), larger);
  std::vector<double> p(static_cast<size_t>(keep));
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) {
    p[static_cast<size_t>(i)] = std::exp((logits[order[i]] - logits[order[0]]) / opt.temperature);
    sum += p[static_cast<size_t>(i)];
  }
  int64_t nucleus = keep;  // the smallest prefix holding top_p of the probability
  if (opt.top_p < 1) {
    double mass = 0;
    for (int64_t i = 0; i < keep; ++i) {
      mass += p[static_cast<size_t>(i)];
      if (mass >= opt.top_p * sum) {
        nucleus = i + 1;
        break;
      }
    }
    sum = 0;
    for (int64_t i = 0; i < nucleus; ++i) sum += p[static_cast<size_t>(i)];
  }
  double u = philox_uniform(opt.seed, rng_key("generate"), counter) * sum;
  for (int64_t i = 0; i < nucleus; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u <= 0) return order[i];
  }
  return order[nucleus - 1];
}

GenerationOutput generate_tokens(GPTModel& model, Device device, const std::vector<std::vector<int32_t>>& prompts,
                                 const GenerationOptions& opt) {
  const ModelConfig& cfg = model.config();
  MC_CHECK(!prompts.empty(), "generate: no prompts");
  for (const auto& p : prompts)
    for (int32_t id : p)
      MC_CHECK(id >= 0 && id < cfg.vocab_size, "prompt token ", id, " is not in the vocabulary [0, ", cfg.vocab_size, ")");
  if (!opt.kv_cache) return generate_full_recompute(model, device, prompts, opt);
  GenerationOutput out;
  const size_t rows = prompts.size();
  out.new_tokens.resize(rows);
  if (opt.max_new_tokens == 0) return out;
  size_t longest = 0;
  for (const auto& p : prompts) {
    MC_CHECK(!p.empty(), "the prompt is empty");
    longest = std::max(longest, p.size());
  }
  const int64_t max_len = static_cast<int64_t>(longest) + opt.max_new_tokens;
  MC_CHECK(max_len <= cfg.seq_length, "the longest prompt (", longest, " tokens) + --max-new-tokens ", opt.max_new_tokens,
           " = ", max_len, " positions exceed the model's --seq-length ", cfg.seq_length,
           " (the KV cache holds whole sequences): shorten them, or give --no-kv-cache (a sliding window)");
  const auto t0 = Clock::now();
  GPTModel::KvCache cache = model.make_kv_cache(static_cast<int64_t>(rows), max_len, device);
  Tensor logits = Tensor::empty({static_cast<int64_t>(rows), cfg.vocab_size}, model.compute_dtype(), device);
  std::vector<int64_t> position(rows);  // of each row's newest token
  for (size_t r = 0; r < rows; ++r) {
    const int64_t len = static_cast<int64_t>(prompts[r].size());
    const Tensor tokens = Tensor::from_vector(prompts[r], {1, len}, device);
    logits.slice(0, static_cast<int64_t>(r), static_cast<int64_t>(r) + 1)
        .copy_from(model.cached_logits(tokens, static_cast<int64_t>(r), {0}, cache));
    out.prefill_tokens += len;
    position[r] = len - 1;
  }
  Tensor f32;
  std::vector<float> host;
  read_logits(logits, f32, host);
  out.prefill_seconds = seconds_since(t0);
  const auto t1 = Clock::now();
  const bool greedy = opt.temperature <= 0;
  DecodeStep decode(model, cache, device, greedy, opt.cuda_graph);
  std::vector<int32_t> last(rows);
  std::vector<bool> active(rows, true);
  for (int64_t step = 0;; ++step) {
    bool any = false;
    for (size_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      if (step > 0 && greedy) {  // the device's argmax: the same first largest logit
        last[r] = decode.greedy_tokens()[r];
      } else {
        const float* row = (step == 0 ? host : decode.logits()).data() + r * static_cast<size_t>(cfg.vocab_size);
        last[r] = sample_token(row, cfg.vocab_size, opt, row_counter(r, step));
      }
      out.new_tokens[r].push_back(last[r]);
      out.decode_tokens += step > 0 ? 1 : 0;
      active[r] = last[r] != opt.eod && step + 1 < opt.max_new_tokens;
      if (active[r]) ++position[r];  // a stopped row re-runs its last position (its own row only)
      any = any || active[r];
    }
    if (!any) break;
    decode.run(last, position);
  }
  out.decode_seconds = seconds_since(t1);
  out.decode_path = decode.graph_status();
  return out;
}

}  // namespace moecore
