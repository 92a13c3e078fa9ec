// The expert-parallel overlap schedule (--overlap-moe-expert-parallel-comm, with or without
// --delay-wgrad-compute; Megatron's "1F1B A2A overlap", issue 29): a step's micro-batches without
// pipeline stages, the forward of micro-batch m + 1 interleaved with the backward of m layer by
// layer, so that each one's expert-parallel all-to-alls run while the other computes.
//
//   F(0)                               alone
//   B(m) with F(m + 1), m = 0 .. M - 2: B(m)'s head backward, F(m + 1)'s embedding; then for
//                                      k = 0 .. L - 1 the pair (F layer k, B layer L - 1 - k);
//                                      then B(m)'s embedding backward, F(m + 1)'s head and loss
//   B(M - 1)                           alone (its layers finish their gradients for the
//                                      gradient-reduce overlap, as without the flag)
// Within a pair, with the phases of GPTModel::forward_layer_phase / backward_layer_phase
// (F1, F3, B1, B3: the MoE layer's all-to-alls; the rest computation, except that F0 ends with
// the alltoall dispatcher's preprocessing: its all-gather of the expert counts on the compute
// stream and the host's read of them, which waits for B1's all-to-all issued before it):
//   B0, B1 | F0, F1 | B2, B3 | [B's delayed expert wgrad] | F2, F3 | B4, F4
// so the forward's attention computes while the backward's combine gradient travels, the
// backward's experts while the forward's tokens are dispatched, the forward's experts (and the
// backward's delayed weight gradients) while the backward's dispatch gradient travels, and the
// backward's router and attention while the forward's combine travels.
//
// On a GPU each collective is issued on a communication stream (moe/side_stream.h, lane
// Communication) after an event of the compute stream, and the pass's next phase makes the compute
// stream wait for its end: streams and events, no host synchronisation added. On the CPU the
// collectives block and the order above is the whole schedule.
//
// Numerics: the same operations as without the flag. Every parameter gradient still accumulates
// micro-batch by micro-batch in order (B(m) finishes before B(m + 1) starts; the output layer's
// and the embedding's shared gradient gets B(m)'s embedding backward before F(m + 1)'s fused
// head), the losses and MoE statistics are recorded in forward order, and each micro-batch keeps
// its own seed: the losses and gradients are bit for bit those of the plain schedule on CPU ranks.
#pragma once

#include <cstdint>
#include <functional>

#include "moecore/model/gpt.h"
#include "moecore/train/arguments.h"
#include "moecore/train/data_source.h"
#include "moecore/train/loss_accumulator.h"

namespace moecore {

struct EpOverlapStep {
  int64_t micro_batches = 2;
  double grad_scale = 0.5;  // d(objective) / d(micro-batch mean loss)
  bool delay_wgrad = false;  // --delay-wgrad-compute
  std::function<Batch(int64_t m)> batch;          // micro-batch m of this step
  std::function<uint64_t(int64_t m)> rng;         // its random seed
  std::function<void(int64_t)> last_layer_done;   // gradient-overlap hook for the last backward
  LossAccumulator* losses = nullptr;              // each micro-batch's loss
};

void run_ep_overlap_schedule(GPTModel& model, const EpOverlapStep& step);

// The train flags' checks for --overlap-moe-expert-parallel-comm and --delay-wgrad-compute (after
// the parallel layout and the device are resolved): what the schedule does not support yet is
// refused by name.
void check_ep_overlap_args(const TrainArgs& a);

}  // namespace moecore
