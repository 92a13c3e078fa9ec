// HF <-> moecore conversion: tiny Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints written by an independent
// Python writer (tests/data/write_hf_checkpoint.py) go hf -> moecore -> hf byte-identically; the
// moecore checkpoint loads into a GPTModel built from its recorded flags with the HF values;
// missing, unexpected and mis-shaped tensors and unsupported architectures are refused by name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/interop/hf_convert.h"
#include "moecore/interop/safetensors.h"
#include "moecore/model/gpt.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/generate.h"
#include "moecore/train/trainer.h"

#include "commands.h"       // run_convert, run_generate (apps/)
#include "train_command.h"  // train_args_from_saved (apps/)

namespace fs = std::filesystem;
using namespace moecore;
using namespace moecore::interop;

namespace {

fs::path data_dir() { return fs::path(__FILE__).parent_path().parent_path() / "data"; }
bool have_python() { return std::system("python3 -c 'import json, struct' >/dev/null 2>&1") == 0; }

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moecore_hf_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_hf(const fs::path& out, const std::string& args) {
  const std::string cmd = "python3 '" + (data_dir() / "write_hf_checkpoint.py").string() + "' '" + out.string() + "' " + args;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

int convert(const std::string& from, const std::string& to, const fs::path& in, const fs::path& out,
            const std::string& shard = "5GB") {
  return run_convert({"--from", from, "--to", to, "--input", in.string(), "--output", out.string(), "--max-shard-size", shard});
}

// Every tensor of a and b: same names, dtypes, shapes and bytes.
void expect_identical(const fs::path& a, const fs::path& b) {
  const SafetensorsReader ra(a.string()), rb(b.string());
  ASSERT_EQ(ra.names(), rb.names());
  for (const std::string& n : ra.names()) {
    EXPECT_EQ(ra.info(n).dtype, rb.info(n).dtype) << n;
    EXPECT_EQ(ra.info(n).shape, rb.info(n).shape) << n;
    EXPECT_TRUE(ra.raw(n) == rb.raw(n)) << n << " differs";
  }
}

void round_trip(const std::string& arch, const std::string& dtype) {
  const fs::path d = temp_dir(arch + dtype);
  write_hf(d / "hf", "--arch " + arch + " --dtype " + dtype + " --shards 3");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  EXPECT_TRUE(fs::exists(d / "ckpt" / "latest_checkpointed_iteration.txt"));
  // back to HF, one file and sharded (2 KB shards)
  ASSERT_EQ(convert("moecore", "hf", d / "ckpt", d / "one"), 0);
  ASSERT_EQ(convert("moecore", "hf", d / "ckpt", d / "many", "2KB"), 0);
  EXPECT_TRUE(fs::exists(d / "one" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(d / "many" / "model.safetensors.index.json"));
  expect_identical(d / "hf", d / "one");
  expect_identical(d / "hf", d / "many");
  // writing one file over a sharded output removes the old shards and index
  ASSERT_EQ(convert("moecore", "hf", d / "ckpt", d / "many"), 0);
  EXPECT_FALSE(fs::exists(d / "many" / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(d / "many" / "model-00001-of-00002.safetensors"));
  expect_identical(d / "hf", d / "many");
  // same config fields
  std::ifstream a(d / "hf" / "config.json"), b(d / "one" / "config.json");
  EXPECT_EQ(nlohmann::json::parse(a), nlohmann::json::parse(b));
  fs::remove_all(d);
}

}  // namespace

TEST(HfConvert, MixtralBf16RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("mixtral", "bf16");
}
TEST(HfConvert, Qwen3MoeBf16RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("qwen3", "bf16");
}
TEST(HfConvert, Qwen2MoeBf16RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("qwen2", "bf16");
}
TEST(HfConvert, Qwen2MoeF32RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("qwen2", "f32");
}
TEST(HfConvert, Qwen3MoeF32RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("qwen3", "f32");
}

// The converted checkpoint loads into a model built from its recorded flags, with the HF values.
void check_loads(const std::string& arch) {
  const fs::path d = temp_dir("load" + arch);
  write_hf(d / "hf", "--arch " + arch + " --dtype bf16");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  const TrainingState meta = read_checkpoint_meta((d / "ckpt").string());
  EXPECT_TRUE(meta.model_only);
  const TrainArgs args = train_args_from_saved(meta.args, "cpu", "test");
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 1);
  GPTModel model(args.model, store);
  store.initialize();
  const TrainingState s = load_checkpoint((d / "ckpt").string(), store);
  EXPECT_EQ(s.iteration, 0);
  const SafetensorsReader hf((d / "hf").string());
  const bool mixtral = arch == "mixtral";
  const std::string moe = mixtral ? "model.layers.0.block_sparse_moe" : "model.layers.0.mlp";
  // expert 2 of layer 0: fc1[2] = [gate; up], fc2[2] = down, element-wise
  const Param& fc1 = store.get("decoder.layers.0.mlp.experts.linear_fc1.weight");
  const Param& fc2 = store.get("decoder.layers.0.mlp.experts.linear_fc2.weight");
  const int64_t f = fc1.shape[1] / 2, h = fc1.shape[2];
  const auto ours1 = fc1.master.to_vector<float>(), ours2 = fc2.master.to_vector<float>();
  const auto gate = hf.read_f32(moe + ".experts.2." + (mixtral ? "w1" : "gate_proj") + ".weight").to_vector<float>();
  const auto up = hf.read_f32(moe + ".experts.2." + (mixtral ? "w3" : "up_proj") + ".weight").to_vector<float>();
  const auto down = hf.read_f32(moe + ".experts.2." + (mixtral ? "w2" : "down_proj") + ".weight").to_vector<float>();
  for (int64_t r = 0; r < f; ++r)
    for (int64_t c = 0; c < h; ++c) {
      ASSERT_EQ(ours1[static_cast<size_t>((2 * 2 * f + r) * h + c)], gate[static_cast<size_t>(r * h + c)]);
      ASSERT_EQ(ours1[static_cast<size_t>((2 * 2 * f + f + r) * h + c)], up[static_cast<size_t>(r * h + c)]);
    }
  for (int64_t r = 0; r < h; ++r)
    for (int64_t c = 0; c < f; ++c)
      ASSERT_EQ(ours2[static_cast<size_t>((2 * h + r) * f + c)], down[static_cast<size_t>(r * f + c)]);
  // one-to-one tensors
  auto same = [&](const std::string& ours, const std::string& theirs) {
    EXPECT_EQ(store.get(ours).master.to_vector<float>(), hf.read_f32(theirs).to_vector<float>()) << ours;
  };
  same("embedding.word_embeddings.weight", "model.embed_tokens.weight");
  same("decoder.layers.1.self_attention.linear_k.weight", "model.layers.1.self_attn.k_proj.weight");
  same("decoder.layers.1.pre_mlp_layernorm.weight", "model.layers.1.post_attention_layernorm.weight");
  same("decoder.layers.0.mlp.router.weight", moe + ".gate.weight");
  same("decoder.final_layernorm.weight", "model.norm.weight");
  if (mixtral) {
    same("output_layer.weight", "lm_head.weight");
    EXPECT_FALSE(args.model.moe.router.pre_softmax);
  } else {
    same("decoder.layers.0.self_attention.q_layernorm.weight", "model.layers.0.self_attn.q_norm.weight");
    EXPECT_FALSE(args.model.is_moe(1));  // mlp_only_layers [1]
    const auto g = hf.read_f32("model.layers.1.mlp.gate_proj.weight").to_vector<float>();
    const auto u = hf.read_f32("model.layers.1.mlp.up_proj.weight").to_vector<float>();
    auto fc = store.get("decoder.layers.1.mlp.linear_fc1.weight").master.to_vector<float>();
    EXPECT_TRUE(std::equal(g.begin(), g.end(), fc.begin()));
    EXPECT_TRUE(std::equal(u.begin(), u.end(), fc.begin() + static_cast<long>(g.size())));
    EXPECT_EQ(args.model.head_dim(), 8);
    EXPECT_FALSE(args.model.untie_embeddings);
  }
  EXPECT_EQ(args.model.kv_heads(), 2);
  EXPECT_EQ(args.model.moe.router.topk, 2);
  // AdamW state zeroed
  for (float x : fc1.exp_avg.to_vector<float>()) ASSERT_EQ(x, 0.0f);
  fs::remove_all(d);
}

TEST(HfConvert, MixtralCheckpointLoadsIntoTheModel) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  check_loads("mixtral");
}
TEST(HfConvert, Qwen3MoeCheckpointLoadsIntoTheModel) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  check_loads("qwen3");
}

