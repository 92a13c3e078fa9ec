// HF <-> moecore checkpoint conversion for Mixtral (MixtralForCausalLM), Qwen2-MoE
// (Qwen2MoeForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM), DeepSeek-V2 (DeepseekV2ForCausalLM) and
// DeepSeek-V3 (DeepseekV3ForCausalLM).
//
//   moecore convert --from hf --to moecore --input HF_DIR --output CKPT_DIR
//   moecore convert --from moecore --to hf --input CKPT_DIR --output HF_DIR [--max-shard-size 5GB]
//
// hf -> moecore writes a model-only checkpoint (train/checkpoint.h, "moecore-model-v1"): fp32
// masters under our names, meta.json "args" = train flags derived from config.json (so
// `moecore generate --load` / `moecore train --load` rebuild the model), and meta.json "source"
// = {"architecture", "config" (config.json as read), "dtypes" {HF tensor: original dtype}}.
// moecore -> hf writes config.json (the recorded one, else one derived from the flags) and the
// tensors in their recorded dtype (else F32): a bf16 checkpoint round-trips bit-identically.
//
// Tensor mapping (HF linear weights are [out, in] like ours; N = layer, M = expert):
//   model.embed_tokens.weight                 embedding.word_embeddings.weight [V,H]
//   model.layers.N.input_layernorm.weight     decoder.layers.N.input_layernorm.weight
//   ...self_attn.{q,k,v,o}_proj.weight        ...self_attention.linear_{q,k,v,proj}.weight
//   ...self_attn.{q,k}_norm.weight (Qwen3)    ...self_attention.{q,k}_layernorm.weight [D]
//   ...self_attn.{q,k,v}_proj.bias (Qwen2)    ...self_attention.linear_{q,k,v}.bias (--add-qkv-bias)
//   ...post_attention_layernorm.weight        ...pre_mlp_layernorm.weight
//   Mixtral ...block_sparse_moe.gate.weight   ...mlp.router.weight [E,H]
//           ...block_sparse_moe.experts.M.{w1 (gate), w3 (up)}.weight [F,H]
//                                             ...mlp.experts.linear_fc1.weight [E,2F,H], [e] = [w1; w3]
//           ...block_sparse_moe.experts.M.w2.weight [H,F]
//                                             ...mlp.experts.linear_fc2.weight [E,H,F]
//   Qwen2/3 ...mlp.gate.weight, ...mlp.experts.M.{gate_proj, up_proj, down_proj}.weight (as above)
//   Qwen2   ...mlp.shared_expert.{gate_proj, up_proj}.weight [S,H]
//                                             ...mlp.shared_experts.linear_fc1.weight [2S,H] = [gate; up]
//           ...mlp.shared_expert.down_proj.weight  ...mlp.shared_experts.linear_fc2.weight [H,S]
//           ...mlp.shared_expert_gate.weight  ...mlp.shared_experts.gate.weight [1,H] (sigmoid gate)
//           dense layers: ...mlp.{gate_proj, up_proj}.weight -> ...mlp.linear_fc1.weight [2F,H],
//                         ...mlp.down_proj.weight -> ...mlp.linear_fc2.weight [H,F]
//   model.norm.weight                         decoder.final_layernorm.weight
//   lm_head.weight (untied only)              output_layer.weight [V,H]
// Routing: Mixtral, and Qwen with norm_topk_prob true, = softmax over the k selected logits (our
// default); Qwen with norm_topk_prob false (Qwen2-MoE's default) = --moe-router-pre-softmax.
// HF's router_aux_loss_coef becomes --moe-aux-loss-coeff, but HF's aux loss (one Switch loss over
// all layers' tokens together, no 1/k) is not Megatron's (a sum of per-layer losses with 1/k).
// RoPE: HF Mixtral/Qwen2/Qwen3 and moecore all rotate halves of each head (rotate_half), so q/k rows
// are copied as they are; no interleave permutation is needed.
// DeepSeek-V2/V3 (config: hf_deepseek.h): MLA's q_a_proj, q_a_layernorm, q_b_proj | q_proj,
// kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj -> linear_q_down_proj, q_layernorm,
// linear_q_up_proj | linear_q_proj, linear_kv_down_proj, kv_layernorm, linear_kv_up_proj,
// linear_proj; the RoPE rows (each head's last qk_rope_head_dim rows of q_b_proj / q_proj, the
// last ones of kv_a_proj_with_mqa) reordered from interleaved pairs to halves (model/mla_attention.h)
// and back on export. mlp.gate.e_score_correction_bias -> mlp.router.expert_bias (a buffer);
// mlp.shared_experts.{gate,up,down}_proj -> mlp.shared_experts.linear_fc1/fc2 (no gate). MTP
// module k = model.layers.<L+k-1> -> mtp.layers.<k-1> (model/mtp.h): its embed_tokens and
// shared_head.head must equal the main ones (ours are shared) and are written from them.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "moecore/interop/safetensors.h"
#include "moecore/model/config.h"
#include "moecore/train/arguments.h"

namespace moecore::interop {

// What `moecore convert` was asked (its flags are in apps/convert_command.cpp).
struct ConvertOptions {
  std::string from, to, input, output;
  std::string max_shard_size = "5GB";  // largest safetensors shard for --to hf ("500MB", "5GB")
  double progress_interval_s = 1.0;    // --progress-interval: seconds between progress lines (0: none)
};
// Runs one conversion (hf -> moecore or moecore -> hf) and prints a line saying so, with progress
// lines on stderr while it runs. Returns 0; errors throw. `codec` turns recorded train flags into a
// model config (train/arguments.h).
int convert(const ConvertOptions& options, const TrainFlagCodec& codec);

// Progress of one conversion (core/progress.h): a line about every interval_s seconds (none before
// the first interval, so quick conversions stay quiet) over the bytes read and then written
// ("convert: 1.2G/2.8G B (43.0%), 310.5M B/s, ETA 5s, reading tensor 120/291"). out == nullptr or
// interval_s <= 0: silent.
struct ConvertProgress {
  std::ostream* out = nullptr;
  double interval_s = 0;
};
void convert_hf_to_moecore(const std::string& hf_dir, const std::string& ckpt_dir, const TrainFlagCodec& codec,
                           const ConvertProgress& progress = {});
void convert_moecore_to_hf(const std::string& ckpt_dir, const std::string& hf_dir, uint64_t max_shard_bytes,
                           const TrainFlagCodec& codec, const ConvertProgress& progress = {});

// Our named tensors (parameters, or their gradients) -> F32 HF tensors of `architecture`
// ("MixtralForCausalLM", ...) by the mapping above, in mapping order; get(ours) returns a
// contiguous CPU F32 tensor of our shape. An Error names a model feature the architecture lacks.
std::vector<StWriteTensor> export_hf_f32(const ModelConfig& cfg, const std::string& architecture,
                                         const std::function<Tensor(const std::string&)>& get);

// config.json text -> the train flag values it determines (the model's sizes, routing, ...);
// TrainFlagCodec::all_values adds every other flag's default, as a checkpoint records them.
std::vector<std::pair<std::string, std::string>> hf_config_to_train_flags(const std::string& config_json,
                                                                          const std::string& origin);

}  // namespace moecore::interop
