#include "moecore/interop/hf_convert.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/core/progress.h"
#include "moecore/data/tokenizer.h"
#include "moecore/interop/hf_deepseek.h"
#include "moecore/interop/hf_config_values.h"
#include "moecore/interop/safetensors.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace moecore::interop {

namespace {

enum class Arch { Mixtral, Qwen2Moe, Qwen3Moe, DeepseekV2, DeepseekV3 };

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Mixtral: return "MixtralForCausalLM";
    case Arch::Qwen2Moe: return "Qwen2MoeForCausalLM";
    case Arch::Qwen3Moe: return "Qwen3MoeForCausalLM";
    case Arch::DeepseekV2: return "DeepseekV2ForCausalLM";
    case Arch::DeepseekV3: return "DeepseekV3ForCausalLM";
  }
  return "";
}
const char* model_type(Arch a) {
  switch (a) {
    case Arch::Mixtral: return "mixtral";
    case Arch::Qwen2Moe: return "qwen2_moe";
    case Arch::Qwen3Moe: return "qwen3_moe";
    case Arch::DeepseekV2: return "deepseek_v2";
    case Arch::DeepseekV3: return "deepseek_v3";
  }
  return "";
}
bool is_deepseek(Arch a) { return a == Arch::DeepseekV2 || a == Arch::DeepseekV3; }

// RoPE rows of an MLA projection [rows, cols]: in every block of `block` rows, the `count` rows
// from `start` are HF's interleaved pairs and our halves: ours[j] = hf[perm[j]], perm = [0, 2,
// ..., count-2, 1, 3, ..., count-1] (model/mla_attention.h). block 0: none.
struct RopeRows {
  int64_t block = 0, start = 0, count = 0;
};
// One of our parameters: the concatenation (flat, in order) of its HF parts.
struct Part {
  std::string hf;
  Shape shape;
  RopeRows rope{};
};
struct Mapped {
  std::string ours;
  Shape shape;
  std::vector<Part> parts;
  // HF tensors that hold a copy of this whole parameter (DeepSeek's MTP layer keeps its own
  // embed_tokens and shared_head.head): equal to it on import, written from it on export.
  std::vector<std::string> copies = {};
};

// Reorders the RoPE rows of `data` (one part) from HF's order to ours (to_ours) or back.
void reorder_rope_rows(float* data, const Part& p, bool to_ours) {
  const RopeRows& r = p.rope;
  if (r.block == 0) return;
  const int64_t rows = p.shape[0], cols = shape_numel(p.shape) / rows;
  std::vector<float> tmp(static_cast<size_t>(r.count * cols));
  for (int64_t b = 0; b + r.block <= rows; b += r.block) {
    float* base = data + (b + r.start) * cols;
    std::copy(base, base + r.count * cols, tmp.begin());
    for (int64_t j = 0; j < r.count; ++j) {
      const int64_t hf = j < r.count / 2 ? 2 * j : 2 * (j - r.count / 2) + 1;
      const int64_t from = to_ours ? hf : j, to = to_ours ? j : hf;
      std::copy(tmp.begin() + from * cols, tmp.begin() + (from + 1) * cols, base + to * cols);
    }
  }
}

// DeepSeek's attention (MLA) of one layer: ours under o, HF's under p.
void add_mla(std::vector<Mapped>& m, const ModelConfig& c, const std::string& o, const std::string& p, bool interleaved) {
  const int64_t h = c.hidden_size, n = c.num_attention_heads, r = c.mla.qk_pos_emb_head_dim;
  const int64_t d = c.mla.q_head_dim(), kvl = c.mla.kv_lora_rank, ql = c.mla.q_lora_rank;
  const RopeRows q_rope = interleaved ? RopeRows{d, c.mla.qk_head_dim, r} : RopeRows{};
  const RopeRows k_rope = interleaved ? RopeRows{kvl + r, kvl, r} : RopeRows{};
  const std::string a = o + ".self_attention", s = p + ".self_attn";
  if (ql > 0) {
    m.push_back({a + ".linear_q_down_proj.weight", {ql, h}, {{s + ".q_a_proj.weight", {ql, h}}}});
    m.push_back({a + ".q_layernorm.weight", {ql}, {{s + ".q_a_layernorm.weight", {ql}}}});
    m.push_back({a + ".linear_q_up_proj.weight", {n * d, ql}, {{s + ".q_b_proj.weight", {n * d, ql}, q_rope}}});
  } else {
    m.push_back({a + ".linear_q_proj.weight", {n * d, h}, {{s + ".q_proj.weight", {n * d, h}, q_rope}}});
  }
  m.push_back({a + ".linear_kv_down_proj.weight", {kvl + r, h}, {{s + ".kv_a_proj_with_mqa.weight", {kvl + r, h}, k_rope}}});
  m.push_back({a + ".kv_layernorm.weight", {kvl}, {{s + ".kv_a_layernorm.weight", {kvl}}}});
  const int64_t kv = n * (c.mla.qk_head_dim + c.mla.v_head_dim);
  m.push_back({a + ".linear_kv_up_proj.weight", {kv, kvl}, {{s + ".kv_b_proj.weight", {kv, kvl}}}});
  m.push_back({a + ".linear_proj.weight", {h, n * c.mla.v_head_dim}, {{s + ".o_proj.weight", {h, n * c.mla.v_head_dim}}}});
}

