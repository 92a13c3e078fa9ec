// Pipeline parallelism: one training step's micro-batches through this rank's stage with the
// 1F1B schedule (Megatron's forward_backward_pipelining_without_interleaving).
//
// Stage s of P, M micro-batches:
//   warm-up     W = min(P - s - 1, M) forwards (receive the input from s - 1, send the output
//               to s + 1)
//   steady      M - W times: forward, then send the output and receive its gradient in one
//               group (send_forward_recv_backward), backward, then send the input gradient
//               and receive the next input in one group (send_backward_recv_forward)
//   cool-down   W backwards (receive the output gradient, send the input gradient)
// So at most P - s activations are alive on stage s, and backwards run in micro-batch order.
// Every transfer is [this rank's tokens of the micro-batch (micro_batch * seq / CP, / TP with
// sequence parallelism), hidden] in the compute dtype, between neighbouring stages of the
// pipeline group (pp rank = stage). The first stage embeds tokens; the last
// computes the loss (its micro-batch losses go into step.losses, on the device).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/model/gpt.h"
#include "moecore/train/data_source.h"
#include "moecore/train/loss_accumulator.h"

namespace moecore {

struct PipelineStep {
  comm::Communicator* pp = nullptr;  // the pipeline group; rank = stage
  int64_t micro_batches = 1;
  double grad_scale = 1.0;  // d(objective) / d(micro-batch mean loss)
  std::function<Batch(int64_t m)> batch;       // micro-batch m of this step
  std::function<uint64_t(int64_t m)> rng;      // its random seed
  std::function<void(int64_t)> last_layer_done;  // gradient-overlap hook for the last backward
  LossAccumulator* losses = nullptr;  // the micro-batch losses of the stage with the head
  std::vector<LossAccumulator>* mtp_losses = nullptr;  // and each MTP depth's (--mtp-num-layers)
};

// The trainer's host checks of micro-batch b for its forward: its label count
// (Ctx::checked_num_labels) and the MTP depths' shifted inputs (Ctx::mtp_inputs).
GPTModel::Ctx& with_checked_batch(GPTModel::Ctx& ctx, const Batch& b);
// A micro-batch's losses after its forward: the main one into `main`, each MTP depth's into
// mtp[k] (when given). Nothing for an undefined sum (a stage without the head).
void add_micro_batch_losses(LossAccumulator& main, std::vector<LossAccumulator>* mtp, const Tensor& sum,
                            const GPTModel::Ctx& ctx);

// Layer assignment (Megatron's get_num_layers_to_build / get_transformer_layer_offset): the model
// chunks of pipeline rank pp_rank, chunk c = virtual stage c * pp + pp_rank (vpp chunks per rank,
// 1 without virtual stages). first / last: --decoder-first-pipeline-num-layers /
// --decoder-last-pipeline-num-layers (0: not given). With M = the stages not given a count
// ("middle" stages, rank 0 and P-1 included when theirs is not given) and
// R = num_layers - first - last, every chunk holds
//   first / vpp   on rank 0 when first is given,
//   last / vpp    on rank P-1 when last is given,
//   R / (M * vpp) on the other ranks,
// and the chunks are laid out in virtual-stage order: chunk c of rank r starts at
// c * num_layers / vpp + (the chunk sizes of ranks < r). Even stages are first = last = 0.
// Errors (naming the flags): pp < 1 or vpp < 1 or pp_rank outside [0, pp); a count < 0; first or
// last without pp > 1; R not divisible by M (or R != 0 with M = 0: PP=2 with both counts must sum
// to num_layers); a stage or middle stage with no layer; a stage's count not divisible by vpp.
std::vector<PipelineStage> stage_layers(int64_t num_layers, int64_t pp, int64_t vpp, int64_t first, int64_t last,
                                        int64_t pp_rank);

// The stage holding the head adds its micro-batch losses to step.losses.
void run_pipeline_1f1b(GPTModel& model, const PipelineStep& step);

// Virtual stages when the micro-batches do not divide by the stages (else the interleaved
// schedule below): this rank holds V model chunks;
// chunk c is virtual stage c * P + s and hands its output to rank s + 1's chunk c, or, from the
// last rank, to rank 0's chunk c + 1. Schedule: every chunk's forwards for all micro-batches in
// chunk order, then the backwards in reverse chunk order (all-forward-all-backward over the
// virtual pipeline: the same arithmetic as Megatron's interleaved 1F1B, with every
// micro-batch's activations alive at once and a larger bubble). Transfers inside a chunk go
// down the ranks in micro-batch order; the wrap-around from the last rank to rank 0 (and back
// for gradients) is sent after the chunk, all micro-batches in one group, so no rank waits on a
// transfer that a blocked rank would have to receive.
void run_pipeline_virtual(std::vector<GPTModel*>& chunks, const PipelineStep& step);

// Interleaved 1F1B over virtual stages (Megatron's forward_backward_pipelining_with_interleaving
// order): rank s runs W = min(2 (P - s - 1) + (V - 1) P, M V) forwards, then alternates one
// forward and one backward, then the remaining backwards; forward k runs chunk (k mod PV) / P
// on micro-batch (k / PV) P + k mod P, backward k the same micro-batch on chunk
// V - 1 - (k mod PV) / P. Needs M divisible by P (as Megatron).
// Transfers: every rank simulates the whole schedule (it is deterministic) and numbers it in
// ticks: at each tick a rank runs its next operation if the input it needs was produced at an
// earlier tick, then every rank exchanges, in one group, exactly the tensors produced at that
// tick with their consumers. Both sides of every transfer know its tick, so the exchanges always
// match and no rank can wait on one that is never posted. At most W + 1 activations are alive.
void run_pipeline_interleaved(std::vector<GPTModel*>& chunks, const PipelineStep& step);

// Forward only (validation): one micro-batch through every chunk of every rank; the loss is
// returned on the rank holding the last virtual stage (0 elsewhere).
double pipeline_forward_only(std::vector<GPTModel*>& chunks, comm::Communicator& pp, const Batch& b);

}  // namespace moecore
