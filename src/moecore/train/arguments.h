// `moecore train` arguments: Megatron-LM flag names, a YAML config (--config FILE, keys = flag
// names, with '-' or '_'), command-line flags overriding the file. Every flag here is
// implemented; see README "moecore train" for the list. The flags themselves (registration,
// parsing, the checks of their combinations) live with the subcommand in
// apps/train_command.cpp; the library sees this struct, filled and checked.
#pragma once

#include <cstdint>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/model/config.h"
#include "moecore/parallel/parallel_config.h"
#include "moecore/moe/token_dispatcher.h"

namespace moecore {

enum class LrDecayStyle { Constant, Linear, Cosine, WSD };

struct TrainArgs {
  ModelConfig model;
  std::string moe_layer_freq = "1";

  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0: = micro batch size (no accumulation)
  int64_t train_iters = 0;
  double lr = 1e-4, min_lr = 0.0;
  LrDecayStyle lr_decay_style = LrDecayStyle::Linear;
  int64_t lr_warmup_iters = 0, lr_decay_iters = 0;  // 0 decay iters: = train iters
  int64_t lr_wsd_decay_iters = 0;                    // WSD: final iterations that decay (0: 10% of decay iters)
  std::string lr_wsd_decay_style = "exponential";   // WSD's final decay: linear, cosine, exponential, minus_sqrt
  double weight_decay = 0.01, adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8, clip_grad = 1.0;
  bool bf16 = false;
  // --use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype: AdamW moments in
  // bf16 (fp32 default); checkpoints keep them in fp32 either way.
  bool precision_aware_optimizer = false;
  bool no_store_param_remainders = false;  // keep whole fp32 masters next to the bf16 weights
  std::string exp_avg_dtype = "fp32", exp_avg_sq_dtype = "fp32";
  int64_t seed = 1234;
  int64_t log_interval = 1, eval_interval = 0, eval_iters = 10;
  double progress_interval_s = 10;  // before the first log line: a progress line this often (0: none)
  bool memory_report = false;     // --memory-report: the peak memory by category at the first log step (train/memory_report.h)
  int64_t timing_log_level = 0;  // --timing-log-level: 0 off, 1 step phases, 2 also model parts (core/step_timers.h)
  std::string save, load, tensorboard_dir, metrics_file;
  int64_t save_interval = 0;
  std::string device_text;  // "" = cuda when present, else cpu
  bool override_opt_param_scheduler = false;  // resume with other learning-rate settings
  // Megatron's --finetune: --load's weights only (iteration, consumed samples, AdamW moments and
  // the learning-rate schedule start afresh; run settings may all differ). --no-load-optim: the
  // iteration is loaded, the AdamW moments and the schedule start afresh. --no-load-rng: accepted
  // (checkpoints hold no RNG state: every random stream derives from --seed and the position).
  bool finetune = false, no_load_optim = false, no_load_rng = false;
  // `moecore eval` (not a flag): --load's weights only, no run-setting checks, no training data.
  bool eval_only = false;
  // Parallelism (Megatron's flags, Parallel Folding). The launched ranks (mpirun/srun/torchrun)
  // form world = TP x CP x DP x PP for attention and the dense layers and, independently,
  // world = ETP x EP x EDP x PP for the experts (parallel/rank_generator.h, order tp-cp-ep-dp-pp).
  int64_t tp = 1, pp = 1, cp = 1, ep = 1, etp = 1;
  bool sequence_parallel = false;  // with tp > 1
  // Activation recomputation (Megatron's flags): --recompute-granularity selective with
  // --recompute-modules (moe_act only in this version).
  // Megatron's performance flags: fusions moecore always runs (accepted), and features it lacks
  // (refused with a message).
  bool moe_grouped_gemm = false, moe_router_fusion = false, moe_permute_fusion = false,
       cross_entropy_loss_fusion = false;
  std::string cross_entropy_fusion_impl, flex_dispatcher_backend;
  bool overlap_param_gather = false, tp_comm_overlap = false, manual_gc = false;
  // Megatron's MoE and FP8 flags for features this version lacks: parsed so that each is refused
  // by name with what to do instead, rather than as an unknown flag.
  bool overlap_moe_ep_comm = false, delay_wgrad_compute = false, moe_shared_expert_overlap = false,
       moe_enable_deepep = false, moe_layer_recompute = false, moe_use_upcycling = false,
       moe_router_padding_for_fp8 = false, fp8_param_gather = false;
  int64_t moe_upcycling_granularity = 1;
  // FP8 training (resolved into model.fp8 by the train command): --fp8-format / --fp8, --fp8-recipe,
  // --fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-margin.
  std::string fp8_format, fp8_recipe, fp8_amax_compute_algo;
  bool fp8 = false;
  static constexpr int64_t kFp8HistoryNotGiven = -1;  // --fp8-amax-history-len not given: 1
  int64_t fp8_amax_history_len = kFp8HistoryNotGiven, fp8_margin = 0;
  // Flags of Megatron's example scripts: dropout (0 only: the model has none), the masked-softmax
  // kernel switch (moecore's attention has no such kernel), --no-position-embedding (turns
  // learned_absolute into none) and the checkpoint format flags (refused: one format).
  double attention_dropout = 0.0, hidden_dropout = 0.0;
  bool no_masked_softmax_fusion = false, no_position_embedding = false, auto_detect_ckpt_format = false;
  std::string ckpt_format;
  // More of Megatron's flags for features this version lacks (refused by name): CUDA graphs,
  // P2P overlap, custom pipeline layouts, MTP, HSDP instances, activation and optimizer offloading,
  // the fake process group for memory planning, --manual-gc-interval.
  std::string cuda_graph_impl, pipeline_layout;
  std::vector<std::string> cuda_graph_scope, offload_modules;
  // --cuda-graph-impl local --cuda-graph-scope full_iteration (train/train_graph.h): after
  // --cuda-graph-warmup-steps eager steps, the training step captured and replayed.
  int64_t cuda_graph_warmup_steps = -1;  // -1: not given (3 with --cuda-graph-impl local)
  bool cuda_graph_full_iteration() const { return cuda_graph_impl == "local"; }
  bool external_cuda_graph = false, te_rng_track = false, overlap_p2p_comm = false,
       fine_grained_activation_offloading = false, optimizer_cpu_offload = false, fake_init_process_group = false;
  // --optimizer-offload-fraction (with --optimizer-cpu-offload): the share of the optimizer state
  // on the host; negative: not given (1.0).
  double optimizer_offload_fraction = -1.0;
  int64_t distributed_optimizer_instances = 1, manual_gc_interval = 0;
  std::string recompute_granularity;
  std::vector<std::string> recompute_modules;
  int64_t layers_per_virtual_stage = 0, virtual_stages_per_rank = 0;  // 0: no virtual stages
  // --decoder-first/last-pipeline-num-layers: uneven stages (0: not given; stage_layers in pipeline.h)
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  bool use_distributed_optimizer = false;
  // --distributed-timeout-minutes: a collective waiting longer ends the job (MPI ranks always, with
  // Megatron's default; NCCL ranks only when the flag is given: watch_nccl_collectives)
  double distributed_timeout_minutes = 10;
  bool watch_nccl_collectives = false;
  bool overlap_grad_reduce = false;  // --overlap-grad-reduce: reduce layer gradients during the backward
  std::string token_dispatcher = "allgather";  // --moe-token-dispatcher-type (Megatron's default)
  DispatcherType dispatcher = DispatcherType::AllGather;
  int64_t world = 1, rank = 0, local_rank = 0;  // from the launcher's environment (or the emulated world)
  // --emulate-world-size N --emulate-rank R: this one process is rank R of an N-rank job
  // (world = N, rank = R above), its communication local stand-ins (comm/emulated_communicator.h):
  // the rank's shard, steps and peak memory are the real rank's, its losses are not. 0: off.
  int64_t emulate_world_size = 0, emulate_rank = -1;
  bool emulated() const { return emulate_world_size > 0; }
  // The process that prints the log and writes the metrics: Megatron's last rank, or the emulated one.
  bool logging_rank() const { return emulated() || rank == world - 1; }
  Device device;
  bool mock_data = false;
  std::string config_file;
  // real data (Megatron .bin/.idx): --data-path [w1] prefix1 [w2 prefix2 ...]
  std::vector<std::string> data_path;
  std::vector<std::pair<double, std::string>> data_blend;  // parsed --data-path
  std::string split = "969,30,1", data_cache_path, tokenizer_type, tokenizer_model;
  int64_t make_vocab_size_divisible_by = 128;

