#include "moecore/moe/router.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "moecore/core/env_switches.h"
#include "moecore/core/philox.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/moe_loss.h"
#include "moecore/ops/random.h"
#include "moecore/ops/router.h"

namespace moecore {

namespace {
using ops::cast_to;

// The router's fp32 GEMMs on bf16 tensor cores (CUDA, bf16 input, no jitter). The bf16 input is
// exact in fp32, and an fp32 operand v is the sum of three bf16 parts (ops::bf16_parts: hi, mid,
// lo; 8 + 8 + 8 mantissa bits, all of fp32's 24), so every product is exact and only the fp32
// accumulation rounds, as in the fp32 GEMM. The input gradient, rounded to bf16 anyway, takes the
// three largest of the products (hi hi, hi mid, mid hi: relative error ~2^-16) and is added to dx
// in the same GEMM. MOECORE_ROUTER_GEMM=fp32 keeps the fp32 GEMMs (cuBLAS, no TF32), as do
// batches of fewer than kSplitRouterMinTokens tokens.
bool split_router_gemm_enabled() {
  const char* env = env_switch("MOECORE_ROUTER_GEMM");
  const std::string v = env ? env : "";
  MC_CHECK(v.empty() || v == "bf16x3" || v == "fp32", "MOECORE_ROUTER_GEMM='", v,
           "': expected bf16x3 (the default: three bf16 parts per fp32 operand) or fp32");
  return v != "fp32";
}

// Below this many tokens (decoding: one per sequence) the three bf16 GEMMs and the weight's
// split into parts take longer than the input's cast and one fp32 GEMM, which the router uses
// there instead.
constexpr int64_t kSplitRouterMinTokens = 64;

bool uses_aux_loss(const MoeConfig& m) {
  return m.aux_loss_coeff > 0 && (m.load_balancing == LoadBalancing::AuxLoss ||
                                  m.load_balancing == LoadBalancing::SeqAuxLoss ||
                                  m.load_balancing == LoadBalancing::GlobalAuxLoss);
}
}  // namespace

TopKRouter::TopKRouter(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par)
    : moe_(cfg.moe), hidden_(cfg.hidden_size), prefix_(prefix), par_(par) {
  router_dtype_ = (store.master_dtype() == DType::F64 || moe_.router_fp64) ? DType::F64 : DType::F32;
  const int64_t e = moe_.num_experts, h = cfg.hidden_size;
  gate_weight_ = &store.add(prefix + ".router.weight", {e, h}, Init::Normal, cfg.init_method_std, true, router_dtype_, false);
  if (moe_.enable_expert_bias) expert_bias_ = &store.add_buffer(prefix + ".router.expert_bias", {e});
  // Sequence parallelism: the router sees this rank's tokens only.
  if (par.dense.sp()) gate_weight_->tp_partial_grad = true;
  token_ranks_ = par.token_group ? par.token_group->size() : 1;
}
Tensor TopKRouter::logits(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx) const {
  const int64_t tokens = x.size(0), e = moe_.num_experts;
  const bool jitter = training && moe_.input_jitter_eps > 0;
  Tensor logits = Tensor::empty({tokens, e}, router_dtype_, x.device());
  if (x.device().is_cuda() && x.dtype() == DType::BF16 && router_dtype_ == DType::F32 && !jitter &&
      tokens >= kSplitRouterMinTokens && split_router_gemm_enabled()) {
    // fp32 logits from bf16 GEMMs (ops::bf16_parts), the smallest part first.
    const std::vector<Tensor> w = ops::bf16_parts(gate_weight_->weight, 3);
    ops::gemm(x, w[2], logits, false, true);
    ops::gemm(x, w[1], logits, false, true, 1.0f, 1.0f);
    ops::gemm(x, w[0], logits, false, true, 1.0f, 1.0f);
    ctx.router_in = x;  // bf16: the backward takes the same path
  } else {
    Tensor router_in = x.dtype() == router_dtype_ ? x.clone() : cast_to(x, router_dtype_);
    if (jitter) {
      ctx.jitter = Tensor::empty(router_in.shape(), router_dtype_, x.device());
      fill_jitter(ctx.jitter, batch, rng_seed);
      ops::mul(router_in, ctx.jitter, router_in);
    }
    ops::gemm(router_in, gate_weight_->weight, logits, false, true);
    ctx.router_in = router_in;
  }
  if (moe_.force_load_balancing) {
    // Round-robin: token t ranks experts (t*k + j) mod E first for j = 0, 1, ...: every expert
    // receives exactly T*k/E tokens when E divides T*k, and the balancing loss is exactly 1.
    // Built on the host once per token count and kept on the device: rebuilding and uploading
    // them every forward made the host wait for the stream in every MoE layer.
    if (!forced_logits_.defined() || forced_logits_.size(0) != tokens || forced_logits_.device() != x.device()) {
      std::vector<double> forced(static_cast<size_t>(tokens * e));
      const int64_t k = moe_.router.topk;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t j = 0; j < e; ++j) forced[static_cast<size_t>(t * e + j)] = -static_cast<double>(((j - t * k) % e + e) % e);
      forced_logits_ = cast_to(Tensor::from_vector(forced, {tokens, e}), router_dtype_).to(x.device());
    }
    logits = forced_logits_.clone();  // the callers may write into the logits
    ctx.forced = true;
  }
  return logits;
}

