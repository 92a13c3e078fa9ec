// FP8 training: the one seam through which the transformer layers' linears compute in FP8.
//
// With FP8 on (ModelConfig::fp8), the ParamStore carries an Fp8Context; every Linear of the
// transformer layers (attention and MLA projections, dense MLPs, shared experts, MTP's eh_proj)
// and the routed experts (one GEMM per expert) hold an Fp8Linear and run their forward, dgrad
// and wgrad GEMMs as ops::fp8_gemm on quantised operands. The router, the shared-expert gate, the
// embeddings and the output layer stay in the compute dtype, as in Megatron.
//
// Operands (E4M3; the gradient dy in E5M2 with --fp8-format hybrid):
//   forward  y  = x . W^T     A = x [rows, in]            B = W [out, in]
//   dgrad    dx = dy . W      A = dy [rows, out]          B = W^T [in, out]
//   wgrad    dW = dy^T . x    A = dy^T [out, rows]        B = x^T [in, rows]
// Recipes (--fp8-recipe):
//   tensorwise  one scale per tensor from its current amax (Transformer Engine's
//               Float8CurrentScaling); for a tensor-parallel linear the amax is the maximum over
//               the TP group (the expert-tensor-parallel group for experts), so every rank uses
//               the scale of the whole tensor.
//   delayed     one scale per tensor from an amax history (Transformer Engine's DelayedScaling):
//               each tensor (x, W, dy of every linear; per expert for the routed experts) has a
//               history of --fp8-amax-history-len amaxes. During a step the training passes
//               record max |.| into history[0]; after the step's backward (finish_step) history[0]
//               is the maximum over the step's micro-batches and over every rank of the pipeline
//               stage (TP, CP, DP; the experts' EP/ETP ranks fold onto them), then TE's update
//               runs: amax = max(history) or history[0] (--fp8-amax-compute-algo), scale =
//               fp8_max / amax / 2^margin (kept when amax is 0 or not finite), the history
//               rolled by one (torch.roll(h, -1)) and history[0] zeroed. Unlike TE, which
//               updates once per micro-batch's forward, the update is once per optimizer step,
//               so the scales do not depend on how the global batch is cut into micro-batches
//               or ranks. The histories and scales are buffers of the ParamStore
//               ("<linear>.fp8_amax_history" [3 sets, len], "<linear>.fp8_scale" [3 sets]; rows
//               x, W, dy per set, a set per expert), so checkpoints keep them and a resumed run is
//               bit-identical. A stored scale 0 means "none yet" (scale 1).
//   blockwise   1x128 tiles for x and dy (128x1 for wgrad's transposed operands, quantised from
//               the high-precision values), 128x128 blocks for W, power-of-two scales
//               (ops/fp8_quant.h): no amax state, no communication.
// The linear's input is kept in the compute dtype and quantised again for the wgrad (the same
// codes as in the forward: the scales are fixed during a step, or recomputed from the same values).
// On a GPU (--device cuda) the GEMMs are cuBLASLt's and every amax, history and scale stays on the
// device (ops/fp8_quant.h, "Per-tensor scaling state"): the tensorwise amax is a 1-element device
// all-reduce (Max), the delayed recipe records and updates with kernels; the CPU runs the same ops
// with the host arithmetic. cuBLASLt wants K a multiple of 16: a wgrad over rows that are not (an
// expert's share of the tokens) is padded with zero codes inside ops::fp8_gemm (same result).
//
// --fp8-param-gather (with the distributed optimizer and bf16 weights): each linear registers its
// weight (Fp8GatheredWeight) and, once the optimizer has gathered it after a step
// (train/fp8_param_gather.h: each rank quantises its shard, the FP8 codes are all-gathered),
// forward and dgrad use that FP8 operand instead of quantising the bf16 weight, whose copy outside
// the rank's shard is then left stale. The codes and factors are those the weight's own
// quantisation gives (the same values and scales), so the numerics do not change. Until the
// first gather (and after a checkpoint load) the operand is not valid and the bf16 weight, whole
// on every rank then, is quantised as without the flag.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/ops/fp8_quant.h"