// One transformer layer (a decoder layer, or an MTP module's): ours under o, HF's under p.
void add_layer(std::vector<Mapped>& m, const ModelConfig& c, Arch arch, const std::string& o, const std::string& p,
               bool moe_layer, bool interleaved) {
  const int64_t h = c.hidden_size, d = c.head_dim();
  auto one = [&](const std::string& ours, const std::string& hf, const Shape& s) { m.push_back({ours, s, {{hf, s}}}); };
  one(o + ".input_layernorm.weight", p + ".input_layernorm.weight", {h});
  if (is_deepseek(arch)) {
    add_mla(m, c, o, p, interleaved);
  } else {
    one(o + ".self_attention.linear_q.weight", p + ".self_attn.q_proj.weight", {c.num_attention_heads * d, h});
    one(o + ".self_attention.linear_k.weight", p + ".self_attn.k_proj.weight", {c.kv_heads() * d, h});
    one(o + ".self_attention.linear_v.weight", p + ".self_attn.v_proj.weight", {c.kv_heads() * d, h});
    one(o + ".self_attention.linear_proj.weight", p + ".self_attn.o_proj.weight", {h, c.num_attention_heads * d});
    if (c.add_qkv_bias) {
      one(o + ".self_attention.linear_q.bias", p + ".self_attn.q_proj.bias", {c.num_attention_heads * d});
      one(o + ".self_attention.linear_k.bias", p + ".self_attn.k_proj.bias", {c.kv_heads() * d});
      one(o + ".self_attention.linear_v.bias", p + ".self_attn.v_proj.bias", {c.kv_heads() * d});
    }
    if (c.qk_layernorm) {
      one(o + ".self_attention.q_layernorm.weight", p + ".self_attn.q_norm.weight", {d});
      one(o + ".self_attention.k_layernorm.weight", p + ".self_attn.k_norm.weight", {d});
    }
  }
  one(o + ".pre_mlp_layernorm.weight", p + ".post_attention_layernorm.weight", {h});
  if (moe_layer) {
    const int64_t e = c.moe.num_experts, f = c.moe.ffn_hidden_size;
    const std::string moe = p + (arch == Arch::Mixtral ? ".block_sparse_moe" : ".mlp");
    one(o + ".mlp.router.weight", moe + ".gate.weight", {e, h});
    if (is_deepseek(arch) && c.moe.enable_expert_bias)
      one(o + ".mlp.router.expert_bias", moe + ".gate.e_score_correction_bias", {e});
    Mapped fc1{o + ".mlp.experts.linear_fc1.weight", {e, 2 * f, h}, {}};
    Mapped fc2{o + ".mlp.experts.linear_fc2.weight", {e, h, f}, {}};
    for (int64_t x = 0; x < e; ++x) {
      const std::string ex = moe + ".experts." + std::to_string(x);
      const bool mx = arch == Arch::Mixtral;
      fc1.parts.push_back({ex + (mx ? ".w1.weight" : ".gate_proj.weight"), {f, h}});
      fc1.parts.push_back({ex + (mx ? ".w3.weight" : ".up_proj.weight"), {f, h}});
      fc2.parts.push_back({ex + (mx ? ".w2.weight" : ".down_proj.weight"), {h, f}});
    }
    m.push_back(fc1);
    m.push_back(fc2);
    if (c.moe.shared_expert_size > 0) {  // Qwen2-MoE (gated) and DeepSeek
      const int64_t s = c.moe.shared_expert_size;
      const std::string sh = moe + (is_deepseek(arch) ? ".shared_experts" : ".shared_expert");
      m.push_back({o + ".mlp.shared_experts.linear_fc1.weight", {2 * s, h},
                   {{sh + ".gate_proj.weight", {s, h}}, {sh + ".up_proj.weight", {s, h}}}});
      one(o + ".mlp.shared_experts.linear_fc2.weight", sh + ".down_proj.weight", {h, s});
      if (!is_deepseek(arch)) one(o + ".mlp.shared_experts.gate.weight", moe + ".shared_expert_gate.weight", {1, h});
    }
  } else {
    const int64_t f = c.ffn_hidden_size;
    m.push_back({o + ".mlp.linear_fc1.weight", {2 * f, h}, {{p + ".mlp.gate_proj.weight", {f, h}}, {p + ".mlp.up_proj.weight", {f, h}}}});
    one(o + ".mlp.linear_fc2.weight", p + ".mlp.down_proj.weight", {h, f});
  }
}

