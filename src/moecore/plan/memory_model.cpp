#include "moecore/plan/memory_model.h"

#include <algorithm>
#include <cmath>

#include "moecore/core/allocator.h"
#include "moecore/model/param_count.h"
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

// Each layer's parameters from the model's own registration (model/param_count.h).
struct LayerParams {
  double attention = 0, norms = 0, router = 0, experts = 0, shared = 0, dense_mlp = 0;
  double embedding = 0, output = 0, final_norm = 0, mtp = 0;
};

LayerParams layer_params(const ModelConfig& cfg) {
  const ParamCount c = count_parameters(cfg);
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) moe_layers += cfg.is_moe(i) ? 1 : 0;
  const double layers = static_cast<double>(cfg.num_layers), moe = static_cast<double>(std::max<int64_t>(1, moe_layers)),
               dense = static_cast<double>(std::max<int64_t>(1, cfg.num_layers - moe_layers));
  LayerParams p;
  p.final_norm = static_cast<double>(cfg.hidden_size * (cfg.rmsnorm ? 1 : 2));
  p.attention = static_cast<double>(c.part("attention")) / layers;
  p.norms = (static_cast<double>(c.part("norms")) - p.final_norm) / layers;
  p.router = static_cast<double>(c.part("router")) / moe;
  p.experts = static_cast<double>(c.part("routed_experts")) / moe;
  p.shared = static_cast<double>(c.part("shared_experts")) / moe;
  p.dense_mlp = static_cast<double>(c.part("dense_mlp")) / dense;
  p.embedding = static_cast<double>(c.part("embedding"));
  p.output = static_cast<double>(c.part("output_layer"));
  p.mtp = static_cast<double>(c.part("mtp"));
  return p;
}

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
    it.add(ActivationModule::kCoreAttn, s.T * heads * qd * s.b, 2);
    it.add(ActivationModule::kCoreAttn, s.T * heads * vd * s.b);
    if (!m.recompute.core_attn) {
      it.add(ActivationModule::kCoreAttn, s.T * heads * vd * s.saved_in);
      it.add(ActivationModule::kCoreAttn, lse);
    }
    return;
  }
  const double d = static_cast<double>(m.head_dim()), kv = static_cast<double>(m.kv_heads()) / s.tp;
  const double q = s.T * heads * d * s.b, k = s.T * kv * d * s.b;
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

RankParams rank_params(const TrainArgs& a, int64_t stage) {
  const ModelConfig& m = a.model;
  const LayerParams lp = layer_params(m);
  const double tp = static_cast<double>(a.tp), experts_split = static_cast<double>(a.ep * a.etp);
  RankParams r;
  for (const PipelineStage& c : stage_layers(m.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers,
                                              a.last_stage_layers, stage)) {
    for (int64_t i = c.first_layer; i < c.end_layer; ++i) {
      r.dense += lp.attention / tp + lp.norms;
      if (m.is_moe(i)) {
        r.dense += lp.router + lp.shared / tp;
        r.expert += lp.experts / experts_split;
      } else {
        r.dense += lp.dense_mlp / tp;
      }
    }
    if (c.has_embedding) r.dense += lp.embedding / tp;
    if (c.has_head) {
      r.dense += lp.final_norm + lp.mtp / tp;
      r.dense += m.untie_embeddings ? lp.output / tp : (c.has_embedding ? 0 : lp.embedding / tp);
    }
  }
  return r;
}

