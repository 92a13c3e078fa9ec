#include "moecore/train/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "moecore/core/philox.h"
#include "moecore/data/tokenizer.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"

namespace moecore {

namespace {

std::vector<int32_t> parse_ids(const std::string& text, int64_t vocab) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (ss >> item) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    MC_CHECK(*end == '\0' && v >= 0 && v < vocab, "--prompt-ids: '", item, "' is not a token id in [0, ", vocab, ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

// Samples from softmax(logits / temperature) restricted to the top_k largest (0: all).
int32_t sample(const std::vector<float>& logits, double temperature, int64_t top_k, uint64_t seed, uint64_t step) {
  const int64_t v = static_cast<int64_t>(logits.size());
  std::vector<int32_t> order(static_cast<size_t>(v));
  for (int64_t i = 0; i < v; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (temperature <= 0) return order[0];
  const int64_t keep = top_k > 0 ? std::min(top_k, v) : v;
  std::vector<double> p(static_cast<size_t>(keep));
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) {
    p[static_cast<size_t>(i)] = std::exp((logits[order[i]] - logits[order[0]]) / temperature);
    sum += p[static_cast<size_t>(i)];
  }
  double u = philox_uniform(seed, rng_key("generate"), step) * sum;
  for (int64_t i = 0; i < keep; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u <= 0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace

int generate(const GenerateArgs& g, const TrainFlagCodec& codec) {
  MC_CHECK(!g.load.empty(), "moecore generate needs --load <checkpoint directory>");
  MC_CHECK(g.prompt.empty() != g.prompt_ids.empty(), "moecore generate needs exactly one of --prompt and --prompt-ids");
  MC_CHECK(g.max_new_tokens >= 0 && g.temperature >= 0 && g.top_k >= 0,
           "--max-new-tokens, --temperature and --top-k must be >= 0");

  const TrainingState meta = read_checkpoint_meta(g.load);
  MC_CHECK(!meta.args.empty(), "checkpoint '", g.load, "' does not record the flags it was trained with");
  const TrainArgs args = codec.rebuild(meta.args, g.device, "checkpoint '" + g.load + "'");
  const ModelConfig& cfg = args.model;
  ParamStore store(args.device, DType::F32, args.bf16 ? DType::BF16 : DType::F32, static_cast<uint64_t>(args.seed));
  GPTModel model(cfg, store);
  store.initialize();
  load_checkpoint(g.load, store);

  std::vector<int32_t> ids;
  const bool text = !g.prompt.empty();
  std::unique_ptr<Tokenizer> tokenizer;
  if (text) {
    // The tokenizer the model was trained with (recorded in the checkpoint).
    std::string type, model_file;
    for (const auto& [name, value] : meta.args) {
      if (name == "tokenizer-type") type = value;
      if (name == "tokenizer-model") model_file = value;
    }
    MC_CHECK(!type.empty(), "--prompt: the checkpoint was trained without a tokenizer (--mock-data); give --prompt-ids");
    tokenizer = make_tokenizer(type, model_file);
    for (int64_t id : tokenizer->encode(g.prompt)) ids.push_back(static_cast<int32_t>(id));
  } else {
    ids = parse_ids(g.prompt_ids, cfg.vocab_size);
  }
  MC_CHECK(!ids.empty(), "the prompt is empty");
  const size_t prompt_len = ids.size();
  for (int64_t step = 0; step < g.max_new_tokens; ++step) {
    const size_t len = std::min(ids.size(), static_cast<size_t>(cfg.seq_length));
    std::vector<int32_t> window(ids.end() - static_cast<std::ptrdiff_t>(len), ids.end());
    const Tensor tokens = Tensor::from_vector(window, {1, static_cast<int64_t>(len)}, args.device);
    const Tensor logits = model.logits(tokens);  // [len, V]
    Tensor last = Tensor::empty({cfg.vocab_size}, DType::F32, args.device);
    Tensor row = logits.slice(0, static_cast<int64_t>(len) - 1, static_cast<int64_t>(len)).view({cfg.vocab_size});
    if (row.dtype() == DType::F32) {
      last = row;
    } else {
      Tensor f = Tensor::empty({cfg.vocab_size}, DType::F32, args.device);
      ops::cast(row, f);
      last = f;
    }
    ids.push_back(sample(last.to_vector<float>(), g.temperature, g.top_k, static_cast<uint64_t>(g.seed),
                         static_cast<uint64_t>(step)));
  }
  // The forwards' deferred routing checks, accumulated over every step: read once, before
  // anything is printed.
  for (MoeLayer* l : model.moe_layers()) l->check_evaluation_routing();
  std::printf("prompt ids:    ");
  for (size_t i = 0; i < prompt_len; ++i) std::printf("%d ", ids[i]);
  std::printf("\ngenerated ids: ");
  for (size_t i = prompt_len; i < ids.size(); ++i) std::printf("%d ", ids[i]);
  std::printf("\n");
  if (tokenizer) {
    std::vector<int64_t> all;
    for (int32_t id : ids)
      if (id < tokenizer->vocab_size() && id != tokenizer->eod()) all.push_back(id);  // padding ids and eod: no text
    std::printf("text: %s\n", tokenizer->decode(all).c_str());
  }
  return 0;
}

}  // namespace moecore
