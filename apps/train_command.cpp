// `moecore train`: its flags (Megatron-LM names, bound to TrainArgs), the parsing (a --config
// YAML file first, then the command line), and the checks that turn the flags into a run the
// library can trust: derived defaults, every combination of flags, the launched ranks, the device.
// Flags that name a word (--moe-router-score-function, --lr-decay-style, ...) are parsed once by
// FlagSet::add_enum / add_choice; the MoE flags' combinations among themselves are checked by
// validate_moe_config (model/config.cpp); this file checks them against the parallel layout and
// the device.
#include "train_command.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>

#include "moecore/comm/bootstrap.h"
#include "moecore/core/system_info.h"
#include "moecore/model/activation_offload.h"
#include "moecore/data/tokenizer.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/ep_overlap_schedule.h"
#include "moecore/train/memory_estimate.h"
#include "moecore/train/pipeline.h"
#include "moecore/train/trainer.h"

namespace moecore {

namespace {

// --exp-avg-dtype / --exp-avg-sq-dtype: why Megatron's other choices are refused.
std::string state_dtype_hint(const std::string& value) {
  return value == "fp16" || value == "fp8" ? " (moecore does not keep AdamW states in fp16 or fp8)" : "";
}

// Multi-Latent Attention and YaRN RoPE (Megatron's names; model/mla_attention.h, ops/rope.h).
void register_mla_flags(cli::FlagSet& f, TrainArgs& a) {
  ModelConfig& m = a.model;
  f.add_bool("multi-latent-attention", &m.mla.enabled, "Multi-Latent Attention (DeepSeek-V2/V3)");
  f.add_int("q-lora-rank", &m.mla.q_lora_rank, "MLA: query latent rank (0: a plain query projection)");
  f.add_int("kv-lora-rank", &m.mla.kv_lora_rank, "MLA: key/value latent rank");
  f.add_int("qk-head-dim", &m.mla.qk_head_dim, "MLA: query/key head dim without RoPE");
  f.add_int("qk-pos-emb-head-dim", &m.mla.qk_pos_emb_head_dim, "MLA: query/key head dim with RoPE (one shared key)");
  f.add_int("v-head-dim", &m.mla.v_head_dim, "MLA: value head dim");
  f.add_enum<bool>("rope-type", &m.rope_yarn, {{"rope", false}, {"yarn", true}},
                   "rope or yarn (YaRN scaling, with --multi-latent-attention)");
  f.add_double("rotary-scaling-factor", &m.rope_scaling.factor, "YaRN: context scaling factor");
  f.add_double("original-max-position-embeddings", &m.rope_scaling.original_max_position,
               "YaRN: the context the RoPE frequencies were trained for");
  f.add_double("beta-fast", &m.rope_scaling.beta_fast, "YaRN: rotations where interpolation ends");
  f.add_double("beta-slow", &m.rope_scaling.beta_slow, "YaRN: rotations where interpolation starts");
  f.add_double("mscale", &m.rope_scaling.mscale, "YaRN: magnitude scale of cos/sin");
  f.add_double("mscale-all-dim", &m.rope_scaling.mscale_all_dim,
               "YaRN: magnitude scale divided out of cos/sin and squared into MLA's softmax scale");
}

// The transformer: sizes, norms, positions, biases.
void register_model_flags(cli::FlagSet& f, TrainArgs& a) {
  ModelConfig& m = a.model;
  f.add_int("num-layers", &m.num_layers, "transformer layers");
  f.add_int("hidden-size", &m.hidden_size, "model width");
  f.add_int("ffn-hidden-size", &m.ffn_hidden_size, "dense MLP width (0: 4 x hidden)");
  f.add_int("num-attention-heads", &m.num_attention_heads, "attention heads");
  f.add_bool("group-query-attention", &a.group_query_attention_flag_, "use --num-query-groups key/value heads");
  f.add_int("num-query-groups", &m.num_query_groups, "key/value heads with --group-query-attention");
  f.add_int("kv-channels", &m.kv_channels, "head dim (0: hidden / heads)");
  f.add_int("seq-length", &m.seq_length, "tokens per sample");
  f.add_int("max-position-embeddings", &m.max_position_embeddings, "longest position (0: seq length)");
  f.add_int("vocab-size", &m.vocab_size, "vocabulary size (with --mock-data)");
  f.add_enum<bool>("normalization", &m.rmsnorm, {{"RMSNorm", true}, {"LayerNorm", false}}, "RMSNorm or LayerNorm");
  f.add_double("norm-epsilon", &m.norm_epsilon, "normalisation epsilon");
  f.add_choice("position-embedding-type", &m.position_embedding_type, {"rope", "learned_absolute", "none"},
               "rope, learned_absolute or none");
  f.add_bool("no-position-embedding", &a.no_position_embedding,
             "no learned position embedding: learned_absolute becomes none (rope is unchanged)");
  f.add_double("rotary-base", &m.rotary_base, "RoPE base");
  f.add_double("attention-dropout", &a.attention_dropout, "dropout of attention probabilities: 0 only (no dropout)");
  f.add_double("hidden-dropout", &a.hidden_dropout, "dropout of hidden states: 0 only (no dropout)");
  f.add_bool("swiglu", &a.swiglu_flag_, "SwiGLU MLPs and experts (default GELU)");
  f.add_bool("disable-bias-linear", &a.disable_bias_flag_, "no biases in linear layers");
  f.add_bool("add-qkv-bias", &m.add_qkv_bias, "biases on the query/key/value projections only, even with --disable-bias-linear (Qwen2)");
  f.add_bool("untie-embeddings-and-output-weights", &m.untie_embeddings, "separate output head");
  f.add_double("init-method-std", &m.init_method_std, "std of the normal weight initialisation");
  f.add_bool("qk-layernorm", &m.qk_layernorm,
             "normalise queries and keys per head (with --multi-latent-attention: the two latent norms)");
  f.add_int("mtp-num-layers", &m.mtp_num_layers, "multi-token prediction: D modules predicting tokens 2..D+1 ahead (0: off)");
  f.add_double("mtp-loss-scaling-factor", &m.mtp_loss_scaling_factor,
               "weight of the MTP loss (mean over the depths) in the objective");
  register_mla_flags(f, a);
}

// MoE layers: experts, the router, balancing, capacity, shared experts, recomputation.
void register_moe_flags(cli::FlagSet& f, TrainArgs& a) {
  MoeConfig& e = a.model.moe;
  f.add_int("num-experts", &e.num_experts, "experts per MoE layer (0: dense model)");
  f.add_string("moe-layer-freq", &a.moe_layer_freq, "MoE layer pattern: int N (every N-th layer) or a list like [0,1,1,1]");
  f.add_int("moe-ffn-hidden-size", &e.ffn_hidden_size, "expert FFN width (0: --ffn-hidden-size)");
  f.add_int("moe-router-topk", &e.router.topk, "experts per token");
  f.add_enum<ops::RouterScore>("moe-router-score-function", &e.router.score,
                              {{"softmax", ops::RouterScore::Softmax}, {"sigmoid", ops::RouterScore::Sigmoid}},
                              "softmax or sigmoid");
  f.add_bool("moe-router-pre-softmax", &e.router.pre_softmax, "softmax before top-k (probabilities not renormalised)");
  f.add_int("moe-router-num-groups", &e.router.num_groups, "expert groups for group-limited routing");
  f.add_int("moe-router-group-topk", &e.router.group_topk, "groups each token may use");
  f.add_double("moe-router-topk-scaling-factor", &e.router.scaling_factor, "multiply routing probabilities (0: off)");
  f.add_enum<bool>("moe-router-dtype", &e.router_fp64, {{"fp32", false}, {"fp64", true}},
                   "router precision: fp32 or fp64 (fp64 on the CPU only)");
  f.add_double("moe-input-jitter-eps", &e.input_jitter_eps, "multiply router inputs by U(1-eps, 1+eps) in training");
  f.add_bool("moe-router-force-load-balancing", &e.force_load_balancing, "benchmark mode: perfectly balanced routing");
  f.add_enum<LoadBalancing>("moe-router-load-balancing-type", &e.load_balancing,
                            {{"aux_loss", LoadBalancing::AuxLoss},
                             {"seq_aux_loss", LoadBalancing::SeqAuxLoss},
                             {"global_aux_loss", LoadBalancing::GlobalAuxLoss},
                             {"sinkhorn", LoadBalancing::Sinkhorn},
                             {"none", LoadBalancing::None}},
                            "aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none");
  f.add_double("moe-aux-loss-coeff", &e.aux_loss_coeff, "load-balancing loss coefficient");
  f.add_double("moe-z-loss-coeff", &e.z_loss_coeff, "router z-loss coefficient");
  f.add_bool("moe-router-enable-expert-bias", &e.enable_expert_bias, "aux-loss-free balancing with a per-expert bias");
  f.add_double("moe-router-bias-update-rate", &e.bias_update_rate, "expert-bias update rate");
  f.add_double("moe-expert-capacity-factor", &e.capacity_factor, "capacity factor (0: dropless)");
  f.add_enum<ops::DropPolicy>("moe-token-drop-policy", &e.drop_policy,
                             {{"probs", ops::DropPolicy::Probs}, {"position", ops::DropPolicy::Position}},
                             "probs or position");
  f.add_bool("moe-pad-expert-input-to-capacity", &e.pad_to_capacity, "pad every expert to its capacity");
  f.add_int("moe-shared-expert-intermediate-size", &e.shared_expert_size, "shared expert width (0: none)");
  f.add_bool("moe-shared-expert-gate", &e.shared_expert_gate, "sigmoid gate on the shared expert (Qwen2-MoE)");
  f.add_bool("moe-per-layer-logging", &e.per_layer_logging, "log tokens per expert and losses per layer");
  f.add_choice("recompute-granularity", &a.recompute_granularity, {"selective", "full"},
               "selective: recompute the --recompute-modules in the backward instead of keeping their outputs; "
               "full: whole decoder layers (--recompute-method, --recompute-num-layers)");
  f.add_list("recompute-modules", &a.recompute_modules,
             "with --recompute-granularity selective: moe_act (the experts' activation function), mla_up_proj "
             "(MLA's up projections), moe (each MoE layer from its input), mlp (each dense MLP from its input), "
             "core_attn (the attention output from q, k, v), shared_experts (from the MoE layer's input), "
             "layernorm (the decoder layers' input norms)");
  f.add_choice("recompute-method", &a.model.recompute.full_method, {"uniform", "block"},
               "with --recompute-granularity full: uniform (every chunk of --recompute-num-layers layers from its "
               "input) or block (the first --recompute-num-layers layers of each pipeline stage)");
  f.add_int("recompute-num-layers", &a.model.recompute.full_num_layers,
            "with --recompute-granularity full: layers per chunk (uniform) or per stage (block)");
}

// Batches, the learning-rate schedule, AdamW, precision, logging, checkpoints, the device.
void register_training_flags(cli::FlagSet& f, TrainArgs& a) {
  f.add_int("micro-batch-size", &a.micro_batch_size, "samples per micro-batch");
  f.add_int("global-batch-size", &a.global_batch_size, "samples per step (0: micro batch size)");
  f.add_int("train-iters", &a.train_iters, "optimizer steps");
  f.add_double("lr", &a.lr, "peak learning rate");
  f.add_double("min-lr", &a.min_lr, "learning rate at the end of decay");
  f.add_enum<LrDecayStyle>("lr-decay-style", &a.lr_decay_style,
                           {{"constant", LrDecayStyle::Constant},
                            {"linear", LrDecayStyle::Linear},
                            {"cosine", LrDecayStyle::Cosine},
                            {"WSD", LrDecayStyle::WSD},
                            {"wsd", LrDecayStyle::WSD}},
                           "constant, linear, cosine or WSD");
  f.add_int("lr-warmup-iters", &a.lr_warmup_iters, "linear warm-up steps");
  f.add_int("lr-decay-iters", &a.lr_decay_iters, "decay steps (0: train iters)");
  f.add_int("lr-wsd-decay-iters", &a.lr_wsd_decay_iters, "WSD: steps of the final decay (0: 10% of decay iters)");
  f.add_choice("lr-wsd-decay-style", &a.lr_wsd_decay_style, {"linear", "cosine", "exponential", "minus_sqrt"},
               "WSD: shape of the final decay: linear, cosine, exponential or minus_sqrt");
  f.add_double("weight-decay", &a.weight_decay, "AdamW weight decay (not on norms and biases)");
  f.add_double("adam-beta1", &a.adam_beta1, "AdamW beta1");
  f.add_double("adam-beta2", &a.adam_beta2, "AdamW beta2");
  f.add_double("adam-eps", &a.adam_eps, "AdamW epsilon");
  f.add_double("clip-grad", &a.clip_grad, "global gradient-norm clip (0: off)");
  f.add_bool("use-precision-aware-optimizer", &a.precision_aware_optimizer,
             "allow AdamW states in lower precision (--exp-avg-dtype, --exp-avg-sq-dtype)");
  f.add_choice("exp-avg-dtype", &a.exp_avg_dtype, {"fp32", "bf16"},
               "AdamW first moment dtype: fp32 or bf16 (needs --use-precision-aware-optimizer)", state_dtype_hint);
  f.add_choice("exp-avg-sq-dtype", &a.exp_avg_sq_dtype, {"fp32", "bf16"},
               "AdamW second moment dtype: fp32 or bf16 (needs --use-precision-aware-optimizer)", state_dtype_hint);
  f.add_bool("bf16", &a.bf16, "bf16 compute with fp32 master weights (on the CPU too: slow, for tests)");
  f.add_bool("no-store-param-remainders", &a.no_store_param_remainders,
             "with --bf16: keep whole fp32 master weights instead of the low 16 bits next to the bf16 weights "
             "(same values, 2 more bytes per parameter)");
  f.add_int("seed", &a.seed, "random seed (initialisation, data, jitter)");
  f.add_int("log-interval", &a.log_interval, "steps between log lines");
  f.add_double("progress-interval", &a.progress_interval_s,
               "seconds between progress lines (steps, rate, ETA) until the first log line (0: none)");
  f.add_int("timing-log-level", &a.timing_log_level,
            "GPU-event timers in the log: 0 none, 1 the step's phases, 2 also attention / MoE parts / output layer");
  f.add_bool("memory-report", &a.memory_report,
             "at the first log step, each rank's peak memory split into weights, gradients, optimizer state, "
             "saved activations by module, communication, workspace and allocator overhead");
  f.add_int("eval-interval", &a.eval_interval, "steps between validation runs (0: none)");
  f.add_int("eval-iters", &a.eval_iters, "validation batches per run");
  f.add_string("save", &a.save, "checkpoint directory");
  f.add_int("save-interval", &a.save_interval, "steps between checkpoints (0: only at the end)");
  f.add_string("load", &a.load,
               "checkpoint directory to resume from (model flags left out come from it; none there: start from "
               "scratch, as Megatron)");
  f.add_bool("override-opt-param-scheduler", &a.override_opt_param_scheduler,
             "resume with this run's learning-rate settings instead of refusing when they differ");
  f.add_bool("finetune", &a.finetune,
             "with --load: its weights only; iteration, consumed samples, AdamW moments and the learning-rate "
             "schedule start afresh, every run setting may differ (the model's flags must match)");
  f.add_bool("no-load-optim", &a.no_load_optim,
             "with --load: fresh AdamW moments and learning-rate schedule (the iteration is loaded)");
  f.add_bool("no-load-rng", &a.no_load_rng,
             "accepted: checkpoints hold no RNG state (every random stream derives from --seed and the step or "
             "sample), so none is ever loaded");
  f.add_string("tensorboard-dir", &a.tensorboard_dir, "write TensorBoard event files here");
  f.add_string("metrics-file", &a.metrics_file, "JSONL metrics file (default: <save>/metrics.jsonl when --save is set)");
  f.add_string("device", &a.device_text, "cpu, cuda or cuda:N (default: cuda:<local rank> when present)");
}

// Parallelism (Megatron's flags, Parallel Folding) and the token dispatcher.
void register_parallel_flags(cli::FlagSet& f, TrainArgs& a) {
  f.add_int("tensor-model-parallel-size", &a.tp,
            "tensor parallelism: ranks that split attention heads, MLP features and the vocabulary");
  f.add_bool("sequence-parallel", &a.sequence_parallel,
             "with tensor parallelism: norms, residuals and MoE layers on 1/TP of each sequence (needed with MoE)");
  f.add_int("pipeline-model-parallel-size", &a.pp, "pipeline stages (1F1B schedule; divides the ranks and --num-layers)");
  f.add_int("num-layers-per-virtual-pipeline-stage", &a.layers_per_virtual_stage,
            "layers per virtual pipeline stage (each rank holds several model chunks; 0: none)");
  f.add_int("num-virtual-stages-per-pipeline-rank", &a.virtual_stages_per_rank,
            "model chunks per pipeline rank (alternative to the flag above; 0: none)");
  f.add_int("decoder-first-pipeline-num-layers", &a.first_stage_layers,
            "layers of the first pipeline stage (uneven stages: the other stages share the rest evenly; 0: even)");
  f.add_int("decoder-last-pipeline-num-layers", &a.last_stage_layers,
            "layers of the last pipeline stage (uneven stages: the other stages share the rest evenly; 0: even)");
  f.add_int("context-parallel-size", &a.cp,
            "context parallelism: ranks that split each sequence (2 x CP chunks, load-balanced for causal attention)");
  f.add_int("expert-model-parallel-size", &a.ep, "expert parallelism: ranks that split the experts (divides the world)");
  f.add_int("expert-tensor-parallel-size", &a.etp, "expert tensor parallelism: ranks that split each expert's FFN");
  f.add_bool("use-distributed-optimizer", &a.use_distributed_optimizer,
             "shard AdamW states over the data-parallel ranks (ZeRO-1; experts over expert-data-parallel)");
  f.add_bool("overlap-grad-reduce", &a.overlap_grad_reduce,
             "reduce each layer's gradients during the last micro-batch's backward (all-reduce, or with the distributed "
             "optimizer a reduce to each shard's owner)");
  f.add_bool("overlap-param-gather", &a.overlap_param_gather,
             "with the distributed optimizer: all-gather the updated parameters layer by layer on the communication "
             "stream; the next forward waits for each layer's just before using it (needs --overlap-grad-reduce)");
  f.add_double("distributed-timeout-minutes", &a.distributed_timeout_minutes,
               "a collective that waits longer ends every rank with a message naming it and its group (fractions "
               "allowed; GPU ranks are watched only when the flag is given)");
  f.add_choice("moe-token-dispatcher-type", &a.token_dispatcher, {"allgather", "alltoall", "flex"},
               "expert-parallel token dispatch: allgather (default) or alltoall");
  f.add_int("emulate-world-size", &a.emulate_world_size,
            "run ONE process as one rank of a job of this many ranks (with --emulate-rank): its shard and steps, "
            "communication replaced by local stand-ins, so --memory-report measures that rank's peak; losses are "
            "not meaningful (0: off)");
  f.add_int("emulate-rank", &a.emulate_rank, "with --emulate-world-size: which rank to emulate (0 <= R < N)");
}

// Megatron flags for fusions moecore always runs (accepted) and features it lacks (refused by name).
void register_megatron_compat_flags(cli::FlagSet& f, TrainArgs& a) {
  // Megatron's performance flags. The fusions they ask for are how moecore always runs, so they
  // are accepted (a Megatron script runs unchanged); the features moecore lacks are refused.
  f.add_bool("moe-grouped-gemm", &a.moe_grouped_gemm, "accepted: the experts always run as grouped GEMMs");
  f.add_bool("moe-router-fusion", &a.moe_router_fusion,
             "accepted: the router's top-k, probabilities and balancing statistics are always fused");
  f.add_bool("moe-permute-fusion", &a.moe_permute_fusion,
             "accepted: permutation and unpermutation are always fused (the probabilities are applied in the "
             "SwiGLU activation, as Megatron does, or in the unpermutation for GELU experts)");
  f.add_bool("cross-entropy-loss-fusion", &a.cross_entropy_loss_fusion,
             "accepted: the loss is always fused with the output layer (chunked, no logits kept)");
  f.add_choice("cross-entropy-fusion-impl", &a.cross_entropy_fusion_impl, {"te", "native"},
               "accepted: te or native (moecore's own kernels)");
  f.add_bool("tp-comm-overlap", &a.tp_comm_overlap,
             "with --sequence-parallel: the layers' sequence all-gathers / reduce-scatters in row chunks, "
             "overlapped with the linears' GEMMs");
  f.add_string("moe-flex-dispatcher-backend", &a.flex_dispatcher_backend, "not available: the flex dispatcher (refused)");
  f.add_bool("manual-gc", &a.manual_gc, "Python's garbage collector: moecore has none (refused: drop the flag)");
  f.add_bool("no-masked-softmax-fusion", &a.no_masked_softmax_fusion,
             "accepted: moecore's attention has no masked-softmax kernel to turn off");
  f.add_string("cuda-graph-impl", &a.cuda_graph_impl,
               "CUDA graphs: local (with --cuda-graph-scope full_iteration, one GPU) or none (default)");
  f.add_list("cuda-graph-scope", &a.cuda_graph_scope,
             "what a CUDA graph captures: full_iteration (the whole training step; Megatron's per-module scopes are refused)");
  f.add_int("cuda-graph-warmup-steps", &a.cuda_graph_warmup_steps, "eager steps before the CUDA graph's capture (with --cuda-graph-impl local; 3 when not given)");
  f.add_bool("external-cuda-graph", &a.external_cuda_graph, "not available: graphs captured by the caller (refused)");
  f.add_bool("te-rng-track", &a.te_rng_track, "not available: Transformer Engine's RNG tracker (refused)");
  f.add_bool("overlap-p2p-comm", &a.overlap_p2p_comm, "not available: pipeline sends overlapped with compute (refused)");
  f.add_string("pipeline-model-parallel-layout", &a.pipeline_layout,
               "not available: custom pipeline layouts; --decoder-first/last-pipeline-num-layers are (refused)");
  f.add_int("num-distributed-optimizer-instances", &a.distributed_optimizer_instances,
            "not available: hybrid-sharded data parallelism (refused unless 1)");
  f.add_bool("fine-grained-activation-offloading", &a.fine_grained_activation_offloading,
             "move the saved inputs of the --offload-modules to host memory after each layer's forward and back "
             "before its backward (copies overlapped with computation)");
  f.add_list("offload-modules", &a.offload_modules,
             "with --fine-grained-activation-offloading: attn_norm, core_attn, attn_proj, mlp_norm, expert_fc1, "
             "moe_act (each module's saved input)");
  f.add_bool("optimizer-cpu-offload", &a.optimizer_cpu_offload,
             "keep (--optimizer-offload-fraction of) the fp32 masters and AdamW moments in host memory and update "
             "them there with a multi-threaded host AdamW (bit-identical results); not with split masters "
             "(bf16 needs --no-store-param-remainders)");
  f.add_double("optimizer-offload-fraction", &a.optimizer_offload_fraction,
               "with --optimizer-cpu-offload: the share 0 < F <= 1 of each rank's optimizer state on the host "
               "(whole parameters, nearest to F)");
  f.set_default_text("optimizer-offload-fraction", "1");
  f.add_bool("fake-init-process-group", &a.fake_init_process_group,
             "Megatron's fake process group (refused: use --emulate-world-size N --emulate-rank R)");
  f.add_int("manual-gc-interval", &a.manual_gc_interval, "Python's garbage collector: moecore has none (refused)");
  f.add_string("ckpt-format", &a.ckpt_format, "not available: one checkpoint format (refused)");
  f.add_bool("auto-detect-ckpt-format", &a.auto_detect_ckpt_format, "not available: one checkpoint format (refused)");
  f.add_bool("overlap-moe-expert-parallel-comm", &a.overlap_moe_ep_comm,
             "interleave one micro-batch's forward with another's backward layer by layer so that each one's "
             "expert-parallel all-to-alls overlap the other's computation (the same numbers); needs "
             "--expert-model-parallel-size > 1, alltoall dispatch, 2+ micro-batches, no pipeline stages");
  f.add_bool("delay-wgrad-compute", &a.delay_wgrad_compute,
             "with --overlap-moe-expert-parallel-comm: the experts' weight gradients after the dispatch gradient's "
             "all-to-all is issued (the same numbers)");
  f.add_bool("moe-shared-expert-overlap", &a.moe_shared_expert_overlap,
             "the shared expert computes while the routed tokens travel (a side stream on the GPU; the same "
             "numbers); needs --moe-shared-expert-intermediate-size and --moe-token-dispatcher-type alltoall");
  f.add_bool("moe-enable-deepep", &a.moe_enable_deepep, "not available: DeepEP kernels (the flex dispatcher) (refused)");
  f.add_bool("moe-layer-recompute", &a.moe_layer_recompute,
             "recompute each MoE layer from its input in the backward (= --recompute-modules moe)");
  f.add_bool("moe-use-upcycling", &a.moe_use_upcycling, "not available: dense-to-MoE upcycling (refused)");
  f.add_int("moe-upcycling-granularity", &a.moe_upcycling_granularity,
            "not available: goes with --moe-use-upcycling (refused unless 1)");
  f.add_bool("fp8-param-gather", &a.fp8_param_gather,
             "the distributed optimizer all-gathers the FP8 linears' weights as FP8 codes (needs --bf16)");
  f.add_bool("moe-router-padding-for-fp8", &a.moe_router_padding_for_fp8,
             "with FP8 training: pad the routing map (not the tokens) so every expert's rows are a multiple of 16 "
             "(the first unrouted tokens, probability 0); alltoall dispatcher, no padding to capacity");
}

// FP8 training (model/fp8_linear.h): the transformer layers' linears on FP8 operands.
void register_fp8_flags(cli::FlagSet& f, TrainArgs& a) {
  f.add_string("fp8-format", &a.fp8_format,
               "FP8 training: e4m3 (every operand E4M3) or hybrid (E4M3 forward, E5M2 gradients); cuBLASLt FP8 GEMMs on a GPU, "
               "emulated on the CPU");
  f.add_bool("fp8", &a.fp8, "FP8 training in E4M3 (= --fp8-format e4m3 unless --fp8-format is given)");
  f.add_string("fp8-recipe", &a.fp8_recipe,
               "FP8 scaling: delayed (default; amax history), tensorwise (current amax), blockwise (1x128 tiles, "
               "128x128 weight blocks); mxfp8 needs Blackwell (refused)");
  f.add_int("fp8-amax-history-len", &a.fp8_amax_history_len, "delayed scaling: amaxes kept per tensor");
  f.set_default_text("fp8-amax-history-len", "1");
  f.add_string("fp8-amax-compute-algo", &a.fp8_amax_compute_algo,
               "delayed scaling: most_recent (default) or max over the history");
  f.add_int("fp8-margin", &a.fp8_margin, "delayed scaling: scales divided by 2^margin (default 0)");
}

// The FP8 flags into a.model.fp8; every misuse refused by name.
void check_fp8_flags(TrainArgs& a) {
  Fp8Config& c = a.model.fp8;
  MC_CHECK(a.fp8_format.empty() || a.fp8_format == "e4m3" || a.fp8_format == "hybrid", "--fp8-format '", a.fp8_format,
           "': expected e4m3 or hybrid");
  c.enabled = a.fp8 || !a.fp8_format.empty();
  c.hybrid = a.fp8_format == "hybrid";
  MC_CHECK(a.fp8_recipe != "mxfp8", "--fp8-recipe mxfp8 needs a Blackwell GPU (MXFP8 block scaling is native on "
           "GB200/GB300); on Hopper and on the CPU use --fp8-recipe blockwise");
  MC_CHECK(a.fp8_recipe.empty() || a.fp8_recipe == "delayed" || a.fp8_recipe == "tensorwise" ||
               a.fp8_recipe == "blockwise",
           "--fp8-recipe '", a.fp8_recipe, "': expected delayed, tensorwise or blockwise");
  MC_CHECK(a.fp8_amax_compute_algo.empty() || a.fp8_amax_compute_algo == "max" ||
               a.fp8_amax_compute_algo == "most_recent",
           "--fp8-amax-compute-algo '", a.fp8_amax_compute_algo, "': expected max or most_recent");
  MC_CHECK(a.fp8_amax_history_len == TrainArgs::kFp8HistoryNotGiven || a.fp8_amax_history_len >= 1, "--fp8-amax-history-len ", a.fp8_amax_history_len,
           ": expected at least 1");
  MC_CHECK(a.fp8_margin >= 0 && a.fp8_margin <= 64, "--fp8-margin ", a.fp8_margin, ": expected 0 to 64");
  for (const auto& [given, flag] : {std::pair{!a.fp8_recipe.empty(), "--fp8-recipe"},
                                    std::pair{a.fp8_amax_history_len != TrainArgs::kFp8HistoryNotGiven, "--fp8-amax-history-len"},
                                    std::pair{!a.fp8_amax_compute_algo.empty(), "--fp8-amax-compute-algo"},
                                    std::pair{a.fp8_margin != 0, "--fp8-margin"},
                                    std::pair{a.moe_router_padding_for_fp8, "--moe-router-padding-for-fp8"}})
    MC_CHECK(!given || c.enabled, flag, " needs FP8 training: add --fp8-format e4m3|hybrid (or --fp8)");
  c.recipe = a.fp8_recipe == "tensorwise" ? Fp8Config::Recipe::Tensorwise
             : a.fp8_recipe == "blockwise" ? Fp8Config::Recipe::Blockwise
                                           : Fp8Config::Recipe::Delayed;
  const bool delayed = c.recipe == Fp8Config::Recipe::Delayed;
  for (const auto& [given, flag] : {std::pair{a.fp8_amax_history_len != TrainArgs::kFp8HistoryNotGiven, "--fp8-amax-history-len"},
                                    std::pair{!a.fp8_amax_compute_algo.empty(), "--fp8-amax-compute-algo"},
                                    std::pair{a.fp8_margin != 0, "--fp8-margin"}})
    MC_CHECK(!given || delayed, flag, " applies to --fp8-recipe delayed only; this run uses --fp8-recipe ",
             a.fp8_recipe);
  c.amax_history_len = a.fp8_amax_history_len == TrainArgs::kFp8HistoryNotGiven ? 1 : a.fp8_amax_history_len;
  c.amax_compute_max = a.fp8_amax_compute_algo == "max";
  c.margin = a.fp8_margin;
  // --fp8-param-gather (train/fp8_param_gather.h): Megatron's requirements, and the layouts it does not cover yet.
  MC_CHECK(!a.fp8_param_gather || c.enabled, "--fp8-param-gather needs FP8 training: add --fp8-format e4m3|hybrid (or --fp8)");
  MC_CHECK(!a.fp8_param_gather || a.use_distributed_optimizer, "--fp8-param-gather needs --use-distributed-optimizer "
           "(it replaces the distributed optimizer's parameter all-gather)");
  MC_CHECK(!a.fp8_param_gather || a.bf16, "--fp8-param-gather needs --bf16: it all-gathers FP8 codes instead of the bf16 "
           "weights; with fp32 parameters the fp32 masters are the weights and are gathered whole");
  MC_CHECK(!a.fp8_param_gather || !a.overlap_param_gather,
           "--fp8-param-gather with --overlap-param-gather is not supported yet: drop one of them");
  MC_CHECK(!a.fp8_param_gather || !a.optimizer_cpu_offload,
           "--fp8-param-gather with --optimizer-cpu-offload is not supported yet: drop one of them");
  c.router_padding = a.moe_router_padding_for_fp8;
  MC_CHECK(!c.router_padding || !a.model.moe.pad_to_capacity, "--moe-router-padding-for-fp8 with "
           "--moe-pad-expert-input-to-capacity: padding to capacity already fixes every expert's rows; drop one of them");
  MC_CHECK(!c.router_padding || a.dispatcher == DispatcherType::AllToAll || (a.ep == 1 && a.etp == 1),
           "--moe-router-padding-for-fp8 with --moe-token-dispatcher-type allgather over --expert-model-parallel-size ",
           a.ep, " x --expert-tensor-parallel-size ", a.etp, ": the padded routing differs in width from rank to rank "
           "(Megatron refuses it too); use --moe-token-dispatcher-type alltoall");
}

// Data: mock data or Megatron .bin/.idx datasets with a tokenizer.
void register_data_flags(cli::FlagSet& f, TrainArgs& a) {
  f.add_bool("mock-data", &a.mock_data, "synthetic learnable data (arithmetic progressions)");
  f.add_list("data-path", &a.data_path, "Megatron dataset prefixes (.bin/.idx), optionally weighted: [w1] p1 [w2 p2 ...]");
  f.add_string("split", &a.split, "train,valid,test weights over documents");
  f.add_string("data-cache-path", &a.data_cache_path, "where sample indices are cached (default: beside the data)");
  f.add_string("tokenizer-type", &a.tokenizer_type, kTokenizerTypes);
  f.add_string("tokenizer-model", &a.tokenizer_model, "tokenizer.json or .model file");
  f.add_int("make-vocab-size-divisible-by", &a.make_vocab_size_divisible_by, "pad the tokenizer's vocabulary to a multiple of this");
}

// Upper bounds of the sizes, far above any model this code is meant for: an absurd value (a typo,
// a wrong unit) fails here naming its flag instead of allocating until memory runs out.
void check_size_bounds(const TrainArgs& a) {
  const ModelConfig& m = a.model;
  struct Bound {
    const char* flag;
    int64_t value, max;
    const char* what;
  };
  const Bound bounds[] = {
      {"--num-layers", m.num_layers, 4096, "layers"},
      {"--hidden-size", m.hidden_size, int64_t{1} << 18, "model width"},
      {"--ffn-hidden-size", m.ffn_hidden_size, int64_t{1} << 21, "MLP width"},
      {"--num-attention-heads", m.num_attention_heads, 4096, "attention heads"},
      {"--num-query-groups", m.num_query_groups, 4096, "key/value heads"},
      {"--kv-channels", m.kv_channels, int64_t{1} << 14, "head dim"},
      {"--q-lora-rank", m.mla.q_lora_rank, int64_t{1} << 18, "query latent width"},
      {"--kv-lora-rank", m.mla.kv_lora_rank, int64_t{1} << 18, "key/value latent width"},
      {"--qk-head-dim", m.mla.qk_head_dim, int64_t{1} << 14, "head dim"},
      {"--qk-pos-emb-head-dim", m.mla.qk_pos_emb_head_dim, int64_t{1} << 14, "head dim"},
      {"--v-head-dim", m.mla.v_head_dim, int64_t{1} << 14, "head dim"},
      {"--seq-length", m.seq_length, int64_t{1} << 22, "tokens per sample"},
      {"--max-position-embeddings", m.max_position_embeddings, int64_t{1} << 22, "positions"},
      {"--vocab-size", m.vocab_size, int64_t{1} << 24, "vocabulary entries"},
      {"--num-experts", m.moe.num_experts, int64_t{1} << 14, "experts per layer"},
      {"--moe-ffn-hidden-size", m.moe.ffn_hidden_size, int64_t{1} << 21, "expert FFN width"},
      {"--moe-shared-expert-intermediate-size", m.moe.shared_expert_size, int64_t{1} << 21, "shared expert width"},
      {"--moe-router-topk", m.moe.router.topk, int64_t{1} << 14, "experts per token"},
      {"--micro-batch-size", a.micro_batch_size, int64_t{1} << 20, "samples per micro-batch"},
      {"--global-batch-size", a.global_batch_size, int64_t{1} << 24, "samples per step"},
  };
  for (const Bound& b : bounds)
    MC_CHECK(b.value <= b.max, b.flag, " ", b.value, " is out of range: expected at most ", b.max, " ", b.what,
             " (far above any model this version trains; a typo or a wrong unit?)");
  MC_CHECK(m.seq_length * a.micro_batch_size <= (int64_t{1} << 31), "--seq-length ", m.seq_length,
           " x --micro-batch-size ", a.micro_batch_size, " is more than 2^31 tokens in one micro-batch");
}

// The weights, gradients and AdamW moments against the device's memory (a lower bound of what the
// run needs: activations come on top): a model that cannot fit fails here naming its size flags.
void check_state_memory(const TrainArgs& a) {
  const ModelConfig& m = a.model;
  StateLayout layout;
  layout.tp = a.tp;
  layout.pp = a.pp;
  layout.ep = a.ep;
  layout.etp = a.etp;
  layout.dp = a.data_parallel_size();
  layout.distributed_optimizer = a.use_distributed_optimizer;
  layout.bf16 = a.bf16;
  layout.exp_avg_bytes = a.exp_avg_dtype == "bf16" ? 2 : 4;
  layout.exp_avg_sq_bytes = a.exp_avg_sq_dtype == "bf16" ? 2 : 4;
  const double available = device_memory_bytes(a.device.is_cuda(), a.device.index, comm::read_launch_env().local_world);
  if (available <= 0) return;
  const StateMemory need = estimate_state_memory(m, layout);
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  MC_CHECK(need.bytes_per_rank <= available, "the model does not fit: ", need.params, " parameters (--num-layers ",
           m.num_layers, ", --hidden-size ", m.hidden_size, ", --ffn-hidden-size ", m.ffn_hidden_size, ", --num-experts ",
           m.moe.num_experts, ", --moe-ffn-hidden-size ", m.moe.ffn_hidden_size, ", --vocab-size ", m.vocab_size,
           ") need at least ", need.bytes_per_rank / kGiB, " GiB per rank for weights, gradients and AdamW moments ",
           "(over --tensor-model-parallel-size ", a.tp, " x --pipeline-model-parallel-size ", a.pp,
           ", experts over --expert-model-parallel-size ", a.ep, "), but ", a.device.str(), " has ", available / kGiB,
           " GiB for this rank; make the model smaller or spread it over more ranks");
}

// --num-experts 0 (a dense model) with flags that only mean something for MoE layers: refused by
// name rather than training a dense model without a word. MoE flags of a config file stay
// allowed when --num-experts 0 on the command line turns its model dense on purpose.
void check_moe_flags_need_experts(const cli::FlagSet& flags, const TrainArgs& a) {
  if (a.model.moe.num_experts > 0) return;
  const bool dense_on_purpose = flags.given_on_command_line("num-experts");
  // Megatron's fusion switches, accepted because moecore always runs so: they change nothing.
  static const char* const kNoEffect[] = {"moe-grouped-gemm", "moe-router-fusion", "moe-permute-fusion"};
  for (const auto& [name, value] : a.flag_values) {
    if (name.rfind("moe-", 0) != 0 || !flags.given(name)) continue;
    if (std::find(std::begin(kNoEffect), std::end(kNoEffect), name) != std::end(kNoEffect)) continue;
    if (dense_on_purpose && !flags.given_on_command_line(name)) continue;
    MC_FAIL("--", name, " is an MoE flag, but --num-experts is ", a.model.moe.num_experts,
            " (a dense model); give --num-experts N for MoE layers, or drop the MoE flags");
  }
}

// The MLA flags without --multi-latent-attention, YaRN's without --rope-type yarn: refused by name
// rather than ignored. `user_given`: the flags the command line or --config gave (a checkpoint's
// recorded values are not the user's: they hold every flag).
const char* const kMlaFlags[] = {"q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim"};
const char* const kYarnFlags[] = {"rotary-scaling-factor", "original-max-position-embeddings", "beta-fast",
                                  "beta-slow", "mscale", "mscale-all-dim"};

std::vector<std::string> given_mla_flags(const cli::FlagSet& flags) {
  std::vector<std::string> out;
  for (const char* name : kMlaFlags)
    if (flags.given(name)) out.push_back(name);
  for (const char* name : kYarnFlags)
    if (flags.given(name)) out.push_back(name);
  return out;
}

void check_mla_flags_need_mla(const std::vector<std::string>& user_given, const TrainArgs& a) {
  for (const std::string& name : user_given) {
    const bool mla_flag = std::find(std::begin(kMlaFlags), std::end(kMlaFlags), name) != std::end(kMlaFlags);
    if (mla_flag)
      MC_CHECK(a.model.mla.enabled, "--", name, " is a Multi-Latent Attention flag: it needs --multi-latent-attention");
    else
      MC_CHECK(a.model.rope_yarn, "--", name, " is a YaRN flag: it needs --rope-type yarn");
  }
}

// The model flags onto the model config; the data source and the vocabulary; the model checks.
void apply_model_flags(TrainArgs& a) {
  ModelConfig& m = a.model;
  check_size_bounds(a);
  m.swiglu = a.swiglu_flag_;
  m.add_bias_linear = !a.disable_bias_flag_;
  // Megatron's --no-position-embedding removes the learned absolute table; RoPE is not one.
  if (a.no_position_embedding && m.position_embedding_type == "learned_absolute") m.position_embedding_type = "none";
  if (!a.group_query_attention_flag_) {
    MC_CHECK(m.num_query_groups == 0 || m.num_query_groups == m.num_attention_heads,
             "--num-query-groups needs --group-query-attention");
    m.num_query_groups = 0;
  }
  MC_CHECK(a.mock_data != !a.data_path.empty(), "moecore train needs exactly one data source: --mock-data or "
                                                "--data-path PREFIX (Megatron .bin/.idx)");
  if (!a.data_path.empty()) {
    a.data_blend = parse_data_path(a.data_path);
    MC_CHECK(!a.tokenizer_type.empty(), "--data-path needs --tokenizer-type (it sets the vocabulary size)");
    const int64_t tok_vocab = make_tokenizer(a.tokenizer_type, a.tokenizer_model)->vocab_size();
    MC_CHECK(a.make_vocab_size_divisible_by >= 1, "--make-vocab-size-divisible-by must be >= 1");
    const int64_t d = a.make_vocab_size_divisible_by, padded = (tok_vocab + d - 1) / d * d;
    MC_CHECK(m.vocab_size == 0 || m.vocab_size >= tok_vocab, "--vocab-size ", m.vocab_size,
             " is smaller than the tokenizer's vocabulary (", tok_vocab, ", --tokenizer-type ", a.tokenizer_type,
             a.load.empty() ? ")" : "); with --load the vocabulary is the checkpoint's model's: its data must be "
                                    "preprocessed with the checkpoint's tokenizer");
    if (m.vocab_size == 0) m.vocab_size = padded;
  }
  finalize_model_config(m, a.moe_layer_freq);
}

// Batches, the learning-rate schedule, AdamW, logging and checkpoint intervals.
void check_schedule_flags(TrainArgs& a) {
  MC_CHECK(a.micro_batch_size >= 1, "--micro-batch-size ", a.micro_batch_size, " must be >= 1");
  MC_CHECK(a.global_batch_size >= 0, "--global-batch-size ", a.global_batch_size, " must be >= 1 (0: micro batch size)");
  if (a.global_batch_size == 0) a.global_batch_size = a.micro_batch_size;
  MC_CHECK(a.global_batch_size % a.micro_batch_size == 0, "--global-batch-size ", a.global_batch_size,
           " is not divisible by --micro-batch-size ", a.micro_batch_size);
  MC_CHECK(a.train_iters >= 1, "--train-iters ", a.train_iters, " must be >= 1");
  MC_CHECK(a.lr >= 0 && a.min_lr >= 0 && a.min_lr <= a.lr, "--lr ", a.lr, " and --min-lr ", a.min_lr,
           " must satisfy 0 <= min-lr <= lr");
  if (a.lr_decay_iters == 0) a.lr_decay_iters = a.train_iters;
  MC_CHECK(a.lr_warmup_iters >= 0 && a.lr_warmup_iters <= a.lr_decay_iters, "--lr-warmup-iters ",
           a.lr_warmup_iters, " must be in [0, --lr-decay-iters ", a.lr_decay_iters, "]");
  MC_CHECK(a.lr_decay_iters >= 1 && a.lr_wsd_decay_iters >= 0, "--lr-decay-iters and --lr-wsd-decay-iters must be >= 0");
  if (a.lr_wsd_decay_iters == 0) a.lr_wsd_decay_iters = std::max<int64_t>(1, a.lr_decay_iters / 10);
  MC_CHECK(a.lr_wsd_decay_iters <= a.lr_decay_iters, "--lr-wsd-decay-iters ", a.lr_wsd_decay_iters,
           " exceeds --lr-decay-iters ", a.lr_decay_iters);
  MC_CHECK(a.weight_decay >= 0, "--weight-decay ", a.weight_decay, " must be >= 0");
  MC_CHECK(a.adam_beta1 >= 0 && a.adam_beta1 < 1 && a.adam_beta2 >= 0 && a.adam_beta2 < 1,
           "--adam-beta1 and --adam-beta2 must be in [0, 1)");
  MC_CHECK(a.adam_eps > 0, "--adam-eps ", a.adam_eps, " must be > 0");
  MC_CHECK(a.clip_grad >= 0, "--clip-grad ", a.clip_grad, " must be >= 0");
  for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{"--exp-avg-dtype", a.exp_avg_dtype},
                                    {"--exp-avg-sq-dtype", a.exp_avg_sq_dtype}}) {
    MC_CHECK(value == "fp32" || a.precision_aware_optimizer, flag, " ", value,
             " needs --use-precision-aware-optimizer (as in Megatron)");
  }
  MC_CHECK(a.bf16 || !a.no_store_param_remainders, "--no-store-param-remainders needs --bf16 (fp32 compute keeps ",
           "whole fp32 weights: there are no remainders to store)");
  MC_CHECK(a.log_interval >= 1, "--log-interval ", a.log_interval, " must be >= 1");
  MC_CHECK(a.progress_interval_s >= 0, "--progress-interval ", a.progress_interval_s, " must be >= 0 seconds");
  MC_CHECK(a.timing_log_level >= 0 && a.timing_log_level <= 2, "--timing-log-level ", a.timing_log_level,
           " must be 0 (no timers), 1 (the step's phases) or 2 (also the model's parts)");
  MC_CHECK(a.eval_interval >= 0 && a.eval_iters >= 1, "--eval-interval must be >= 0 and --eval-iters >= 1");
  MC_CHECK(a.save_interval >= 0, "--save-interval ", a.save_interval, " must be >= 0");
  MC_CHECK(a.save_interval == 0 || !a.save.empty(), "--save-interval needs --save");
  MC_CHECK(!a.finetune || !a.load.empty(), "--finetune needs --load (the checkpoint whose weights to start from)");
  MC_CHECK(!a.no_load_optim || !a.load.empty(), "--no-load-optim needs --load (the checkpoint to resume from)");
  MC_CHECK(a.distributed_timeout_minutes > 0, "--distributed-timeout-minutes ", a.distributed_timeout_minutes,
           " must be > 0");
  std::error_code ec;
  MC_CHECK(a.load.empty() || !std::filesystem::exists(a.load, ec) || std::filesystem::is_directory(a.load, ec),
           "--load '", a.load, "' is a file; expected a checkpoint directory (a --save directory or an iter_* in it)");
}

