#include "moecore/plan/memory_model.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "moecore/core/allocator.h"
#include "moecore/model/activation_offload.h"
#include "moecore/model/gpt.h"
#include "moecore/model/params.h"
#include "moecore/train/pipeline.h"

namespace moecore::plan {

double MemoryParts::category(MemoryCategory c) const {
  double s = 0;
  for (int t = 0; t < kNumMemoryTags; ++t)
    if (memory_tag_category(static_cast<MemoryTag>(t)) == c) s += by_tag[static_cast<size_t>(t)];
  return s;
}

double MemoryParts::tagged() const {
  double s = 0;
  for (double v : by_tag) s += v;
  return s;
}

namespace {

// Tensors of one kind: `count` of `bytes` each, charged to `tag`; the allocator rounds each.
struct Items {
  MemoryParts parts;
  // count < 0 takes tensors away (one freed before the peak).
  void add(MemoryTag tag, double bytes, double count = 1) {
    if (bytes <= 0 || count == 0) return;
    const double rounded = static_cast<double>(CachingAllocator::round_size(static_cast<size_t>(std::ceil(bytes))));
    parts.by_tag[tag] += bytes * count;
    parts.rounding += (rounded - bytes) * count;
  }
  // Many small tensors (one per parameter): their rounding is negligible.
  void add_unrounded(MemoryCategory c, double bytes) { parts.by_tag[memory_tag(c)] += bytes; }
  void add(ActivationModule m, double bytes, double count = 1) { add(memory_tag(m), bytes, count); }
  void add(MemoryCategory c, double bytes, double count = 1) { add(memory_tag(c), bytes, count); }
  void merge(const Items& o, double times = 1) {
    for (int t = 0; t < kNumMemoryTags; ++t) parts.by_tag[static_cast<size_t>(t)] += o.parts.by_tag[static_cast<size_t>(t)] * times;
    parts.rounding += o.parts.rounding * times;
  }
};

struct Shapes {  // one micro-batch on one rank
  double b = 4;         // compute bytes (bf16: 2)
  double saved_in = 4;  // bytes of a saved GEMM input (fp8: 1)
  double rb = 4;        // router dtype bytes (fp64 router: 8)
  double T = 0;         // tokens inside attention (after the CP split)
  double Tl = 0;        // tokens between the blocks (after SP)
  double B = 0, S = 0, H = 0, tp = 1, cp = 1;
  double rows = 0;      // expert rows per rank: Tl x top-k x ETP (balanced)
  double F = 0;         // expert FFN width per rank (/ ETP)
  bool sp = false, rms = true, swiglu = true;
};

Shapes shapes_of(const TrainArgs& a, const PlanOptions& o) {
  const ModelConfig& m = a.model;
  Shapes s;
  s.b = a.bf16 ? 2 : 4;
  s.saved_in = o.fp8 ? 1 : s.b;
  s.rb = m.moe.router_fp64 ? 8 : 4;
  s.B = static_cast<double>(a.micro_batch_size);
  s.S = static_cast<double>(m.seq_length);
  s.H = static_cast<double>(m.hidden_size);
  s.tp = static_cast<double>(a.tp);
  s.cp = static_cast<double>(a.cp);
  s.sp = a.sequence_parallel && a.tp > 1;
  s.T = s.B * s.S / s.cp;
  s.Tl = s.sp ? s.T / s.tp : s.T;
  s.rows = s.Tl * static_cast<double>(m.moe.router.topk) * static_cast<double>(a.etp);
  s.F = static_cast<double>(m.moe.ffn_hidden_size) / static_cast<double>(a.etp);
  s.rms = m.rmsnorm;
  s.swiglu = m.swiglu;
  return s;
}

// The attention's saved tensors of one layer (AttentionBlock::Ctx / MlaAttention::Ctx).
void attention_items(const TrainArgs& a, const Shapes& s, Items& it) {
  const ModelConfig& m = a.model;
  const double stat = s.rms ? 4 : 8;  // rstd (+ mean): f32 per token
  // The input norm: its statistics; its output is saved by q/k/v unless SP gathers it first.
  it.add(ActivationModule::kAttnNorm, s.Tl * stat);
  if (!s.sp) it.add(ActivationModule::kAttnNorm, s.Tl * s.H * s.saved_in);
  if (s.sp) it.add(ActivationModule::kCoreAttn, s.T * s.H * s.saved_in);  // the gathered input
  const double heads = static_cast<double>(m.num_attention_heads) / s.tp;
  const double lse = s.T * heads * 4;
  if (m.mla.enabled) {  // latent projections, q / k [T, heads, qk + rope], v and out [T, heads, v]
    const double qd = static_cast<double>(m.mla.q_head_dim()), vd = static_cast<double>(m.mla.v_head_dim);
    const double latent = static_cast<double>(m.mla.q_lora_rank + m.mla.kv_lora_rank + m.mla.qk_pos_emb_head_dim);
    it.add(ActivationModule::kCoreAttn, s.T * latent * s.b, 2);  // the down projections and their norms
    if (m.mla.recompute_up_proj) {  // --recompute-modules mla_up_proj: q, k, v rebuilt from the latents
      it.add(ActivationModule::kCoreAttn, s.T * static_cast<double>(m.mla.qk_pos_emb_head_dim) * s.b);  // k_pe
    } else {
      it.add(ActivationModule::kCoreAttn, s.T * heads * qd * s.b, 2);
      it.add(ActivationModule::kCoreAttn, s.T * heads * vd * s.b);
    }
    if (!m.recompute.core_attn) {
      it.add(ActivationModule::kCoreAttn, s.T * heads * vd * s.saved_in);
      it.add(ActivationModule::kCoreAttn, lse);
    }
    return;
  }
  const double d = static_cast<double>(m.head_dim()), kv = static_cast<double>(m.kv_heads()) / s.tp;
  const double q = s.T * heads * d * s.b, k = s.T * kv * d * s.b;
  if (m.qk_layernorm) {  // the norms keep their inputs (q and k before the norm) and statistics
    it.add(ActivationModule::kCoreAttn, q);
    it.add(ActivationModule::kCoreAttn, k);
    it.add(ActivationModule::kCoreAttn, s.T * (heads + kv) * stat);
  }
  if (s.cp > 1) {  // CP: the local queries and one local K/V, K and V of the whole sequence, the output
    it.add(ActivationModule::kCoreAttn, q);
    it.add(ActivationModule::kCoreAttn, k);
    it.add(ActivationModule::kCoreAttn, k * s.cp, 2);
    it.add(ActivationModule::kCoreAttn, s.T * heads * d * s.saved_in);
    it.add(ActivationModule::kCoreAttn, lse);
  } else {
    it.add(ActivationModule::kCoreAttn, q);
    it.add(ActivationModule::kCoreAttn, k, 2);
    if (!m.recompute.core_attn) {  // --recompute-modules core_attn drops the output and its lse
      it.add(ActivationModule::kCoreAttn, s.T * heads * d * s.saved_in);
      it.add(ActivationModule::kCoreAttn, lse);
    }
  }
}

// A MoE layer's saved tensors (router, dispatch, experts, shared experts) after its input norm.
void moe_items(const TrainArgs& a, const Shapes& s, bool dropped, Items& it) {
  const ModelConfig& m = a.model;
  const double E = static_cast<double>(m.moe.num_experts), k = static_cast<double>(m.moe.router.topk);
  // The router: its input in the router dtype, logits and scores [T, E], probabilities and ids [T, k].
  it.add(ActivationModule::kRouter, s.Tl * s.H * s.rb);
  it.add(ActivationModule::kRouter, s.Tl * E * 4, 2);
  it.add(ActivationModule::kRouter, s.Tl * k * 4, 2);
  it.add(ActivationModule::kRouter, E * 4);
  if (dropped) return;  // --recompute-modules moe: rebuilt in the backward
  it.add(ActivationModule::kMoeDispatch, s.rows * s.H * s.saved_in);
  it.add(ActivationModule::kMoeDispatch, s.rows * 4, 2);
  it.add(ActivationModule::kExpertFc1, s.rows * s.F * (s.swiglu ? 2 : 1) * s.b);
  if (!m.moe.recompute_act) it.add(ActivationModule::kMoeAct, s.rows * s.F * s.saved_in);
  const double shared = static_cast<double>(m.moe.shared_expert_size) / s.tp;
  if (shared > 0 && !m.recompute.shared_experts) {
    if (s.sp) it.add(ActivationModule::kSharedExperts, s.T * s.H * s.saved_in);
    it.add(ActivationModule::kSharedExperts, s.T * shared * (s.swiglu ? 2 : 1) * s.b);
    it.add(ActivationModule::kSharedExperts, s.T * shared * s.saved_in);
  }
}

// One decoder layer's saved tensors for one micro-batch (GPTModel::layer_forward).
Items layer_items(const TrainArgs& a, const Shapes& s, int64_t layer) {
  const ModelConfig& m = a.model;
  Items it;
  attention_items(a, s, it);
  it.add(ActivationModule::kResidual, s.Tl * s.H * s.b, 2);  // h + attention, h + MLP
  const double stat = s.rms ? 4 : 8;
  it.add(ActivationModule::kMlpNorm, s.Tl * stat);
  if (m.is_moe(layer)) {
    it.add(ActivationModule::kMlpNorm, s.Tl * s.H * s.b);  // the router and the dispatch read it
    moe_items(a, s, m.recompute.moe, it);
  } else if (!m.recompute.mlp) {
    const double f = static_cast<double>(m.ffn_hidden_size) / s.tp;
    if (s.sp) it.add(ActivationModule::kMlp, s.T * s.H * s.saved_in);
    else it.add(ActivationModule::kMlpNorm, s.Tl * s.H * s.saved_in);
    it.add(ActivationModule::kMlp, s.T * f * (s.swiglu ? 2 : 1) * s.b);
    it.add(ActivationModule::kMlp, s.T * f * s.saved_in);
  } else {
    it.add(ActivationModule::kMlpNorm, s.Tl * s.H * s.b);  // the MLP's input, kept for the rerun
  }
  return it;
}

// A layer under --recompute-granularity full: only the router's tensors stay.
Items full_recompute_items(const TrainArgs& a, const Shapes& s, int64_t layer) {
  Items it;
  if (a.model.is_moe(layer)) moe_items(a, s, true, it);
  return it;
}

// One multi-token-prediction depth (model/mtp.h) on the head stage, under "mtp" (its attention
// included: MtpLayer names no module inside), its MoE layer's parts under their own names: the
// depth's embeddings, [enorm | hnorm] and their statistics, eh_proj's output, the layer's norms,
// attention and residuals, its output (the next depth's input) and the final norm's statistics.
Items mtp_items(const TrainArgs& a, const Shapes& s) {
  const ModelConfig& m = a.model;
  Items inner, it;
  attention_items(a, s, inner);
  for (int t = 0; t < kNumMemoryTags; ++t) {
    const MemoryTag tag = static_cast<MemoryTag>(t);
    if (memory_tag_category(tag) != MemoryCategory::kActivations) continue;
    it.parts.by_tag[memory_tag(ActivationModule::kMtp)] += inner.parts.by_tag[tag];
  }
  it.parts.rounding += inner.parts.rounding;
  const double u = s.Tl * s.H * s.b, stat = s.rms ? 4 : 8;
  it.add(ActivationModule::kBatch, s.T * 4, 2);  // the depth's shifted tokens and labels
  it.add(ActivationModule::kMtp, u);             // its embeddings
  it.add(ActivationModule::kMtp, 2 * u);         // [enorm(emb) | hnorm(h)]
  it.add(ActivationModule::kMtp, u, 3);          // eh_proj's output, h + attention, the depth's output
  it.add(ActivationModule::kMtp, s.Tl * stat, 5);
  const int64_t last = m.num_layers - 1;
  if (m.is_moe(last)) {
    it.add(ActivationModule::kMtp, u);  // the MoE input (router and dispatch read it)
    moe_items(a, s, m.recompute.moe, it);
  } else {
    const double f = static_cast<double>(m.ffn_hidden_size) / s.tp;
    it.add(ActivationModule::kMtp, s.sp ? s.T * s.H * s.saved_in : u);
    it.add(ActivationModule::kMtp, s.T * f * (s.swiglu ? 2 : 1) * s.b);
    it.add(ActivationModule::kMtp, s.T * f * s.saved_in);
  }
  return it;
}

// --offload-modules (model/gpt_offload.cpp): the saved tensors of decoder layer `layer` that leave
// the device after its forward, under the tags they were charged to (a reloaded copy is charged to
// the same module again). The planner models mlp_norm (the norm's input, the residual h +
// attention, and its statistics), expert_fc1 (the dispatched rows) and moe_act (fc1's output and
// the rows' probabilities); plan_command refuses the other modules.
Items offloaded_items(const TrainArgs& a, const Shapes& s, const OffloadModules& mods, int64_t layer) {
  const ModelConfig& m = a.model;
  Items it;
  if (mods.has(OffloadModule::kMlpNorm)) {
    it.add(ActivationModule::kResidual, s.Tl * s.H * s.b);
    it.add(ActivationModule::kMlpNorm, s.Tl * (s.rms ? 4 : 8));
  }
  if (!m.is_moe(layer)) return it;
  if (mods.has(OffloadModule::kExpertFc1)) it.add(ActivationModule::kMoeDispatch, s.rows * s.H * s.saved_in);
  if (mods.has(OffloadModule::kMoeAct)) {
    it.add(ActivationModule::kExpertFc1, s.rows * s.F * (s.swiglu ? 2 : 1) * s.b);
    it.add(ActivationModule::kMoeDispatch, s.rows * 4);
  }
  return it;
}

// The chunk forwards alive at the first backward of pipeline rank `stage`, as chunk indices.
std::vector<int64_t> in_flight_chunks(const TrainArgs& a, int64_t stage) {
  const int64_t p = a.pp, v = a.virtual_stages();
  const int64_t m = a.num_microbatches() / a.data_parallel_size();
  std::vector<int64_t> chunks;
  if (p == 1) return {0};
  if (v == 1) {
    for (int64_t i = 0; i < std::min(p - stage, m); ++i) chunks.push_back(0);
    return chunks;
  }
  if (m % p != 0) {  // all forwards, then all backwards
    for (int64_t i = 0; i < m * v; ++i) chunks.push_back(i / m);
    return chunks;
  }
  const int64_t total = m * v, warmup = std::min(2 * (p - stage - 1) + (v - 1) * p, total);
  for (int64_t k = 0; k < std::min(warmup + 1, total); ++k) chunks.push_back((k / p) % v);
  return chunks;
}

}  // namespace

namespace {
// Where a parameter lives: its decoder layer (-1: none) and whether it is on the first / head stage.
struct Placement {
  int64_t layer = -1;
  bool embedding = false, head = false;
};
Placement placement_of(const std::string& name) {
  Placement p;
  const std::string layers = "decoder.layers.";
  if (name.rfind(layers, 0) == 0) p.layer = std::stoll(name.substr(layers.size()));
  else if (name.rfind("embedding.", 0) == 0) p.embedding = true;
  else p.head = true;  // output_layer, decoder.final_layernorm, mtp.*
  return p;
}
// The share of a parameter one rank holds: experts over EP x ETP; the dense matrices over TP
// (attention, MLPs, shared experts, vocabulary); norms, the router, position embeddings and the
// MTP's eh_proj whole.
double rank_share(const Param& p, const TrainArgs& a) {
  if (p.expert) return 1.0 / static_cast<double>(a.ep * a.etp);
  const std::string& n = p.name;
  const bool whole = p.shape.size() < 2 || n.find("layernorm") != std::string::npos ||
                     n.find(".router.") != std::string::npos || n.find("position_embeddings") != std::string::npos ||
                     n.find("eh_proj") != std::string::npos || n.find("norm") != std::string::npos;
  return whole ? 1.0 : 1.0 / static_cast<double>(a.tp);
}

// The whole model's trainable parameters as GPTModel registers them (one rank, shapes only),
// kept for the last model asked about (a --search plans one model in many layouts).
struct Registered {
  std::string name;
  double numel = 0;
  bool expert = false, whole = false;  // whole: not split over TP (rank_share)
};
std::string shape_key(const ModelConfig& m) {
  std::string k;
  for (int64_t v : {m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
                    m.kv_channels, m.vocab_size, m.max_position_embeddings, m.seq_length, m.mtp_num_layers,
                    m.moe.num_experts, m.moe.ffn_hidden_size, m.moe.shared_expert_size, m.mla.q_lora_rank,
                    m.mla.kv_lora_rank, m.mla.qk_head_dim, m.mla.qk_pos_emb_head_dim, m.mla.v_head_dim})
    k += std::to_string(v) + ",";
  for (bool v : {m.rmsnorm, m.mla.enabled, m.swiglu, m.add_bias_linear, m.add_qkv_bias, m.untie_embeddings,
                 m.qk_layernorm, m.moe.shared_expert_gate, m.moe.enable_expert_bias})
    k += v ? "1" : "0";
  k += m.position_embedding_type + ",";
  for (bool v : m.moe_layer) k += v ? "1" : "0";
  return k;
}
const std::vector<Registered>& registered_params(const ModelConfig& m) {
  static std::string key;
  static std::vector<Registered> list;
  const std::string now = shape_key(m);
  if (now == key) return list;
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 0);
  store.set_shapes_only(true);
  const GPTModel model(m, store);
  list.clear();
  for (const auto& p : store.all()) {
    if (!p->trainable) continue;
    TrainArgs one;  // TP 2: tells the split parameters from the whole ones
    one.tp = 2;
    list.push_back({p->name, static_cast<double>(shape_numel(p->full_shape())), p->expert,
                    !p->expert && rank_share(*p, one) == 1.0});
  }
  key = now;
  return list;
}
}  // namespace