namespace moecore {

// Whether a checkpoint tensor is FP8 delayed-scaling state ("<linear>.fp8_amax_history" or
// ".fp8_scale"): training state, not model weights. Loading skips it when the model has no FP8
// state (generate, eval or a run without the recipe), and a delayed-scaling run loading a
// checkpoint without it starts its histories afresh (train/checkpoint.cpp, with a note).
bool is_fp8_scaling_state(const std::string& name);

// One linear's weight under --fp8-param-gather: `sets` matrices [out, in] (the experts of this
// rank: the weight is [sets, out, in]; else [out, in]), the FP8 E4M3 operand of each (codes: views
// of the optimizer's gathered FP8 buffer; factors: [1] per tensor or the 128x128 grid) and, for the
// per-tensor recipes, each matrix's amax [sets] (the delayed recipe records it while training, as
// the quantisation of the bf16 weight would). valid: filled by the last gather.
struct Fp8GatheredWeight {
  Param* weight = nullptr;
  int64_t first_set = 0;  // the linear's set (delayed-scaling rows) of matrix 0
  int64_t sets = 1, out = 0, in = 0;
  comm::Communicator* amax_group = nullptr;  // tensorwise: the amax is the maximum over it too
  Param* scale = nullptr;                    // delayed: the linear's stored scales [3 * all sets]
  std::vector<ops::Fp8Tensor> operands;
  Tensor amax;
  bool valid = false;
};

class Fp8Context {
 public:
  explicit Fp8Context(const Fp8Config& cfg) : cfg_(cfg) {}
  const Fp8Config& config() const { return cfg_; }
  // The tensor-parallel group: the tensorwise amax group of split dense linears (null: TP = 1).
  void set_tensor_parallel_group(comm::Communicator* tp) { tp_ = tp; }
  comm::Communicator* tensor_parallel_group() const { return tp_; }
  // Training passes record amaxes (delayed recipe); evaluation and generation do not.
  void set_recording(bool on) { recording_ = on; }
  bool recording() const { return recording_; }
  // Delayed recipe: registers a linear's history and scale buffers (Fp8Linear does).
  void add_state(Param* history, Param* scale) { states_.push_back({history, scale}); }
  // Delayed recipe, after the step's backward: history[0] reduced (max) over tp then dp_cp (null:
  // size 1), then TE's scale update and roll (above). Nothing for the other recipes.
  void finish_step(comm::Communicator* tp, comm::Communicator* dp_cp);
  // --fp8-param-gather: the linears register their weights (set before the model is built).
  void set_param_gather(bool on) { param_gather_ = on; }
  bool param_gather() const { return param_gather_; }
  Fp8GatheredWeight& add_gathered_weight(const Fp8GatheredWeight& w);
  const std::vector<std::unique_ptr<Fp8GatheredWeight>>& gathered_weights() const { return gathered_; }
  // After a checkpoint load: the bf16 weights are whole again and quantised as without the flag
  // until the next gather.
  void invalidate_gathered_weights();

 private:
  struct State {
    Param* history;
    Param* scale;
  };
  Fp8Config cfg_;
  comm::Communicator* tp_ = nullptr;
  bool recording_ = false;
  std::vector<State> states_;
  bool param_gather_ = false;
  std::vector<std::unique_ptr<Fp8GatheredWeight>> gathered_;
};

// The FP8 GEMMs of one linear (sets > 1: one set of delayed state per expert).
class Fp8Linear {
 public:
  Fp8Linear() = default;
  // amax_group: the group over which a tensorwise amax is the maximum (null: this rank's). in, out:
  // the linear's features on this rank (on a GPU both must be multiples of 16, cuBLASLt's FP8
  // alignment: refused here by name otherwise).
  Fp8Linear(Fp8Context& ctx, ParamStore& store, const std::string& name, int64_t sets,
            comm::Communicator* amax_group, int64_t in, int64_t out);
  bool on() const { return ctx_ != nullptr; }
  // y [rows, out] = x [rows, in] . w [out, in]^T
  void forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t set = 0) const;
  // dx [rows, in] = dy [rows, out] . w + beta dx
  void dgrad(const Tensor& dy, const Tensor& w, Tensor& dx, float beta, int64_t set = 0) const;
  // dw [out, in] = dy^T . x + beta dw
  void wgrad(const Tensor& dy, const Tensor& x, Tensor& dw, float beta, int64_t set = 0) const;
  // The routed experts' weight operands at once: w [sets, out, in] (this rank's experts) quantised
  // as one [sets * out, in] matrix, one launch instead of one per expert, sliced per expert (dgrad
  // transposes an expert's slice with ops::fp8_transpose). Only where that gives each expert's own
  // operand: the blockwise recipe, out a multiple of 128 (no 128x128 block spans two experts) and
  // no gathered operand; else empty, and the GEMMs quantise per expert.
  std::vector<ops::Fp8Tensor> expert_weight_operands(const Tensor& w) const;
  // forward and dgrad with the weight's operand given (from expert_weight_operands).
  void forward(const Tensor& x, const ops::Fp8Tensor& w, Tensor& y, int64_t set) const;
  void dgrad(const Tensor& dy, const ops::Fp8Tensor& w_transposed, Tensor& dx, float beta, int64_t set) const;
  // --fp8-param-gather (when the context has it on): w [sets, out, in] or [out, in] (sets 1) is
  // this linear's weight, its matrix 0 the linear's set first_set; forward and dgrad then take its
  // gathered operand once valid (above). A weight shared with another FP8 linear is refused.
  void gather_weight(Param& w, int64_t first_set, int64_t sets);

 private:
  enum Role { kInput = 0, kWeight = 1, kGrad = 2 };
  // Per-tensor operands (tensorwise, delayed): role's tensor t quantised with its scale, kept on
  // t's device (the delayed recipe records t's amax first while recording).
  ops::Fp8Tensor quantize_per_tensor(const Tensor& t, Role role, int64_t set, ops::Fp8Format f) const;
  ops::Fp8Tensor weight_operand(const Tensor& w, int64_t set, bool transposed) const;
  ops::Fp8Tensor activation_operand(const Tensor& t, Role role, int64_t set, bool transposed) const;
  ops::Fp8Format grad_format() const;

  Fp8Context* ctx_ = nullptr;
  comm::Communicator* amax_group_ = nullptr;
  Param* history_ = nullptr;  // delayed: [3 sets, len]
  Param* scale_ = nullptr;    // delayed: [3 sets]
  Fp8GatheredWeight* gathered_ = nullptr;  // --fp8-param-gather
  int64_t in_ = 0, out_ = 0;
};

}  // namespace moecore
