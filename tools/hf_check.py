#!/usr/bin/env python3
"""Hold moecore's import of HF MoE checkpoints to transformers (needs torch + transformers).

For each of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and DeepSeek-V2 this script
  1. builds a tiny random model with transformers in fp32 (GQA; Qwen2-MoE with q/k/v biases, a
     gated shared expert, norm_topk_prob false and one dense layer through mlp_only_layers;
     Qwen3-MoE with q/k norms, head_dim != hidden/heads, tied embeddings, norm_topk_prob true
     and one dense layer; DeepSeek-V3 with MLA (q-lora), YaRN, sigmoid group routing with a
     random e_score_correction_bias, a shared expert and a dense first layer; DeepSeek-V2 with
     MLA without q-lora and softmax group_limited_greedy routing), draws every parameter at random
     (norm weights around 1, biases nonzero: nothing keeps its zero/one initialisation) and saves
     it with save_pretrained;
  2. imports it: `moecore convert --from hf --to moecore`;
  3. runs moecore (tools/hf_reference, fp32, on each --devices entry) on the same token ids
     for logits, the causal-LM loss and the gradient of every weight (under HF names);
  4. runs transformers' forward + loss.backward() on the CPU in fp32 (the reference) and in
     fp64 (to show the fp32 noise floor), and compares.
Gradients of transformers are saved through save_pretrained as well (each parameter replaced by
its gradient), so they carry exactly the on-disk names that the converter maps; a buffer
(e_score_correction_bias) keeps its value there, and hf_reference writes the value as well.

Differences are relative to the reference's largest magnitude:
  rel(x, ref) = max|x - ref| / max|ref|   (per tensor; the loss: |x - ref| / |ref|)
Targets: logits and loss <= 1e-4, every weight gradient <= 1e-3.
The MoE balancing loss is not compared: transformers adds its aux loss only with
output_router_logits (off here), and its formula (one Switch loss over all layers' tokens
together, without 1/k) differs from Megatron's per-layer loss that moecore implements.

usage: python3 tools/hf_check.py --moecore build/moecore --hf-reference build/tools/hf_reference
                                 [--devices cpu,cuda:0] [--workdir DIR] [--json OUT.json]
Exit status 0 when every comparison meets its target.
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

VOCAB, HIDDEN, BATCH, SEQ = 128, 128, 2, 16  # head dims 32 and 64: moecore CUDA attention takes 32/64/128
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-4, 1e-3


def make_config(name):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, hidden_act="silu", num_experts_per_tok=2,
                  router_aux_loss_coef=0.01, output_router_logits=False, attention_dropout=0.0)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=48, num_hidden_layers=2, num_local_experts=8,
                                         rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
                                         sliding_window=None, router_jitter_noise=0.0, **common)
        cls = transformers.MixtralForCausalLM
    elif name == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=80, num_hidden_layers=3, num_experts=8,
                                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                                          rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                                          use_sliding_window=False, qkv_bias=True, **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif name == "deepseek_v3":
        # MLA with q-lora (D = 64, Dv = 64), YaRN with mscale_all_dim (the softmax scale), sigmoid
        # routing with a random e_score_correction_bias, 4 groups (top-4 from the best 2), a
        # shared expert, one dense first layer; no MTP layer (transformers builds none).
        cfg = transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=32, v_head_dim=64,
            qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
            norm_topk_prob=True, hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_theta=10000.0, rope_interleave=True, attention_bias=False,
            attention_dropout=0.0, num_nextn_predict_layers=0)
        set_yarn(cfg, dict(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                           mscale=1.0, mscale_all_dim=1.0))
        cls = transformers.DeepseekV3ForCausalLM
    elif name == "deepseek_v2":
        # MLA without q-lora (D = 64, Dv = 32), softmax group_limited_greedy (4 groups, top-2 from
        # the best 2), routed_scaling_factor, two shared experts, one dense first layer.
        cfg = transformers.DeepseekV2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
            routed_scaling_factor=2.0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32,
            qk_nope_head_dim=48, topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, norm_topk_prob=False, hidden_act="silu", max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False,
            attention_dropout=0.0, scoring_func="softmax")
        cls = transformers.DeepseekV2ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, head_dim=64,
                                          num_hidden_layers=3, num_experts=8, norm_topk_prob=True,
                                          decoder_sparse_step=1, mlp_only_layers=[2], rms_norm_eps=1e-6,
                                          rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False,
                                          attention_bias=False, **common)
        cls = transformers.Qwen3MoeForCausalLM
    # Plain PyTorch attention and experts (transformers 5 defaults to grouped_mm experts, which
    # take no fp64).
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg, cls


def set_yarn(cfg, yarn):
    """YaRN: transformers 5 keeps it in rope_parameters (with rope_theta), 4.x in rope_scaling."""
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        params = dict(cfg.rope_parameters)
        params.update(rope_type="yarn", **yarn)
        cfg.rope_parameters = params
    else:
        cfg.rope_scaling = dict(type="yarn", **yarn)


def build(cls, cfg, dtype):
    m = cls(cfg).to(dtype).eval()
    if hasattr(m, "set_experts_implementation"):
        m.set_experts_implementation("eager")
    return m


def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * r)
            elif n.endswith(".bias"):
                p.copy_(0.2 * r)
            elif "embed_tokens" in n:
                p.copy_(0.5 * r)
            else:
                p.copy_(0.1 * r)
        # DeepSeek-V3's correction bias is a buffer: drawn too, so that it changes the routing
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g, dtype=torch.float64))


def st_load_dir(d):
    """Every tensor of a save_pretrained directory (one file or shards)."""
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def rel(x, ref):
    x, ref = x.double(), ref.double()
    den = ref.abs().max().item()
    return (x - ref).abs().max().item() / (den if den > 0 else 1.0)


def hf_run(model, ids, num_experts, topk):
    """Logits, loss and {saved name: gradient} of transformers; min top-k routing margin."""
    margins = []

    def hook(_module, _inp, out):
        t = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(t) and t.dim() >= 2 and t.shape[-1] == num_experts:
            p = torch.softmax(t.detach().double().reshape(-1, num_experts), dim=-1)
            s = torch.sort(p, dim=-1, descending=True).values
            margins.append((s[:, topk - 1] - s[:, topk]).min().item())

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith(".gate")]
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    for h in handles:
        h.remove()
    return out.logits.detach(), out.loss.detach(), min(margins) if margins else float("nan")


def saved_grads(model, workdir, tag):
    """The gradients under the names save_pretrained writes (each parameter replaced by its gradient)."""
    m = model
    with torch.no_grad():
        for n, p in m.named_parameters():
            assert p.grad is not None, "no gradient reached " + n
            p.copy_(p.grad)
    d = os.path.join(workdir, tag)
    m.save_pretrained(d, safe_serialization=True)
    return {k: v for k, v in st_load_dir(d).items()}


def check_model(name, args, report):
    torch.manual_seed(args.seed)
    cfg, cls = make_config(name)
    model = build(cls, cfg, torch.float32)
    if name == "qwen2_moe":
        assert model.model.layers[0].self_attn.q_proj.bias is not None, "this transformers' Qwen2-MoE has no q/k/v bias"
    randomise(model, args.seed)
    work = os.path.join(args.workdir, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    hf_dir = os.path.join(work, "hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    n_exp = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tok_file = os.path.join(work, "tokens.txt")
    with open(tok_file, "w") as f:
        f.write("%d %d\n%s\n" % (BATCH, SEQ, " ".join(str(int(x)) for x in ids.flatten())))

    # transformers: fp64 first (noise floor), then fp32 (the reference).
    m64 = build(cls, cfg, torch.float64)
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    try:
        logits64, loss64, margin = hf_run(m64, ids, n_exp, cfg.num_experts_per_tok)
        grads64 = saved_grads(m64, work, "grads_hf64")
        fp64_error = None
    except Exception as e:  # keep the fp32 comparison when fp64 does not run
        fp64_error = "%s: %s" % (type(e).__name__, e)
    logits32, loss32, margin32 = hf_run(model, ids, n_exp, cfg.num_experts_per_tok)
    grads32 = saved_grads(model, work, "grads_hf32")
    if fp64_error:
        logits64, loss64, grads64, margin = logits32, loss32, grads32, margin32

    ckpt = os.path.join(work, "ckpt")
    p = subprocess.run([args.moecore, "convert", "--from", "hf", "--to", "moecore", "--input", hf_dir, "--output", ckpt],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        with open(os.path.join(hf_dir, "config.json")) as f:
            raise RuntimeError("moecore convert failed: %s\nconfig.json: %s" % (p.stderr.strip(), f.read()))
    entry = {"architecture": cls.__name__, "hf_loss_fp32": loss32.item(), "hf_loss_fp64": loss64.item(),
             "min_topk_margin": margin, "num_weight_tensors": len(grads32), "fp64_error": fp64_error,
             "experts_implementation": getattr(model.config, "_experts_implementation", None),
             "hf_fp32_vs_fp64": {"logits": rel(logits32, logits64), "loss": rel(loss32, loss64),
                                 "grad_max": max(rel(grads32[k], grads64[k]) for k in grads64)},
             "devices": {}}
    ok = True
    for dev in args.devices:
        out = os.path.join(work, "moecore_%s.safetensors" % dev.replace(":", ""))
        p = subprocess.run([args.hf_reference, "--load", ckpt, "--tokens", tok_file, "--out", out, "--device", dev],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            ok = False
            entry["devices"][dev] = {"error": p.stderr.strip(), "pass": False}
            continue
        ours = load_file(out)
        with safe_open(out, "pt") as f:
            loss = float(f.metadata()["loss"])
        logits = ours.pop("logits").reshape(logits32.shape)
        missing = sorted(set(grads32) - set(ours))
        extra = sorted(set(ours) - set(grads32))
        assert not missing and not extra, "gradient names differ: missing %s, extra %s" % (missing, extra)
        per = {k: rel(ours[k], grads32[k]) for k in sorted(grads32)}
        per64 = {k: rel(ours[k], grads64[k]) for k in sorted(grads64)}
        worst = max(per, key=per.get)
        r = {"loss": loss, "logits_rel": rel(logits, logits32), "loss_rel": abs(loss - loss32.item()) / abs(loss32.item()),
             "grad_max_rel": per[worst], "grad_worst": worst,
             "vs_fp64": {"logits_rel": rel(logits, logits64), "loss_rel": abs(loss - loss64.item()) / abs(loss64.item()),
                         "grad_max_rel": max(per64.values())},
             "grad_rel": per}
        r["pass"] = r["logits_rel"] <= LOGITS_TOL and r["loss_rel"] <= LOSS_TOL and r["grad_max_rel"] <= GRAD_TOL
        ok = ok and r["pass"]
        entry["devices"][dev] = r
    report["models"][name] = entry
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moecore", default="build/moecore")
    ap.add_argument("--hf-reference", default="build/tools/hf_reference")
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--models", default="mixtral,qwen2_moe,qwen3_moe,deepseek_v3,deepseek_v2")
    ap.add_argument("--workdir", default="/tmp/moecore_hf_check")
    ap.add_argument("--json", default="hf_check.json")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    args.devices = [d for d in args.devices.split(",") if d]
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
              "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "shape": {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "hidden": HIDDEN},
              "targets": {"logits": LOGITS_TOL, "loss": LOSS_TOL, "grad": GRAD_TOL}, "models": {}}
    ok = True
    for name in args.models.split(","):
        try:
            ok = check_model(name, args, report) and ok
        except Exception as e:  # report the model's failure and go on with the others
            ok = False
            report["models"][name] = {"error": "%s: %s" % (type(e).__name__, e)}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print("transformers %s, torch %s, GPU %s, %s" % (report["transformers"], report["torch"], report["gpu"], report["date"]))
    print("%-10s %-7s %12s %12s %12s  %-8s %s" % ("model", "device", "logits rel", "loss rel", "grad max rel",
                                                   "result", "worst gradient"))
    for name, e in report["models"].items():
        if "error" in e:
            print("%-10s ERROR %s" % (name, e["error"]))
            continue
        f = e["hf_fp32_vs_fp64"]
        print("%-10s %-7s %12.3e %12.3e %12.3e  %-8s (transformers fp32 vs fp64; top-k margin %.2e)" % (
            name, "hf32", f["logits"], f["loss"], f["grad_max"], "", e["min_topk_margin"]))
        for dev, r in e["devices"].items():
            if "error" in r:
                print("%-10s %-7s ERROR %s" % (name, dev, r["error"]))
                continue
            print("%-10s %-7s %12.3e %12.3e %12.3e  %-8s %s" % (name, dev, r["logits_rel"], r["loss_rel"],
                                                              r["grad_max_rel"], "PASS" if r["pass"] else "FAIL",
                                                              r["grad_worst"]))
    print("wrote", args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