// Qwen2-MoE: q/k/v biases, the gated shared expert and pre-softmax routing arrive in the model.
TEST(HfConvert, Qwen2MoeCheckpointLoadsIntoTheModel) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("loadqwen2");
  write_hf(d / "hf", "--arch qwen2 --dtype bf16");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  const TrainArgs args = train_args_from_saved(read_checkpoint_meta((d / "ckpt").string()).args, "cpu", "test");
  const ModelConfig& c = args.model;
  EXPECT_TRUE(c.add_qkv_bias);
  EXPECT_FALSE(c.add_bias_linear);
  EXPECT_FALSE(c.qk_layernorm);
  EXPECT_TRUE(c.moe.router.pre_softmax);  // norm_topk_prob false
  EXPECT_EQ(c.moe.shared_expert_size, 10);
  EXPECT_TRUE(c.moe.shared_expert_gate);
  EXPECT_TRUE(c.untie_embeddings);
  // decoder_sparse_step 2: layers 1 and 3 are MoE
  EXPECT_FALSE(c.is_moe(0));
  EXPECT_TRUE(c.is_moe(1));
  EXPECT_FALSE(c.is_moe(2));
  EXPECT_TRUE(c.is_moe(3));
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 1);
  GPTModel model(c, store);
  store.initialize();
  load_checkpoint((d / "ckpt").string(), store);
  const SafetensorsReader hf((d / "hf").string());
  auto same = [&](const std::string& ours, const std::string& theirs) {
    EXPECT_EQ(store.get(ours).master.to_vector<float>(), hf.read_f32(theirs).to_vector<float>()) << ours;
  };
  same("decoder.layers.2.self_attention.linear_q.bias", "model.layers.2.self_attn.q_proj.bias");
  same("decoder.layers.0.self_attention.linear_v.bias", "model.layers.0.self_attn.v_proj.bias");
  same("decoder.layers.3.mlp.shared_experts.linear_fc2.weight", "model.layers.3.mlp.shared_expert.down_proj.weight");
  same("decoder.layers.3.mlp.shared_experts.gate.weight", "model.layers.3.mlp.shared_expert_gate.weight");
  EXPECT_THROW(store.get("decoder.layers.0.self_attention.linear_proj.bias"), Error);  // o_proj has no bias
  const auto g = hf.read_f32("model.layers.1.mlp.shared_expert.gate_proj.weight").to_vector<float>();
  const auto u = hf.read_f32("model.layers.1.mlp.shared_expert.up_proj.weight").to_vector<float>();
  const auto fc1 = store.get("decoder.layers.1.mlp.shared_experts.linear_fc1.weight").master.to_vector<float>();
  ASSERT_EQ(fc1.size(), g.size() + u.size());
  EXPECT_TRUE(std::equal(g.begin(), g.end(), fc1.begin()));
  EXPECT_TRUE(std::equal(u.begin(), u.end(), fc1.begin() + static_cast<long>(g.size())));
  fs::remove_all(d);
}