  int64_t num_microbatches() const { return global_batch_size / micro_batch_size; }  // over all DP ranks
  int64_t data_parallel_size() const { return world / (pp * tp * cp); }
  parallel::ParallelConfig parallel_config() const;  // the sizes as parallel/ takes them
  // Model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage or
  // --num-virtual-stages-per-pipeline-rank; 1 without virtual stages).
  int64_t virtual_stages() const {
    if (virtual_stages_per_rank > 0) return virtual_stages_per_rank;
    return layers_per_virtual_stage > 0 ? model.num_layers / (pp * layers_per_virtual_stage) : 1;
  }

  // Every train flag's value as given or defaulted (saved with checkpoints: generate rebuilds
  // the model from it).
  std::vector<std::pair<std::string, std::string>> flag_values;

  // flags mapped onto the model config in finalize_train_args (their defaults differ from the model's)
  bool swiglu_flag_ = false, disable_bias_flag_ = false, group_query_attention_flag_ = false;
};

// The train flags as text (a checkpoint's meta.json "args") <-> TrainArgs. The flag registry
// lives with the train subcommand (apps/train_command.cpp); library code that rebuilds a model
// from recorded flags (interop/hf_convert) receives it through this seam.
struct TrainFlagCodec {
  using Values = std::vector<std::pair<std::string, std::string>>;
  // Every train flag's value as a checkpoint records it: `set` over the defaults.
  std::function<Values(const Values& set, const std::string& origin)> all_values;
  // The arguments a checkpoint was trained with (its saved flag values), on `device`.
  std::function<TrainArgs(const Values& saved, const std::string& device, const std::string& origin)> rebuild;
};

// The flags a checkpoint supplies to `moecore train --load` when neither the command line nor the
// --config file gives them: the model's shapes and numerics (layers, sizes, heads, vocabulary,
// norm, RoPE, sequence length), the MoE shape and router options, and the tokenizer
// (tokenizer-type, tokenizer-model: see checkpoint_tokenizer in checkpoint.h).
const std::vector<std::string>& checkpoint_model_flags();

// Before resuming: flags that define the model or the routing must equal the checkpoint's
// (an Error names the first that differs); learning-rate schedule flags too unless
// --override-opt-param-scheduler; other changed flags are listed on stdout.
// check_schedule false: a model-only checkpoint (moecore convert), whose training starts afresh.
void check_resume_flags(const std::vector<std::pair<std::string, std::string>>& saved, const TrainArgs& now,
                        bool check_schedule = true);

}  // namespace moecore
