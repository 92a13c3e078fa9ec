#!/usr/bin/env python3
"""Independent writer of tiny random HF MoE checkpoints (stdlib only) for the converter tests.

usage: write_hf_checkpoint.py OUT_DIR --arch mixtral|qwen2|qwen3|deepseek_v3|deepseek_v2
                              [--dtype bf16|f32] [--shards K]
                              [--seed S] [--drop NAME] [--extra NAME] [--bad-shape NAME]
                              [--architecture NAME] [--no-mtp] [--distinct-copies]
Writes OUT_DIR/config.json and OUT_DIR/model.safetensors, or K shards
model-0000i-of-0000K.safetensors with model.safetensors.index.json.
DeepSeek: e_score_correction_bias is always F32 (as DeepSeek-V3's checkpoint keeps it), and the
MTP layer's embed_tokens / shared_head.head are copies of model.embed_tokens / lm_head
(--distinct-copies: drawn at random instead); --no-mtp leaves the MTP layer out but keeps
num_nextn_predict_layers in config.json (as transformers' save_pretrained of DeepseekV3 does).
"""
import argparse
import json
import os
import random
import struct


def deepseek_config(arch):
    if arch == "deepseek_v3":
        # DeepSeek-V3 in small: q-lora, sigmoid routing with the correction bias, 4 groups of 2
        # experts (top-4 from the best 2 groups), one dense first layer, a shared expert, YaRN,
        # one MTP layer (model.layers.2).
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
            "vocab_size": 40, "hidden_size": 16, "intermediate_size": 20, "moe_intermediate_size": 6,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 1,
            "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 8, "q_lora_rank": 12,
            "qk_rope_head_dim": 4, "v_head_dim": 5, "qk_nope_head_dim": 6, "topk_method": "noaux_tc",
            "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "moe_layer_freq": 1,
            "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001,
            "seq_aux": True, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "ep_size": 1, "attention_bias": False,
            "torch_dtype": "bfloat16",
        }
    # DeepSeek-V2-Lite in small: a plain q_proj, softmax routing, group_limited_greedy (3 groups of
    # 2, top-2 from the best 2 groups), routed_scaling_factor, two shared experts, a dense first layer.
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_act": "silu",
        "vocab_size": 40, "hidden_size": 16, "intermediate_size": 20, "moe_intermediate_size": 6,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 2,
        "n_routed_experts": 6, "routed_scaling_factor": 2.0, "kv_lora_rank": 8, "q_lora_rank": None,
        "qk_rope_head_dim": 4, "v_head_dim": 6, "qk_nope_head_dim": 6, "topk_method": "group_limited_greedy",
        "n_group": 3, "topk_group": 2, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": False, "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": None,
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
    }


def deepseek_layer(p, cfg, moe):
    h, heads, r = cfg["hidden_size"], cfg["num_attention_heads"], cfg["qk_rope_head_dim"]
    d, kvl, ql = cfg["qk_nope_head_dim"] + r, cfg["kv_lora_rank"], cfg["q_lora_rank"]
    a = p + ".self_attn"
    out = [(p + ".input_layernorm.weight", [h])]
    if ql:
        out += [(a + ".q_a_proj.weight", [ql, h]), (a + ".q_a_layernorm.weight", [ql]),
                (a + ".q_b_proj.weight", [heads * d, ql])]
    else:
        out.append((a + ".q_proj.weight", [heads * d, h]))
    out += [(a + ".kv_a_proj_with_mqa.weight", [kvl + r, h]), (a + ".kv_a_layernorm.weight", [kvl]),
            (a + ".kv_b_proj.weight", [heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kvl]),
            (a + ".o_proj.weight", [h, heads * cfg["v_head_dim"]]), (p + ".post_attention_layernorm.weight", [h])]
    if not moe:
        f = cfg["intermediate_size"]
        return out + [(p + ".mlp.gate_proj.weight", [f, h]), (p + ".mlp.up_proj.weight", [f, h]),
                      (p + ".mlp.down_proj.weight", [h, f])]
    e, f = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out.append((p + ".mlp.gate.weight", [e, h]))
    if cfg["scoring_func"] == "sigmoid":
        out.append((p + ".mlp.gate.e_score_correction_bias", [e]))
    for x in range(e):
        q = p + ".mlp.experts.%d" % x
        out += [(q + ".gate_proj.weight", [f, h]), (q + ".up_proj.weight", [f, h]), (q + ".down_proj.weight", [h, f])]
    s = f * cfg["n_shared_experts"]
    q = p + ".mlp.shared_experts"
    return out + [(q + ".gate_proj.weight", [s, h]), (q + ".up_proj.weight", [s, h]), (q + ".down_proj.weight", [h, s])]


def deepseek_tensors(cfg):
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out = [("model.embed_tokens.weight", [v, h])]
    for i in range(n):
        out += deepseek_layer("model.layers.%d" % i, cfg, i >= cfg["first_k_dense_replace"])
    out += [("model.norm.weight", [h]), ("lm_head.weight", [v, h])]
    for k in range(cfg.get("num_nextn_predict_layers", 0)):
        p = "model.layers.%d" % (n + k)
        out += [(p + ".embed_tokens.weight", [v, h]), (p + ".enorm.weight", [h]), (p + ".hnorm.weight", [h]),
                (p + ".eh_proj.weight", [h, 2 * h])]
        out += deepseek_layer(p, cfg, True)
        out += [(p + ".shared_head.norm.weight", [h]), (p + ".shared_head.head.weight", [v, h])]
    return out


