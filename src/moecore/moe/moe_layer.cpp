#include "moecore/moe/moe_layer.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "moecore/core/philox.h"
#include "moecore/core/step_timers.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/moe_loss.h"
#include "moecore/ops/random.h"
#include "moecore/ops/router.h"
#include "moecore/ops/swiglu.h"

namespace moecore {

namespace {
using ops::cast_to;

double read_scalar(const Tensor& t) {
  const Tensor host = cast_to(t, t.dtype() == DType::F64 ? DType::F64 : DType::F32).to(Device::cpu());
  return host.dtype() == DType::F64 ? host.data<double>()[0] : host.data<float>()[0];
}

// The router's fp32 GEMMs on bf16 tensor cores (CUDA, bf16 input, no jitter). The bf16 input is
// exact in fp32, and an fp32 operand v is the sum of three bf16 parts (ops::bf16_parts: hi, mid,
// lo; 8 + 8 + 8 mantissa bits, all of fp32's 24), so every product is exact and only the fp32
// accumulation rounds, as in the fp32 GEMM. The input gradient, rounded to bf16 anyway, takes the
// three largest of the products (hi hi, hi mid, mid hi: relative error ~2^-16) and is added to dx
// in the same GEMM. MOECORE_ROUTER_GEMM=fp32 keeps the fp32 GEMMs (cuBLAS, no TF32).
bool split_router_gemm_enabled() {
  const char* env = std::getenv("MOECORE_ROUTER_GEMM");
  const std::string v = env ? env : "";
  MC_CHECK(v.empty() || v == "bf16x3" || v == "fp32", "MOECORE_ROUTER_GEMM='", v,
           "': expected bf16x3 (the default: three bf16 parts per fp32 operand) or fp32");
  return v != "fp32";
}

bool uses_aux_loss(const MoeConfig& m) {
  return m.aux_loss_coeff > 0 && (m.load_balancing == LoadBalancing::AuxLoss ||
                                  m.load_balancing == LoadBalancing::SeqAuxLoss ||
                                  m.load_balancing == LoadBalancing::GlobalAuxLoss);
}
}  // namespace

MoeLayer::MoeLayer(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par)
    : moe_(cfg.moe), hidden_(cfg.hidden_size), swiglu_(cfg.swiglu), prefix_(prefix), par_(par),
      dispatcher_(par.ep, par.dispatcher, cfg.moe.num_experts, par.etp, par.tp_ep) {
  MC_CHECK(!cfg.add_bias_linear, "MoE experts have no biases yet: add --disable-bias-linear to use --num-experts");
  router_dtype_ = (store.master_dtype() == DType::F64 || moe_.router_fp64) ? DType::F64 : DType::F32;
  const int64_t e = moe_.num_experts, h = cfg.hidden_size, f = moe_.ffn_hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  gate_weight_ = &store.add(prefix + ".router.weight", {e, h}, Init::Normal, std, true, router_dtype_, false);
  if (moe_.enable_expert_bias) expert_bias_ = &store.add_buffer(prefix + ".router.expert_bias", {e});
  // This rank's experts: rows [first, first + L) of the [E, ...] expert weights.
  // With ETP, part r of each expert's FFN: fc1 rows (per GLU half), fc2 columns.
  const int64_t local = dispatcher_.local_experts(), first = dispatcher_.first_expert();
  const int64_t etp = par.etp ? par.etp->size() : 1, etp_rank = par.etp ? par.etp->rank() : 0;
  MC_CHECK(f % etp == 0, "--moe-ffn-hidden-size ", f, " is not divisible by --expert-tensor-parallel-size ", etp);
  const int64_t fl = f / etp;
  fc1_ = &store.add_expert(prefix + ".experts.linear_fc1.weight", {local, swiglu_ ? 2 * fl : fl, h}, e, first, std, etp,
                           etp_rank, 1, swiglu_);
  fc2_ = &store.add_expert(prefix + ".experts.linear_fc2.weight", {local, h, fl}, e, first, out_std, etp, etp_rank, 2);
  if (moe_.shared_expert_size > 0) {
    shared_ = Mlp(store, prefix + ".shared_experts", h, moe_.shared_expert_size, swiglu_, false, std, out_std, par.dense);
    if (moe_.shared_expert_gate) shared_gate_ = Linear(store, prefix + ".shared_experts.gate", h, 1, false, std);
  }
  // Sequence parallelism: the router (and the shared-expert gate) see this rank's tokens only.
  if (par.dense.sp()) {
    gate_weight_->tp_partial_grad = true;
    if (shared_gate_.weight) shared_gate_.weight->tp_partial_grad = true;
  }
  token_ranks_ = par.token_group ? par.token_group->size() : 1;
  stats_.tokens_per_expert.assign(static_cast<size_t>(e), 0.0);
}

Tensor MoeLayer::router_logits(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx) const {
  const int64_t tokens = x.size(0), e = moe_.num_experts;
  const bool jitter = training && moe_.input_jitter_eps > 0;
  Tensor logits = Tensor::empty({tokens, e}, router_dtype_, x.device());
  if (x.device().is_cuda() && x.dtype() == DType::BF16 && router_dtype_ == DType::F32 && !jitter &&
      split_router_gemm_enabled()) {
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
    std::vector<double> forced(static_cast<size_t>(tokens * e));
    const int64_t k = moe_.router.topk;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < e; ++j) forced[static_cast<size_t>(t * e + j)] = -static_cast<double>(((j - t * k) % e + e) % e);
    logits = cast_to(Tensor::from_vector(forced, {tokens, e}), router_dtype_).to(x.device());
    ctx.forced = true;
  }
  return logits;
}