RankParams rank_params(const TrainArgs& a, int64_t stage) {
  const ModelConfig& m = a.model;
  const std::vector<PipelineStage> chunks =
      stage_layers(m.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers, a.last_stage_layers, stage);
  bool first = false, head = false;
  for (const PipelineStage& c : chunks) {
    first = first || c.has_embedding;
    head = head || c.has_head;
  }
  RankParams r;
  for (const Registered& p : registered_params(m)) {
    const Placement at = placement_of(p.name);
    bool here = false;
    if (at.layer >= 0) {
      for (const PipelineStage& c : chunks) here = here || (at.layer >= c.first_layer && at.layer < c.end_layer);
    } else if (at.embedding) {
      // A head stage without the first stage's embedding keeps a copy (tied, or read by MTP).
      here = first || (head && m.head_stage_has_embedding() && p.name.find("word_embeddings") != std::string::npos);
    } else {
      here = head;
    }
    if (!here) continue;
    const double n = p.numel / (p.expert ? static_cast<double>(a.ep * a.etp) : p.whole ? 1.0 : static_cast<double>(a.tp));
    (p.expert ? r.expert : r.dense) += n;
    r.tensors.push_back(n);
    (p.expert ? r.expert_tensors : r.dense_tensors).push_back(n);
  }
  return r;
}