TEST(HfConvert, Qwen2MoeRefusesMissingSharedExpertGateAndBias) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("badqwen2");
  for (const std::string name : {"model.layers.3.mlp.shared_expert_gate.weight", "model.layers.2.self_attn.k_proj.bias",
                                 "model.layers.1.mlp.experts.2.down_proj.weight"}) {
    const fs::path in = d / "in", out = d / "out";
    fs::remove_all(in);
    write_hf(in, "--arch qwen2 --drop " + name);
    const std::string msg = error_of([&] { convert("hf", "moecore", in, out); });
    EXPECT_NE(msg.find("missing tensor '" + name + "'"), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(out / "iter_0000000")) << name;
  }
  // An unexpected bias (o_proj has none in Qwen2-MoE) is refused by name too.
  fs::remove_all(d / "in");
  write_hf(d / "in", "--arch qwen2 --extra model.layers.0.self_attn.o_proj.bias");
  const std::string msg = error_of([&] { convert("hf", "moecore", d / "in", d / "out"); });
  EXPECT_NE(msg.find("model.layers.0.self_attn.o_proj.bias"), std::string::npos) << msg;
  fs::remove_all(d);
}

// config.json as transformers 5.17 writes it (save_pretrained of tools/hf_check.py's models): RoPE
// base under rope_parameters, Qwen3-MoE's expert count as num_local_experts, Qwen2-MoE's qkv_bias
// and layer_types, Mixtral's head_dim null.
TEST(HfConvert, Transformers5ConfigJson) {
  auto flags_of = [](const std::string& file) {
    std::ifstream f(data_dir() / "hf" / file);
    std::stringstream text;
    text << f.rdbuf();
    std::map<std::string, std::string> out;
    for (const auto& [k, v] : hf_config_to_train_flags(text.str(), file)) out[k] = v;
    return out;
  };
  auto q3 = flags_of("qwen3_moe_transformers5.config.json");
  EXPECT_EQ(q3["num-experts"], "8");
  EXPECT_EQ(std::stod(q3["rotary-base"]), 1e6);
  EXPECT_EQ(q3["kv-channels"], "64");
  EXPECT_EQ(q3["moe-layer-freq"], "[1,1,0]");
  EXPECT_EQ(q3["qk-layernorm"], "true");
  EXPECT_EQ(q3["moe-router-pre-softmax"], "false");  // norm_topk_prob true
  EXPECT_EQ(q3["untie-embeddings-and-output-weights"], "false");
  auto q2 = flags_of("qwen2_moe_transformers5.config.json");
  EXPECT_EQ(q2["num-experts"], "8");
  EXPECT_EQ(std::stod(q2["rotary-base"]), 1e6);
  EXPECT_EQ(q2["add-qkv-bias"], "true");
  EXPECT_EQ(q2["moe-shared-expert-intermediate-size"], "80");
  EXPECT_EQ(q2["moe-shared-expert-gate"], "true");
  EXPECT_EQ(q2["moe-router-pre-softmax"], "true");  // norm_topk_prob false
  EXPECT_EQ(q2["moe-layer-freq"], "[1,0,1]");
  auto mx = flags_of("mixtral_transformers5.config.json");
  EXPECT_EQ(mx["num-experts"], "8");
  EXPECT_EQ(mx["kv-channels"], "32");  // head_dim null: hidden / heads
  EXPECT_EQ(std::stod(mx["rotary-base"]), 1e6);
  EXPECT_EQ(mx["moe-layer-freq"], "1");
  EXPECT_EQ(mx["add-qkv-bias"], "false");
  EXPECT_EQ(mx["moe-shared-expert-intermediate-size"], "0");
  // A RoPE scaling type other than default is refused by name.
  const std::string msg = error_of([] {
    hf_config_to_train_flags(R"({"architectures": ["Qwen3MoeForCausalLM"], "rope_scaling": {"rope_type": "yarn"}})", "x");
  });
  EXPECT_NE(msg.find("yarn"), std::string::npos) << msg;
}