// --emulate-world-size N --emulate-rank R: this one process stands for rank R of an N-rank job
// (comm/emulated_communicator.h). Returns the place the layout checks see: rank R of N.
comm::LaunchEnv emulated_launch(const TrainArgs& a, const comm::LaunchEnv& launched) {
  if (a.emulate_world_size == 0 && a.emulate_rank == -1) return launched;
  MC_CHECK(a.emulate_world_size != 0, "--emulate-rank ", a.emulate_rank,
           " needs --emulate-world-size N (the number of ranks of the job whose rank to emulate)");
  MC_CHECK(a.emulate_world_size >= 1, "--emulate-world-size ", a.emulate_world_size,
           " must be >= 1 (the number of ranks of the job to emulate)");
  MC_CHECK(a.emulate_rank != -1, "--emulate-world-size ", a.emulate_world_size,
           " needs --emulate-rank R: which of the ranks to run (0 <= R < ", a.emulate_world_size, ")");
  MC_CHECK(a.emulate_rank >= 0 && a.emulate_rank < a.emulate_world_size, "--emulate-rank ", a.emulate_rank,
           " is outside the emulated world of ", a.emulate_world_size, " ranks (--emulate-world-size); expected 0 <= R < ",
           a.emulate_world_size);
  MC_CHECK(launched.world == 1, "--emulate-world-size runs one process standing for rank ", a.emulate_rank, " of ",
           a.emulate_world_size, ", but the launcher (", launched.launcher, ") started this one as rank ", launched.rank,
           " of ", launched.world, "; start a single process, without mpirun / srun / torchrun");
  MC_CHECK(a.save.empty(), "--save with --emulate-world-size: an emulated rank holds one shard trained on stand-in "
           "values, not a checkpoint; drop --save");
  MC_CHECK(a.load.empty(), "--load with --emulate-world-size: the emulated rank's memory does not depend on the weights "
           "and its shard alone cannot be loaded consistently; drop --load");
  comm::LaunchEnv env = launched;
  env.world = static_cast<int>(a.emulate_world_size);
  env.rank = static_cast<int>(a.emulate_rank);
  return env;
}