// interleaved: DeepSeek's RoPE rows are interleaved pairs (deepseek_rope_interleaved).
std::vector<Mapped> build_mapping(const ModelConfig& c, Arch arch, bool interleaved = true) {
  const int64_t h = c.hidden_size, v = c.vocab_size;
  std::vector<Mapped> m;
  auto one = [&](const std::string& ours, const std::string& hf, const Shape& s) { m.push_back({ours, s, {{hf, s}}}); };
  one("embedding.word_embeddings.weight", "model.embed_tokens.weight", {v, h});
  for (int64_t i = 0; i < c.num_layers; ++i)
    add_layer(m, c, arch, "decoder.layers." + std::to_string(i), "model.layers." + std::to_string(i), c.is_moe(i),
              interleaved);
  one("decoder.final_layernorm.weight", "model.norm.weight", {h});
  if (c.untie_embeddings) one("output_layer.weight", "lm_head.weight", {v, h});
  // DeepSeek-V3's MTP module k: the extra layer model.layers.<num_layers + k - 1> (model/mtp.h).
  // The other architectures have none: an export names our mtp.* tensors as having no equivalent.
  for (int64_t k = 0; arch == Arch::DeepseekV3 && k < c.mtp_num_layers; ++k) {
    const std::string o = "mtp.layers." + std::to_string(k), p = "model.layers." + std::to_string(c.num_layers + k);
    one(o + ".enorm.weight", p + ".enorm.weight", {h});
    one(o + ".hnorm.weight", p + ".hnorm.weight", {h});
    one(o + ".eh_proj.weight", p + ".eh_proj.weight", {h, 2 * h});
    add_layer(m, c, arch, o + ".transformer_layer", p, c.is_moe(c.num_layers - 1), interleaved);
    one(o + ".final_layernorm.weight", p + ".shared_head.norm.weight", {h});
    m[0].copies.push_back(p + ".embed_tokens.weight");
    const std::string head = p + ".shared_head.head.weight";
    for (Mapped& x : m)
      if (x.ours == (c.untie_embeddings ? "output_layer.weight" : "embedding.word_embeddings.weight")) x.copies.push_back(head);
  }
  return m;
}

json read_json_file(const fs::path& p) {
  std::ifstream f(p);
  MC_CHECK(f.good(), "cannot read '", p.string(), "'");
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    MC_FAIL("'", p.string(), "' is not valid JSON: ", e.what());
  }
}

Arch arch_of(const json& cfg, const std::string& origin) {
  std::string a;
  if (cfg.contains("architectures") && cfg["architectures"].is_array() && !cfg["architectures"].empty())
    a = cfg["architectures"][0].get<std::string>();
  const std::string mt = cfg.value("model_type", "");
  if (a == "MixtralForCausalLM" || (a.empty() && mt == "mixtral")) return Arch::Mixtral;
  if (a == "Qwen2MoeForCausalLM" || (a.empty() && mt == "qwen2_moe")) return Arch::Qwen2Moe;
  if (a == "Qwen3MoeForCausalLM" || (a.empty() && mt == "qwen3_moe")) return Arch::Qwen3Moe;
  if (a == "DeepseekV2ForCausalLM" || (a.empty() && mt == "deepseek_v2")) return Arch::DeepseekV2;
  if (a == "DeepseekV3ForCausalLM" || (a.empty() && mt == "deepseek_v3")) return Arch::DeepseekV3;
  MC_FAIL(origin, ": architecture '", a.empty() ? mt : a,
          "' is not supported; supported: MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, ",
          "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM");
}


// Per layer: MoE? (Qwen2/Qwen3: not in mlp_only_layers and (i+1) % decoder_sparse_step == 0.)
std::vector<bool> moe_layers(const json& cfg, Arch arch, int64_t layers) {
  std::vector<bool> out(static_cast<size_t>(layers), true);
  if (arch == Arch::Mixtral) return out;
  const int64_t step = cfg.value("decoder_sparse_step", int64_t{1});
  std::set<int64_t> dense;
  if (cfg.contains("mlp_only_layers") && cfg["mlp_only_layers"].is_array())
    for (const auto& x : cfg["mlp_only_layers"]) dense.insert(x.get<int64_t>());
  for (int64_t i = 0; i < layers; ++i) out[static_cast<size_t>(i)] = !dense.count(i) && step > 0 && (i + 1) % step == 0;
  return out;
}

// The HF folder's tokenizer, as Megatron's --tokenizer-type names it: tokenizer.json ->
// HuggingFaceTokenizer when moecore reads it (byte-level BPE); otherwise tokenizer.model ->
// Llama2Tokenizer when tokenizer_config.json adds a BOS token (add_bos_token true, or a Llama
// tokenizer class without add_bos_token: Mixtral, Llama 2), else SentencePieceTokenizer. None: {}.
struct HfTokenizer {
  std::string type, file;
};
HfTokenizer hf_tokenizer(const fs::path& dir, const std::string& origin) {
  const fs::path json_file = dir / "tokenizer.json", sp_file = dir / "tokenizer.model";
  std::string json_problem;
  if (fs::exists(json_file)) {
    try {
      make_tokenizer("HuggingFaceTokenizer", json_file.string());
      return {"HuggingFaceTokenizer", json_file.string()};
    } catch (const Error& e) {
      json_problem = e.what();
    }
  }
  if (fs::exists(sp_file)) {
    bool bos = false;
    const fs::path config_file = dir / "tokenizer_config.json";
    if (fs::exists(config_file)) {
      const json c = read_json_file(config_file);
      const std::string cls = c.value("tokenizer_class", "");
      bos = c.contains("add_bos_token") && c["add_bos_token"].is_boolean() ? c["add_bos_token"].get<bool>()
                                                                           : cls.rfind("Llama", 0) == 0;
    }
    if (!json_problem.empty())
      std::printf("note: %s: tokenizer.json is not byte-level BPE moecore reads (%s); using tokenizer.model\n",
                  origin.c_str(), json_problem.c_str());
    return {bos ? "Llama2Tokenizer" : "SentencePieceTokenizer", sp_file.string()};
  }
  if (!json_problem.empty()) {
    std::printf("note: %s: tokenizer.json is recorded, but moecore cannot read it: %s\n", origin.c_str(),
                json_problem.c_str());
    return {"HuggingFaceTokenizer", json_file.string()};
  }
  return {};
}

}  // namespace