TEST(HfConvert, RefusesMissingUnexpectedAndMisShapedTensors) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("bad");
  auto refused = [&](const std::string& name, const std::string& flags, const std::string& needle) {
    write_hf(d / name, "--arch mixtral " + flags);
    const std::string msg = error_of([&] { convert("hf", "moecore", d / name, d / (name + "_out")); });
    EXPECT_NE(msg.find(needle), std::string::npos) << name << ": " << msg;
    EXPECT_FALSE(fs::exists(d / (name + "_out") / "iter_0000000")) << name;
  };
  refused("missing", "--drop model.layers.0.block_sparse_moe.experts.3.w2.weight",
          "model.layers.0.block_sparse_moe.experts.3.w2.weight");
  refused("extra", "--extra model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.bias");
  refused("shape", "--bad-shape model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.v_proj.weight");
  refused("arch", "--architecture LlamaForCausalLM", "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM");
  const std::string msg = error_of([&] { run_convert({"--from", "hf", "--to", "gguf", "--input", "a", "--output", "b"}); });
  EXPECT_NE(msg.find("gguf"), std::string::npos) << msg;
  fs::remove_all(d);
}

// `moecore generate --load` and `moecore train --load` work on a converted checkpoint; training
// starts at iteration 0 and saves a regular checkpoint.
TEST(HfConvert, ConvertedCheckpointGeneratesAndTrains) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("train");
  write_hf(d / "hf", "--arch mixtral --dtype bf16");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  EXPECT_EQ(run_generate({"--load", (d / "ckpt").string(), "--prompt-ids", "1 2 3", "--max-new-tokens", "2",
                          "--device", "cpu"}),
            0);
  TrainArgs a = train_args_from_saved(read_checkpoint_meta((d / "ckpt").string()).args, "cpu", "test");
  a.load = (d / "ckpt").string();
  a.finetune = true;  // a model-only checkpoint: its weights, trained afresh
  a.save = (d / "trained").string();
  a.model.seq_length = 16;
  EXPECT_EQ(run_training(a), 0);
  const TrainingState s = read_checkpoint_meta((d / "trained").string());
  EXPECT_EQ(s.iteration, 1);
  EXPECT_FALSE(s.model_only);
  // A trained checkpoint records no HF source: export derives config.json from the flags and
  // writes F32 tensors; converting that back gives the trained values.
  ASSERT_EQ(convert("moecore", "hf", d / "trained", d / "hf2"), 0);
  std::ifstream cf(d / "hf2" / "config.json");
  const nlohmann::json cfg = nlohmann::json::parse(cf);
  EXPECT_EQ(cfg["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(cfg["num_local_experts"], 4);
  EXPECT_EQ(cfg["num_key_value_heads"], 2);
  EXPECT_EQ(cfg["intermediate_size"], 12);
  EXPECT_EQ(cfg["tie_word_embeddings"], false);
  const SafetensorsReader hf2((d / "hf2").string()), hf1((d / "hf").string());
  EXPECT_EQ(hf2.names(), hf1.names());
  EXPECT_EQ(hf2.info("model.layers.0.block_sparse_moe.experts.1.w3.weight").dtype, StDType::F32);
  ASSERT_EQ(convert("hf", "moecore", d / "hf2", d / "ckpt2"), 0);
  const SafetensorsFile ta(checkpoint_tensor_file((d / "trained").string())), tb(checkpoint_tensor_file((d / "ckpt2").string()));
  for (const StTensorInfo& t : tb.tensors()) EXPECT_EQ(ta.raw(t.name), tb.raw(t.name)) << t.name;
  fs::remove_all(d);
}

// A trained Qwen2-MoE checkpoint (no recorded HF source) exports as Qwen2-MoE from its flags alone:
// q/k/v biases and the gated shared expert select the architecture, config.json is derived
// (norm_topk_prob false from pre-softmax routing, the dense layers as mlp_only_layers) and
// imports back to the trained values.
TEST(HfConvert, TrainedQwen2MoeExportsWithDerivedConfig) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("trainqwen2");
  write_hf(d / "hf", "--arch qwen2 --dtype bf16");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  TrainArgs a = train_args_from_saved(read_checkpoint_meta((d / "ckpt").string()).args, "cpu", "test");
  a.load = (d / "ckpt").string();
  a.finetune = true;  // a model-only checkpoint: its weights, trained afresh
  a.save = (d / "trained").string();
  a.model.seq_length = 16;
  ASSERT_EQ(run_training(a), 0);
  ASSERT_EQ(convert("moecore", "hf", d / "trained", d / "hf2"), 0);
  std::ifstream cf(d / "hf2" / "config.json");
  const nlohmann::json cfg = nlohmann::json::parse(cf);
  EXPECT_EQ(cfg["architectures"][0], "Qwen2MoeForCausalLM");
  EXPECT_EQ(cfg["model_type"], "qwen2_moe");
  EXPECT_EQ(cfg["shared_expert_intermediate_size"], 10);
  EXPECT_EQ(cfg["norm_topk_prob"], false);
  EXPECT_EQ(cfg["mlp_only_layers"], nlohmann::json::array({0, 2}));
  EXPECT_EQ(cfg["qkv_bias"], true);
  const SafetensorsReader hf2((d / "hf2").string()), hf1((d / "hf").string());
  EXPECT_EQ(hf2.names(), hf1.names());
  ASSERT_EQ(convert("hf", "moecore", d / "hf2", d / "ckpt2"), 0);
  const SafetensorsFile ta(checkpoint_tensor_file((d / "trained").string())), tb(checkpoint_tensor_file((d / "ckpt2").string()));
  for (const StTensorInfo& t : tb.tensors()) EXPECT_EQ(ta.raw(t.name), tb.raw(t.name)) << t.name;
  fs::remove_all(d);
}

