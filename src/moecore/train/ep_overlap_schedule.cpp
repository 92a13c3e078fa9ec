// The expert-parallel overlap schedule of train/ep_overlap_schedule.h.
#include "moecore/train/ep_overlap_schedule.h"

#include <memory>
#include <string>

#include "moecore/core/error.h"
#include "moecore/moe/side_stream.h"
#include "moecore/train/pipeline.h"

namespace moecore {

namespace {

// One micro-batch's pass through the model, in phases.
struct MicroPass {
  int64_t m = 0;
  Batch batch;
  GPTModel::Ctx ctx;
  GPTModel::PhasedPass pass;
  Device device;
  // The pass's collective in flight on the communication stream (a GPU): the next phase waits for it.
  std::unique_ptr<SideStream> comm = std::make_unique<SideStream>();
};

class Schedule {
 public:
  Schedule(GPTModel& model, const EpOverlapStep& step) : model_(model), step_(step) {}

  void forward_begin(MicroPass& p, int64_t m) {
    p.m = m;
    p.batch = step_.batch(m);
    p.device = p.batch.tokens.device();
    p.ctx.fused_head_scale = step_.grad_scale;  // the output layer's backward runs in the forward
    p.pass.training = true;
    p.pass.rng_seed = step_.rng(m);
    model_.phased_forward_begin(p.batch.tokens, p.batch.labels, p.pass, with_checked_batch(p.ctx, p.batch));
  }
  void forward_end(MicroPass& p) {
    p.comm->join();
    const Tensor loss_sum = model_.phased_forward_end(p.batch.tokens, p.batch.labels, p.pass, p.ctx);
    add_micro_batch_losses(*step_.losses, nullptr, loss_sum, p.ctx);  // after the forward has set the counts
  }
  void backward_begin(MicroPass& p) {
    p.pass.grad_scale = step_.grad_scale;
    p.pass.delay_wgrad = step_.delay_wgrad;
    p.pass.layer_done = p.m == step_.micro_batches - 1 ? step_.last_layer_done : std::function<void(int64_t)>();
    model_.phased_backward_begin(p.pass, p.ctx);
  }
  void backward_end(MicroPass& p) {
    p.comm->join();
    model_.phased_backward_end(p.pass, p.ctx);
  }
  // Phase `phase` of layer i of p's forward (or backward): a collective goes to the communication
  // stream, any other phase first waits for the pass's collective in flight.
  void phase(MicroPass& p, bool forward, int64_t i, int phase) {
    if (phase != 0 && !model_.config().is_moe(i)) return;  // a dense layer runs in phase 0
    if (GPTModel::phase_communicates(phase)) {
      p.comm->fork(p.device, true, SideLane::Communication);
      run(p, forward, i, phase);
      p.comm->leave();
      return;
    }
    p.comm->join();
    run(p, forward, i, phase);
  }
  // The delayed expert weight gradients of layer i (--delay-wgrad-compute), after its backward's
  // phase 3 has issued the dispatch gradient's collective.
  void wgrad(MicroPass& p, int64_t i) {
    if (p.pass.delay_wgrad) model_.backward_layer_wgrad(i, p.ctx);
  }

  void forward_alone(MicroPass& p, int64_t m) {
    forward_begin(p, m);
    for (int64_t i = model_.first_layer(); i < model_.end_layer(); ++i)
      for (int ph = 0; ph < GPTModel::kLayerPhases; ++ph) phase(p, true, i, ph);
    forward_end(p);
  }
  void backward_alone(MicroPass& p) {
    backward_begin(p);
    for (int64_t i = model_.end_layer() - 1; i >= model_.first_layer(); --i)
      for (int ph = 0; ph < GPTModel::kLayerPhases; ++ph) {
        phase(p, false, i, ph);
        if (ph == 3) wgrad(p, i);
      }
    backward_end(p);
  }
  // b's backward with f's forward (micro-batch m + 1), layer pair by layer pair.
  void backward_with_forward(MicroPass& b, MicroPass& f, int64_t m_next) {
    backward_begin(b);
    forward_begin(f, m_next);
    const int64_t first = model_.first_layer(), layers = model_.end_layer() - first;
    for (int64_t k = 0; k < layers; ++k) {
      const int64_t fi = first + k, bi = first + layers - 1 - k;
      phase(b, false, bi, 0);
      phase(b, false, bi, 1);
      phase(f, true, fi, 0);
      phase(f, true, fi, 1);
      phase(b, false, bi, 2);
      phase(b, false, bi, 3);
      wgrad(b, bi);
      phase(f, true, fi, 2);
      phase(f, true, fi, 3);
      phase(b, false, bi, 4);
      phase(f, true, fi, 4);
    }
    backward_end(b);  // the embedding's gradient before f's fused output layer adds to a tied one
    forward_end(f);
  }

 private:
  void run(MicroPass& p, bool forward, int64_t i, int phase) {
    if (forward) {
      model_.forward_layer_phase(i, phase, p.pass, p.ctx);
    } else {
      model_.backward_layer_phase(i, phase, p.pass, p.ctx);
    }
  }