// Philox by global element index of the whole micro-batch [B, S, H] (token b, position p ->
// elements (b S + p) H ...), so every TP / CP layout draws the single-rank values: one fill per
// run of consecutive positions of one sequence (at most two per sequence under CP).
void MoeLayer::fill_jitter(Tensor& jitter, int64_t batch, uint64_t rng_seed) const {
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

Tensor MoeLayer::balancing_counts(const Tensor& aux_scores, int64_t batch, bool training) {
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

Tensor MoeLayer::forward(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx) {
  const int64_t tokens = x.size(0), e = moe_.num_experts, k = moe_.router.topk;
  const Device dev = x.device();
  // --timing-log-level 2: the layer's phases, one after the other.
  std::optional<TimedRegion> phase(std::in_place, "moe-router", 2, dev);
  ctx.x = x;
  ctx.logits = router_logits(x, batch, training, rng_seed, ctx);

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
      accumulate_loss(aux_acc_, loss);
    }
    if (moe_.z_loss_coeff > 0) {
      Tensor loss = Tensor::empty({1}, router_dtype_, dev);
      ops::z_loss_forward(ctx.logits, z_loss_coeff(), loss);
      accumulate_loss(z_acc_, loss);
    }
  }

  Tensor kept;
  int64_t pad = 0;
  if (moe_.capacity_factor > 0) {
    const int64_t capacity = ops::expert_capacity(tokens, k, e, moe_.capacity_factor);
    kept = Tensor::empty({tokens, k}, DType::U8, dev);
    ops::capacity_mask(ctx.indices, ctx.probs, e, capacity, moe_.drop_policy, kept);
    if (moe_.pad_to_capacity) pad = capacity;
  }
  const DType combine = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  ctx.combine_probs = cast_to(ctx.probs, combine);

  // Expert GEMMs that read device offsets (the Hopper kernel for all three) let the plan's
  // counts stay on the device: nothing in this layer then waits for the GPU.
  const bool device_rows = ops::grouped_gemm_device_rows(fc1_->weight) && ops::grouped_gemm_device_rows(fc2_->weight);
  phase.emplace("moe-dispatch", 2, dev);
  ctx.permuted = dispatcher_.dispatch(x, ctx.indices, kept, pad, ctx.dispatch, device_rows);
  // SwiGLU experts apply each row's probability in the activation (Megatron's weighted SwiGLU):
  // the probabilities travel with the tokens, the combine is a plain sum, and their gradient
  // comes from the activation's backward, which reads the rows anyway (the combine's backward
  // would read every expert output row once more for it).
  if (swiglu_) ctx.row_probs = dispatcher_.dispatch_probs(ctx.combine_probs, ctx.dispatch);
  const ops::MoeRouting& plan = ctx.dispatch.routing;
  if (training) {
    // Tokens per expert after capacity dropping (Megatron counts its final routing map): the
    // expert-bias update and the per-layer log use them. When the dispatcher's plan covers
    // exactly this rank's tokens over all E experts, its counts are these numbers: on the host
    // when they were copied for the GEMM sizes (unpadded), else summed on the device and read
    // with the losses; otherwise count from the indices.
    const bool whole = plan.num_tokens == tokens && plan.num_experts == e;
    if (whole && pad == 0 && static_cast<int64_t>(plan.host_tokens_per_expert.size()) == e) {
      for (int64_t i = 0; i < e; ++i)
        stats_.tokens_per_expert[static_cast<size_t>(i)] +=
            static_cast<double>(plan.host_tokens_per_expert[static_cast<size_t>(i)]);
    } else if (whole && plan.kept_per_expert.device().is_cuda()) {
      // With the plan's deferred checks (a plan made without the host copy): read together.
      if (!counts_acc_.defined()) counts_acc_ = Tensor::zeros({e + 2}, DType::I64, dev);
      ops::accumulate_routing_counts(plan, counts_acc_);
    } else {
      const std::vector<int32_t> idx = ctx.indices.to_vector<int32_t>();
      const std::vector<uint8_t> keep = kept.defined() ? kept.to_vector<uint8_t>() : std::vector<uint8_t>();
      for (size_t i = 0; i < idx.size(); ++i)
        if (keep.empty() || keep[i]) stats_.tokens_per_expert[static_cast<size_t>(idx[i])] += 1.0;
    }
    stats_.micro_batches++;
  } else if (plan.status.defined()) {
    // Evaluation: only the plan's deferred checks (flags), read with the next statistics or by
    // check_evaluation_routing after the evaluation.
    if (!eval_checks_.defined()) eval_checks_ = Tensor::zeros({e + 2}, DType::I64, dev);
    ops::accumulate_routing_counts(plan, eval_checks_);
  }
  const int64_t rows = ctx.permuted.size(0);
  const ops::ExpertRows& groups = ctx.dispatch.local_rows;
  phase.emplace("moe-experts", 2, dev);
  ctx.fc1_out = Tensor::empty({rows, fc1_->shape[1]}, x.dtype(), dev);
  ops::grouped_gemm_forward(ctx.permuted, fc1_->weight, groups, ctx.fc1_out);
  ctx.act = Tensor::empty({rows, fc2_->shape[2]}, x.dtype(), dev);
  if (swiglu_) {
    ops::weighted_swiglu_forward(ctx.fc1_out, ctx.row_probs, ctx.act);
  } else {
    ops::gelu_forward(ctx.fc1_out, ctx.act);
  }
  Tensor expert_out = Tensor::empty({rows, hidden_}, x.dtype(), dev);
  ops::grouped_gemm_forward(ctx.act, fc2_->weight, groups, expert_out);
  if (moe_.recompute_act) ctx.act = Tensor();  // --recompute-modules moe_act: rebuilt in the backward
  phase.emplace("moe-combine", 2, dev);
  // The expert output outlives the forward only where the combine's probability gradient needs
  // it (the dispatcher's Ctx keeps it then: GELU experts).
  Tensor out = dispatcher_.combine(expert_out, swiglu_ ? Tensor() : ctx.combine_probs, ctx.dispatch);

  if (moe_.shared_expert_size > 0) {
    phase.emplace("moe-shared-expert", 2, dev);
    ctx.shared_out = shared_.forward(x, ctx.shared, batch);
    if (moe_.shared_expert_gate) {
      // out += sigmoid(x w_gate) * shared: the per-token scale is a combine with one "expert"
      // and the gate as its probability.
      ctx.gate_logit = shared_gate_.forward(x, ctx.gate);
      Tensor gate = Tensor::empty({tokens, 1}, x.dtype(), dev);
      ops::sigmoid_forward(ctx.gate_logit, gate);
      ctx.gate_prob = cast_to(gate, combine);
      // Every token to "expert" 0: the row count is known, so no host copy of the counts.
      ctx.gate_routing = ops::make_moe_routing(Tensor::zeros({tokens, 1}, DType::I32, dev), Tensor(), 1, 0, false);
      Tensor scaled = Tensor::empty({tokens, hidden_}, x.dtype(), dev);
      ops::moe_unpermute_forward(ctx.shared_out, ctx.gate_prob, ctx.gate_routing, scaled);
      add_into(out, scaled);
    } else {
      add_into(out, ctx.shared_out);
    }
  }
  return out;
}