// Philox by global element index of the whole micro-batch [B, S, H] (token b, position p ->
// elements (b S + p) H ...), so every TP / CP layout draws the single-rank values: one fill per
// run of consecutive positions of one sequence (at most two per sequence under CP).
void TopKRouter::fill_jitter(Tensor& jitter, int64_t batch, uint64_t rng_seed) const {
  const uint64_t key = rng_key(prefix_ + ".input_jitter");
  const double lo = 1.0 - moe_.input_jitter_eps, hi = 1.0 + moe_.input_jitter_eps;
  const int64_t tokens = jitter.size(0), h = jitter.size(1);
  if (!par_.dense.sp() && !par_.dense.cp) {
    ops::fill_uniform(jitter, rng_seed, key, lo, hi);
    return;
  }
  const int64_t local = tokens / batch, cp_seq = par_.dense.sp() ? local * par_.dense.tp_size() : local;
  const int64_t seq = cp_seq * par_.dense.cp_size();
  const std::vector<int32_t> pos = par_.dense.token_positions(batch, cp_seq);
  for (int64_t t = 0; t < tokens;) {
    int64_t end = t + 1;
    while (end < tokens && end / local == t / local && pos[static_cast<size_t>(end)] == pos[static_cast<size_t>(end - 1)] + 1)
      ++end;
    Tensor run = jitter.slice(0, t, end);
    ops::fill_uniform(run, rng_seed, key, lo, hi, ((t / local) * seq + pos[static_cast<size_t>(t)]) * h);
    t = end;
  }
}

Tensor TopKRouter::balancing_counts(const Tensor& aux_scores, int64_t batch, bool training) {
  const int64_t e = moe_.num_experts, k = moe_.router.topk;
  const DType cdt = DType::F32;  // token counts are integers (averages for global_aux_loss): exact in f32
  const int64_t groups = moe_.load_balancing == LoadBalancing::SeqAuxLoss ? batch : 1;
  Tensor counts = Tensor::empty({groups, e}, cdt, aux_scores.device());
  // aux_scores: the scores [T, E], or (i32) their top-k indices [T, k] from router_topk_aux_forward.
  if (aux_scores.dtype() == DType::I32) {
    ops::topk_counts_from_indices(aux_scores, groups, counts);
  } else {
    ops::topk_counts(aux_scores, k, groups, counts);
  }
  // Counts of every part of the sequences (TP x CP); the loss op's token count is this rank's,
  // N times too small, so the counts carry 1 / N^2: the op then gives this rank's share of the
  // whole-sequence loss (L = coeff E / (k T^2) sum_e P_e c_e with T = N T_local).
  if (par_.token_group) {
    par_.token_group->all_reduce(counts, comm::ReduceOp::Sum);
    ops::axpby(1.0f / static_cast<float>(token_ranks_ * token_ranks_), counts, 0.0f, counts, counts);
  }
  if (moe_.load_balancing != LoadBalancing::GlobalAuxLoss || !training) return counts;
  // Megatron sums the counts over TP x DP x CP and divides the loss by the global token count;
  // averaging the counts over the group and keeping the local count is the same loss.
  if (par_.aux_group) par_.aux_group->all_reduce(counts, comm::ReduceOp::Avg);
  // global_aux_loss: counts averaged over the micro-batches of this step so far.
  if (!global_counts_.defined() || global_micro_ == 0) {
    global_counts_ = Tensor::zeros({1, e}, cdt, aux_scores.device());
  }
  ops::add(global_counts_, counts, global_counts_);
  ++global_micro_;
  Tensor averaged = Tensor::empty({1, e}, cdt, aux_scores.device());
  ops::axpby(1.0f / static_cast<float>(global_micro_), global_counts_, 0.0f, global_counts_, averaged);
  return averaged;
}