// The launched ranks and the parallel layout (Megatron's rules) against the model.
void check_parallel_layout(TrainArgs& a, const comm::LaunchEnv& env) {
  ModelConfig& m = a.model;
  MoeConfig& e = a.model.moe;
  a.world = env.world;
  a.rank = env.rank;
  a.local_rank = env.local_rank;
  for (const auto& [flag, size] : {std::pair<const char*, int64_t>{"--tensor-model-parallel-size", a.tp},
                                   {"--pipeline-model-parallel-size", a.pp}, {"--context-parallel-size", a.cp},
                                   {"--expert-model-parallel-size", a.ep}, {"--expert-tensor-parallel-size", a.etp}})
    MC_CHECK(size >= 1, flag, " ", size, " must be >= 1");
  MC_CHECK(a.ep == 1 || e.num_experts > 0, "--expert-model-parallel-size ", a.ep, " needs an MoE model (--num-experts)");
  MC_CHECK(a.etp == 1 || e.num_experts > 0, "--expert-tensor-parallel-size ", a.etp, " needs an MoE model (--num-experts)");
  const char* ranks = a.emulated() ? " emulated ranks (--emulate-world-size)" : " launched ranks";
  MC_CHECK(a.world % (a.tp * a.cp * a.pp) == 0, "--tensor-model-parallel-size ", a.tp, " x --context-parallel-size ",
           a.cp, " x --pipeline-model-parallel-size ", a.pp, " does not divide the ", a.world, ranks,
           "; expected a divisor of the world size");
  MC_CHECK(a.world % (a.etp * a.ep * a.pp) == 0, "--expert-model-parallel-size ", a.ep,
           " x --expert-tensor-parallel-size ", a.etp, " x --pipeline-model-parallel-size ", a.pp, " does not divide the ",
           a.world, ranks, "; expected a divisor of the world size");
  // The layout as process groups (Megatron's rules: order, pp placement, sizes vs the model).
  parallel::validate(a.parallel_config(), parallel::ModelDims{});
  MC_CHECK(m.num_attention_heads % a.tp == 0 && m.kv_heads() % a.tp == 0, "--tensor-model-parallel-size ", a.tp,
           " must divide --num-attention-heads ", m.num_attention_heads, " and the ", m.kv_heads(),
           " query groups (--num-query-groups)");
  MC_CHECK(m.vocab_size % a.tp == 0, "--tensor-model-parallel-size ", a.tp, " does not divide the vocabulary of ",
           m.vocab_size, " (--vocab-size, or the tokenizer's padded by --make-vocab-size-divisible-by)");
  bool dense_layers = false;  // the dense FFN size matters only where a layer is dense
  for (int64_t i = 0; i < m.num_layers; ++i) dense_layers = dense_layers || !m.is_moe(i);
  MC_CHECK((!dense_layers || m.ffn_hidden_size % a.tp == 0) && e.shared_expert_size % a.tp == 0,
           "--tensor-model-parallel-size ", a.tp, " must divide --ffn-hidden-size ", m.ffn_hidden_size,
           " (dense layers) and --moe-shared-expert-intermediate-size ", e.shared_expert_size);
  MC_CHECK(a.cp == 1 || m.seq_length % (2 * a.cp) == 0, "--seq-length ", m.seq_length,
           " must be divisible by 2 x --context-parallel-size = ", 2 * a.cp, " (two chunks per rank)");
  if (a.tp == 1) a.sequence_parallel = false;  // Megatron: nothing to split over one rank
  MC_CHECK(!a.sequence_parallel || (m.seq_length / a.cp) % a.tp == 0, "--sequence-parallel: --seq-length ",
           m.seq_length, " / --context-parallel-size ", a.cp, " must be divisible by --tensor-model-parallel-size ", a.tp);
  MC_CHECK(e.num_experts == 0 || a.tp == 1 || a.sequence_parallel, "MoE layers with --tensor-model-parallel-size ",
           a.tp, " need --sequence-parallel (as in Megatron-Core)");
  const bool uneven = a.first_stage_layers != 0 || a.last_stage_layers != 0;
  MC_CHECK(uneven || a.model.num_layers % a.pp == 0, "--num-layers ", a.model.num_layers,
           " is not divisible by --pipeline-model-parallel-size ", a.pp,
           "; expected equal stages, or uneven ones through --decoder-first-pipeline-num-layers / "
           "--decoder-last-pipeline-num-layers");
  // Megatron's rule: with uneven stages the virtual pipeline is given per rank.
  MC_CHECK(!uneven || a.layers_per_virtual_stage == 0, "--num-layers-per-virtual-pipeline-stage with "
           "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: use "
           "--num-virtual-stages-per-pipeline-rank to give the virtual pipeline size with uneven stages");
  MC_CHECK(a.layers_per_virtual_stage >= 0 && a.virtual_stages_per_rank >= 0,
           "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank must be >= 0");
  MC_CHECK(a.layers_per_virtual_stage == 0 || a.virtual_stages_per_rank == 0,
           "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are alternatives; pass one");
  if (a.layers_per_virtual_stage > 0 || a.virtual_stages_per_rank > 0) {
    MC_CHECK(a.pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1");
    const int64_t per_rank = a.model.num_layers / a.pp;
    MC_CHECK(uneven || a.layers_per_virtual_stage == 0 || per_rank % a.layers_per_virtual_stage == 0,
             "--num-layers-per-virtual-pipeline-stage ", a.layers_per_virtual_stage, " does not divide the ", per_rank,
             " layers of each pipeline rank (--num-layers / --pipeline-model-parallel-size)");
    MC_CHECK(uneven || a.virtual_stages_per_rank == 0 || per_rank % a.virtual_stages_per_rank == 0,
             "--num-virtual-stages-per-pipeline-rank ", a.virtual_stages_per_rank, " does not divide the ", per_rank,
             " layers of each pipeline rank (--num-layers / --pipeline-model-parallel-size)");
  }
  stage_layers(a.model.num_layers, a.pp, a.virtual_stages(), a.first_stage_layers, a.last_stage_layers, 0);  // checks
}

// Activation recomputation: --recompute-granularity selective with --recompute-modules, full with
// --recompute-method and --recompute-num-layers, --moe-layer-recompute.
void check_recompute_flags(TrainArgs& a) {
  MoeConfig& e = a.model.moe;
  RecomputeConfig& r = a.model.recompute;
  MC_CHECK(a.recompute_modules.empty() || a.recompute_granularity == "selective",
           "--recompute-modules needs --recompute-granularity selective");
  MC_CHECK(r.full_method.empty() || a.recompute_granularity == "full", "--recompute-method ", r.full_method,
           " needs --recompute-granularity full");
  MC_CHECK(r.full_num_layers == 0 || a.recompute_granularity == "full", "--recompute-num-layers ", r.full_num_layers,
           " needs --recompute-granularity full");
  if (a.recompute_granularity == "full") {
    MC_CHECK(!r.full_method.empty(), "--recompute-granularity full: give --recompute-method uniform or block");
    MC_CHECK(r.full_num_layers >= 1 && r.full_num_layers <= a.model.num_layers, "--recompute-num-layers ",
             r.full_num_layers, " is out of range: expected 1 to the ", a.model.num_layers, " decoder layers");
  }
  MC_CHECK(a.recompute_granularity != "selective" || !a.recompute_modules.empty(),
           "--recompute-granularity selective: name the modules with --recompute-modules (core_attn, moe_act, moe, "
           "mlp, shared_experts, mla_up_proj, layernorm)");
  if (a.moe_layer_recompute) {
    MC_CHECK(e.num_experts > 0, "--moe-layer-recompute needs an MoE model (--num-experts)");
    r.moe = true;
  }
  for (const std::string& module : a.recompute_modules) {
    if (module == "layernorm") {
      r.layernorm = true;
      continue;
    }
    if (module == "shared_experts") {
      MC_CHECK(e.shared_expert_size > 0, "--recompute-modules shared_experts needs shared experts "
               "(--moe-shared-expert-intermediate-size)");
      r.shared_experts = true;
      continue;
    }
    if (module == "core_attn") {
      r.core_attn = true;
      continue;
    }
    if (module == "mla_up_proj") {
      MC_CHECK(a.model.mla.enabled, "--recompute-modules mla_up_proj needs --multi-latent-attention");
      MC_CHECK(a.cp == 1, "--recompute-modules mla_up_proj with --context-parallel-size ", a.cp,
               " is not available in this version");
      a.model.mla.recompute_up_proj = true;
      continue;
    }
    if (module == "mlp") {
      r.mlp = true;
      continue;
    }
    MC_CHECK(module == "moe_act" || module == "moe", "--recompute-modules '", module,
             "': expected core_attn, moe_act, moe, mlp, shared_experts, mla_up_proj or layernorm");
    MC_CHECK(e.num_experts > 0, "--recompute-modules ", module, " needs an MoE model (--num-experts)");
    (module == "moe" ? r.moe : e.recompute_act) = true;
  }
}

// --fine-grained-activation-offloading with --offload-modules (model/activation_offload.h). After
// check_recompute_flags: a module whose saved input recomputation already drops is refused.
void check_offload_flags(TrainArgs& a) {
  MC_CHECK(!a.fine_grained_activation_offloading || !a.offload_modules.empty(),
           "--fine-grained-activation-offloading: name the modules with --offload-modules (",
           offload_module_names(), ")");
  MC_CHECK(a.fine_grained_activation_offloading || a.offload_modules.empty(),
           "--offload-modules needs --fine-grained-activation-offloading (as in Megatron)");
  if (!a.fine_grained_activation_offloading) return;
  const OffloadModules m = parse_offload_modules(a.offload_modules);  // an unknown name raises, listing them
  const RecomputeConfig& r = a.model.recompute;
  MC_CHECK(r.full_method.empty(), "--fine-grained-activation-offloading with --recompute-granularity full is not "
           "available in this version (the recomputed layers keep only their input); use --recompute-granularity "
           "selective");
  for (OffloadModule mod : {OffloadModule::kExpertFc1, OffloadModule::kMoeAct}) {
    if (!m.has(mod)) continue;
    MC_CHECK(a.model.moe.num_experts > 0, "--offload-modules ", offload_module_name(mod),
             " needs an MoE model (--num-experts)");
    MC_CHECK(!r.moe, "--offload-modules ", offload_module_name(mod), " with --recompute-modules moe (or "
             "--moe-layer-recompute): the MoE layer's saved tensors are dropped and recomputed, none is left to "
             "offload; drop one of them");
  }
  MC_CHECK(!m.has(OffloadModule::kAttnProj) || !r.core_attn, "--offload-modules attn_proj with --recompute-modules "
           "core_attn: the output projection's input is dropped and recomputed, none is left to offload; drop one "
           "of them (core_attn can be both: its q, k, v are offloaded, the output recomputed)");
  a.model.offload_modules = a.offload_modules;
}

// --tp-comm-overlap chunks the sequence-parallel collectives of tensor parallelism: it needs both.
void check_tp_comm_overlap(const TrainArgs& a) {
  if (!a.tp_comm_overlap) return;
  MC_CHECK(a.tp > 1 && a.sequence_parallel, "--tp-comm-overlap needs --tensor-model-parallel-size > 1 and "
           "--sequence-parallel (it overlaps their sequence all-gathers and reduce-scatters with the GEMMs); got "
           "--tensor-model-parallel-size ", a.tp, a.tp > 1 ? " without --sequence-parallel" : "");
  MC_CHECK(!a.model.mla.enabled, "--tp-comm-overlap with --multi-latent-attention is not available in this version "
           "(the overlapped linears are the standard attention's and the MLPs'); drop one of them");
  MC_CHECK(!a.fp8 && a.fp8_format.empty(), "--tp-comm-overlap with FP8 training (--fp8 / --fp8-format) is not available in "
           "this version (each row chunk would get its own scaling); drop one of them");
}

// Layout-dependent MoE limits; Megatron flags moecore accepts or refuses by name; the dispatcher.
void check_feature_flags(TrainArgs& a) {
  MoeConfig& e = a.model.moe;
  MC_CHECK(a.pp == 1 || !e.per_layer_logging, "--moe-per-layer-logging with --pipeline-model-parallel-size ", a.pp,
           " is not available in this version");
  MC_CHECK(a.etp == 1 || e.ffn_hidden_size % a.etp == 0, "--moe-ffn-hidden-size ", e.ffn_hidden_size,
           " is not divisible by --expert-tensor-parallel-size ", a.etp);
  MC_CHECK(e.num_experts % a.ep == 0, "--num-experts ", e.num_experts, " is not divisible by --expert-model-parallel-size ",
           a.ep, "; expected the same number of experts on every rank");
  MC_CHECK(!a.overlap_param_gather || a.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer (without it every rank updates its whole model: "
           "there is nothing to gather)");
  MC_CHECK(!a.overlap_param_gather || a.overlap_grad_reduce,
           "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron)");
  check_tp_comm_overlap(a);
  MC_CHECK(a.flex_dispatcher_backend.empty(), "--moe-flex-dispatcher-backend ", a.flex_dispatcher_backend,
           ": the flex dispatcher (DeepEP / HybridEP kernels) is not available in this version; use "
           "--moe-token-dispatcher-type alltoall or allgather");
  MC_CHECK(!a.manual_gc, "--manual-gc controls Python's garbage collector; moecore has none: drop the flag");
  for (const auto& [value, flag] : {std::pair{a.attention_dropout, "--attention-dropout"},
                                    std::pair{a.hidden_dropout, "--hidden-dropout"}})
    MC_CHECK(value == 0.0, flag, " ", value, ": dropout is not available in this version (the model has no dropout "
             "layers); pass 0 or drop the flag");
  MC_CHECK(a.ckpt_format.empty(), "--ckpt-format ", a.ckpt_format, ": moecore has one checkpoint format (full tensors "
           "in safetensors, read and written by every parallel layout); drop the flag");
  MC_CHECK(!a.auto_detect_ckpt_format, "--auto-detect-ckpt-format: moecore has one checkpoint format (HF checkpoints "
           "come in through moecore convert); drop the flag");
  MC_CHECK(!a.te_rng_track, "--te-rng-track: Transformer Engine's RNG tracker does not exist in moecore (its CUDA "
           "graphs need none: every random stream derives from --seed and the step); drop the flag");
  MC_CHECK(!a.overlap_p2p_comm, "--overlap-p2p-comm is not available in this version: pipeline sends and receives "
           "are not overlapped with computation; drop the flag");
  MC_CHECK(a.pipeline_layout.empty(), "--pipeline-model-parallel-layout is not available in this version; give uneven "
           "stages with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers");
  MC_CHECK(a.distributed_optimizer_instances == 1, "--num-distributed-optimizer-instances ",
           a.distributed_optimizer_instances, ": hybrid-sharded data parallelism is not available in this version "
           "(the distributed optimizer shards over the whole data-parallel group); drop the flag");
  MC_CHECK(a.optimizer_offload_fraction < 0 || a.optimizer_cpu_offload, "--optimizer-offload-fraction ",
           a.optimizer_offload_fraction, " needs --optimizer-cpu-offload");
  if (a.optimizer_cpu_offload) {
    if (a.optimizer_offload_fraction < 0) a.optimizer_offload_fraction = 1.0;
    MC_CHECK(a.optimizer_offload_fraction > 0 && a.optimizer_offload_fraction <= 1, "--optimizer-offload-fraction ",
             a.optimizer_offload_fraction, ": expected 0 < F <= 1");
    MC_CHECK(!a.bf16 || a.no_store_param_remainders, "--optimizer-cpu-offload with --bf16 keeps whole fp32 masters on "
             "the host, not split masters (a bf16 weight and a 16-bit remainder): add --no-store-param-remainders");
  }
  // Megatron's flag takes the world size and rank from WORLD_SIZE and RANK, which moecore reads as a
  // torchrun launch; the explicit flags say the same without the ambiguity.
  MC_CHECK(!a.fake_init_process_group, "--fake-init-process-group is not available in this version: to measure one "
           "rank of a large job on one device, use --emulate-world-size N --emulate-rank R (one process, no "
           "launcher) with --memory-report");
  MC_CHECK(a.manual_gc_interval == 0, "--manual-gc-interval controls Python's garbage collector; moecore has none: "
           "drop the flag");
  if (a.moe_shared_expert_overlap) {
    // Megatron's rules: a shared expert to overlap, and the alltoall dispatcher.
    MC_CHECK(e.shared_expert_size > 0, "--moe-shared-expert-overlap needs a shared expert: set "
             "--moe-shared-expert-intermediate-size (and --num-experts), or drop the flag");
    MC_CHECK(a.token_dispatcher == "alltoall", "--moe-shared-expert-overlap works with --moe-token-dispatcher-type "
             "alltoall only (as in Megatron), not ", a.token_dispatcher, ": add --moe-token-dispatcher-type alltoall");
    // The shared expert's tensor-parallel collectives would run on the side stream beside the
    // dispatch's on the compute stream (two communicators at once on one GPU).
    MC_CHECK(a.tp == 1, "--moe-shared-expert-overlap with --tensor-model-parallel-size ", a.tp, " is not available in "
             "this version (the shared expert's tensor-parallel collectives would run beside the dispatch's): use "
             "--tensor-model-parallel-size 1 or drop the flag");
    e.shared_expert_overlap = true;
  }
  MC_CHECK(!a.moe_enable_deepep, "--moe-enable-deepep: the flex dispatcher (DeepEP kernels) is not available in this "
           "version; use --moe-token-dispatcher-type alltoall or allgather");
  MC_CHECK(!a.moe_use_upcycling, "--moe-use-upcycling (dense-to-MoE upcycling) is not available in this version; "
           "drop the flag");
  MC_CHECK(a.moe_upcycling_granularity == 1, "--moe-upcycling-granularity ", a.moe_upcycling_granularity,
           ": upcycling is not available in this version (the flag goes with --moe-use-upcycling)");
  MC_CHECK(a.token_dispatcher != "flex", "--moe-token-dispatcher-type flex (DeepEP kernels) is not available in "
           "this version; use alltoall or allgather");
  a.dispatcher = a.token_dispatcher == "alltoall" ? DispatcherType::AllToAll : DispatcherType::AllGather;
}

// --cuda-graph-impl local --cuda-graph-scope full_iteration (train/train_graph.h): one GPU's whole
// step; what the graph cannot do yet is refused by name. After resolve_device and the FP8 flags.
void check_cuda_graph_flags(TrainArgs& a) {
  MC_CHECK(!a.external_cuda_graph, "--external-cuda-graph (graphs captured by the calling script) is not available: "
           "moecore captures its own with --cuda-graph-impl local --cuda-graph-scope full_iteration");
  MC_CHECK(a.cuda_graph_impl.empty() || a.cuda_graph_impl == "none" || a.cuda_graph_impl == "local",
           "--cuda-graph-impl ", a.cuda_graph_impl, ": expected local or none (Transformer Engine's graphs do not "
           "exist in moecore)");
  const bool on = a.cuda_graph_impl == "local";
  MC_CHECK(on || a.cuda_graph_scope.empty(), "--cuda-graph-scope needs --cuda-graph-impl local");
  MC_CHECK(on || a.cuda_graph_warmup_steps == -1, "--cuda-graph-warmup-steps ", a.cuda_graph_warmup_steps,
           " needs --cuda-graph-impl local");
  if (!on) return;
  if (a.cuda_graph_warmup_steps == -1) a.cuda_graph_warmup_steps = 3;
  MC_CHECK(!a.cuda_graph_scope.empty(), "--cuda-graph-impl local needs --cuda-graph-scope full_iteration (the whole "
           "training step; per-layer graphs are not available in this version)");
  for (const std::string& scope : a.cuda_graph_scope) {
    const bool megatron = scope == "attn" || scope == "mlp" || scope == "moe" || scope == "moe_router" ||
                          scope == "moe_preprocess" || scope == "mamba";
    MC_CHECK(!megatron, "--cuda-graph-scope ", scope, ": per-module graphs are not available in this version; use "
             "--cuda-graph-scope full_iteration (the whole training step on one GPU)");
    MC_CHECK(scope == "full_iteration", "--cuda-graph-scope ", scope, ": expected full_iteration");
  }
  MC_CHECK(a.cuda_graph_warmup_steps >= 1, "--cuda-graph-warmup-steps ", a.cuda_graph_warmup_steps,
           ": expected at least 1 (the first step initialises what the graph then reuses)");
  const char* flag = "--cuda-graph-impl local: ";
  MC_CHECK(a.world == 1 && !a.emulated(), flag, "the whole-step graph runs on one GPU only, not ", a.world,
           " ranks (tensor, pipeline, expert, context or data parallelism); drop the flag");
  MC_CHECK(!a.model.fp8.enabled, flag, "FP8 training (--fp8 / --fp8-format) is not available with CUDA graphs (its "
           "routed experts read their row counts on the host); drop one of them");
  MC_CHECK(!a.optimizer_cpu_offload, flag, "--optimizer-cpu-offload updates on the host, which a graph cannot "
           "capture; drop one of them");
  MC_CHECK(!a.fine_grained_activation_offloading, flag, "--fine-grained-activation-offloading is not available "
           "with CUDA graphs; drop one of them");
  MC_CHECK(a.model.mtp_num_layers == 0, flag, "--mtp-num-layers ", a.model.mtp_num_layers, ": multi-token "
           "prediction is not available with CUDA graphs yet; drop one of them");
  MC_CHECK(a.model.moe.input_jitter_eps == 0.0, flag, "--moe-input-jitter-eps draws a new seed each step, which a "
           "graph would freeze; drop one of them");
  MC_CHECK(a.model.moe.capacity_factor <= 0.0, flag, "--moe-expert-capacity-factor: the capacity layer reads the "
           "expert counts on the host, which a graph cannot capture; use dropless MoE or drop the flag");
  MC_CHECK(a.model.position_embedding_type != "learned_absolute", flag, "--position-embedding-type learned_absolute "
           "uploads the positions from pageable host memory each step, which a graph cannot replay; use rope or none");
  MC_CHECK(a.timing_log_level == 0, flag, "--timing-log-level ", a.timing_log_level, " reads events each step, "
           "which replayed steps do not record; use --timing-log-level 0 with CUDA graphs");
  MC_CHECK(a.device.is_cuda(), flag, "CUDA graphs need a GPU, and this run is on ", a.device.str(),
           "; use --device cuda or drop the flag");
}

// The device of this rank, host threads, device limits; the resolved values a checkpoint records.
void resolve_device(TrainArgs& a, const comm::LaunchEnv& env) {
  ModelConfig& m = a.model;
  MoeConfig& e = a.model.moe;
  MC_CHECK(a.global_batch_size % (a.micro_batch_size * a.data_parallel_size()) == 0, "--global-batch-size ",
           a.global_batch_size, " is not divisible by --micro-batch-size ", a.micro_batch_size, " x data-parallel size ",
           a.data_parallel_size(), " (the launched ranks / pipeline stages)");
  const int64_t gpus = cuda_device_count();
  // Without an index ("cuda"), each local rank takes its own GPU, as with no --device.
  a.device = a.device_text.empty() ? (gpus > 0 ? Device::cuda(static_cast<int>(a.local_rank % gpus)) : Device::cpu())
             : a.device_text == "cuda" && gpus > 0 ? Device::cuda(static_cast<int>(a.local_rank % gpus))
                                                  : parse_device(a.device_text);
  // torchrun starts no MPI: its ranks talk through NCCL only, one GPU per local rank.
  comm::check_torchrun_devices(env, static_cast<int>(gpus), a.device, !a.device_text.empty());
  configure_host_threads(env.local_world, a.device.is_cuda());
  // --bf16 on the CPU: bf16 weights and activations with fp32 masters and accumulation, as on a GPU
  // (slow; for testing the mixed-precision paths without one).
  MC_CHECK(!(e.router_fp64 && a.device.is_cuda()), "--moe-router-dtype fp64 is CPU-only; the GPU router runs in fp32");
  MC_CHECK(!(a.device.is_cuda() && e.num_experts > ops::kRouterCudaMaxExperts), "--num-experts ", e.num_experts,
           " exceeds the CUDA router's limit of ", ops::kRouterCudaMaxExperts);
  // Record resolved values so that a checkpoint says what the run actually used.
  for (auto& [name, value] : a.flag_values) {
    if (name == "lr-decay-iters") value = std::to_string(a.lr_decay_iters);
    if (name == "lr-wsd-decay-iters") value = std::to_string(a.lr_wsd_decay_iters);
    if (name == "vocab-size") value = std::to_string(m.vocab_size);
    if (name == "global-batch-size") value = std::to_string(a.global_batch_size);
  }
}

bool same_file_contents(const std::string& a, const std::string& b) {
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  if (!fa || !fb) return false;
  const std::string ta((std::istreambuf_iterator<char>(fa)), std::istreambuf_iterator<char>());
  const std::string tb((std::istreambuf_iterator<char>(fb)), std::istreambuf_iterator<char>());
  return ta == tb;
}

// --load: the model flags the command line and --config leave out come from the checkpoint
// (checkpoint_model_flags); the ones given are compared with it later (check_resume_flags). The
// tokenizer too: the checkpoint's (checkpoint_tokenizer) unless one is given, and a given one
// must be the checkpoint's (same type, same file contents) when the checkpoint records one.
void take_model_flags_from_checkpoint(cli::FlagSet& flags, TrainArgs& a, const std::vector<std::string>& also) {
  const TrainingState meta = read_checkpoint_meta(a.load);
  const std::string origin = "--load " + a.load;
  std::vector<std::string> names = checkpoint_model_flags();
  names.insert(names.end(), also.begin(), also.end());
  for (const std::string& name : names) {
    if (flags.given(name) || name == "tokenizer-type" || name == "tokenizer-model") continue;
    for (const auto& [saved, value] : meta.args)
      if (saved == name) flags.set(name, value, origin);
  }
  const CheckpointTokenizer tok = checkpoint_tokenizer(a.load);
  if (tok.type.empty()) return;  // no tokenizer recorded: this run's, if any (the vocabulary is checked)
  const bool type_given = flags.given("tokenizer-type"), model_given = flags.given("tokenizer-model");
  const std::string recorded = tok.type + (tok.path.empty() ? "" : " (" + tok.path + ")");
  MC_CHECK(!type_given || a.tokenizer_type == tok.type, "--tokenizer-type ", a.tokenizer_type, ": the checkpoint in ",
           "--load ", a.load, " was trained with --tokenizer-type ", recorded, "; data must be preprocessed with that "
           "tokenizer (leave out --tokenizer-type and --tokenizer-model to use it)");
  if (!type_given) flags.set("tokenizer-type", tok.type, origin);
  if (!model_given) {
    flags.set("tokenizer-model", tok.path, origin);
    return;
  }
  std::string given = a.tokenizer_model;
  if (std::filesystem::is_directory(given)) given = (std::filesystem::path(given) / "tokenizer.json").string();
  MC_CHECK(tok.path.empty() || !std::filesystem::exists(tok.path) || same_file_contents(given, tok.path),
           "--tokenizer-model ", a.tokenizer_model,
           " is not the tokenizer the checkpoint in --load ", a.load, " was trained with (", recorded, ": expected the ",
           "same file contents); data must be preprocessed with that tokenizer (leave out --tokenizer-type and "
           "--tokenizer-model to use it)");
}

}  // namespace

void register_train_flags(cli::FlagSet& f, TrainArgs& a) {
  f.add_string("config", &a.config_file, "YAML file of flag values (keys = flag names); flags on the command line override it");
  register_model_flags(f, a);
  register_moe_flags(f, a);
  register_training_flags(f, a);
  register_parallel_flags(f, a);
  register_megatron_compat_flags(f, a);
  register_fp8_flags(f, a);
  register_data_flags(f, a);
}

std::vector<std::pair<double, std::string>> parse_data_path(const std::vector<std::string>& items) {
  // Megatron: "w1 p1 w2 p2 ..." (weights and prefixes alternate), or prefixes alone (equal weights).
  std::vector<std::pair<double, std::string>> blend;
  auto weight = [](const std::string& s, double* w) {
    char* end = nullptr;
    *w = std::strtod(s.c_str(), &end);
    return !s.empty() && *end == '\0';
  };
  bool weighted = items.size() % 2 == 0;
  for (size_t i = 0; weighted && i < items.size(); i += 2) {
    double w = 0;
    weighted = weight(items[i], &w);
  }
  if (!weighted) {
    for (const std::string& p : items) {
      double w = 0;
      MC_CHECK(!weight(p, &w), "--data-path: '", p, "' looks like a weight but the list does not alternate weights and "
                                "prefixes");
      blend.emplace_back(1.0, p);
    }
    return blend;
  }
  for (size_t i = 0; i < items.size(); i += 2) {
    double w = 0;
    weight(items[i], &w);
    MC_CHECK(w > 0, "--data-path: weight '", items[i], "' of prefix '", items[i + 1], "' must be > 0");
    blend.emplace_back(w, items[i + 1]);
  }
  return blend;
}

TrainArgs parse_train_args(const std::vector<std::string>& argv, bool* help_requested, std::string* help_text,
                           const TrainFlagsUse& use) {
  TrainArgs a;
  cli::FlagSet flags(use.command, use.summary);
  register_train_flags(flags, a);
  if (use.extra_flags) use.extra_flags(flags);
  for (const auto& [name, value] : use.defaults) flags.set(name, value, use.command);
  // --config first, so that command-line flags override the file.
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string file;
    if (argv[i] == "--config" && i + 1 < argv.size()) file = argv[i + 1];
    if (argv[i].rfind("--config=", 0) == 0) file = argv[i].substr(9);
    if (!file.empty()) flags.load_yaml(file);
  }
  flags.parse(argv);
  *help_requested = flags.help_requested();
  *help_text = flags.help();
  if (*help_requested) return a;
  const std::vector<std::string> user_mla_flags = given_mla_flags(flags);
  if (!a.load.empty() && checkpoint_exists(a.load)) take_model_flags_from_checkpoint(flags, a, use.also_from_checkpoint);
  a.flag_values = flags.values();
  if (use.before_finalize) use.before_finalize(a);
  finalize_train_args(a, use.launch_env ? &*use.launch_env : nullptr);  // first: flags refused by name (features not available) say so
  check_moe_flags_need_experts(flags, a);
  a.watch_nccl_collectives = flags.given("distributed-timeout-minutes");
  check_mla_flags_need_mla(user_mla_flags, a);
  return a;
}