Tensor MoeLayer::backward(const Tensor& dy, double loss_grad_scale, Ctx& ctx) {
  const Device dev = dy.device();
  const int64_t tokens = dy.size(0), e = moe_.num_experts, k = moe_.router.topk;
  Tensor dx_shared;
  std::optional<TimedRegion> phase;  // --timing-log-level 2: the layer's phases
  if (moe_.shared_expert_size > 0) {
    phase.emplace("moe-shared-expert-backward", 2, dev);
    if (moe_.shared_expert_gate) {
      Tensor d_shared = Tensor::empty({tokens, hidden_}, dy.dtype(), dev);
      Tensor d_gate = Tensor::empty({tokens, 1}, ctx.gate_prob.dtype(), dev);
      ops::moe_unpermute_backward(ctx.shared_out, ctx.gate_prob, ctx.gate_routing, dy, d_shared, d_gate);
      Tensor d_logit = Tensor::empty({tokens, 1}, dy.dtype(), dev);
      ops::sigmoid_backward(ctx.gate_logit, cast_to(d_gate, dy.dtype()), d_logit);
      dx_shared = shared_.backward(d_shared, ctx.shared);
      add_into(dx_shared, shared_gate_.backward(d_logit, ctx.gate));
    } else {
      dx_shared = shared_.backward(dy, ctx.shared);
    }
  }

  // combine and experts
  const ops::ExpertRows& groups = ctx.dispatch.local_rows;
  Tensor d_expert_out, dprobs;
  phase.emplace("moe-combine-backward", 2, dev);
  dispatcher_.combine_backward(dy, ctx.dispatch, d_expert_out, dprobs);
  phase.emplace("moe-experts-backward", 2, dev);
  if (!ctx.act.defined()) {  // recompute the activation from the kept fc1 output
    ctx.act = Tensor::empty({ctx.fc1_out.size(0), fc2_->shape[2]}, dy.dtype(), dev);
    if (swiglu_) {
      ops::weighted_swiglu_forward(ctx.fc1_out, ctx.row_probs, ctx.act);
    } else {
      ops::gelu_forward(ctx.fc1_out, ctx.act);
    }
  }
  Tensor d_act = Tensor::empty(ctx.act.shape(), dy.dtype(), dev);
  ops::grouped_gemm_dgrad(d_expert_out, fc2_->weight, groups, d_act);
  ops::grouped_gemm_wgrad(d_expert_out, ctx.act, groups, fc2_->grad, fc2_->grad_accumulates());
  Tensor d_fc1 = Tensor::empty(ctx.fc1_out.shape(), dy.dtype(), dev);
  Tensor d_row_probs;
  if (swiglu_) {
    d_row_probs = Tensor::empty(ctx.row_probs.shape(), ctx.row_probs.dtype(), dev);
    ops::weighted_swiglu_backward(ctx.fc1_out, ctx.row_probs, d_act, d_fc1, d_row_probs);
  } else {
    ops::gelu_backward(ctx.fc1_out, d_act, d_fc1);
  }
  Tensor d_perm = Tensor::empty(ctx.permuted.shape(), dy.dtype(), dev);
  ops::grouped_gemm_dgrad(d_fc1, fc1_->weight, groups, d_perm);
  ops::grouped_gemm_wgrad(d_fc1, ctx.permuted, groups, fc1_->grad, fc1_->grad_accumulates());
  phase.emplace("moe-dispatch-backward", 2, dev);
  Tensor dx = dispatcher_.dispatch_backward(d_perm, ctx.dispatch);
  if (swiglu_ && !ctx.forced) dprobs = dispatcher_.dispatch_probs_backward(d_row_probs, ctx.dispatch);
  phase.emplace("moe-router-backward", 2, dev);

  // router: probabilities, balancing losses, then the gate GEMM
  if (!ctx.forced) {
    Tensor dlogits = Tensor::empty({tokens, e}, router_dtype_, dev);
    ops::router_topk_backward(ctx.logits, ctx.indices, cast_to(dprobs, router_dtype_), moe_.router, dlogits);
    if (ctx.aux_scores.defined()) {
      Tensor daux = Tensor::empty({tokens, e}, router_dtype_, dev);
      ops::switch_aux_loss_backward(ctx.aux_counts, k, moe_.aux_loss_coeff, loss_grad_scale, tokens, daux);
      ops::aux_scores_backward(ctx.logits, moe_.router.score, daux, dlogits);
    }
    if (moe_.z_loss_coeff > 0) ops::z_loss_backward(ctx.logits, z_loss_coeff(), loss_grad_scale, dlogits);
    if (ctx.router_in.dtype() != router_dtype_) {  // router_logits' bf16 GEMMs: the same here
      const std::vector<Tensor> d = ops::bf16_parts(dlogits, 3);
      Tensor& dw = gate_weight_->grad;
      ops::gemm(d[2], ctx.router_in, dw, true, false, 1.0f, gate_weight_->grad_beta());
      ops::gemm(d[1], ctx.router_in, dw, true, false, 1.0f, 1.0f);
      ops::gemm(d[0], ctx.router_in, dw, true, false, 1.0f, 1.0f);
      // The input gradient straight into dx (bf16, beta 1: one rounding): one GEMM over K = 3E,
      // [d_mid | d_hi | d_hi] [w_hi; w_mid; w_hi] (three GEMMs into an fp32 buffer read and wrote
      // [tokens, hidden] fp32 three times: 0.33 ms at the Qwen3 layer shape, H100).
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
      add_into(dx, cast_to(d_router_in, dy.dtype()));
    }
  }
  if (dx_shared.defined()) add_into(dx, dx_shared);
  ctx = Ctx{};
  return dx;
}