namespace {
std::string file_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}
}  // namespace

// convert --from hf copies the tokenizer into <ckpt>/tokenizer/ and records it relative to the
// checkpoint directory; checkpoint_tokenizer resolves it from the save directory and from its
// iter_* directory alike; convert --to hf writes the files back beside config.json. A
// tokenizer.model is Llama2Tokenizer when tokenizer_config.json adds a BOS token, else
// SentencePieceTokenizer.
TEST(HfConvert, TokenizerTravelsWithTheCheckpoint) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("tokenizer");
  write_hf(d / "hf", "--arch mixtral --dtype bf16");
  fs::copy_file(data_dir() / "tiny_bpe_tokenizer.json", d / "hf" / "tokenizer.json");
  std::ofstream(d / "hf" / "special_tokens_map.json") << R"({"eos_token": "<|endoftext|>"})";
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  const fs::path expected = fs::absolute(d / "ckpt" / "tokenizer" / "tokenizer.json").lexically_normal();
  for (const fs::path& dir : {d / "ckpt", d / "ckpt" / "iter_0000000"}) {
    const CheckpointTokenizer t = checkpoint_tokenizer(dir.string());
    EXPECT_EQ(t.type, "HuggingFaceTokenizer") << dir;
    EXPECT_EQ(t.path, expected.string()) << dir;
  }
  for (const auto& [name, value] : read_checkpoint_meta((d / "ckpt").string()).args)
    if (name == "tokenizer-model") EXPECT_EQ(value, "tokenizer/tokenizer.json");
  EXPECT_EQ(file_text(d / "ckpt" / "tokenizer" / "special_tokens_map.json"), file_text(d / "hf" / "special_tokens_map.json"));
  ASSERT_EQ(convert("moecore", "hf", d / "ckpt", d / "hf2"), 0);
  EXPECT_EQ(file_text(d / "hf2" / "tokenizer.json"), file_text(d / "hf" / "tokenizer.json"));
  EXPECT_EQ(file_text(d / "hf2" / "special_tokens_map.json"), file_text(d / "hf" / "special_tokens_map.json"));

  // SentencePiece: Llama2Tokenizer with a BOS token, SentencePieceTokenizer without
  fs::remove(d / "hf" / "tokenizer.json");
  fs::copy_file(data_dir() / "tiny_sentencepiece.model", d / "hf" / "tokenizer.model");
  std::ofstream(d / "hf" / "tokenizer_config.json") << R"({"tokenizer_class": "LlamaTokenizer", "add_bos_token": true})";
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "sp"), 0);
  CheckpointTokenizer t = checkpoint_tokenizer((d / "sp").string());
  EXPECT_EQ(t.type, "Llama2Tokenizer");
  EXPECT_EQ(fs::path(t.path).filename(), "tokenizer.model");
  EXPECT_EQ(file_text(t.path), file_text(data_dir() / "tiny_sentencepiece.model"));
  std::ofstream(d / "hf" / "tokenizer_config.json", std::ios::trunc) << R"({"add_bos_token": false})";
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "sp2"), 0);
  EXPECT_EQ(checkpoint_tokenizer((d / "sp2").string()).type, "SentencePieceTokenizer");
  ASSERT_EQ(convert("moecore", "hf", d / "sp2", d / "hf3"), 0);
  EXPECT_EQ(file_text(d / "hf3" / "tokenizer.model"), file_text(data_dir() / "tiny_sentencepiece.model"));
  // a tokenizer.json moecore does not read (Mixtral's: Metaspace, not byte-level) beside a
  // tokenizer.model: the .model is recorded, and both files are kept
  std::ofstream(d / "hf" / "tokenizer.json")
      << R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}})";
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "both"), 0);
  t = checkpoint_tokenizer((d / "both").string());
  EXPECT_EQ(t.type, "SentencePieceTokenizer");
  EXPECT_EQ(fs::path(t.path).filename(), "tokenizer.model");
  EXPECT_EQ(file_text(d / "both" / "tokenizer" / "tokenizer.json"), file_text(d / "hf" / "tokenizer.json"));
  fs::remove(d / "hf" / "tokenizer.json");
  // no tokenizer in the folder: none recorded
  fs::remove(d / "hf" / "tokenizer.model");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "none"), 0);
  t = checkpoint_tokenizer((d / "none").string());
  EXPECT_EQ(t.type, "");
  EXPECT_EQ(t.path, "");
  fs::remove_all(d);
}

// DeepSeek-V3 (q-lora, sigmoid routing with e_score_correction_bias in F32, groups, a dense first
// layer, a shared expert, YaRN, one MTP layer whose embed_tokens / shared_head.head are copies)
// and DeepSeek-V2 (a plain q_proj, softmax group_limited_greedy, routed_scaling_factor) go
// hf -> moecore -> hf byte-identically: the RoPE row reordering is undone exactly on export.
TEST(HfConvert, DeepseekV3Bf16RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("deepseek_v3", "bf16");
}
TEST(HfConvert, DeepseekV3F32RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("deepseek_v3", "f32");
}
TEST(HfConvert, DeepseekV2Bf16RoundTripIsByteIdentical) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  round_trip("deepseek_v2", "bf16");
}