std::vector<std::pair<std::string, std::string>> hf_config_to_train_flags(const std::string& text,
                                                                          const std::string& origin) {
  json cfg;
  try {
    cfg = json::parse(text);
  } catch (const std::exception& e) {
    MC_FAIL(origin, ": config.json is not valid JSON: ", e.what());
  }
  const Arch arch = arch_of(cfg, origin);
  if (is_deepseek(arch)) return deepseek_config_to_train_flags(cfg, arch == Arch::DeepseekV3, origin);
  const std::string act = cfg.value("hidden_act", "silu");
  MC_CHECK(act == "silu", origin, ": hidden_act '", act, "' is not supported (SwiGLU experts need silu)");
  MC_CHECK(!cfg.value("attention_bias", false), origin,
           ": attention_bias true (biases on q/k/v and o) is not supported; Qwen2-MoE's q/k/v biases are");
  // Qwen2-MoE always has q/k/v biases (newer transformers: config "qkv_bias", default true).
  const bool qkv_bias = arch == Arch::Qwen2Moe && cfg.value("qkv_bias", true);
  // RoPE: plain rotate-half only (rope_scaling / rope_parameters of another type would change it).
  double rope_theta = cfg.value("rope_theta", 10000.0);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!cfg.contains(key) || cfg[key].is_null()) continue;
    const json& r = cfg[key];
    MC_CHECK(r.is_object(), origin, ": config.json '", key, "' is not an object");
    const std::string type = r.value("rope_type", r.value("type", std::string("default")));
    MC_CHECK(type == "default", origin, ": ", key, " type '", type, "' is not supported (only default RoPE)");
    if (r.contains("rope_theta") && r["rope_theta"].is_number()) rope_theta = r["rope_theta"].get<double>();
  }
  MC_CHECK(!cfg.value("use_sliding_window", false), origin, ": use_sliding_window true is not supported");
  if (cfg.contains("layer_types") && cfg["layer_types"].is_array())
    for (const auto& t : cfg["layer_types"])
      MC_CHECK(t == "full_attention", origin, ": layer_types entry ", t.dump(), " is not supported (full_attention only)");
  const int64_t layers = need_int(cfg, "num_hidden_layers", origin), hidden = need_int(cfg, "hidden_size", origin),
                heads = need_int(cfg, "num_attention_heads", origin);
  const int64_t kv = cfg.contains("num_key_value_heads") && cfg["num_key_value_heads"].is_number_integer()
                         ? cfg["num_key_value_heads"].get<int64_t>() : heads;
  const int64_t head_dim = cfg.contains("head_dim") && cfg["head_dim"].is_number_integer()
                               ? cfg["head_dim"].get<int64_t>() : hidden / heads;
  const int64_t maxpos = need_int(cfg, "max_position_embeddings", origin);
  const bool tied = cfg.value("tie_word_embeddings", false);
  // Mixtral says num_local_experts, Qwen num_experts; transformers 5 writes Qwen3-MoE's as
  // num_local_experts too.
  const char* experts_key = arch == Arch::Mixtral ? "num_local_experts" : "num_experts";
  if (!cfg.contains(experts_key)) experts_key = arch == Arch::Mixtral ? "num_experts" : "num_local_experts";
  const int64_t experts = need_int(cfg, experts_key, origin);
  const int64_t ffn = need_int(cfg, "intermediate_size", origin);
  const int64_t moe_ffn = arch == Arch::Mixtral ? ffn : need_int(cfg, "moe_intermediate_size", origin);
  const int64_t shared = arch == Arch::Qwen2Moe ? need_int(cfg, "shared_expert_intermediate_size", origin) : 0;
  MC_CHECK(arch != Arch::Qwen2Moe || shared > 0, origin, ": shared_expert_intermediate_size must be > 0");
  // Qwen2/Qwen3 with norm_topk_prob false: softmax over all experts, top-k, no renormalisation =
  // Megatron's pre-softmax. Mixtral and norm_topk_prob true: softmax over the chosen k (default).
  const bool pre_softmax = arch != Arch::Mixtral && !cfg.value("norm_topk_prob", false);
  std::string freq = "[";
  const std::vector<bool> moe = moe_layers(cfg, arch, layers);
  for (size_t i = 0; i < moe.size(); ++i) freq += std::string(i ? "," : "") + (moe[i] ? "1" : "0");
  freq += "]";
  // Every layer MoE: Megatron's "1" (what a user passes to resume); otherwise the per-layer list
  // (HF's (i+1) % decoder_sparse_step differs from Megatron's i % N).
  if (std::find(moe.begin(), moe.end(), false) == moe.end()) freq = "1";

  return {
      {"num-layers", std::to_string(layers)},
      {"hidden-size", std::to_string(hidden)},
      {"ffn-hidden-size", std::to_string(ffn)},
      {"num-attention-heads", std::to_string(heads)},
      {"group-query-attention", "true"},
      {"num-query-groups", std::to_string(kv)},
      {"kv-channels", std::to_string(head_dim)},
      {"vocab-size", std::to_string(need_int(cfg, "vocab_size", origin))},
      {"normalization", "RMSNorm"},
      {"norm-epsilon", config_number_text(cfg.value("rms_norm_eps", 1e-6))},
      {"position-embedding-type", "rope"},
      {"rotary-base", config_number_text(rope_theta)},
      {"max-position-embeddings", std::to_string(maxpos)},
      {"seq-length", std::to_string(std::min<int64_t>(maxpos, 4096))},
      {"swiglu", "true"},
      {"disable-bias-linear", "true"},
      {"add-qkv-bias", qkv_bias ? "true" : "false"},
      {"untie-embeddings-and-output-weights", tied ? "false" : "true"},
      {"qk-layernorm", arch == Arch::Qwen3Moe ? "true" : "false"},
      {"num-experts", std::to_string(experts)},
      {"moe-layer-freq", freq},
      {"moe-router-topk", std::to_string(need_int(cfg, "num_experts_per_tok", origin))},
      {"moe-ffn-hidden-size", std::to_string(moe_ffn)},
      {"moe-aux-loss-coeff", config_number_text(cfg.value("router_aux_loss_coef", 0.0))},
      {"moe-router-pre-softmax", pre_softmax ? "true" : "false"},
      {"moe-shared-expert-intermediate-size", std::to_string(shared)},
      {"moe-shared-expert-gate", shared > 0 ? "true" : "false"},
      {"mock-data", "true"},
      {"micro-batch-size", "1"},
      {"global-batch-size", "1"},
      {"train-iters", "1"},
  };
}