// The balancing losses stay on the device over the micro-batches (no synchronisation per
// layer and micro-batch); the host values are read when the statistics are asked for.
void MoeLayer::accumulate_loss(Tensor& acc, const Tensor& loss) {
  if (!acc.defined()) acc = Tensor::zeros({1}, loss.dtype(), loss.device());
  ops::add(acc, loss, acc);
}

void MoeLayer::prefetch_stats() {
  const Tensor* any = counts_acc_.defined() ? &counts_acc_ : aux_acc_.defined() ? &aux_acc_
                      : z_acc_.defined()    ? &z_acc_
                      : eval_checks_.defined() ? &eval_checks_ : nullptr;
  if (!any || !any->device().is_cuda()) return;  // nothing to read, or host tensors already
  auto to_pinned = [](Tensor& on_device, Tensor& host, bool as_float) {
    if (!on_device.defined()) return;
    const Tensor src = as_float ? cast_to(on_device, on_device.dtype() == DType::F64 ? DType::F64 : DType::F32)
                                : on_device;
    host = Tensor::empty_pinned(src.shape(), src.dtype());
    host.copy_from(src);  // asynchronous: the destination is pinned
    on_device = Tensor();
  };
  const Device dev = any->device();
  to_pinned(eval_checks_, host_eval_checks_, false);
  to_pinned(counts_acc_, host_counts_, false);
  to_pinned(aux_acc_, host_aux_, true);
  to_pinned(z_acc_, host_z_, true);
  prefetched_ = std::make_shared<Event>(dev);
  prefetched_->record();
}

