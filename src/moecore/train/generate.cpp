#include "moecore/train/generate.h"

#include <cstdio>
#include <sstream>

#include "moecore/data/jsonl.h"
#include "moecore/data/tokenizer.h"
#include "moecore/model/gpt.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/generation.h"

namespace moecore {

namespace {

std::vector<int32_t> parse_ids(const std::string& text, int64_t vocab, const std::string& what) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (ss >> item) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    MC_CHECK(*end == '\0' && v >= 0 && v < vocab, what, ": '", item, "' is not a token id in [0, ", vocab, ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

// The ids of "prompt_ids": [..] in a line already known to be a JSON object, as "a b c"; false
// if the key is missing; an Error if its value is not an array of integers.
bool json_id_array(const std::string& line, const std::string& where, std::string& ids) {
  const size_t key = line.find("\"prompt_ids\"");
  if (key == std::string::npos) return false;
  size_t i = line.find_first_not_of(" \t", key + 12);
  MC_CHECK(i != std::string::npos && line[i] == ':', where, ": expected ':' after \"prompt_ids\"");
  i = line.find_first_not_of(" \t", i + 1);
  MC_CHECK(i != std::string::npos && line[i] == '[', where, ": \"prompt_ids\" must be an array of token ids");
  const size_t close = line.find(']', i);
  MC_CHECK(close != std::string::npos, where, ": \"prompt_ids\" has no closing ']'");
  ids = line.substr(i + 1, close - i - 1);
  for (char& c : ids) {
    if (c == ',') c = ' ';
    MC_CHECK(c == ' ' || c == '\t' || c == '-' || (c >= '0' && c <= '9'), where,
             ": \"prompt_ids\" must be an array of integers, got '", line.substr(i, close - i + 1), "'");
  }
  return true;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Text of ids: padding ids (beyond the tokenizer's vocabulary) and eod have none.
std::string decode_text(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  std::vector<int64_t> kept;
  for (int32_t id : ids)
    if (id < tokenizer.vocab_size() && id != tokenizer.eod()) kept.push_back(id);
  return tokenizer.decode(kept);
}

struct Prompt {
  std::vector<int32_t> ids;
  bool text = false;
};

std::vector<Prompt> read_prompt_file(const std::string& path, const Tokenizer* tokenizer, int64_t vocab) {
  std::vector<Prompt> prompts;
  JsonlLineReader reader(path);
  std::string line;
  int64_t number = 0;
  while (reader.next(line, number)) {
    const std::string where = "--prompt-file '" + path + "' line " + std::to_string(number);
    std::vector<std::string> values;
    const std::string object = parse_jsonl_fields(line, {}, values);
    MC_CHECK(object.empty(), where, ": ", object, " (expected {\"prompt\": \"...\"} or {\"prompt_ids\": [..]})");
    Prompt p;
    std::string ids;
    if (json_id_array(line, where, ids)) {
      p.ids = parse_ids(ids, vocab, where);
    } else {
      const std::string err = parse_jsonl_fields(line, {"prompt"}, values);
      MC_CHECK(err.empty(), where, ": ", err, " (expected {\"prompt\": \"...\"} or {\"prompt_ids\": [..]})");
      MC_CHECK(tokenizer, where, ": a text prompt, but the checkpoint was trained without a tokenizer (--mock-data); give \"prompt_ids\"");
      for (int64_t id : tokenizer->encode(values[0])) p.ids.push_back(static_cast<int32_t>(id));
      p.text = true;
    }
    MC_CHECK(!p.ids.empty(), where, ": the prompt is empty");
    prompts.push_back(std::move(p));
  }
  MC_CHECK(!prompts.empty(), "--prompt-file '", path, "' holds no prompts");
  return prompts;
}

void print_json_lines(const std::vector<Prompt>& prompts, const GenerationOutput& out, const Tokenizer* tokenizer) {
  int64_t generated = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<int32_t>& ids = out.new_tokens[i];
    generated += static_cast<int64_t>(ids.size());
    std::string line = "{\"prompt_index\": " + std::to_string(i) + ", ";
    if (prompts[i].text && tokenizer) {
      line += "\"text\": " + json_string(decode_text(*tokenizer, ids));
    } else {
      line += "\"ids\": [";
      for (size_t j = 0; j < ids.size(); ++j) line += (j ? ", " : "") + std::to_string(ids[j]);
      line += "]";
    }
    std::printf("%s, \"new_tokens\": %zu}\n", line.c_str(), ids.size());
  }
  auto rate = [](int64_t n, double s) { return s > 0 ? static_cast<double>(n) / s : 0.0; };
  std::printf("{\"summary\": true, \"prompts\": %zu, \"new_tokens\": %lld, \"prefill_tokens\": %lld, "
              "\"prefill_seconds\": %.6f, \"prefill_tokens_per_s\": %.1f, \"decode_tokens\": %lld, "
              "\"decode_seconds\": %.6f, \"decode_tokens_per_s\": %.1f, \"decode_path\": %s}\n",
              prompts.size(), static_cast<long long>(generated), static_cast<long long>(out.prefill_tokens),
              out.prefill_seconds, rate(out.prefill_tokens, out.prefill_seconds),
              static_cast<long long>(out.decode_tokens), out.decode_seconds, rate(out.decode_tokens, out.decode_seconds),
              json_string(out.decode_path.empty() ? "full-recompute" : out.decode_path).c_str());
}

}  // namespace

int generate(const GenerateArgs& g, const TrainFlagCodec& codec) {
  MC_CHECK(!g.load.empty(), "moecore generate needs --load <checkpoint directory>");
  MC_CHECK((!g.prompt.empty()) + (!g.prompt_ids.empty()) + (!g.prompt_file.empty()) == 1,
           "moecore generate needs exactly one of --prompt, --prompt-ids and --prompt-file");
  MC_CHECK(g.max_new_tokens >= 0 && g.temperature >= 0 && g.top_k >= 0,
           "--max-new-tokens, --temperature and --top-k must be >= 0");
  MC_CHECK(g.top_p > 0 && g.top_p <= 1, "--top-p ", g.top_p, ": expected a probability in (0, 1] (1: off)");
  MC_CHECK(g.eod_id >= -2, "--eod-id ", g.eod_id, ": expected a token id, -1 (none) or -2 (the tokenizer's)");

  const TrainingState meta = read_checkpoint_meta(g.load);
  MC_CHECK(!meta.args.empty(), "checkpoint '", g.load, "' does not record the flags it was trained with");
  const TrainArgs args = codec.rebuild(meta.args, g.device, "checkpoint '" + g.load + "'");
  const ModelConfig& cfg = args.model;
  ParamStore store(args.device, DType::F32, args.bf16 ? DType::BF16 : DType::F32, static_cast<uint64_t>(args.seed));
  GPTModel model(cfg, store);
  store.initialize();
  load_checkpoint(g.load, store);

  // The tokenizer the checkpoint records (convert and train --save keep its files beside it).
  const CheckpointTokenizer recorded = checkpoint_tokenizer(g.load);
  std::unique_ptr<Tokenizer> tokenizer;
  if (!recorded.type.empty()) tokenizer = make_tokenizer(recorded.type, recorded.path);
  std::vector<Prompt> prompts;
  if (!g.prompt_file.empty()) {
    prompts = read_prompt_file(g.prompt_file, tokenizer.get(), cfg.vocab_size);
  } else if (!g.prompt.empty()) {
    MC_CHECK(tokenizer, "--prompt: the checkpoint was trained without a tokenizer (--mock-data); give --prompt-ids");
    Prompt p;
    for (int64_t id : tokenizer->encode(g.prompt)) p.ids.push_back(static_cast<int32_t>(id));
    p.text = true;
    prompts.push_back(std::move(p));
  } else {
    prompts.push_back({parse_ids(g.prompt_ids, cfg.vocab_size, "--prompt-ids"), false});
  }
  MC_CHECK(!prompts[0].ids.empty(), "the prompt is empty");

  GenerationOptions opt;
  opt.max_new_tokens = g.max_new_tokens;
  opt.temperature = g.temperature;
  opt.top_k = g.top_k;
  opt.top_p = g.top_p;
  opt.seed = static_cast<uint64_t>(g.seed);
  opt.eod = g.eod_id == -2 ? (tokenizer ? tokenizer->eod() : -1) : g.eod_id;
  opt.kv_cache = !g.no_kv_cache;
  opt.cuda_graph = !g.no_cuda_graph;
  std::vector<std::vector<int32_t>> ids;
  for (const Prompt& p : prompts) ids.push_back(p.ids);
  const GenerationOutput out = generate_tokens(model, args.device, ids, opt);
  // The forwards' deferred routing checks, accumulated over every step: read once, before
  // anything is printed.
  for (MoeLayer* l : model.moe_layers()) l->check_evaluation_routing();
  if (!g.prompt_file.empty()) {
    print_json_lines(prompts, out, tokenizer.get());
    return 0;
  }
  std::printf("prompt ids:    ");
  for (int32_t id : prompts[0].ids) std::printf("%d ", id);
  std::printf("\ngenerated ids: ");
  for (int32_t id : out.new_tokens[0]) std::printf("%d ", id);
  std::printf("\n");
  if (tokenizer) {
    std::vector<int32_t> all = prompts[0].ids;
    all.insert(all.end(), out.new_tokens[0].begin(), out.new_tokens[0].end());
    std::printf("text: %s\n", decode_text(*tokenizer, all).c_str());
  }
  return 0;
}

}  // namespace moecore