  GPTModel& model_;
  const EpOverlapStep& step_;
};

}  // namespace

void run_ep_overlap_schedule(GPTModel& model, const EpOverlapStep& step) {
  MC_CHECK(step.micro_batches >= 2 && step.losses && step.batch && step.rng,
           "the expert-parallel overlap schedule needs at least 2 micro-batches, their batches, seeds and losses");
  Schedule schedule(model, step);
  auto current = std::make_unique<MicroPass>();
  schedule.forward_alone(*current, 0);
  for (int64_t m = 0; m + 1 < step.micro_batches; ++m) {
    auto next = std::make_unique<MicroPass>();
    schedule.backward_with_forward(*current, *next, m + 1);
    current = std::move(next);
  }
  schedule.backward_alone(*current);
}

void check_ep_overlap_args(const TrainArgs& a) {
  MC_CHECK(!a.delay_wgrad_compute || a.overlap_moe_ep_comm, "--delay-wgrad-compute needs "
           "--overlap-moe-expert-parallel-comm (as in Megatron: the delayed expert weight gradients overlap the "
           "other micro-batch's communication): add it or drop the flag");
  if (!a.overlap_moe_ep_comm) return;
  const char* flag = "--overlap-moe-expert-parallel-comm";
  MC_CHECK(a.model.moe.num_experts > 0, flag, " needs an MoE model (--num-experts)");
  MC_CHECK(a.ep > 1, flag, " needs --expert-model-parallel-size > 1: with ", a.ep,
           " expert-parallel rank there is no all-to-all to overlap; drop the flag");
  MC_CHECK(a.pp == 1, flag, " is not yet available with --pipeline-model-parallel-size > 1 (got ", a.pp,
           "): the overlap schedule runs without pipeline stages; drop one of them");
  const int64_t dp = a.data_parallel_size(), micro = dp > 0 ? a.num_microbatches() / dp : 0;
  MC_CHECK(micro >= 2, flag, " needs at least 2 micro-batches per step on each data-parallel rank to interleave "
           "(--global-batch-size ", a.global_batch_size, " / (--micro-batch-size ", a.micro_batch_size, " x ", dp,
           " data-parallel ranks) = ", micro, "); raise --global-batch-size");
  MC_CHECK(a.token_dispatcher == "alltoall", flag, " works with --moe-token-dispatcher-type alltoall only (as in "
           "Megatron), not ", a.token_dispatcher, ": add --moe-token-dispatcher-type alltoall");
  // Recomputation inside a module (moe_act, shared_experts, core_attn, mla_up_proj, mlp) runs in
  // the layer phases as it does without the flag; what drops a whole layer or MoE layer (or the
  // norms' outputs, kept across the phases) is not phased yet.
  const RecomputeConfig& r = a.model.recompute;
  MC_CHECK(a.recompute_granularity != "full" && !r.moe && !r.layernorm, flag, " is not yet available with "
           "--recompute-granularity full, --recompute-modules moe or layernorm, or --moe-layer-recompute (selective "
           "moe_act, shared_experts, core_attn, mla_up_proj and mlp are); drop one of them");
  MC_CHECK(!a.fine_grained_activation_offloading, flag, " is not yet available with "
           "--fine-grained-activation-offloading; drop one of them");
  MC_CHECK(a.model.mtp_num_layers == 0, flag, " is not yet available with --mtp-num-layers ", a.model.mtp_num_layers,
           " (multi-token prediction); drop one of them");
  // On a GPU the all-to-alls run on a communication stream: a tensor-, context- or
  // expert-tensor-parallel collective (or global_aux_loss's average over the data-parallel ranks)
  // would run on the compute stream beside them (two NCCL communicators at once on one GPU), which
  // is not validated yet.
  MC_CHECK(!a.device.is_cuda() || (a.tp == 1 && a.cp == 1 && a.etp == 1), flag, " on GPUs is not yet available "
           "with --tensor-model-parallel-size, --context-parallel-size or --expert-tensor-parallel-size > 1 (got ",
           a.tp, ", ", a.cp, ", ", a.etp, "): their collectives would run beside the expert-parallel all-to-alls on "
           "the communication stream from the compute stream; drop one of them");
  MC_CHECK(!a.device.is_cuda() || a.model.moe.load_balancing != LoadBalancing::GlobalAuxLoss ||
               a.data_parallel_size() == 1,
           flag, " on GPUs is not yet available with --moe-router-load-balancing-type global_aux_loss over ",
           a.data_parallel_size(), " data-parallel ranks: its all-reduce would run beside the expert-parallel "
           "all-to-alls on the communication stream from the compute stream; use aux_loss or seq_aux_loss, or drop the flag");
  // --cuda-graph-impl local is refused before: its whole-step graph runs on one rank (no EP).
  MC_CHECK(!a.model.fp8.enabled, flag, " is not yet available with FP8 training (--fp8 / --fp8-format); drop one "
           "of them");
}

}  // namespace moecore