namespace {
// DeepSeek's RoPE rows are interleaved pairs, ours halves: our row j of each RoPE block is HF's
// row perm[j], perm = [0, 2, ..., 1, 3, ...] (model/mla_attention.h), stated here independently.
void expect_rope_rows(const std::vector<float>& ours, const std::vector<float>& hf, int64_t rows, int64_t cols,
                      int64_t block, int64_t start, int64_t r, const std::string& what) {
  ASSERT_EQ(ours.size(), hf.size()) << what;
  const std::vector<int64_t> perm = r == 4 ? std::vector<int64_t>{0, 2, 1, 3} : std::vector<int64_t>{};
  ASSERT_EQ(static_cast<int64_t>(perm.size()), r) << what;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t b = row / block * block, j = row % block - start;
    const int64_t from = j >= 0 && j < r ? b + start + perm[static_cast<size_t>(j)] : row;
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(ours[static_cast<size_t>(row * cols + c)], hf[static_cast<size_t>(from * cols + c)])
          << what << " row " << row;
  }
}
}  // namespace

// The imported DeepSeek-V3 model: its flags, the RoPE rows reordered, the F32 expert bias, the
// shared expert, the dense first layer and the MTP layer in place.
TEST(HfConvert, DeepseekV3CheckpointLoadsIntoTheModel) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("loaddsv3");
  write_hf(d / "hf", "--arch deepseek_v3 --dtype bf16");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  const TrainArgs args = train_args_from_saved(read_checkpoint_meta((d / "ckpt").string()).args, "cpu", "test");
  const ModelConfig& c = args.model;
  EXPECT_TRUE(c.mla.enabled);
  EXPECT_EQ(c.mla.q_lora_rank, 12);
  EXPECT_EQ(c.mla.kv_lora_rank, 8);
  EXPECT_EQ(c.mla.qk_head_dim, 6);
  EXPECT_EQ(c.mla.qk_pos_emb_head_dim, 4);
  EXPECT_EQ(c.mla.v_head_dim, 5);
  EXPECT_TRUE(c.qk_layernorm);
  EXPECT_TRUE(c.rope_yarn);
  EXPECT_EQ(c.rope_scaling.factor, 4);
  EXPECT_EQ(c.rope_scaling.original_max_position, 16);
  EXPECT_EQ(c.rope_scaling.mscale_all_dim, 1.0);
  EXPECT_EQ(c.moe.router.score, ops::RouterScore::Sigmoid);
  EXPECT_TRUE(c.moe.enable_expert_bias);
  EXPECT_EQ(c.moe.router.num_groups, 4);
  EXPECT_EQ(c.moe.router.group_topk, 2);
  EXPECT_EQ(c.moe.router.topk, 4);
  EXPECT_EQ(c.moe.router.scaling_factor, 2.5);
  EXPECT_EQ(c.moe.load_balancing, LoadBalancing::SeqAuxLoss);
  EXPECT_EQ(c.moe.aux_loss_coeff, 0.001);
  EXPECT_EQ(c.moe.shared_expert_size, 6);
  EXPECT_FALSE(c.moe.shared_expert_gate);
  EXPECT_FALSE(c.is_moe(0));
  EXPECT_TRUE(c.is_moe(1));
  EXPECT_EQ(c.mtp_num_layers, 1);
  EXPECT_TRUE(c.untie_embeddings);
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 1);
  GPTModel model(c, store);
  store.initialize();
  load_checkpoint((d / "ckpt").string(), store);
  const SafetensorsReader hf((d / "hf").string());
  auto ours = [&](const std::string& n) { return store.get(n).master.to_vector<float>(); };
  auto theirs = [&](const std::string& n) { return hf.read_f32(n).to_vector<float>(); };
  for (const auto& [o, p] : {std::pair<std::string, std::string>{"decoder.layers.1", "model.layers.1"},
                             {"mtp.layers.0.transformer_layer", "model.layers.2"}}) {
    // q_up [N D, q_lora]: per head (D = 10) rows 6..9; kv_down [8 + 4, H]: rows 8..11
    expect_rope_rows(ours(o + ".self_attention.linear_q_up_proj.weight"), theirs(p + ".self_attn.q_b_proj.weight"),
                     20, 12, 10, 6, 4, o + " q_up");
    expect_rope_rows(ours(o + ".self_attention.linear_kv_down_proj.weight"),
                     theirs(p + ".self_attn.kv_a_proj_with_mqa.weight"), 12, 16, 12, 8, 4, o + " kv_down");
    EXPECT_EQ(ours(o + ".self_attention.linear_kv_up_proj.weight"), theirs(p + ".self_attn.kv_b_proj.weight"));
    EXPECT_EQ(ours(o + ".self_attention.q_layernorm.weight"), theirs(p + ".self_attn.q_a_layernorm.weight"));
    EXPECT_EQ(ours(o + ".mlp.router.expert_bias"), theirs(p + ".mlp.gate.e_score_correction_bias"));
    EXPECT_EQ(ours(o + ".mlp.shared_experts.linear_fc2.weight"), theirs(p + ".mlp.shared_experts.down_proj.weight"));
  }
  EXPECT_EQ(hf.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype, StDType::F32);
  EXPECT_EQ(ours("decoder.layers.0.mlp.linear_fc2.weight"), theirs("model.layers.0.mlp.down_proj.weight"));
  EXPECT_EQ(ours("mtp.layers.0.eh_proj.weight"), theirs("model.layers.2.eh_proj.weight"));
  EXPECT_EQ(ours("mtp.layers.0.final_layernorm.weight"), theirs("model.layers.2.shared_head.norm.weight"));
  EXPECT_EQ(ours("output_layer.weight"), theirs("model.layers.2.shared_head.head.weight"));
  EXPECT_EQ(ours("embedding.word_embeddings.weight"), theirs("model.layers.2.embed_tokens.weight"));
  fs::remove_all(d);
}