def config(arch):
    if arch.startswith("deepseek"):
        return deepseek_config(arch)
    if arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
            "hidden_size": 16, "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 40, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "max_position_embeddings": 64, "tie_word_embeddings": False, "num_local_experts": 4,
            "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16",
        }
    if arch == "qwen2":
        # Qwen2-MoE: q/k/v biases, a gated shared expert, norm_topk_prob false (pre-softmax
        # routing), one dense layer through decoder_sparse_step 2 (layers 1 and 3 are MoE).
        return {
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
            "hidden_size": 16, "intermediate_size": 20, "moe_intermediate_size": 6,
            "shared_expert_intermediate_size": 10, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 40, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": False, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 2,
            "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "use_sliding_window": False,
            "torch_dtype": "bfloat16",
        }
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
        "hidden_size": 16, "intermediate_size": 20, "moe_intermediate_size": 6, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 40,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "router_aux_loss_coef": 0.001,
        "attention_bias": False, "torch_dtype": "bfloat16",
    }


def tensors(arch, cfg):
    if arch.startswith("deepseek"):
        return deepseek_tensors(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    out = [("model.embed_tokens.weight", [v, h])]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d" % i
        out += [(p + ".input_layernorm.weight", [h]),
                (p + ".self_attn.q_proj.weight", [heads * d, h]),
                (p + ".self_attn.k_proj.weight", [kv * d, h]),
                (p + ".self_attn.v_proj.weight", [kv * d, h]),
                (p + ".self_attn.o_proj.weight", [h, heads * d])]
        if arch == "qwen3":
            out += [(p + ".self_attn.q_norm.weight", [d]), (p + ".self_attn.k_norm.weight", [d])]
        if arch == "qwen2":
            out += [(p + ".self_attn.q_proj.bias", [heads * d]), (p + ".self_attn.k_proj.bias", [kv * d]),
                    (p + ".self_attn.v_proj.bias", [kv * d])]
        out.append((p + ".post_attention_layernorm.weight", [h]))
        if arch == "mixtral":
            f = cfg["intermediate_size"]
            out.append((p + ".block_sparse_moe.gate.weight", [cfg["num_local_experts"], h]))
            for e in range(cfg["num_local_experts"]):
                x = p + ".block_sparse_moe.experts.%d" % e
                out += [(x + ".w1.weight", [f, h]), (x + ".w2.weight", [h, f]), (x + ".w3.weight", [f, h])]
        elif i in cfg["mlp_only_layers"] or (i + 1) % cfg["decoder_sparse_step"] != 0:
            f = cfg["intermediate_size"]
            out += [(p + ".mlp.gate_proj.weight", [f, h]), (p + ".mlp.up_proj.weight", [f, h]),
                    (p + ".mlp.down_proj.weight", [h, f])]
        else:
            f = cfg["moe_intermediate_size"]
            out.append((p + ".mlp.gate.weight", [cfg["num_experts"], h]))
            for e in range(cfg["num_experts"]):
                x = p + ".mlp.experts.%d" % e
                out += [(x + ".gate_proj.weight", [f, h]), (x + ".up_proj.weight", [f, h]),
                        (x + ".down_proj.weight", [h, f])]
            if arch == "qwen2":
                s, x = cfg["shared_expert_intermediate_size"], p + ".mlp.shared_expert"
                out += [(x + ".gate_proj.weight", [s, h]), (x + ".up_proj.weight", [s, h]),
                        (x + ".down_proj.weight", [h, s]), (p + ".mlp.shared_expert_gate.weight", [1, h])]
    out.append(("model.norm.weight", [h]))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", [v, h]))
    return out


def encode(values, dtype):
    raw = struct.pack("<%df" % len(values), *values)
    if dtype == "F32":
        return raw
    # bf16: the upper half of each f32, rounded to nearest even
    out = bytearray()
    for (bits,) in struct.iter_unpack("<I", raw):
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out += struct.pack("<H", bits & 0xFFFF)
    return bytes(out)


def write_file(path, items):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in items:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for item in items:
            f.write(item[3])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", choices=["mixtral", "qwen2", "qwen3", "deepseek_v3", "deepseek_v2"], required=True)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--drop", action="append", default=[])
    ap.add_argument("--extra", action="append", default=[])
    ap.add_argument("--bad-shape", action="append", default=[])
    ap.add_argument("--architecture")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--distinct-copies", action="store_true")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    cfg = config(a.arch)
    if a.architecture:
        cfg["architectures"] = [a.architecture]
    dtype = "BF16" if a.dtype == "bf16" else "F32"
    specs = [(n, s) for n, s in tensors(a.arch, cfg) if n not in a.drop] + [(n, [3]) for n in a.extra]
    if a.no_mtp:
        specs = [(n, s) for n, s in specs if not n.startswith("model.layers.%d." % cfg["num_hidden_layers"])]
    items, written = [], {}
    for name, shape in specs:
        if name in a.bad_shape:
            shape = [shape[0] + 1] + shape[1:]
        n = 1
        for x in shape:
            n *= x
        dt = "F32" if name.endswith("e_score_correction_bias") else dtype
        copy_of = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
        source = [v for k, v in copy_of.items() if name.endswith(k) and name != v and v in written and not a.distinct_copies]
        data = written[source[0]] if source else encode([rng.gauss(0.0, 0.5) for _ in range(n)], dt)
        written[name] = data
        items.append((name, dt, shape, data))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if a.shards <= 1:
        write_file(os.path.join(a.out, "model.safetensors"), items)
        return
    per = (len(items) + a.shards - 1) // a.shards
    weight_map, total = {}, 0
    for k in range(a.shards):
        part = items[k * per:(k + 1) * per]
        fname = "model-%05d-of-%05d.safetensors" % (k + 1, a.shards)
        write_file(os.path.join(a.out, fname), part)
        for item in part:
            weight_map[item[0]] = fname
            total += len(item[3])
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


if __name__ == "__main__":
    main()
