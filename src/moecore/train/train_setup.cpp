#include "moecore/train/train_setup.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include <omp.h>

#include "moecore/comm/collective_watchdog.h"
#include "moecore/comm/emulated_communicator.h"
#include "moecore/core/env_switches.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/train/checkpoint_transfer.h"
#include "moecore/train/pipeline.h"
#include "moecore/train/trainer.h"

namespace moecore {

void sum_over_ranks(comm::Communicator* c, std::vector<double>& v) {
  if (c) comm::all_reduce_host(*c, v);  // token counts: exact in f32 up to 2^24
}

namespace {

// Every rank must run the same configuration: compare a hash of the flag values.
void check_same_flags(comm::Communicator* c, const TrainArgs& args) {
  if (!c) return;
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](const std::string& text) {
    for (char ch : text) h = (h ^ static_cast<uint8_t>(ch)) * 0x100000001b3ull;
  };
  for (const auto& [name, value] : args.flag_values) {
    if (name == "device") continue;  // may legitimately differ per rank
    mix(name + "=" + value + ";");
  }
  // The environment switches that change which collectives a step issues (core/env_switches.h:
  // the fused output layer's per-chunk TP collectives and CP label count) must agree like flags.
  std::string checked_env;
  for (const EnvSwitch& sw : env_switches()) {
    if (sw.agreement != EnvAgreement::Checked) continue;
    const char* value = env_switch(sw.name);
    mix(std::string("env ") + sw.name + "=" + (value ? value : "(unset)") + ";");
    checked_env += (checked_env.empty() ? "" : " / ") + std::string(sw.name);
  }
  const int64_t mine = static_cast<int64_t>(h >> 1);
  Tensor t = Tensor::from_vector(std::vector<int64_t>{mine, -mine}, {2}).to(c->device());
  c->all_reduce(t, comm::ReduceOp::Max);
  const std::vector<int64_t> r = t.to_vector<int64_t>();
  MC_CHECK(r[0] == mine && r[1] == -mine, "the ranks were started with different flags (rank ", c->rank(),
           " differs); start every rank with the same command line (and the same ", checked_env, " environment)");
}

}  // namespace

TrainingRun::TrainingRun(const TrainArgs& a) : args(a), cfg(a.model), dev(a.device) {
  set_current_device(dev);
  open_groups();
  build_model();
  state = load_training_checkpoint(args, chunk_stages, *optimizer);
  data = make_data_sources(args);
  micro = args.num_microbatches() / dp_size;
  tokens_per_step = args.global_batch_size * cfg.seq_length;
  flops_per_step = model_flops_per_step(cfg, tokens_per_step);
  for (GPTModel* c : chunks) {
    for (MoeLayer* l : c->moe_layers()) moe_layers.push_back(l);
    for (int64_t n : c->moe_layer_numbers()) moe_numbers.push_back(n);
  }
}

TrainingRun::~TrainingRun() = default;

void TrainingRun::open_groups() {
  // Data parallelism: every launched rank trains its share of each global batch; gradients,
  // losses and MoE statistics are averaged (or summed) over the ranks.
  std::unique_ptr<comm::Communicator> world;
  // The watchdog runs before the world exists, so that every communicator is watched (NCCL ones
  // only with --distributed-timeout-minutes given: each collective then records a CUDA event).
  // An emulated rank (--emulate-world-size) has no peers to wait for: no watchdog.
  if (args.world > 1 && !args.emulated() && (!dev.is_cuda() || args.watch_nccl_collectives))
    comm::set_collective_timeout(args.distributed_timeout_minutes * 60.0, args.rank);
  if (args.world > 1)
    world = args.emulated() ? comm::make_emulated_world(static_cast<int>(args.rank), static_cast<int>(args.world), dev)
            : dev.is_cuda() ? comm::make_nccl_world(dev)
                            : comm::make_mpi_world();
  check_same_flags(world.get(), args);
  // Process groups (Parallel Folding): the dense generator gives this rank's data-parallel and
  // pipeline groups, the expert generator its expert-parallel and expert-data-parallel groups.
  parallel::ProcessGroupOptions options;
  options.tied_embeddings = cfg.head_stage_has_embedding();  // tied, or read by the MTP modules
  options.overlap_param_gather = args.overlap_param_gather;
  groups = std::make_unique<parallel::ProcessGroups>(std::move(world), args.parallel_config(), args.rank, options);
  const parallel::ProcessGroupLayout& layout = groups->layout();
  pp = groups->pp();
  dp = groups->dp();
  dp_size = args.data_parallel_size();
  dp_rank = layout.dp_rank;
  stage = layout.pp_rank;
  stages = args.pp;
  logger = args.logging_rank();
  writer = args.rank == 0;
}