// DeepSeek-V2: a plain q_proj with its RoPE rows reordered; softmax group-limited routing with
// the scaling factor, no expert bias.
TEST(HfConvert, DeepseekV2CheckpointLoadsIntoTheModel) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("loaddsv2");
  write_hf(d / "hf", "--arch deepseek_v2 --dtype f32");
  ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
  const TrainArgs args = train_args_from_saved(read_checkpoint_meta((d / "ckpt").string()).args, "cpu", "test");
  const ModelConfig& c = args.model;
  EXPECT_EQ(c.mla.q_lora_rank, 0);
  EXPECT_FALSE(c.rope_yarn);
  EXPECT_EQ(c.moe.router.score, ops::RouterScore::Softmax);
  EXPECT_TRUE(c.moe.router.pre_softmax);
  EXPECT_FALSE(c.moe.enable_expert_bias);
  EXPECT_EQ(c.moe.router.num_groups, 3);
  EXPECT_EQ(c.moe.router.group_topk, 2);
  EXPECT_EQ(c.moe.router.scaling_factor, 2.0);
  EXPECT_EQ(c.moe.shared_expert_size, 12);
  EXPECT_EQ(c.mtp_num_layers, 0);
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 1);
  GPTModel model(c, store);
  store.initialize();
  load_checkpoint((d / "ckpt").string(), store);
  const SafetensorsReader hf((d / "hf").string());
  expect_rope_rows(store.get("decoder.layers.2.self_attention.linear_q_proj.weight").master.to_vector<float>(),
                   hf.read_f32("model.layers.2.self_attn.q_proj.weight").to_vector<float>(), 20, 16, 10, 6, 4, "q_proj");
  EXPECT_THROW(store.get("decoder.layers.1.mlp.router.expert_bias"), Error);
  fs::remove_all(d);
}

// `moecore generate` and training run on imported DeepSeek models; a trained one (no recorded HF
// source) exports with a derived config.json and imports back to the trained values.
TEST(HfConvert, ConvertedDeepseekGeneratesTrainsAndExports) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  for (const std::string arch : {"deepseek_v3", "deepseek_v2"}) {
    const fs::path d = temp_dir("train" + arch);
    write_hf(d / "hf", "--arch " + arch + " --dtype bf16");
    ASSERT_EQ(convert("hf", "moecore", d / "hf", d / "ckpt"), 0);
    EXPECT_EQ(run_generate({"--load", (d / "ckpt").string(), "--prompt-ids", "1 2 3", "--max-new-tokens", "3",
                            "--device", "cpu"}),
              0)
        << arch;
    TrainArgs a = train_args_from_saved(read_checkpoint_meta((d / "ckpt").string()).args, "cpu", "test");
    a.load = (d / "ckpt").string();
    a.finetune = true;
    a.save = (d / "trained").string();
    a.model.seq_length = 16;
    ASSERT_EQ(run_training(a), 0) << arch;
    ASSERT_EQ(convert("moecore", "hf", d / "trained", d / "hf2"), 0) << arch;
    std::ifstream cf(d / "hf2" / "config.json");
    const nlohmann::json cfg = nlohmann::json::parse(cf);
    std::ifstream of(d / "hf" / "config.json");
    const nlohmann::json orig = nlohmann::json::parse(of);
    for (const char* key : {"architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                            "num_attention_heads", "max_position_embeddings", "rms_norm_eps", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                            "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                            "num_experts_per_tok", "n_group", "topk_group", "topk_method", "scoring_func",
                            "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace", "intermediate_size",
                            "moe_intermediate_size", "seq_aux", "aux_loss_alpha", "tie_word_embeddings"})
      EXPECT_EQ(cfg[key], orig[key]) << arch << " " << key;
    if (arch == "deepseek_v3") {
      EXPECT_EQ(cfg["num_nextn_predict_layers"], 1);
      EXPECT_EQ(cfg["rope_scaling"]["factor"], 4.0);
      EXPECT_EQ(cfg["rope_scaling"]["mscale_all_dim"], 1.0);
    }
    const SafetensorsReader hf2((d / "hf2").string()), hf1((d / "hf").string());
    EXPECT_EQ(hf2.names(), hf1.names()) << arch;
    ASSERT_EQ(convert("hf", "moecore", d / "hf2", d / "ckpt2"), 0) << arch;
    const SafetensorsFile ta(checkpoint_tensor_file((d / "trained").string())),
        tb(checkpoint_tensor_file((d / "ckpt2").string()));
    for (const StTensorInfo& t : tb.tensors()) EXPECT_EQ(ta.raw(t.name), tb.raw(t.name)) << arch << " " << t.name;
    fs::remove_all(d);
  }
}