namespace {

// Weights, gradients and AdamW moments as ParamStore and the optimizer hold them during the step,
// and their peak while the store and the optimizer are set up.
struct StateBytes {
  Items steady;
  Items setup;  // at the set-up's peak
};

// --optimizer-cpu-offload (train/optimizer.cpp): the elements of rank 0's shard of one kind's
// gradient buffer (ParamStore::initialize: each parameter padded to 64 elements, the buffer to 64 x
// the shard count) that stay on the host: the first F of the shard, cut at the parameter end
// nearest to F (a tie: the later one).
struct OffloadSplit {
  double shard = 0, host = 0;
};
OffloadSplit offload_split(const std::vector<double>& tensors, double shards, double fraction) {
  constexpr double kAlign = 64;
  auto padded = [](double n, double unit) { return std::ceil(n / unit) * unit; };
  double total = 0;
  std::vector<std::pair<double, double>> pieces;  // each parameter's [offset, end)
  for (double n : tensors) {
    pieces.emplace_back(total, total + n);
    total += padded(n, kAlign);
  }
  OffloadSplit o;
  o.shard = padded(total, kAlign * shards) / shards;
  if (fraction >= 1.0) {
    o.host = o.shard;
    return o;
  }
  const double target = fraction * o.shard;
  double best = 0;
  for (const auto& [offset, end] : pieces) {
    if (offset >= o.shard) break;  // not in the shard
    const double b = std::min(end, o.shard);
    const double d = std::abs(b - target), db = std::abs(best - target);
    if (d < db || (d == db && b > best)) best = b;
  }
  o.host = best;
  return o;
}

StateBytes state_bytes(const TrainArgs& a, const RankParams& p, MemoryParts* host) {
  const bool rem = a.bf16 && !a.no_store_param_remainders;
  const double wc = a.bf16 ? 2 : 0;  // a bf16 compute copy beside the fp32 master
  const double ea = a.exp_avg_dtype == "bf16" ? 2 : 4, eas = a.exp_avg_sq_dtype == "bf16" ? 2 : 4, moments = ea + eas;
  const double dense_shard = a.use_distributed_optimizer ? static_cast<double>(a.data_parallel_size() * a.cp) : 1;
  const double expert_shard =
      a.use_distributed_optimizer ? static_cast<double>(a.world / (a.pp * a.ep * a.etp)) : 1;
  const bool offload = a.optimizer_cpu_offload;
  const bool sharded = a.use_distributed_optimizer || offload;  // flat moment shards
  const double fraction = a.optimizer_offload_fraction < 0 ? 1.0 : a.optimizer_offload_fraction;
  StateBytes s;
  for (const auto& [n, shard, tensors] : {std::tuple{p.dense, dense_shard, &p.dense_tensors},
                                          std::tuple{p.expert, expert_shard, &p.expert_tensors}}) {
    if (n <= 0) continue;
    // The device part of the shard: all of it, or with the CPU offload what the host does not keep.
    double on_device = n / shard, on_host = 0;
    if (offload) {
      const OffloadSplit split = offload_split(*tensors, shard, fraction);
      on_host = split.host;
      on_device = split.shard - split.host;
      host->by_tag[memory_tag(MemoryCategory::kOptimizerState)] += on_host * moments;
      host->by_tag[memory_tag(MemoryCategory::kGradients)] += on_host * 4;  // the downloaded gradients
      host->by_tag[memory_tag(MemoryCategory::kWeights)] += on_host * (4 + wc);  // masters (+ bf16 weights)
    }
    s.steady.add(MemoryCategory::kGradients, n * 4);  // the flat fp32 gradient buffer
    if (sharded) {  // two flat shards (the device part)
      s.steady.add(MemoryCategory::kOptimizerState, on_device * ea);
      s.steady.add(MemoryCategory::kOptimizerState, on_device * eas);
    } else {
      s.steady.add_unrounded(MemoryCategory::kOptimizerState, n * moments);  // per parameter
    }
    if (!a.bf16) {
      s.steady.add(MemoryCategory::kWeights, n * 4);  // the fp32 masters are the weights
    } else if (rem) {  // bf16 high halves (the weights) + int16 remainders (sharded: this rank's)
      s.steady.add(MemoryCategory::kWeights, n * 2);
      s.steady.add(MemoryCategory::kWeights, n * 2 / shard);
    } else {  // fp32 masters (sharded: this rank's device part) + bf16 weights
      s.steady.add(MemoryCategory::kWeights, sharded ? on_device * 4 : n * 4);
      s.steady.add(MemoryCategory::kWeights, n * 2);
    }
  }
  double moment_rounding = 0;  // the per-parameter moments, each rounded by the allocator
  for (double n : p.tensors)
    for (double bytes : {n * ea, n * eas})
      moment_rounding += static_cast<double>(CachingAllocator::round_size(static_cast<size_t>(std::ceil(bytes)))) - bytes;
  if (!sharded) s.steady.parts.rounding += moment_rounding;
  // ParamStore::add gives every parameter its own master, compute copy, gradient and moments;
  // initialize() then moves the dense, then the expert parameters into flat buffers (a gradient
  // buffer and the masters: fp32, or bf16 high halves + int16 remainders), freeing the
  // per-parameter ones as it goes; the distributed optimizer allocates its shards before it
  // frees the per-parameter moments.
  auto per_param = [&](Items& it, double n) {  // master, compute copy, gradient; moments elsewhere
    it.add_unrounded(MemoryCategory::kWeights, n * (4 + wc));
    it.add_unrounded(MemoryCategory::kGradients, n * 4);
  };
  auto flat = [&](Items& it, double n) {
    it.add(MemoryCategory::kGradients, n * 4);
    if (rem) {
      it.add(MemoryCategory::kWeights, n * 2, 2);
    } else {
      it.add(MemoryCategory::kWeights, n * 4);
    }
  };
  auto moments_all = [&](Items& it) {
    it.add_unrounded(MemoryCategory::kOptimizerState, p.total() * moments);
    it.parts.rounding += moment_rounding;
  };
  Items first, second;
  per_param(first, p.total());
  moments_all(first);
  flat(first, p.dense);
  flat(second, p.dense);
  if (a.bf16 && !rem) second.add_unrounded(MemoryCategory::kWeights, p.dense * 2);  // the bf16 copies stay
  moments_all(second);
  per_param(second, p.expert);
  flat(second, p.expert);
  s.setup = first.parts.total() > second.parts.total() ? first : second;
  if (sharded) {  // the shards are allocated before the per-parameter moments go
    Items shards = s.steady;
    shards.add_unrounded(MemoryCategory::kOptimizerState, p.total() * moments);
    if (shards.parts.total() > s.setup.parts.total()) s.setup = shards;
  }
  return s;
}

}  // namespace