namespace {
// One progress line over a conversion's bytes: those read (each source tensor), then those written
// (each target tensor); the total is both, so the ETA covers the whole conversion.
class ConvertMeter {
 public:
  ConvertMeter(const ConvertProgress& p, uint64_t read_bytes, size_t read_tensors, uint64_t write_bytes,
               size_t write_tensors)
      : line_("convert", static_cast<double>(read_bytes + write_bytes), "B", p.out, p.interval_s),
        read_tensors_(read_tensors), write_tensors_(write_tensors) {}
  void read(uint64_t bytes) { step(bytes, "reading", ++read_, read_tensors_); }
  void wrote(uint64_t bytes) { step(bytes, "writing", ++written_, write_tensors_); }

 private:
  void step(uint64_t bytes, const char* what, size_t n, size_t of) {
    done_ += static_cast<double>(bytes);
    line_.update(done_, std::string(what) + " tensor " + std::to_string(n) + "/" + std::to_string(of));
  }
  ProgressLine line_;
  size_t read_tensors_, write_tensors_, read_ = 0, written_ = 0;
  double done_ = 0;
};
}  // namespace

void convert_hf_to_moecore(const std::string& hf_dir, const std::string& ckpt_dir, const TrainFlagCodec& codec,
                           const ConvertProgress& progress) {
  const std::string origin = "HF checkpoint '" + hf_dir + "'";
  const json cfg = read_json_file(fs::path(hf_dir) / "config.json");
  const Arch arch = arch_of(cfg, origin);
  auto set = hf_config_to_train_flags(cfg.dump(), origin);
  const SafetensorsReader reader(hf_dir);
  // transformers' DeepseekV3 builds no MTP layer (its save_pretrained writes none) but keeps
  // num_nextn_predict_layers: a folder without the layer imports without MTP.
  for (auto& [name, value] : set)
    if (name == "mtp-num-layers" && value != "0") {
      const std::string layer = "model.layers." + std::to_string(need_int(cfg, "num_hidden_layers", origin));
      if (reader.has(layer + ".eh_proj.weight")) continue;
      std::printf("note: %s: num_nextn_predict_layers is %s but there is no MTP layer (%s.*): imported without "
                  "multi-token prediction (--mtp-num-layers 0)\n", origin.c_str(), value.c_str(), layer.c_str());
      value = "0";
    }
  // The tokenizer goes with the checkpoint: <ckpt_dir>/tokenizer/, recorded relative to ckpt_dir.
  const HfTokenizer tok = hf_tokenizer(hf_dir, origin);
  if (!tok.file.empty()) {
    set.push_back({"tokenizer-type", tok.type});
    set.push_back({"tokenizer-model", "tokenizer/" + tokenizer_file_name(tok.file)});
  }
  const auto flags = codec.all_values(set, origin);
  const TrainArgs args = codec.rebuild(flags, "cpu", origin);
  const std::vector<Mapped> mapping = build_mapping(args.model, arch, deepseek_rope_interleaved(cfg));

  std::set<std::string> expected;
  for (const Mapped& m : mapping) {
    for (const Part& p : m.parts) expected.insert(p.hf);
    for (const std::string& c : m.copies) expected.insert(c);
  }
  for (const std::string& n : reader.names())
    MC_CHECK(expected.count(n), origin, " has tensor '", n, "' that a ", arch_name(arch),
             " with this config.json does not (unexpected tensor; not converted)");

  uint64_t read_bytes = 0, write_bytes = 0;
  size_t read_tensors = 0;
  for (const Mapped& m : mapping) {
    write_bytes += static_cast<uint64_t>(shape_numel(m.shape)) * 4;
    for (const Part& p : m.parts) {
      read_bytes += reader.has(p.hf) ? reader.info(p.hf).nbytes() : 0;
      ++read_tensors;
    }
    for (const std::string& c : m.copies) {
      read_bytes += reader.has(c) ? reader.info(c).nbytes() : 0;
      ++read_tensors;
    }
  }
  ConvertMeter meter(progress, read_bytes, read_tensors, write_bytes, mapping.size());
  std::vector<NamedTensor> out;
  json dtypes = json::object(), order = json::array();
  auto read_part = [&](const Part& p) {
    MC_CHECK(reader.has(p.hf), origin, " is missing tensor '", p.hf, "' (expected ", shape_str(p.shape), ")");
    const StTensorInfo& info = reader.info(p.hf);
    MC_CHECK(info.shape == p.shape, origin, ": tensor '", p.hf, "' has shape ", shape_str(info.shape),
             "; config.json implies ", shape_str(p.shape));
    MC_CHECK(info.dtype == StDType::BF16 || info.dtype == StDType::F16 || info.dtype == StDType::F32, origin,
             ": tensor '", p.hf, "' is ", st_dtype_name(info.dtype), "; only BF16, F16 and F32 weights convert");
    dtypes[p.hf] = st_dtype_name(info.dtype);
    order.push_back(p.hf);
    meter.read(info.nbytes());
    return reader.read_f32(p.hf);
  };
  for (const Mapped& m : mapping) {
    Tensor t = Tensor::empty(m.shape, DType::F32);
    float* dst = static_cast<float*>(t.data_ptr());
    for (const Part& p : m.parts) {
      const Tensor src = read_part(p);
      std::memcpy(dst, src.data_ptr(), src.nbytes());
      reorder_rope_rows(dst, p, true);
      dst += src.numel();
    }
    for (const std::string& copy : m.copies) {
      const Tensor c = read_part({copy, m.shape});
      MC_CHECK(std::memcmp(c.data_ptr(), t.data_ptr(), t.nbytes()) == 0, origin, ": tensor '", copy,
               "' differs from '", m.parts[0].hf, "'; moecore's MTP layer shares the main model's (model/mtp.h)");
    }
    out.push_back({m.ours, t});
  }
  const json source = {{"architecture", arch_name(arch)}, {"config", cfg}, {"dtypes", dtypes}, {"tensor_order", order}};
  if (!tok.file.empty()) {
    const std::string name = copy_tokenizer_files(tok.file, (fs::path(ckpt_dir) / "tokenizer").string());
    std::printf("tokenizer: %s, copied to %s\n", tok.type.c_str(), (fs::path(ckpt_dir) / "tokenizer" / name).c_str());
  }
  // The resolved values (as `moecore train` records them), so that a resuming run compares equal.
  save_model_checkpoint(ckpt_dir, out, args.flag_values, source.dump(), [&](uint64_t n) { meter.wrote(n); });
}