// The router's top-k cannot produce these; they guard the plans' deferred checks.
void MoeLayer::check_routing_flags(const std::vector<int64_t>& c) const {
  const size_t e = stats_.tokens_per_expert.size();
  MC_CHECK(c[e] == 0, prefix_, ": an expert index outside [0, ", e, ") reached the token dispatch");
  MC_CHECK(c[e + 1] == 0, prefix_, ": an expert received more assignments than its padded capacity");
}

void MoeLayer::check_evaluation_routing() const {
  // A prefetched host copy is read only once its copy has arrived.
  if (host_eval_checks_.defined() && prefetched_ && !prefetched_->ready()) prefetched_->synchronize();
  for (Tensor* t : {&host_eval_checks_, &eval_checks_}) {
    if (!t->defined()) continue;
    const std::vector<int64_t> c = t->to_vector<int64_t>();
    *t = Tensor();
    check_routing_flags(c);
  }
}

void MoeLayer::sync_stats() const {
  const size_t e = stats_.tokens_per_expert.size();
  if (prefetched_) {  // the copies of prefetch_stats(): wait only if they have not arrived yet
    if (!prefetched_->ready()) prefetched_->synchronize();
    prefetched_.reset();
  }
  // Each statistic from its prefetched host copy, then from the device (what accumulated since,
  // or everything when nothing was prefetched).
  check_evaluation_routing();
  for (Tensor* t : {&host_counts_, &counts_acc_}) {
    if (!t->defined()) continue;
    const std::vector<int64_t> c = t->to_vector<int64_t>();
    *t = Tensor();
    check_routing_flags(c);
    for (size_t i = 0; i < e; ++i) stats_.tokens_per_expert[i] += static_cast<double>(c[i]);
  }
  for (Tensor* t : {&host_aux_, &aux_acc_}) {
    if (!t->defined()) continue;
    stats_.aux_loss += read_scalar(*t) / moe_.aux_loss_coeff;
    *t = Tensor();
  }
  for (Tensor* t : {&host_z_, &z_acc_}) {
    if (!t->defined()) continue;
    stats_.z_loss += read_scalar(*t) / moe_.z_loss_coeff;
    *t = Tensor();
  }
}