TrainArgs train_args_from_saved(const std::vector<std::pair<std::string, std::string>>& saved,
                                const std::string& device, const std::string& origin) {
  TrainArgs a;
  cli::FlagSet flags("moecore generate", "");
  register_train_flags(flags, a);
  // Run-specific flags do not describe the model, and neither does the parallel layout: the
  // checkpoint holds full tensors, read here by one rank.
  static const char* const kNotModel[] = {"config", "load", "save", "tensorboard-dir", "metrics-file", "device",
                                          "tensor-model-parallel-size", "sequence-parallel", "context-parallel-size",
                                          "pipeline-model-parallel-size", "num-layers-per-virtual-pipeline-stage",
                                          "num-virtual-stages-per-pipeline-rank", "decoder-first-pipeline-num-layers",
                                          "decoder-last-pipeline-num-layers", "expert-model-parallel-size",
                                          "expert-tensor-parallel-size", "use-distributed-optimizer",
                                          "overlap-grad-reduce", "overlap-param-gather", "no-store-param-remainders",
                                          "tp-comm-overlap"};
  for (const auto& [name, value] : saved) {
    if (std::find(std::begin(kNotModel), std::end(kNotModel), name) != std::end(kNotModel)) continue;
    flags.set(name, value, origin);
  }
  a.flag_values = flags.values();
  // The device decides the precision: the CPU computes in fp32; the GPU router is fp32.
  a.device_text = device.empty() ? (cuda_device_count() > 0 ? "cuda" : "cpu") : device;
  if (a.device_text.rfind("cuda", 0) != 0) a.bf16 = false;
  if (a.device_text.rfind("cuda", 0) == 0) a.model.moe.router_fp64 = false;
  a.load.clear();
  a.save.clear();
  a.save_interval = 0;
  a.metrics_file.clear();
  // Generation reads no data: the recorded vocabulary size stands (the tokenizer file may be gone).
  MC_CHECK(a.model.vocab_size > 0, origin, " does not record the vocabulary size");
  a.data_path.clear();
  a.mock_data = true;
  finalize_train_args(a);
  return a;
}