// transformers' save_pretrained of DeepseekV3 writes no MTP layer but keeps
// num_nextn_predict_layers: imported without MTP. An MTP copy of the embedding or of lm_head that
// differs, a missing MTP tensor and the config values moecore cannot express are refused by name.
TEST(HfConvert, DeepseekRefusals) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  const fs::path d = temp_dir("dsbad");
  write_hf(d / "nomtp", "--arch deepseek_v3 --no-mtp");
  ASSERT_EQ(convert("hf", "moecore", d / "nomtp", d / "nomtp_ck"), 0);
  EXPECT_EQ(train_args_from_saved(read_checkpoint_meta((d / "nomtp_ck").string()).args, "cpu", "t").model.mtp_num_layers, 0);
  ASSERT_EQ(convert("moecore", "hf", d / "nomtp_ck", d / "nomtp_back"), 0);
  expect_identical(d / "nomtp", d / "nomtp_back");
  write_hf(d / "copies", "--arch deepseek_v3 --distinct-copies");
  std::string msg = error_of([&] { convert("hf", "moecore", d / "copies", d / "copies_ck"); });
  EXPECT_NE(msg.find("'model.layers.2.embed_tokens.weight' differs from 'model.embed_tokens.weight'"), std::string::npos) << msg;
  write_hf(d / "drop", "--arch deepseek_v3 --drop model.layers.2.hnorm.weight");
  msg = error_of([&] { convert("hf", "moecore", d / "drop", d / "drop_ck"); });
  EXPECT_NE(msg.find("missing tensor 'model.layers.2.hnorm.weight'"), std::string::npos) << msg;

  std::ifstream f3(d / "nomtp" / "config.json");
  const nlohmann::json v3 = nlohmann::json::parse(f3);
  auto refused = [&](nlohmann::json cfg, const std::string& key, const nlohmann::json& value, const std::string& needle) {
    if (value.is_null()) cfg.erase(key);
    else cfg[key] = value;
    const std::string m = error_of([&] { hf_config_to_train_flags(cfg.dump(), "cfg"); });
    EXPECT_NE(m.find(needle), std::string::npos) << key << ": " << m;
  };
  refused(v3, "topk_method", "greedy", "topk_method 'greedy' is not supported (noaux_tc)");
  refused(v3, "scoring_func", "softmax", "scoring_func 'softmax' is not supported (sigmoid)");
  refused(v3, "topk_group", 4, "num_experts_per_tok = 2 * topk_group");
  refused(v3, "norm_topk_prob", false, "norm_topk_prob false");
  refused(v3, "moe_layer_freq", 2, "moe_layer_freq 2 is not supported");
  refused(v3, "quantization_config", {{"quant_method", "fp8"}}, "quantized checkpoints");
  refused(v3, "rope_scaling", {{"type", "linear"}, {"factor", 2}}, "rope_scaling type 'linear' is not supported");
  refused(v3, "n_routed_experts", nullptr, "no integer 'n_routed_experts'");
  refused(v3, "attention_bias", true, "attention_bias true");
  nlohmann::json v2 = v3;
  v2["architectures"] = {"DeepseekV2ForCausalLM"};
  v2["scoring_func"] = "softmax";
  v2["topk_method"] = "group_limited_greedy";
  v2["norm_topk_prob"] = false;
  v2["topk_group"] = 4;
  EXPECT_EQ(error_of([&] { hf_config_to_train_flags(v2.dump(), "cfg"); }), "");
  refused(v2, "topk_group", 2, "num_experts_per_tok = topk_group");
  refused(v2, "norm_topk_prob", true, "norm_topk_prob true is not supported");
  refused(v2, "topk_method", "noaux_tc", "topk_method 'noaux_tc' is not supported (greedy or group_limited_greedy)");
  fs::remove_all(d);
}

// DeepSeek-V3's published config.json (the 671B model's) without its fp8 quantization_config (a
// BF16 copy, as DeepSeek's fp8_cast_bf16 writes one): the flags it maps to.
TEST(HfConvert, DeepseekV3PublishedConfigJson) {
  std::ifstream f(data_dir() / "hf" / "deepseek_v3_bf16.config.json");
  std::stringstream text;
  text << f.rdbuf();
  std::map<std::string, std::string> m;
  for (const auto& [k, v] : hf_config_to_train_flags(text.str(), "deepseek_v3")) m[k] = v;
  EXPECT_EQ(m["num-layers"], "61");
  EXPECT_EQ(m["q-lora-rank"], "1536");
  EXPECT_EQ(m["kv-lora-rank"], "512");
  EXPECT_EQ(m["qk-head-dim"], "128");
  EXPECT_EQ(m["qk-pos-emb-head-dim"], "64");
  EXPECT_EQ(m["moe-router-num-groups"], "8");
  EXPECT_EQ(m["moe-router-group-topk"], "4");
  EXPECT_EQ(std::stod(m["moe-router-topk-scaling-factor"]), 2.5);
  EXPECT_EQ(m["moe-shared-expert-intermediate-size"], "2048");
  EXPECT_EQ(m["moe-layer-freq"].substr(0, 8), "[0,0,0,1");
  EXPECT_EQ(m["rope-type"], "yarn");
  EXPECT_EQ(std::stod(m["rotary-scaling-factor"]), 40);
  EXPECT_EQ(m["mtp-num-layers"], "1");
}