namespace {
json config_from_args(const ModelConfig& c, Arch arch, const std::string& origin) {
  if (is_deepseek(arch)) return deepseek_config_from_args(c, arch == Arch::DeepseekV3, origin);
  json j = {{"architectures", {arch_name(arch)}},
            {"model_type", model_type(arch)},
            {"hidden_act", "silu"},
            {"hidden_size", c.hidden_size},
            {"num_hidden_layers", c.num_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.kv_heads()},
            {"head_dim", c.head_dim()},
            {"vocab_size", c.vocab_size},
            {"rms_norm_eps", c.norm_epsilon},
            {"rope_theta", c.rotary_base},
            {"max_position_embeddings", c.max_position_embeddings},
            {"tie_word_embeddings", !c.untie_embeddings},
            {"num_experts_per_tok", c.moe.router.topk},
            {"router_aux_loss_coef", c.moe.aux_loss_coeff},
            {"attention_bias", false},
            {"torch_dtype", "float32"}};
  if (arch == Arch::Mixtral) {
    j["num_local_experts"] = c.moe.num_experts;
    j["intermediate_size"] = c.moe.ffn_hidden_size;
  } else {
    j["num_experts"] = c.moe.num_experts;
    j["intermediate_size"] = c.ffn_hidden_size;
    j["moe_intermediate_size"] = c.moe.ffn_hidden_size;
    j["norm_topk_prob"] = !c.moe.router.pre_softmax;
    if (arch == Arch::Qwen2Moe) {
      j["shared_expert_intermediate_size"] = c.moe.shared_expert_size;
      j["qkv_bias"] = true;
      j.erase("attention_bias");
    }
    j["decoder_sparse_step"] = 1;
    json dense = json::array();
    for (int64_t i = 0; i < c.num_layers; ++i)
      if (!c.is_moe(i)) dense.push_back(i);
    j["mlp_only_layers"] = dense;
  }
  return j;
}
// The HF architecture of a moecore model: the recorded one (a converted checkpoint), else inferred
// (Multi-Latent Attention: DeepSeek-V3 with sigmoid routing, else DeepSeek-V2; q/k norms:
// Qwen3-MoE; q/k/v biases or a gated shared expert: Qwen2-MoE; pre-softmax routing or dense
// layers: Qwen3-MoE; else Mixtral); then every feature is checked against it.
Arch export_arch(const ModelConfig& c, const json& source, const std::string& origin) {
  MC_CHECK(c.moe.num_experts > 0, origin, ": a dense model (no --num-experts) has no HF MoE equivalent");
  MC_CHECK(c.swiglu && !c.add_bias_linear && c.rmsnorm && c.position_embedding_type == "rope", origin,
           ": only models with SwiGLU, RMSNorm, RoPE and no linear biases (--add-qkv-bias aside) map to an HF MoE ",
           "architecture");
  bool dense = false;
  for (int64_t i = 0; i < c.num_layers; ++i) dense = dense || !c.is_moe(i);
  Arch arch = c.mla.enabled ? (c.moe.router.score == ops::RouterScore::Sigmoid ? Arch::DeepseekV3 : Arch::DeepseekV2)
              : c.qk_layernorm                                  ? Arch::Qwen3Moe
              : c.add_qkv_bias || c.moe.shared_expert_size > 0 ? Arch::Qwen2Moe
              : c.moe.router.pre_softmax || dense             ? Arch::Qwen3Moe
                                                              : Arch::Mixtral;
  if (source.contains("architecture")) arch = arch_of({{"architectures", {source["architecture"]}}}, origin);
  if (is_deepseek(arch)) {
    MC_CHECK(!c.add_qkv_bias, origin, ": ", arch_name(arch), " has no q/k/v biases (--add-qkv-bias)");
    deepseek_config_from_args(c, arch == Arch::DeepseekV3, origin);  // its checks name what does not map
    return arch;
  }
  MC_CHECK(!c.mla.enabled, origin, ": ", arch_name(arch), " has no Multi-Latent Attention (--multi-latent-attention)");
  MC_CHECK(!c.moe.enable_expert_bias && c.moe.router.score == ops::RouterScore::Softmax &&
               c.moe.router.num_groups == 0 && c.moe.router.scaling_factor == 0,
           origin, ": ", arch_name(arch), " routes by softmax without --moe-router-enable-expert-bias, groups or ",
           "--moe-router-topk-scaling-factor");
  const std::string name = arch_name(arch);
  MC_CHECK(c.qk_layernorm == (arch == Arch::Qwen3Moe), origin, ": ", name,
           arch == Arch::Qwen3Moe ? " needs --qk-layernorm" : " has no q/k norms (--qk-layernorm)");
  MC_CHECK(c.add_qkv_bias == (arch == Arch::Qwen2Moe), origin, ": ", name,
           arch == Arch::Qwen2Moe ? " needs --add-qkv-bias" : " has no q/k/v biases (--add-qkv-bias)");
  MC_CHECK((c.moe.shared_expert_size > 0) == (arch == Arch::Qwen2Moe), origin, ": ", name,
           arch == Arch::Qwen2Moe ? " needs a shared expert (--moe-shared-expert-intermediate-size)"
                                  : " has no shared expert (--moe-shared-expert-intermediate-size)");
  MC_CHECK(c.moe.shared_expert_size == 0 || c.moe.shared_expert_gate, origin,
           ": Qwen2-MoE's shared expert is gated (--moe-shared-expert-gate)");
  MC_CHECK(arch != Arch::Mixtral || (!dense && !c.moe.router.pre_softmax), origin,
           ": Mixtral has no dense layers and renormalises the top-k probabilities (no --moe-router-pre-softmax)");
  return arch;
}
}  // namespace