namespace {

// Weights, gradients and AdamW moments as ParamStore and the optimizer hold them during the step,
// and their peak while the store and the optimizer are set up.
struct StateBytes {
  Items steady;
  double setup_peak = 0;
};

StateBytes state_bytes(const TrainArgs& a, const RankParams& p) {
  const bool rem = a.bf16 && !a.no_store_param_remainders;
  const double wc = a.bf16 ? 2 : 0;  // a bf16 compute copy beside the fp32 master
  const double ea = a.exp_avg_dtype == "bf16" ? 2 : 4, eas = a.exp_avg_sq_dtype == "bf16" ? 2 : 4, moments = ea + eas;
  const double dense_shard = a.use_distributed_optimizer ? static_cast<double>(a.data_parallel_size() * a.cp) : 1;
  const double expert_shard =
      a.use_distributed_optimizer ? static_cast<double>(a.world / (a.pp * a.ep * a.etp)) : 1;
  StateBytes s;
  for (const auto& [n, shard] : {std::pair{p.dense, dense_shard}, std::pair{p.expert, expert_shard}}) {
    if (n <= 0) continue;
    s.steady.add(MemoryCategory::kGradients, n * 4);  // the flat fp32 gradient buffer
    if (a.use_distributed_optimizer) {  // two flat shards
      s.steady.add(MemoryCategory::kOptimizerState, n * ea / shard);
      s.steady.add(MemoryCategory::kOptimizerState, n * eas / shard);
    } else {
      s.steady.add_unrounded(MemoryCategory::kOptimizerState, n * moments);  // per parameter
    }
    if (!a.bf16) {
      s.steady.add(MemoryCategory::kWeights, n * 4);  // the fp32 masters are the weights
    } else if (rem) {  // bf16 high halves (the weights) + int16 remainders (sharded: this rank's)
      s.steady.add(MemoryCategory::kWeights, n * 2);
      s.steady.add(MemoryCategory::kWeights, n * 2 / shard);
    } else {  // fp32 masters (sharded: this rank's) + bf16 weights
      s.steady.add(MemoryCategory::kWeights, n * 4 / shard);
      s.steady.add(MemoryCategory::kWeights, n * 2);
    }
  }
  // ParamStore::add gives every parameter its own master, compute copy, gradient and moments;
  // initialize() then moves the dense, then the expert parameters into flat buffers (gradients
  // and masters, 8 bytes each), freeing the per-parameter ones as it goes; the distributed
  // optimizer allocates its shards before it frees the per-parameter moments.
  const double per_param = 4 + wc + 4 + moments, flat = 8;
  const double after_flat = 4 + (a.bf16 && !rem ? 6 : 4) + moments;
  const double first = p.total() * per_param + p.dense * flat;
  const double second = p.dense * after_flat + p.expert * (per_param + flat);
  const double shards = p.total() * after_flat + p.dense * moments / dense_shard + p.expert * moments / expert_shard;
  s.setup_peak = std::max({first, second, a.use_distributed_optimizer ? shards : 0.0});
  return s;
}

}  // namespace

std::vector<StageMemory> predict_memory(const TrainArgs& a, const PlanOptions& o) {
  const ModelConfig& m = a.model;
  const Shapes s = shapes_of(a, o);
  const bool full = a.recompute_granularity == "full";
  std::vector<StageMemory> out;
  for (int64_t stage = 0; stage < a.pp; ++stage) {
    const std::vector<PipelineStage> chunks =
        stage_layers(m.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers, a.last_stage_layers, stage);
    const RankParams params = rank_params(a, stage);
    const StateBytes state = state_bytes(a, params);
    // One micro-batch's saved tensors per chunk; with full recomputation only the routers' and
    // each recomputed group's input, plus, at the peak, the last group's rebuilt layers.
    std::vector<Items> per_chunk(chunks.size());
    Items rebuilt;  // the layers the first backward recomputes (full recomputation)
    for (size_t c = 0; c < chunks.size(); ++c) {
      const PipelineStage& st = chunks[c];
      Items& it = per_chunk[c];
      it.add(ActivationModule::kBatch, s.T * 4, 2);  // tokens and labels (i32)
      if (st.has_embedding) it.add(ActivationModule::kEmbedding, s.Tl * s.H * s.b);
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
    const bool head = chunks.back().has_head;
    if (head) act.add(ActivationModule::kResidual, s.Tl * s.H * s.b, -1);  // the final norm's input, freed
    // The backward of the last layer's experts (or MLP): the incoming gradient, the rows'
    // gradients, the activation's and fc1's gradients; selective recomputation rebuilds here.
    const int64_t last_layer = chunks.back().end_layer - 1;
    Items ws;
    ws.add(MemoryCategory::kWorkspace, s.Tl * s.H * s.b);
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
    Items step = state.steady;
    step.merge(act);
    step.merge(ws);
    step.merge(comm);
    sm.parts = step.parts;
    sm.peak_at = "step";
    if (o.whole_run_peak && state.setup_peak > step.parts.total()) {
      Items setup;
      setup.add(MemoryCategory::kWeights, state.setup_peak);  // the set-up's parts: not split further
      sm.parts = setup.parts;
      sm.parts.rounding = 0;
      sm.peak_at = "setup";
    }
    out.push_back(sm);
  }
  return out;
}

}  // namespace moecore::plan
