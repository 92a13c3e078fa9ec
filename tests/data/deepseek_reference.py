#!/usr/bin/env python3
"""Independent fp64 forward of a tiny HF DeepSeek-V2/V3 checkpoint (stdlib only), as DeepSeek's
published modeling and inference code compute it: MLA on the HF weights as stored (RoPE on interleaved pairs,
no row reordering), YaRN (DeepSeek's yarn rotary embedding and softmax mscale), V3 sigmoid routing
with e_score_correction_bias and groups ranked by their best 2, V2 softmax greedy /
group_limited_greedy (groups ranked by their best expert), shared experts, dense first layers.

usage: deepseek_reference.py HF_DIR LOGITS.safetensors IDS...
Compares the reference logits of the token ids (one sequence) with the "logits" tensor of
LOGITS.safetensors (tools/hf_reference's output, [1, S, V]); exit 0 when
max |ours - ref| / max |ref| <= 1e-5.
"""
import json
import math
import os
import struct
import sys

TOL = 1e-5


def read_safetensors(path):
    out = {}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    for name, t in header.items():
        if name == "__metadata__":
            continue
        raw = data[t["data_offsets"][0]:t["data_offsets"][1]]
        if t["dtype"] == "F32":
            vals = list(struct.unpack("<%df" % (len(raw) // 4), raw))
        elif t["dtype"] == "BF16":
            vals = [struct.unpack("<f", struct.pack("<I", h << 16))[0]
                    for (h,) in struct.iter_unpack("<H", raw)]
        else:
            raise SystemExit("%s: dtype %s not supported here" % (name, t["dtype"]))
        shape = t["shape"]
        out[name] = [vals[i * shape[-1]:(i + 1) * shape[-1]] for i in range(len(vals) // shape[-1])] \
            if len(shape) == 2 else vals
    return out


def linear(w, x):
    return [sum(a * b for a, b in zip(row, x)) for row in w]


def rmsnorm(x, w, eps):
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v * r * g for v, g in zip(x, w)]


def silu(v):
    return v / (1.0 + math.exp(-v))


def mlp(W, p, x):
    g, u = linear(W[p + ".gate_proj.weight"], x), linear(W[p + ".up_proj.weight"], x)
    return linear(W[p + ".down_proj.weight"], [silu(a) * b for a, b in zip(g, u)])


def get_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_tables(cfg, positions):
    """cos/sin per position and pair (DeepSeek's rotary embedding, YaRN when configured)."""
    dim, base = cfg["qk_rope_head_dim"], cfg.get("rope_theta", 10000.0)
    extra = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    inv, mscale = extra, 1.0
    rs = cfg.get("rope_scaling")
    if rs and rs.get("type", rs.get("rope_type")) == "yarn":
        f, orig = rs["factor"], rs["original_max_position_embeddings"]

        def find_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(find_dim(rs.get("beta_fast", 32))), 0)
        high = min(math.ceil(find_dim(rs.get("beta_slow", 1))), dim - 1)
        if low == high:
            high += 0.001
        mask = [1.0 - min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
        inv = [e / f * (1 - m) + e * m for e, m in zip(extra, mask)]
        mscale = get_mscale(f, rs.get("mscale", 1)) / get_mscale(f, rs.get("mscale_all_dim", 0))
    return [[(math.cos(t * w) * mscale, math.sin(t * w) * mscale) for w in inv] for t in positions]


def rotate(x, table):  # interleaved pairs (2i, 2i+1)
    out = list(x)
    for i, (c, s) in enumerate(table):
        a, b = x[2 * i], x[2 * i + 1]
        out[2 * i], out[2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def attention(W, p, cfg, xs, tables):
    n, nope, r, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    d, kvl, eps = nope + r, cfg["kv_lora_rank"], cfg["rms_norm_eps"]
    scale = d ** -0.5
    rs = cfg.get("rope_scaling")
    if rs and rs.get("mscale_all_dim"):
        m = get_mscale(rs["factor"], rs["mscale_all_dim"])
        scale *= m * m
    qs, ks, vs = [], [], []
    for t, x in enumerate(xs):
        if cfg.get("q_lora_rank"):
            q = linear(W[p + ".q_b_proj.weight"],
                       rmsnorm(linear(W[p + ".q_a_proj.weight"], x), W[p + ".q_a_layernorm.weight"], eps))
        else:
            q = linear(W[p + ".q_proj.weight"], x)
        kv_a = linear(W[p + ".kv_a_proj_with_mqa.weight"], x)
        kv = linear(W[p + ".kv_b_proj.weight"], rmsnorm(kv_a[:kvl], W[p + ".kv_a_layernorm.weight"], eps))
        k_pe = rotate(kv_a[kvl:], tables[t])
        qh, kh, vh = [], [], []
        for h in range(n):
            qq = q[h * d:(h + 1) * d]
            qh.append(qq[:nope] + rotate(qq[nope:], tables[t]))
            e = kv[h * (nope + dv):(h + 1) * (nope + dv)]
            kh.append(e[:nope] + k_pe)
            vh.append(e[nope:])
        qs.append(qh)
        ks.append(kh)
        vs.append(vh)
    out = []
    for t in range(len(xs)):
        o = []
        for h in range(n):
            sc = [scale * sum(a * b for a, b in zip(qs[t][h], ks[u][h])) for u in range(t + 1)]
            mx = max(sc)
            e = [math.exp(s - mx) for s in sc]
            z = sum(e)
            o += [sum(e[u] / z * vs[u][h][c] for u in range(t + 1)) for c in range(dv)]
        out.append(linear(W[p + ".o_proj.weight"], o))
    return out


def topk(vals, k):
    return sorted(range(len(vals)), key=lambda i: -vals[i])[:k]


def moe(W, p, cfg, x):
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    ng, tg = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    per = e // ng
    logits = linear(W[p + ".gate.weight"], x)
    if cfg.get("scoring_func", "softmax") == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
        choice = [s + b for s, b in zip(scores, W[p + ".gate.e_score_correction_bias"])]
        gs = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(ng)]
    else:
        mx = max(logits)
        ex = [math.exp(v - mx) for v in logits]
        scores = [v / sum(ex) for v in ex]
        choice = list(scores)
        gs = [max(choice[g * per:(g + 1) * per]) for g in range(ng)]
        if cfg.get("topk_method", "greedy") == "greedy":
            gs = [0.0] * ng
            tg = ng
    keep = set(topk(gs, tg))
    # experts outside the kept groups: -inf, as DeepSeek-V3's inference code (model.py, Gate)
    # masks them; transformers' DeepseekV3 fills 0.0, which differs only where a kept expert's
    # biased score is negative
    masked = [c if i // per in keep else -math.inf for i, c in enumerate(choice)]
    idx = topk(masked, k)
    w = [scores[i] for i in idx]
    if cfg.get("norm_topk_prob") and k > 1:
        s = sum(w) + 1e-20
        w = [v / s for v in w]
    w = [v * cfg.get("routed_scaling_factor", 1.0) for v in w]
    out = mlp(W, p + ".shared_experts", x) if cfg.get("n_shared_experts") else [0.0] * len(x)
    for i, wi in zip(idx, w):
        y = mlp(W, p + ".experts.%d" % i, x)
        out = [a + wi * b for a, b in zip(out, y)]
    return out


def forward(W, cfg, ids):
    eps = cfg["rms_norm_eps"]
    xs = [list(W["model.embed_tokens.weight"][i]) for i in ids]
    tables = rope_tables(cfg, range(len(ids)))
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d" % layer
        a = attention(W, p + ".self_attn", cfg, [rmsnorm(x, W[p + ".input_layernorm.weight"], eps) for x in xs], tables)
        xs = [[u + v for u, v in zip(x, y)] for x, y in zip(xs, a)]
        for t, x in enumerate(xs):
            h = rmsnorm(x, W[p + ".post_attention_layernorm.weight"], eps)
            y = moe(W, p + ".mlp", cfg, h) if layer >= cfg.get("first_k_dense_replace", 0) else mlp(W, p + ".mlp", h)
            xs[t] = [u + v for u, v in zip(x, y)]
    head = W["lm_head.weight"] if not cfg.get("tie_word_embeddings") else W["model.embed_tokens.weight"]
    return [linear(head, rmsnorm(x, W["model.norm.weight"], eps)) for x in xs]


def main():
    hf_dir, ours_file, ids = sys.argv[1], sys.argv[2], [int(v) for v in sys.argv[3:]]
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    W = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            W.update(read_safetensors(os.path.join(hf_dir, name)))
    ref = forward(W, cfg, ids)
    ours = read_safetensors(ours_file)["logits"]  # [1, S, V] as a flat list
    v = len(ref[0])
    flat_ref = [x for row in ref for x in row]
    assert len(ours) == len(flat_ref), "logits: %d values, expected %d (S %d, V %d)" % (len(ours), len(flat_ref), len(ids), v)
    den = max(abs(x) for x in flat_ref)
    rel = max(abs(a - b) for a, b in zip(ours, flat_ref)) / den
    print("%s: max |moecore - reference| / max |reference| = %.3e over %d logits (tolerance %.0e)" % (
        cfg["architectures"][0], rel, len(flat_ref), TOL))
    return 0 if rel <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