void TrainingRun::build_model() {
  // This rank's model chunks: virtual stage c * P + s for c < V (V = 1 without virtual stages),
  // each a contiguous run of layers; the first virtual stage embeds, the last has the head.
  // Uneven stages: --decoder-first/last-pipeline-num-layers (stage_layers).
  vstages = args.virtual_stages();
  chunk_stages = stage_layers(cfg.num_layers, stages, vstages, args.first_stage_layers, args.last_stage_layers, stage);
  for (int64_t r = 0; r < stages; ++r) {
    int64_t n = 0;
    for (const PipelineStage& st : stage_layers(cfg.num_layers, stages, vstages, args.first_stage_layers,
                                                args.last_stage_layers, r))
      n += st.end_layer - st.first_layer;
    if (r > 0) stage_sizes += "/";
    stage_sizes += std::to_string(n);
  }
  has_head = chunk_stages.back().has_head;
  compute = args.bf16 ? DType::BF16 : DType::F32;
  store = std::make_unique<ParamStore>(dev, DType::F32, compute, static_cast<uint64_t>(args.seed));
  if (cfg.fp8.enabled) {
    fp8 = std::make_unique<Fp8Context>(cfg.fp8);
    fp8->set_tensor_parallel_group(groups->tp());
    fp8->set_param_gather(args.fp8_param_gather);
    store->set_fp8(fp8.get());
  }
  MoeParallel moe_par = groups->moe_parallel(args.dispatcher, args.sequence_parallel);
  DenseParallel dense_par = groups->dense_parallel(args.sequence_parallel);
  moe_par.dense.tp_comm_overlap = dense_par.tp_comm_overlap = args.tp_comm_overlap;
  for (const PipelineStage& st : chunk_stages) {
    chunk_models.push_back(std::make_unique<GPTModel>(cfg, *store, moe_par, st, dense_par));
    chunks.push_back(chunk_models.back().get());
  }
  const OptimizerGroups opt_groups = groups->optimizer_groups();
  const auto [dense_multiple, expert_multiple] = Optimizer::shard_multiples(opt_groups, args.use_distributed_optimizer);
  auto state_dtype = [](const std::string& s) { return s == "bf16" ? DType::BF16 : DType::F32; };
  store->set_optimizer_state_dtypes(state_dtype(args.exp_avg_dtype), state_dtype(args.exp_avg_sq_dtype));
  store->store_param_remainders(args.bf16 && !args.no_store_param_remainders);
  store->initialize(dense_multiple, expert_multiple);
  // Overlap needs a data-parallel reduction to overlap (over DP x CP, or experts over EDP).
  optimizer = std::make_unique<Optimizer>(*store, opt_groups, args.use_distributed_optimizer,
                                          args.overlap_grad_reduce && (opt_groups.dp != nullptr || opt_groups.edp != nullptr),
                                          args.optimizer_cpu_offload ? args.optimizer_offload_fraction : 0.0);
  if (args.overlap_param_gather) {
    optimizer->set_overlap_param_gather(true);
    Optimizer* opt = optimizer.get();
    for (GPTModel* c : chunks) c->set_param_wait([opt](int64_t unit) { opt->wait_params(unit); });
  }
  if (args.fp8_param_gather) optimizer->set_fp8_param_gather();
}

Batch TrainingRun::context_parallel_batch(Batch b) const {
  if (args.cp == 1) return b;
  const int64_t cp_rank = groups->layout().cp_rank;
  Batch local;
  local.tokens = context_parallel_slice(b.tokens, args.cp, cp_rank);
  local.labels = context_parallel_slice(b.labels, args.cp, cp_rank);
  local.num_labels = b.num_labels;
  return local;
}

Batch TrainingRun::checked_upload(Batch host) {
  host.num_labels = check_batch_on_host(host.tokens, host.labels, cfg.vocab_size);
  const Batch local = context_parallel_batch(host);
  Batch up;
  up.tokens = uploader_.upload(local.tokens.contiguous(), dev);
  up.labels = uploader_.upload(local.labels.contiguous(), dev);
  up.num_labels = host.num_labels;
  if (cfg.mtp_num_layers > 0 && has_head) {
    const MtpBatch mtp = make_mtp_batch(host.tokens.contiguous(), host.labels.contiguous(), cfg.mtp_num_layers);
    const int64_t cp_rank = groups->layout().cp_rank;
    for (size_t k = 0; k < mtp.tokens.size(); ++k) {
      const Tensor tokens = args.cp > 1 ? context_parallel_slice(mtp.tokens[k], args.cp, cp_rank) : mtp.tokens[k];
      const Tensor labels = args.cp > 1 ? context_parallel_slice(mtp.labels[k], args.cp, cp_rank) : mtp.labels[k];
      up.mtp_tokens.push_back(uploader_.upload(tokens.contiguous(), dev));
      up.mtp_labels.push_back(uploader_.upload(labels.contiguous(), dev));
    }
    up.mtp_num_labels = mtp.num_labels;
  }
  return up;
}