std::vector<StWriteTensor> export_hf_f32(const ModelConfig& c, const std::string& architecture,
                                         const std::function<Tensor(const std::string&)>& get) {
  const Arch arch = export_arch(c, {{"architecture", architecture}}, "export to " + architecture);
  std::vector<StWriteTensor> out;
  for (const Mapped& m : build_mapping(c, arch)) {
    const Tensor t = get(m.ours);
    MC_CHECK(t.defined() && t.dtype() == DType::F32 && t.shape() == m.shape && t.is_contiguous() && t.device().is_cpu(),
             "export to ", architecture, ": tensor '", m.ours, "' must be a contiguous CPU F32 ", shape_str(m.shape),
             ", got ", t.defined() ? t.describe() : std::string("none"));
    const float* src = static_cast<const float*>(t.data_ptr());
    std::vector<float> part;
    for (const Part& p : m.parts) {
      const size_t n = static_cast<size_t>(shape_numel(p.shape));
      part.assign(src, src + n);
      reorder_rope_rows(part.data(), p, false);
      out.push_back({p.hf, StDType::F32, p.shape, f32_to_st_bytes(part.data(), n, StDType::F32)});
      src += n;
    }
    for (const std::string& copy : m.copies)  // one part (the embedding or the output layer)
      out.push_back({copy, StDType::F32, m.shape, f32_to_st_bytes(part.data(), part.size(), StDType::F32)});
  }
  return out;
}