std::vector<StageMemory> predict_memory(const TrainArgs& a, const PlanOptions& o) {
  const ModelConfig& m = a.model;
  const Shapes s = shapes_of(a, o);
  const bool full = a.recompute_granularity == "full";
  const OffloadModules mods = parse_offload_modules(a.model.offload_modules);
  std::vector<StageMemory> out;
  for (int64_t stage = 0; stage < a.pp; ++stage) {
    const std::vector<PipelineStage> chunks =
        stage_layers(m.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers, a.last_stage_layers, stage);
    const RankParams params = rank_params(a, stage);
    MemoryParts host;
    const StateBytes state = state_bytes(a, params, &host);
    // One micro-batch's saved tensors per chunk; with full recomputation only the routers' and
    // each recomputed group's input, plus, at the peak, the last group's rebuilt layers.
    std::vector<Items> per_chunk(chunks.size());
    Items rebuilt;  // the layers the first backward recomputes (full recomputation)
    for (size_t c = 0; c < chunks.size(); ++c) {
      const PipelineStage& st = chunks[c];
      Items& it = per_chunk[c];
      it.add(ActivationModule::kBatch, s.T * 4, 2);  // tokens and labels (i32)
      if (st.has_embedding) it.add(ActivationModule::kEmbedding, s.Tl * s.H * s.b);
      if (st.has_embedding && m.position_embedding_type == "learned_absolute")
        it.add(ActivationModule::kEmbedding, s.Tl * 4);  // the position ids
      const int64_t n = a.model.recompute.full_num_layers;
      for (int64_t i = st.first_layer; i < st.end_layer; ++i) {
        const int64_t offset = i - st.first_layer;
        const bool recomputed =
            full && (m.recompute.full_method == "uniform" || offset < n);
        const bool group_start = !full || m.recompute.full_method == "block" || offset % n == 0;
        if (!recomputed) {
          it.merge(layer_items(a, s, i));
          continue;
        }
        it.merge(full_recompute_items(a, s, i));
        if (group_start && i > st.first_layer) it.add(ActivationModule::kResidual, s.Tl * s.H * s.b);
        const bool last_group = m.recompute.full_method == "uniform" ? (st.end_layer - 1 - st.first_layer) / n == offset / n
                                                                     : i == std::min(st.end_layer, st.first_layer + n) - 1;
        if (c + 1 == chunks.size() && last_group) {
          rebuilt.merge(layer_items(a, s, i));
          rebuilt.merge(full_recompute_items(a, s, i), -1);
        }
      }
    }
    const std::vector<int64_t> flight = in_flight_chunks(a, stage);
    Items act;
    for (int64_t c : flight) act.merge(per_chunk[static_cast<size_t>(c)]);
    act.merge(rebuilt);
    // Activation offloading (model/activation_offload.h): every offloaded layer of the in-flight
    // forwards is on the host; at the first backward its last layer is back, and the next layer in
    // backward order is prefetched: the layer below, or with a one-layer chunk the same layer of
    // the oldest other micro-batch of that chunk. With asynchronous copies (a GPU) the last
    // offloaded layer's device tensors stay until the end of the forward.
    Items offload_host, offload_back, offload_last;
    if (mods.any()) {
      for (int64_t c : flight)
        for (int64_t i = chunks[static_cast<size_t>(c)].first_layer; i < chunks[static_cast<size_t>(c)].end_layer; ++i)
          offload_host.merge(offloaded_items(a, s, mods, i));
      const PipelineStage& lastc = chunks.back();
      offload_last = offloaded_items(a, s, mods, lastc.end_layer - 1);
      offload_back.merge(offload_last);
      const int64_t same_chunk = std::count(flight.begin(), flight.end(), static_cast<int64_t>(chunks.size()) - 1);
      if (lastc.end_layer - lastc.first_layer >= 2) offload_back.merge(offloaded_items(a, s, mods, lastc.end_layer - 2));
      else if (same_chunk >= 2) offload_back.merge(offload_last);
      act.merge(offload_host, -1);
    }
    act.merge(offload_back);
    const bool head = chunks.back().has_head;
    // The final norm's input is freed by the first backward (with MTP the first depth keeps it);
    // the MTP depths' tensors (model/mtp.h) on the head stage.
    if (head && m.mtp_num_layers == 0) act.add(ActivationModule::kResidual, s.Tl * s.H * s.b, -1);
    if (head && m.mtp_num_layers > 0) act.merge(mtp_items(a, s), static_cast<double>(m.mtp_num_layers));
    // The backward of the last layer's experts (or MLP): the incoming gradient, the rows'
    // gradients, the activation's and fc1's gradients; selective recomputation rebuilds here.
    const int64_t last_layer = chunks.back().end_layer - 1;
    Items ws;
    ws.add(MemoryCategory::kWorkspace, s.Tl * s.H * s.b, head && m.mtp_num_layers > 0 ? 2 : 1);
    if (m.is_moe(last_layer)) {
      ws.add(MemoryCategory::kWorkspace, s.rows * s.H * s.b, 2);
      ws.add(MemoryCategory::kWorkspace, s.rows * s.F * s.b);
      ws.add(MemoryCategory::kWorkspace, s.rows * s.F * (s.swiglu ? 2 : 1) * s.b);
      ws.add(MemoryCategory::kWorkspace, s.rows * 4);
      if (m.moe.recompute_act) ws.add(MemoryCategory::kWorkspace, s.rows * s.F * s.b);
      if (m.recompute.moe && !full) {  // --recompute-modules moe: the layer's parts rebuilt under their names
        Items again, router;
        moe_items(a, s, false, again);
        moe_items(a, s, true, router);
        again.merge(router, -1);
        act.merge(again);
      }
    } else {
      const double f = static_cast<double>(m.ffn_hidden_size) / s.tp;
      if (m.recompute.mlp && !full) {  // --recompute-modules mlp: the last MLP rebuilt under its name
        act.add(ActivationModule::kMlp, s.T * f * (s.swiglu ? 2 : 1) * s.b);
        act.add(ActivationModule::kMlp, s.T * f * s.saved_in);
      }
      ws.add(MemoryCategory::kWorkspace, s.T * f * s.b);
      ws.add(MemoryCategory::kWorkspace, s.T * f * (s.swiglu ? 2 : 1) * s.b);
      ws.add(MemoryCategory::kWorkspace, s.T * s.H * s.b);
    }
    if (m.recompute.core_attn && !full) {  // rebuilt in the backward of the last layer
      const double heads = static_cast<double>(m.num_attention_heads) / s.tp;
      ws.add(MemoryCategory::kWorkspace, s.T * heads * static_cast<double>(m.head_dim()) * s.b);
      ws.add(MemoryCategory::kWorkspace, s.T * heads * 4);
    }
    // Pipeline receive buffers (1F1B: one; interleaved: one per in-flight forward of a chunk
    // that receives its input, and on the last stage one per in-flight forward more).
    Items comm;
    if (a.pp > 1) {
      double buffers = 1;
      if (a.virtual_stages() > 1) {
        buffers = 0;
        for (int64_t c : flight) buffers += chunks[static_cast<size_t>(c)].has_embedding ? 0 : 1;
        buffers += stage == a.pp - 1 ? static_cast<double>(flight.size()) : 1;
      }
      comm.add(MemoryCategory::kCommunication, s.Tl * s.H * s.b, buffers);
    }
    StageMemory sm;
    sm.stage = stage;
    sm.in_flight = static_cast<int64_t>(flight.size());
    sm.state_params = params.total();
    sm.host = host;
    sm.host_offloaded = offload_host.parts.tagged();
    Items step = state.steady;
    step.merge(act);
    step.merge(ws);
    step.merge(comm);
    sm.parts = step.parts;
    sm.peak_at = "step";
    // --overlap-moe-expert-parallel-comm without pipeline stages (train/ep_overlap_schedule.h):
    // in the first pair, micro-batch m + 1 has run its embedding and first layer while m still holds
    // every layer (the later pairs free one of m's layers for each of m + 1's). Beside them: m + 1's
    // batch and embedding; its combine all-to-all in flight, the rows sent and received (kept until
    // the next phase); m's combine-gradient all-to-all, its rows sent and received, and the layer's
    // incoming gradient and its un-permuted copy. Checked against the memory report on CPU ranks
    // (tests/cli/plan_memory_matches.sh, "ep-overlap").
    if (o.ep_overlap && a.pp == 1 && !full) {
      const PipelineStage& st = chunks.front();
      Items pair = state.steady;
      pair.merge(act);
      pair.add(ActivationModule::kBatch, s.T * 4, 2);
      if (st.has_embedding) pair.add(ActivationModule::kEmbedding, s.Tl * s.H * s.b);
      pair.merge(layer_items(a, s, st.first_layer));
      pair.add(ActivationModule::kMoeCombine, s.rows * s.H * s.b, 2);
      pair.add(MemoryCategory::kWorkspace, s.rows * s.H * s.b, 2);
      pair.add(MemoryCategory::kWorkspace, s.Tl * s.H * s.b, 2);
      if (pair.parts.total() > sm.parts.total()) sm.parts = pair.parts;
    }
    if (head) {  // the end of the head stage's forward: the final norm and the fused output layer
      // (CPU: logits and their fp32 copy over this rank's vocabulary, the loss statistics; GPU:
      // one chunk of them)
      // beside every saved tensor, before the first backward frees any or allocates workspace.
      Items fwd = state.steady;
      fwd.merge(act);
      fwd.merge(rebuilt, -1);
      fwd.merge(offload_back, -1);  // before the first backward reloads any
      if (!o.offload_copies_synchronous) fwd.merge(offload_last);
      if (m.mtp_num_layers == 0) fwd.add(ActivationModule::kResidual, s.Tl * s.H * s.b);
      fwd.add(ActivationModule::kFinalNorm, s.Tl * s.H * s.b);
      fwd.add(ActivationModule::kFinalNorm, s.Tl * (s.rms ? 4 : 8));
      // The head reads every token of the TP group (SP gathers them); TP adds the gathered input
      // and the input gradient reduced over TP.
      const double vocab = static_cast<double>(m.vocab_size) / s.tp;
      if (o.gpu_head_chunks) {
        // GPTModel::head_forward_chunked: chunks of kFusedHeadChunkElements / (V / TP) rows, each
        // chunk's logits (their gradient written in place) and its input gradient; the whole
        // input gradient, the rows' losses, and the chunk's lse and loss gradient.
        const double c = std::min(s.T, std::max(1.0, std::floor(static_cast<double>(GPTModel::kFusedHeadChunkElements) / vocab)));
        fwd.add(ActivationModule::kOutputLayer, c * vocab * s.b);
        fwd.add(ActivationModule::kOutputLayer, c * s.H * s.b);
        fwd.add(ActivationModule::kOutputLayer, s.T * s.H * s.b);
        fwd.add(ActivationModule::kOutputLayer, s.T * 4);
        fwd.add(ActivationModule::kOutputLayer, c * 4, 2);
      } else {
        fwd.add(ActivationModule::kOutputLayer, s.T * vocab * 4, 2);
        fwd.add(ActivationModule::kOutputLayer, s.T * 4, a.tp > 1 ? 2 : 3);
      }
      if (a.tp > 1) fwd.add(ActivationModule::kOutputLayer, s.T * s.H * s.b);
      if (s.sp) fwd.add(ActivationModule::kOutputLayer, s.T * s.H * s.b);
      fwd.merge(comm);
      if (fwd.parts.total() > sm.parts.total()) sm.parts = fwd.parts;
    }
    if (o.whole_run_peak && state.setup.parts.total() > sm.parts.total()) {
      sm.parts = state.setup.parts;
      sm.peak_at = "setup";
    }
    out.push_back(sm);
  }
  return out;
}

}  // namespace moecore::plan