int64_t TrainingRun::checked_upload_into(const Batch& host, Batch& fixed) {
  MC_CHECK(args.cp == 1 && cfg.mtp_num_layers == 0, "checked_upload_into: one rank without MTP only");
  const int64_t labelled = check_batch_on_host(host.tokens, host.labels, cfg.vocab_size);
  uploader_.upload_into(host.tokens.contiguous(), fixed.tokens);
  uploader_.upload_into(host.labels.contiguous(), fixed.labels);
  fixed.num_labels = labelled;
  return labelled;
}

void print_run_summary(const TrainingRun& run) {
  const TrainArgs& args = run.args;
  const ModelConfig& cfg = run.cfg;
  const bool logger = run.logger;
  const int64_t dp_size = run.dp_size, micro = run.micro, stages = run.stages, vstages = run.vstages;
  // The whole model's parameter count, whichever experts, expert slices and stage this rank holds
  // (the tied output copy of the last stage not counted twice).
  std::vector<double> counted = {0.0};
  for (const auto& p : run.store->all()) {
    if (!p->trainable || !chunks_save_tensor(run.chunk_stages, cfg, p->name)) continue;
    double n = 1;
    for (int64_t d : p->full_shape()) n *= static_cast<double>(d);
    counted[0] += n;
  }
  if (run.pp) sum_over_ranks(run.pp, counted);
  const int64_t model_params = static_cast<int64_t>(counted[0] + 0.5);
  if (logger && args.emulated())
    std::printf("moecore train: EMULATING rank %lld of %lld (--emulate-world-size): this rank's shard and steps on "
                "one process, its communication replaced by local stand-ins of the right sizes; the memory (and "
                "--memory-report) is the rank's, the losses, norms and the parameter count%s are NOT meaningful\n",
                static_cast<long long>(args.rank), static_cast<long long>(args.world),
                stages > 1 ? " (this stage's)" : "");
  if (logger)
    std::printf("moecore train: %lld parameters (%lld active matmul), %s, %s compute, %lld data-parallel rank(s), "
                "%lld micro-batches of %lld per rank, %.3g model FLOPs per step\n",
                static_cast<long long>(model_params), static_cast<long long>(active_matmul_params(cfg)),
                run.dev.str().c_str(), dtype_name(run.compute), static_cast<long long>(dp_size),
                static_cast<long long>(micro), static_cast<long long>(args.micro_batch_size), run.flops_per_step);
  if (logger && args.world > 1)
    std::printf("moecore train: %d host threads per rank (OpenMP / OpenBLAS)\n", omp_get_max_threads());
  if (logger && stages > 1)
    std::printf("moecore train: %lld pipeline stages x %lld model chunks, layers per stage %s (%s), %lld data-parallel "
                "rank(s) per stage\n",
                static_cast<long long>(stages), static_cast<long long>(vstages), run.stage_sizes.c_str(),
                vstages == 1                ? "1F1B"
                : micro % stages == 0 ? "virtual stages, interleaved 1F1B"
                                      : "virtual stages, all-forward-all-backward: micro-batches not divisible by the stages",
                static_cast<long long>(dp_size));
  if (logger && (args.tp > 1 || args.cp > 1))
    std::printf("moecore train: tensor-parallel size %lld (%s), context-parallel size %lld\n",
                static_cast<long long>(args.tp), args.sequence_parallel ? "sequence parallel" : "no sequence parallelism",
                static_cast<long long>(args.cp));
  if (logger && (args.ep > 1 || args.etp > 1 || args.use_distributed_optimizer))
    std::printf("moecore train: expert-parallel size %lld (%lld experts per rank, %s dispatcher), expert-tensor-parallel "
                "size %lld, expert-data-parallel size %lld, %s optimizer; %lld parameters on this rank\n",
                static_cast<long long>(args.ep), static_cast<long long>(cfg.moe.num_experts / args.ep),
                dispatcher_name(args.dispatcher), static_cast<long long>(args.etp),
                static_cast<long long>(dp_size / (args.ep * args.etp)),
                args.use_distributed_optimizer ? "distributed (ZeRO-1)" : "replicated",
                static_cast<long long>(run.store->num_elements()));

  if (logger && args.precision_aware_optimizer)
    std::printf("moecore train: precision-aware optimizer: AdamW exp_avg in %s, exp_avg_sq in %s (checkpoints: f32)\n",
                dtype_name(run.store->exp_avg_dtype()), dtype_name(run.store->exp_avg_sq_dtype()));
  if (logger && args.optimizer_cpu_offload) {
    const auto [host, all] = run.optimizer->offloaded_elements();
    std::printf("moecore train: optimizer CPU offload: %lld of this rank's %lld optimizer-state elements on the host "
                "(fraction %g asked)\n", static_cast<long long>(host), static_cast<long long>(all),
                args.optimizer_offload_fraction);
  }
}

}  // namespace moecore