const MoeStepStats& MoeLayer::stats() const {
  sync_stats();
  return stats_;
}

MoeStepStats& MoeLayer::mutable_stats() {
  sync_stats();
  return stats_;
}

MoeStepStats MoeLayer::finish_step() {
  sync_stats();
  if (expert_bias_ && stats_.micro_batches > 0 && moe_.bias_update_rate > 0) {
    // Aux-loss-free balancing: b_e += u * sign(mean(c) - c_e) over this step's selections.
    const std::vector<double>& c = stats_.tokens_per_expert;
    double mean = 0;
    for (double v : c) mean += v;
    mean /= static_cast<double>(c.size());
    std::vector<double> bias = cast_to(expert_bias_->master, DType::F64).to_vector<double>();
    for (size_t i = 0; i < c.size(); ++i) {
      const double d = mean - c[i];
      bias[i] += moe_.bias_update_rate * (d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0));
    }
    expert_bias_->master.copy_from(cast_to(Tensor::from_vector(bias, expert_bias_->shape), expert_bias_->master.dtype())
                                       .to(expert_bias_->master.device()));
  }
  global_micro_ = 0;
  MoeStepStats out = stats_;
  stats_ = MoeStepStats{};
  stats_.tokens_per_expert.assign(out.tokens_per_expert.size(), 0.0);
  return out;
}

}  // namespace moecore