TopKRouter::Routing TopKRouter::forward(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed,
                                        MoeStats& stats, Ctx& ctx) {
  const int64_t tokens = x.size(0), e = moe_.num_experts, k = moe_.router.topk;
  const Device dev = x.device();
  ctx.logits = logits(x, batch, training, rng_seed, ctx);

  Tensor bias;
  if (expert_bias_) bias = cast_to(expert_bias_->master, router_dtype_);
  ctx.probs = Tensor::empty({tokens, k}, router_dtype_, dev);
  ctx.indices = Tensor::empty({tokens, k}, DType::I32, dev);
  ops::RouterConfig router = moe_.router;
  if (router.sinkhorn && !training) {
    // Megatron's sinkhorn router outside training: a plain top-k of the activation, softmax over
    // all experts (k > 1, not renormalised: the pre-softmax path) or the sigmoid (k = 1).
    router.sinkhorn = false;
    if (router.topk > 1) {
      router.pre_softmax = true;
    } else {
      router.score = ops::RouterScore::Sigmoid;
    }
  }
  // Training with a balancing loss: the selection, the aux scores and their top-k in one pass
  // (router_topk_aux_forward) unless the sinkhorn router selects.
  const bool aux = training && uses_aux_loss(moe_);
  Tensor aux_topk;
  if (aux && !router.sinkhorn) {
    ctx.aux_scores = Tensor::empty({tokens, e}, router_dtype_, dev);
    aux_topk = Tensor::empty({tokens, k}, DType::I32, dev);
    ops::router_topk_aux_forward(ctx.logits, bias, router, ctx.probs, ctx.indices, ctx.aux_scores, aux_topk);
  } else {
    ops::router_topk_forward(ctx.logits, bias, router, ctx.probs, ctx.indices);
  }

  if (training) {
    if (aux) {
      if (!ctx.aux_scores.defined()) {
        ctx.aux_scores = Tensor::empty({tokens, e}, router_dtype_, dev);
        ops::aux_scores_forward(ctx.logits, moe_.router.score, ctx.aux_scores);
      }
      ctx.aux_counts = balancing_counts(aux_topk.defined() ? aux_topk : ctx.aux_scores, batch, training);
      Tensor loss = Tensor::empty({1}, router_dtype_, dev);
      ops::switch_aux_loss_forward(ctx.aux_scores, ctx.aux_counts, k, moe_.aux_loss_coeff, loss);
      stats.add_aux_loss(loss);
    }
    if (moe_.z_loss_coeff > 0) {
      Tensor loss = Tensor::empty({1}, router_dtype_, dev);
      ops::z_loss_forward(ctx.logits, z_loss_coeff(), loss);
      stats.add_z_loss(loss);
    }
  }

  Routing out{ctx.probs, ctx.indices, Tensor(), 0};
  if (moe_.capacity_factor > 0) {
    const int64_t capacity = ops::expert_capacity(tokens, k, e, moe_.capacity_factor);
    out.kept = Tensor::empty({tokens, k}, DType::U8, dev);
    ops::capacity_mask(ctx.indices, ctx.probs, e, capacity, moe_.drop_policy, out.kept);
    if (moe_.pad_to_capacity) out.pad = capacity;
  }
  return out;
}