void convert_moecore_to_hf(const std::string& ckpt_dir, const std::string& hf_dir, uint64_t max_shard_bytes,
                           const TrainFlagCodec& codec, const ConvertProgress& progress) {
  const std::string origin = "checkpoint '" + ckpt_dir + "'";
  const TrainingState meta = read_checkpoint_meta(ckpt_dir);
  MC_CHECK(!meta.args.empty(), origin, " does not record the flags it was trained with");
  const TrainArgs args = codec.rebuild(meta.args, "cpu", origin);
  const ModelConfig& c = args.model;
  const json source = json::parse(read_checkpoint_source(ckpt_dir));
  MC_CHECK(c.moe.num_experts > 0, origin, ": a dense model (no --num-experts) has no HF MoE equivalent");
  const Arch arch = export_arch(c, source, origin);
  const std::vector<Mapped> mapping =
      build_mapping(c, arch, deepseek_rope_interleaved(source.value("config", json::object())));
  const SafetensorsFile file(checkpoint_tensor_file(ckpt_dir));
  std::set<std::string> ours;
  for (const Mapped& m : mapping) ours.insert(m.ours);
  for (const StTensorInfo& t : file.tensors()) {
    const bool optimizer = t.name.ends_with(".exp_avg") || t.name.ends_with(".exp_avg_sq");
    MC_CHECK(optimizer || ours.count(t.name), origin, " has tensor '", t.name, "' that has no ", arch_name(arch),
             " equivalent");
  }
  const json dtypes = source.value("dtypes", json::object());
  const auto hf_dtype = [&](const std::string& hf) {
    return dtypes.contains(hf) ? parse_st_dtype(dtypes[hf].get<std::string>(), origin) : StDType::F32;
  };
  uint64_t read_bytes = 0, write_bytes = 0;
  size_t write_tensors = 0;
  for (const Mapped& m : mapping) {
    read_bytes += static_cast<uint64_t>(shape_numel(m.shape)) * 4;
    for (const Part& p : m.parts) {
      write_bytes += static_cast<uint64_t>(shape_numel(p.shape)) * st_dtype_size(hf_dtype(p.hf));
      ++write_tensors;
    }
    for (const std::string& copy : m.copies) {
      write_bytes += static_cast<uint64_t>(shape_numel(m.shape)) * st_dtype_size(hf_dtype(copy));
      ++write_tensors;
    }
  }
  ConvertMeter meter(progress, read_bytes, mapping.size(), write_bytes, write_tensors);
  std::vector<StWriteTensor> out;
  for (const Mapped& m : mapping) {
    const StTensorInfo& info = file.info(m.ours);
    MC_CHECK(info.dtype == StDType::F32 && info.shape == m.shape, origin, ": tensor '", m.ours, "' is ",
             st_dtype_name(info.dtype), " ", shape_str(info.shape), "; expected F32 ", shape_str(m.shape));
    const float* src = reinterpret_cast<const float*>(file.data(info));
    std::vector<float> aligned;  // the mapping is 8-byte aligned; copy anyway for strict aliasing safety
    for (const Part& p : m.parts) {
      const size_t n = static_cast<size_t>(shape_numel(p.shape));
      aligned.assign(n, 0.f);
      std::memcpy(aligned.data(), src, n * 4);
      src += n;
      reorder_rope_rows(aligned.data(), p, false);
      const StDType dt = hf_dtype(p.hf);
      out.push_back({p.hf, dt, p.shape, f32_to_st_bytes(aligned.data(), n, dt)});
    }
    for (const std::string& copy : m.copies)  // one part (the embedding or the output layer)
      out.push_back({copy, hf_dtype(copy), m.shape, f32_to_st_bytes(aligned.data(), aligned.size(), hf_dtype(copy))});
    meter.read(info.nbytes());
  }
  json cfg = source.contains("config") ? source["config"] : config_from_args(c, arch, origin);
  std::error_code ec;
  fs::create_directories(hf_dir, ec);
  MC_CHECK(!ec, "cannot create '", hf_dir, "': ", ec.message());
  write_safetensors_checkpoint(hf_dir, out, max_shard_bytes, [&](uint64_t n) { meter.wrote(n); });
  std::ofstream f(fs::path(hf_dir) / "config.json", std::ios::trunc);
  f << cfg.dump(2) << "\n";
  f.close();
  MC_CHECK(!f.fail(), "writing '", (fs::path(hf_dir) / "config.json").string(), "' failed");
  // The tokenizer the checkpoint records goes back beside config.json.
  const CheckpointTokenizer tok = checkpoint_tokenizer(ckpt_dir);
  if (!tok.path.empty() && fs::exists(tok.path))
    copy_tokenizer_files(tok.path, hf_dir);
  else if (!tok.path.empty())
    std::printf("note: %s: its tokenizer '%s' (tokenizer-model) is missing; %s has no tokenizer files\n",
                origin.c_str(), tok.path.c_str(), hf_dir.c_str());
}

int convert(const ConvertOptions& o, const TrainFlagCodec& codec) {
  const std::string &from = o.from, &to = o.to, &input = o.input, &output = o.output;
  MC_CHECK(!input.empty() && !output.empty(), "moecore convert needs --input and --output");
  const uint64_t max_shard = parse_size(o.max_shard_size);
  MC_CHECK(o.progress_interval_s >= 0, "--progress-interval ", o.progress_interval_s, " must be >= 0 seconds");
  const ConvertProgress progress{&std::cerr, o.progress_interval_s};
  if (from == "hf" && to == "moecore") {
    convert_hf_to_moecore(input, output, codec, progress);
  } else if (from == "moecore" && to == "hf") {
    convert_moecore_to_hf(input, output, max_shard, codec, progress);
  } else {
    MC_FAIL("moecore convert: --from '", from, "' --to '", to, "': expected --from hf --to moecore or --from moecore --to hf");
  }
  std::printf("converted %s (%s) -> %s (%s)\n", input.c_str(), from.c_str(), output.c_str(), to.c_str());
  return 0;
}

}  // namespace moecore::interop