std::vector<std::pair<std::string, std::string>> train_flag_values(
    const std::vector<std::pair<std::string, std::string>>& set, const std::string& origin) {
  TrainArgs a;
  cli::FlagSet flags("moecore convert", "");
  register_train_flags(flags, a);
  for (const auto& [k, v] : set) flags.set(k, v, origin);
  return flags.values();
}

TrainFlagCodec train_flag_codec() { return {train_flag_values, train_args_from_saved}; }

void finalize_train_args(TrainArgs& a, const comm::LaunchEnv* launched) {
  apply_model_flags(a);
  check_schedule_flags(a);
  // Ranks: data parallelism over every process the launcher started (world = DP).
  const comm::LaunchEnv env = launched ? *launched : comm::read_launch_env();
  check_parallel_layout(a, emulated_launch(a, env));  // --emulate-world-size: rank R of N
  check_recompute_flags(a);
  check_offload_flags(a);
  check_feature_flags(a);
  resolve_device(a, env);
  check_fp8_flags(a);
  check_cuda_graph_flags(a);
  check_ep_overlap_args(a);  // --overlap-moe-expert-parallel-comm, --delay-wgrad-compute
  if (a.metrics_file.empty() && !a.save.empty()) a.metrics_file = a.save + "/metrics.jsonl";
}

int run_train(const std::vector<std::string>& args) {
  bool help = false;
  std::string help_text;
  const TrainArgs parsed = parse_train_args(args, &help, &help_text);
  if (help) {
    std::cout << help_text;
    return 0;
  }
  check_state_memory(parsed);  // a run, not a parse: presets of large models parse anywhere
  return run_training(parsed);
}

}  // namespace moecore