// The probabilities, balancing losses, then the gate GEMM.
void TopKRouter::backward(const Tensor& dprobs, double loss_grad_scale, Ctx& ctx, Tensor& dx) {
  if (ctx.forced) return;
  const Device dev = dx.device();
  const int64_t tokens = dx.size(0), e = moe_.num_experts, k = moe_.router.topk;
  Tensor dlogits = Tensor::empty({tokens, e}, router_dtype_, dev);
  ops::router_topk_backward(ctx.logits, ctx.indices, cast_to(dprobs, router_dtype_), moe_.router, dlogits);
  if (ctx.aux_scores.defined()) {
    Tensor daux = Tensor::empty({tokens, e}, router_dtype_, dev);
    ops::switch_aux_loss_backward(ctx.aux_counts, k, moe_.aux_loss_coeff, loss_grad_scale, tokens, daux);
    ops::aux_scores_backward(ctx.logits, moe_.router.score, daux, dlogits);
  }
  if (moe_.z_loss_coeff > 0) ops::z_loss_backward(ctx.logits, z_loss_coeff(), loss_grad_scale, dlogits);
  if (ctx.router_in.dtype() != router_dtype_) {  // logits()' bf16 GEMMs: the same here
    const std::vector<Tensor> d = ops::bf16_parts(dlogits, 3);
    Tensor& dw = gate_weight_->grad;
    ops::gemm(d[2], ctx.router_in, dw, true, false, 1.0f, gate_weight_->grad_beta());
    ops::gemm(d[1], ctx.router_in, dw, true, false, 1.0f, 1.0f);
    ops::gemm(d[0], ctx.router_in, dw, true, false, 1.0f, 1.0f);
    // The input gradient straight into dx (bf16, beta 1: one rounding): one GEMM over K = 3E,
    // [d_mid | d_hi | d_hi] [w_hi; w_mid; w_hi] (three GEMMs into an fp32 buffer would read and
    // write [tokens, hidden] fp32 three times).
    const std::vector<Tensor> w = ops::bf16_parts(gate_weight_->weight, 2);
    Tensor a = Tensor::empty({tokens, 3 * e}, DType::BF16, dev), b = Tensor::empty({3 * e, hidden_}, DType::BF16, dev);
    const Tensor* a_parts[3] = {&d[1], &d[0], &d[0]};
    const Tensor* b_parts[3] = {&w[0], &w[1], &w[0]};
    for (int64_t i = 0; i < 3; ++i) {
      a.slice(1, i * e, (i + 1) * e).copy_from(*a_parts[i]);
      b.slice(0, i * e, (i + 1) * e).copy_from(*b_parts[i]);
    }
    if (dx.dtype() == DType::BF16) {
      ops::gemm(a, b, dx, false, false, 1.0f, 1.0f);
    } else {
      Tensor d_router_in = Tensor::empty({tokens, hidden_}, DType::F32, dev);
      ops::gemm(a, b, d_router_in, false, false);
      add_into(dx, cast_to(d_router_in, dx.dtype()));
    }
  } else {
    if (gate_weight_->grad.dtype() == router_dtype_) {
      ops::gemm(dlogits, ctx.router_in, gate_weight_->grad, true, false, 1.0f, gate_weight_->grad_beta());
    } else {  // fp64 router with fp32 master weights
      Tensor dw = Tensor::empty(gate_weight_->shape, router_dtype_, dev);
      ops::gemm(dlogits, ctx.router_in, dw, true, false);
      add_into(gate_weight_->grad_to_accumulate(), cast_to(dw, gate_weight_->grad.dtype()));
    }
    Tensor d_router_in = Tensor::empty({tokens, hidden_}, router_dtype_, dev);
    ops::gemm(dlogits, gate_weight_->weight, d_router_in, false, false);
    if (ctx.jitter.defined()) ops::mul(d_router_in, ctx.jitter, d_router_in);
    add_into(dx, cast_to(d_router_in, dx.dtype()));
  }
}

}  // namespace moecore
