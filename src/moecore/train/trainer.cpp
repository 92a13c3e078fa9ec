#include "moecore/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>
#include <omp.h>

#include "moecore/comm/communicator.h"
#include "moecore/core/allocator.h"
#include "moecore/core/host_transfer.h"
#include "moecore/core/step_timers.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/data_source.h"
#include "moecore/model/gpt.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/ops/adamw.h"
#include "moecore/ops/reduce.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/loss_accumulator.h"
#include "moecore/train/lr_schedule.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/pipeline.h"
#include "moecore/parallel/rank_generator.h"
#include "moecore/train/tensorboard.h"

namespace moecore {

int64_t active_matmul_params(const ModelConfig& c) {
  const int64_t h = c.hidden_size, d = c.head_dim();
  const int64_t attn = h * c.num_attention_heads * d * 2 + h * c.kv_heads() * d * 2;
  int64_t total = c.vocab_size * h;  // output head
  for (int64_t i = 0; i < c.num_layers; ++i) {
    total += attn;
    if (c.is_moe(i)) {
      const int64_t f = c.moe.ffn_hidden_size;
      total += c.moe.num_experts * h + c.moe.router.topk * h * f * (c.swiglu ? 3 : 2);
      if (c.moe.shared_expert_size > 0) total += h * c.moe.shared_expert_size * (c.swiglu ? 3 : 2);
    } else {
      total += h * c.ffn_hidden_size * (c.swiglu ? 3 : 2);
    }
  }
  return total;
}

double model_flops_per_step(const ModelConfig& c, int64_t tokens) {
  return 6.0 * static_cast<double>(active_matmul_params(c)) * static_cast<double>(tokens) +
         6.0 * static_cast<double>(c.num_layers) * static_cast<double>(c.seq_length) *
             static_cast<double>(c.hidden_size) * static_cast<double>(tokens);
}

namespace {

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  return buf;
}

AllocatorStats memory_stats(Device d) {
  return d.is_cuda() ? cuda_allocator(d.index).stats() : cpu_allocator().stats();
}

// A null communicator means one rank.
void sum_over_ranks(comm::Communicator* c, std::vector<double>& v) {
  if (c) comm::all_reduce_host(*c, v);  // token counts: exact in f32 up to 2^24
}

// Every rank must run the same configuration: compare a hash of the flag values.
// Environment switches that change which collectives a step issues (the fused output layer's
// per-chunk TP collectives and CP label count): they must agree like the flags.
const char* const kCollectiveEnvironment[] = {"MOECORE_FUSED_HEAD", "MOECORE_FUSED_HEAD_ROWS"};

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
  for (const char* name : kCollectiveEnvironment) {
    const char* value = std::getenv(name);
    mix(std::string("env ") + name + "=" + (value ? value : "(unset)") + ";");
  }
  const int64_t mine = static_cast<int64_t>(h >> 1);
  Tensor t = Tensor::from_vector(std::vector<int64_t>{mine, -mine}, {2}).to(c->device());
  c->all_reduce(t, comm::ReduceOp::Max);
  const std::vector<int64_t> r = t.to_vector<int64_t>();
  MC_CHECK(r[0] == mine && r[1] == -mine, "the ranks were started with different flags (rank ", c->rank(),
           " differs); start every rank with the same command line (and the same MOECORE_FUSED_HEAD / "
           "MOECORE_FUSED_HEAD_ROWS environment)");
}

// Whether a checkpoint tensor ("<param>" or "<param>.exp_avg[_sq]") belongs to this pipeline stage.
bool owns_tensor(const PipelineStage& st, const ModelConfig& cfg, const std::string& name) {
  const std::string layers = "decoder.layers.";
  if (name.rfind(layers, 0) == 0) {
    const int64_t i = std::stoll(name.substr(layers.size()));
    return i >= st.first_layer && i < st.end_layer;
  }
  // Tied embeddings: the last stage holds a copy of the word embedding (loaded, never saved).
  if (name.rfind("embedding.word_embeddings.", 0) == 0) return st.has_embedding || (!cfg.untie_embeddings && st.has_head);
  if (name.rfind("embedding.", 0) == 0) return st.has_embedding;
  return st.has_head;  // final norm, output layer
}

// Whether this stage writes the tensor to a checkpoint: what it owns, less the tied copy.
bool saves_tensor(const PipelineStage& st, const ModelConfig& cfg, const std::string& name) {
  return owns_tensor(st, cfg, name) && (st.has_embedding || name.rfind("embedding.", 0) != 0);
}

// Checkpoints of pipeline stages go to stage 0's writer in two rounds over the pipeline group:
// each other stage first sends the list of its tensors (names, dtypes, full shapes as JSON), so the
// writer can lay out the whole file, then the tensors themselves, one message each, as its
// Optimizer::full_state produces them (the device and host hold one tensor at a time).
void send_bytes(comm::Communicator& pp, const std::string& bytes) {
  const Device dev = pp.device();
  Tensor n = Tensor::from_vector(std::vector<int64_t>{static_cast<int64_t>(bytes.size())}, {1}).to(dev);
  pp.send(n, 0);
  if (bytes.empty()) return;
  Tensor host = Tensor::empty({static_cast<int64_t>(bytes.size())}, DType::U8, Device::cpu());
  std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  pp.send(host.to(dev), 0);
}

std::string recv_bytes(comm::Communicator& pp, int peer) {
  const Device dev = pp.device();
  Tensor n = Tensor::empty({1}, DType::I64, dev);
  pp.recv(n, peer);
  const int64_t size = n.to_vector<int64_t>()[0];
  std::string out(static_cast<size_t>(size), '\0');
  if (size == 0) return out;
  Tensor t = Tensor::empty({size}, DType::U8, dev);
  pp.recv(t, peer);
  const Tensor host = t.to(Device::cpu());
  std::memcpy(out.data(), host.data_ptr(), out.size());
  return out;
}

// pp rank 0 gets every other stage's list (index: pp rank; its own entry empty); the others send
// theirs and get nothing.
std::vector<std::vector<TensorSpec>> exchange_stage_specs(comm::Communicator& pp, const std::vector<TensorSpec>& mine) {
  if (pp.rank() != 0) {
    nlohmann::json header = nlohmann::json::array();
    for (const TensorSpec& t : mine)
      header.push_back({{"name", t.name}, {"dtype", static_cast<int>(t.dtype)}, {"shape", t.shape}});
    send_bytes(pp, header.dump());
    return {};
  }
  std::vector<std::vector<TensorSpec>> out(static_cast<size_t>(pp.size()));
  for (int peer = 1; peer < pp.size(); ++peer)
    for (const auto& h : nlohmann::json::parse(recv_bytes(pp, peer)))
      out[static_cast<size_t>(peer)].push_back(
          {h.at("name").get<std::string>(), static_cast<DType>(h.at("dtype").get<int>()), h.at("shape").get<Shape>()});
  return out;
}

// A tensor's bytes as one u8 message to pp rank 0 (on the communicator's device for NCCL).
void send_stage_tensor(comm::Communicator& pp, const Tensor& t) {
  if (t.nbytes() == 0) return;
  const Tensor c = t.to(Device::cpu()).contiguous();
  Tensor b = Tensor::empty({static_cast<int64_t>(c.nbytes())}, DType::U8, Device::cpu());
  std::memcpy(b.data_ptr(), c.data_ptr(), c.nbytes());
  pp.send(b.to(pp.device()), 0);
}

Tensor recv_stage_tensor(comm::Communicator& pp, int peer, const TensorSpec& spec) {
  Tensor t = Tensor::empty(spec.shape, spec.dtype, Device::cpu());
  if (t.nbytes() == 0) return t;
  Tensor bytes = Tensor::empty({static_cast<int64_t>(t.nbytes())}, DType::U8, pp.device());
  pp.recv(bytes, peer);
  std::memcpy(t.data_ptr(), bytes.to(Device::cpu()).data_ptr(), t.nbytes());
  return t;
}

// --timing-log-level: one line per region, indented by nesting, milliseconds per iteration over
// the log interval (this rank's current stream) and the share of the step time.
void print_timers(const std::vector<RegionTime>& timers, int64_t steps, double step_ms) {
  if (timers.empty() || steps <= 0) return;
  std::printf("   timers (ms per iteration, this rank's GPU events; nested regions are part of their parent):\n");
  for (const RegionTime& r : timers) {
    const double ms = r.ms / static_cast<double>(steps);
    std::printf("   %*s%-*s %9.2f ms %5.1f%%  (%lld calls)\n", 2 * r.depth, "", 28 - 2 * r.depth, r.name.c_str(), ms,
                step_ms > 0 ? 100.0 * ms / step_ms : 0.0, static_cast<long long>(r.calls));
  }
}
}  // namespace

int run_training(const TrainArgs& args) {
  const ModelConfig& cfg = args.model;
  const Device dev = args.device;
  set_current_device(dev);
  // Data parallelism: every launched rank trains its share of each global batch; gradients,
  // losses and MoE statistics are averaged (or summed) over the ranks.
  std::unique_ptr<comm::Communicator> world;
  if (args.world > 1) world = dev.is_cuda() ? comm::make_nccl_world(dev) : comm::make_mpi_world();
  check_same_flags(world.get(), args);
  // Process groups (Parallel Folding): the dense generator gives this rank's data-parallel and
  // pipeline groups, the expert generator its expert-parallel and expert-data-parallel groups.
  const parallel::ProcessGroupLayout layout = parallel::layout_for_rank(args.parallel_config(), args.rank);
  // own: a communicator of its own even when the group is the whole world (EP all-to-alls run on
  // the compute stream while --overlap-grad-reduce uses the world on the communication stream;
  // pipeline transfers interleave with both).
  std::vector<std::unique_ptr<comm::Communicator>> owned;
  auto group = [&](const std::vector<int64_t>& ranks, bool own) -> comm::Communicator* {
    if (ranks.size() <= 1) return nullptr;
    if (!own && static_cast<int64_t>(ranks.size()) == args.world) return world.get();
    owned.push_back(world->split(ranks));
    return owned.back().get();
  };
  // Every rank creates its groups in the same order (NCCL bootstraps them collectively).
  comm::Communicator* dp = group(layout.dp, false);
  comm::Communicator* pp = group(layout.pp, true);
  // Tensor and context parallelism: their own communicators (sequence-parallel and attention
  // collectives run on the compute stream); dense gradients reduce over DP x CP.
  comm::Communicator* tp = group(layout.tp, true);
  comm::Communicator* cp = group(layout.cp, true);
  comm::Communicator* dp_cp = args.cp > 1 ? group(layout.dp_cp, false) : dp;
  // The ranks sharing each sequence (MoE balancing counts): TP x CP.
  comm::Communicator* token_group = args.tp > 1 && args.cp > 1 ? group(layout.tp_cp, true) : (tp ? tp : cp);
  OptimizerGroups groups;
  groups.dp = dp_cp;
  groups.tp = tp;
  groups.ep = group(layout.ep, true);
  groups.edp = group(layout.expt_dp, false);
  groups.pp = pp;
  groups.etp = group(layout.expt_tp, true);
  comm::Communicator* tp_ep = args.etp > 1 ? group(layout.tp_ep, true) : nullptr;
  if (args.overlap_param_gather) {  // the parameter gathers' own communicators (optimizer.h)
    groups.dp_gather = group(args.cp > 1 ? layout.dp_cp : layout.dp, true);
    groups.edp_gather = group(layout.expt_dp, true);
  }
  groups.dp_size = args.data_parallel_size();
  const int64_t dp_size = args.data_parallel_size(), dp_rank = layout.dp_rank;
  const int64_t stage = layout.pp_rank, stages = args.pp;
  const bool logger = args.rank == args.world - 1;  // Megatron logs from the last rank (last stage)
  const bool writer = args.rank == 0;               // and saves from the first
  // The ranks that keep checkpoint tensors: the first of each stage's TP, CP and DP groups.
  const bool keeper = dp_rank == 0 && layout.tp_rank == 0 && layout.cp_rank == 0;
  // Tied embeddings across pipeline stages: the first and last stage of each pipeline group sum
  // their word-embedding gradients (Megatron's embedding group). Every rank splits (NCCL over TCP
  // splits collectively over the world); a middle stage gets a group of its own, unused.
  if (args.pp > 1 && !cfg.untie_embeddings) {
    const int64_t first_rank = layout.pp.front(), last_rank = layout.pp.back();
    const bool member = args.rank == first_rank || args.rank == last_rank;
    owned.push_back(world->split(member ? std::vector<int64_t>{first_rank, last_rank} : std::vector<int64_t>{args.rank}));
    if (member) groups.embedding = owned.back().get();
  }
  // This rank's model chunks: virtual stage c * P + s for c < V (V = 1 without virtual stages),
  // each a contiguous run of layers; the first virtual stage embeds, the last has the head.
  // Uneven stages: --decoder-first/last-pipeline-num-layers (stage_layers).
  const int64_t vstages = args.virtual_stages();
  const std::vector<PipelineStage> chunk_stages =
      stage_layers(cfg.num_layers, stages, vstages, args.first_stage_layers, args.last_stage_layers, stage);
  std::string stage_sizes;  // layers per pipeline rank, for the log
  for (int64_t r = 0; r < stages; ++r) {
    int64_t n = 0;
    for (const PipelineStage& st : stage_layers(cfg.num_layers, stages, vstages, args.first_stage_layers,
                                                args.last_stage_layers, r))
      n += st.end_layer - st.first_layer;
    if (r > 0) stage_sizes += "/";
    stage_sizes += std::to_string(n);
  }
  auto owns = [&](const std::string& name) {
    for (const PipelineStage& st : chunk_stages)
      if (owns_tensor(st, cfg, name)) return true;
    return false;
  };
  auto saves = [&](const std::string& name) {
    for (const PipelineStage& st : chunk_stages)
      if (saves_tensor(st, cfg, name)) return true;
    return false;
  };
  const bool has_head = chunk_stages.back().has_head;
  const DType compute = args.bf16 ? DType::BF16 : DType::F32;
  ParamStore store(dev, DType::F32, compute, static_cast<uint64_t>(args.seed));
  MoeParallel moe_par;
  moe_par.ep = groups.ep;
  moe_par.dispatcher = args.dispatcher;
  moe_par.aux_group = dp;
  moe_par.etp = groups.etp;
  moe_par.tp_ep = tp_ep;
  moe_par.token_group = token_group;
  DenseParallel dense_par;
  dense_par.tp = tp;
  dense_par.cp = cp;
  dense_par.sequence_parallel = args.sequence_parallel;
  std::vector<std::unique_ptr<GPTModel>> chunk_models;
  std::vector<GPTModel*> chunks;
  for (const PipelineStage& st : chunk_stages) {
    chunk_models.push_back(std::make_unique<GPTModel>(cfg, store, moe_par, st, dense_par));
    chunks.push_back(chunk_models.back().get());
  }
  GPTModel& model = *chunks.front();
  const auto [dense_multiple, expert_multiple] = Optimizer::shard_multiples(groups, args.use_distributed_optimizer);
  auto state_dtype = [](const std::string& s) { return s == "bf16" ? DType::BF16 : DType::F32; };
  store.set_optimizer_state_dtypes(state_dtype(args.exp_avg_dtype), state_dtype(args.exp_avg_sq_dtype));
  store.store_param_remainders(args.bf16 && !args.no_store_param_remainders);
  store.initialize(dense_multiple, expert_multiple);
  // Overlap needs a data-parallel reduction to overlap (over DP x CP, or experts over EDP).
  Optimizer optimizer(store, groups, args.use_distributed_optimizer,
                      args.overlap_grad_reduce && (groups.dp != nullptr || groups.edp != nullptr));
  if (args.overlap_param_gather) {
    optimizer.set_overlap_param_gather(true);
    for (GPTModel* c : chunks) c->set_param_wait([&optimizer](int64_t unit) { optimizer.wait_params(unit); });
  }
  TrainingState state;
  if (!args.load.empty() && !checkpoint_exists(args.load)) {
    // Megatron's behaviour for the first run of a job that passes --load and --save alike.
    std::printf("note: no checkpoint in --load %s; training from scratch\n", args.load.c_str());
  } else if (!args.load.empty()) {
    const TrainingState meta = read_checkpoint_meta(args.load);
    // A model-only checkpoint (moecore convert) starts training afresh: only the model must match.
    check_resume_flags(meta.args, args, /*check_schedule=*/!meta.model_only);
    // Checkpoints hold the whole model: a pipeline stage leaves the other stages' tensors.
    auto elsewhere = [&](const std::string& name) { return stages > 1 && !owns(name); };
    state = load_checkpoint(args.load, [&](const TensorFetch& fetch, bool model_only) { optimizer.load(fetch, model_only); },
                            elsewhere);
    if (args.rank == args.world - 1)
      std::printf("loaded checkpoint from %s at iteration %lld\n", args.load.c_str(),
                  static_cast<long long>(state.iteration));
  }
  const DataSources data = make_data_sources(args);
  std::unique_ptr<TensorBoardWriter> tb;
  if (logger && !args.tensorboard_dir.empty()) tb = std::make_unique<TensorBoardWriter>(args.tensorboard_dir);
  std::ofstream metrics;
  if (logger && !args.metrics_file.empty()) {
    std::error_code ec;
    const auto parent = std::filesystem::path(args.metrics_file).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    metrics.open(args.metrics_file, std::ios::app);
    MC_CHECK(metrics.good(), "--metrics-file '", args.metrics_file, "': cannot open it for writing");
  }

  const int64_t micro = args.num_microbatches() / dp_size;  // micro-batches of this rank per step
  // Context parallelism: this rank's two chunks of every sequence.
  auto context_parallel_batch = [&](Batch b) {
    if (args.cp == 1) return b;
    return Batch{context_parallel_slice(b.tokens, args.cp, layout.cp_rank),
                 context_parallel_slice(b.labels, args.cp, layout.cp_rank), b.num_labels};
  };
  // Training micro-batches are checked and their labels counted on the host, then go up through
  // pinned memory: neither the upload nor the forward waits for the GPU (GPTModel::Ctx::
  // checked_num_labels).
  PinnedUploader uploader;
  auto checked_upload = [&](Batch host) {
    host.num_labels = check_batch_on_host(host.tokens, host.labels, cfg.vocab_size);
    const Batch local = context_parallel_batch(host);
    return Batch{uploader.upload(local.tokens.contiguous(), dev), uploader.upload(local.labels.contiguous(), dev),
                 host.num_labels};
  };
  const int64_t tokens_per_step = args.global_batch_size * cfg.seq_length;
  const double flops_per_step = model_flops_per_step(cfg, tokens_per_step);
  // The whole model's parameter count, whichever experts, expert slices and stage this rank holds
  // (the tied output copy of the last stage not counted twice).
  std::vector<double> counted = {0.0};
  for (const auto& p : store.all()) {
    if (!p->trainable || !saves(p->name)) continue;
    double n = 1;
    for (int64_t d : p->full_shape()) n *= static_cast<double>(d);
    counted[0] += n;
  }
  if (pp) sum_over_ranks(pp, counted);
  const int64_t model_params = static_cast<int64_t>(counted[0] + 0.5);
  if (logger)
    std::printf("moecore train: %lld parameters (%lld active matmul), %s, %s compute, %lld data-parallel rank(s), "
                "%lld micro-batches of %lld per rank, %.3g model FLOPs per step\n",
                static_cast<long long>(model_params), static_cast<long long>(active_matmul_params(cfg)),
                dev.str().c_str(), dtype_name(compute), static_cast<long long>(dp_size), static_cast<long long>(micro),
                static_cast<long long>(args.micro_batch_size), flops_per_step);
  if (logger && args.world > 1)
    std::printf("moecore train: %d host threads per rank (OpenMP / OpenBLAS)\n", omp_get_max_threads());
  if (logger && stages > 1)
    std::printf("moecore train: %lld pipeline stages x %lld model chunks, layers per stage %s (%s), %lld data-parallel "
                "rank(s) per stage\n",
                static_cast<long long>(stages), static_cast<long long>(vstages), stage_sizes.c_str(),
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
                args.use_distributed_optimizer ? "distributed (ZeRO-1)" : "replicated", static_cast<long long>(store.num_elements()));

  if (logger && args.precision_aware_optimizer)
    std::printf("moecore train: precision-aware optimizer: AdamW exp_avg in %s, exp_avg_sq in %s (checkpoints: f32)\n",
                dtype_name(store.exp_avg_dtype()), dtype_name(store.exp_avg_sq_dtype()));

  std::vector<MoeLayer*> moe_layers;
  std::vector<int64_t> moe_numbers;
  for (GPTModel* c : chunks) {
    for (MoeLayer* l : c->moe_layers()) moe_layers.push_back(l);
    for (int64_t n : c->moe_layer_numbers()) moe_numbers.push_back(n);
  }
  double interval_loss = 0;
  int64_t interval_steps = 0, interval_skipped = 0, interval_nan = 0;  // Megatron logs these per interval
  int64_t interval_loss_steps = 0;  // steps whose loss enters the average (not the skipped ones)
  uint64_t interval_syncs = 0;      // host synchronisations in the interval's steps (core/device.h)
  double interval_aux = 0, interval_z = 0;  // balancing losses, averaged over the interval like lm loss
  state.args = args.flag_values;
  auto save = [&] {
    if (args.save.empty()) return;
    // Collective (experts gathered over ETP and EP, TP parts over TP, Adam shards over DP); the
    // first rank of each stage's TP, CP and DP groups keeps the tensors, and the writer (stage 0's)
    // streams them into the file one at a time, then every other stage's in stage order. The tied
    // word-embedding copy of the last stage stays out (the first stage's is written).
    std::vector<TensorSpec> specs = optimizer.state_specs();
    if (pp) std::erase_if(specs, [&](const TensorSpec& t) { return !saves(t.name); });
    std::vector<std::vector<TensorSpec>> stage_specs;
    if (pp && keeper) stage_specs = exchange_stage_specs(*pp, specs);
    std::unique_ptr<CheckpointWriter> out;
    if (writer) {
      MC_CHECK(keeper, "the checkpoint writer (rank 0) must be the first rank of its stage's groups");
      std::vector<TensorSpec> all = specs;
      for (const auto& stage : stage_specs) all.insert(all.end(), stage.begin(), stage.end());
      out = std::make_unique<CheckpointWriter>(args.save, all, state);
    }
    optimizer.full_state([&](const std::string& name, const Tensor& full) {
      if (!keeper || (pp && !saves(name))) return;
      if (writer) {
        out->write(name, full);
      } else {
        send_stage_tensor(*pp, full);
      }
    });
    if (writer) {
      for (size_t peer = 1; peer < stage_specs.size(); ++peer)
        for (const TensorSpec& t : stage_specs[peer]) out->write(t.name, recv_stage_tensor(*pp, static_cast<int>(peer), t));
      out->finish();
      std::printf("saved checkpoint to %s at iteration %lld\n", args.save.c_str(), static_cast<long long>(state.iteration));
    }
    if (world) world->barrier();
  };

  set_timing_level(static_cast<int>(args.timing_log_level));
  // The host waits for the GPU at a log step only (and each step with --timing-log-level, whose
  // timers read their events): the interval's time is the wall time from its start to the wait
  // at its log step, less evaluations and checkpoints in it.
  using Clock = std::chrono::steady_clock;
  auto interval_start = Clock::now();
  double interval_excluded_ms = 0;
  auto ms_since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  const DType loss_dtype = compute == DType::F64 ? DType::F64 : DType::F32;
  for (int64_t it = state.iteration + 1; it <= args.train_iters; ++it) {
    const uint64_t syncs0 = host_synchronizations();
    if (dev.is_cuda()) cuda_allocator(dev.index).reset_peak();
    // Megatron's order: micro-batch m of the step is [dp rank 0's samples | dp rank 1's | ...];
    // its seed is the same on every pipeline stage and equals the single-rank run's.
    auto batch_of = [&](int64_t m) {
      return checked_upload(data.train->batch(state.consumed_samples + (m * dp_size + dp_rank) * args.micro_batch_size,
                                              args.micro_batch_size, Device::cpu()));
    };
    auto rng_of = [&](int64_t m) {
      return static_cast<uint64_t>(args.seed) * 0x100000001B3ull + static_cast<uint64_t>((it * micro + m) * dp_size + dp_rank);
    };
    // The last micro-batch's backward finalises each layer's gradients: reduce them as it goes.
    const std::function<void(int64_t)> layer_done =
        optimizer.overlapping() ? std::function<void(int64_t)>([&](int64_t l) { optimizer.layer_ready(l); })
                                : std::function<void(int64_t)>();
    LossAccumulator losses(micro, dev, loss_dtype);
    std::optional<TimedRegion> phase(std::in_place, "forward-backward", 1, dev);  // --timing-log-level
    if (pp) {
      PipelineStep step;
      step.pp = pp;
      step.micro_batches = micro;
      step.grad_scale = 1.0 / static_cast<double>(micro);
      step.batch = batch_of;
      step.rng = rng_of;
      step.last_layer_done = layer_done;
      step.losses = &losses;
      if (vstages == 1) {
        run_pipeline_1f1b(model, step);
      } else if (micro % stages == 0) {
        run_pipeline_interleaved(chunks, step);
      } else {
        run_pipeline_virtual(chunks, step);
      }
    } else {
      for (int64_t m = 0; m < micro; ++m) {
        const Batch b = batch_of(m);
        GPTModel::Ctx ctx;
        ctx.fused_head_scale = 1.0 / static_cast<double>(micro);  // the output layer's backward runs in the forward
        ctx.checked_num_labels = b.num_labels;
        const Tensor loss_sum = model.forward_loss_sum(b.tokens, b.labels, true, rng_of(m), ctx);
        losses.add(loss_sum, ctx.num_labels);  // after the forward has set the count
        model.backward(1.0 / static_cast<double>(micro), ctx, m == micro - 1 ? layer_done : std::function<void(int64_t)>());
      }
    }
    // The MoE layers' statistics start for the host now; the gradient norm's read below waits for
    // them too (same stream), so reading them afterwards waits no more (not once per layer).
    for (MoeLayer* l : moe_layers) l->prefetch_stats();
    phase.emplace("grads-reduce", 1, dev);
    optimizer.reduce_gradients();
    // The step's loss, averaged over DP on the device, goes to the host behind the gradients: the
    // gradient norm's read below waits for it too (no wait of its own).
    if (dp && has_head) dp->all_reduce(losses.value(), comm::ReduceOp::Avg);
    PendingRead loss_read;
    if (has_head) loss_read.start(losses.value());
    phase.emplace("grad-norm", 1, dev);
    const double grad_sq = optimizer.grad_norm_sq();
    phase.emplace("moe-statistics", 1, dev);
    for (MoeLayer* l : moe_layers) reduce_moe_step_stats(l->mutable_stats(), token_group, dp);
    phase.emplace("moe-finish-step", 1, dev);
    std::vector<MoeStepStats> layer_stats;
    for (MoeLayer* l : moe_layers) layer_stats.push_back(l->finish_step());
    phase.emplace("loss-and-checks", 1, dev);
    // The loss lives on the last stage, MoE layers on every stage: sums over the pipeline give
    // every rank the same values (the skip decision must agree everywhere).
    std::vector<double> sums = {has_head ? loss_read.get()[0] : 0.0, 0.0, 0.0, static_cast<double>(layer_stats.size())};
    for (const MoeStepStats& s : layer_stats) {
      sums[1] += s.aux_loss / static_cast<double>(micro);
      sums[2] += s.z_loss / static_cast<double>(micro);
    }
    if (pp) sum_over_ranks(pp, sums);
    const double lm_loss = sums[0];
    const double aux = sums[3] > 0 ? sums[1] / sums[3] : 0.0, z = sums[3] > 0 ? sums[2] / sums[3] : 0.0;
    state.consumed_samples += args.global_batch_size;
    state.iteration = it;
    // Megatron's scheduler: the step after n successful steps uses lr(n); skipped steps do not count.
    const double lr = learning_rate(args, it - 1 - state.skipped_iterations);
    double grad_norm = std::sqrt(grad_sq);
    phase.emplace("optimizer", 1, dev);
    if (!std::isfinite(lm_loss) || !std::isfinite(grad_sq)) {
      if (logger) std::printf("iteration %lld: %s in the %s; step skipped\n", static_cast<long long>(it),
                  std::isnan(lm_loss) || std::isnan(grad_sq) ? "NaN" : "Inf",
                  std::isfinite(lm_loss) ? "gradients" : "loss");
      state.skipped_iterations++;
      state.nan_iterations++;
      interval_skipped++;
      interval_nan++;
      optimizer.skip();
    } else {
      const double clip = args.clip_grad > 0 && grad_norm > args.clip_grad ? args.clip_grad / (grad_norm + 1e-6) : 1.0;
      const AdamHyper hyper{args.adam_beta1, args.adam_beta2, args.adam_eps, args.weight_decay};
      optimizer.step(hyper, lr, static_cast<float>(clip), it - state.skipped_iterations);
    }
    phase.reset();
    const bool log_now = it % args.log_interval == 0 || it == args.train_iters;
    const bool timers_on = args.timing_log_level > 0;
    if (log_now || timers_on) synchronize(dev);
    // Read the clock before the logging below (params-norm collective, printing): the interval's time is its steps'.
    const double interval_ms = log_now ? ms_since(interval_start) - interval_excluded_ms : 0.0;
    if (timers_on) collect_region_times();  // after the synchronisation: reads finished events only
    // Includes the log step's synchronisation just above; evaluation and checkpoint waits come
    // after this line and before the next step's syncs0, so they are not counted (as their time).
    interval_syncs += host_synchronizations() - syncs0;
    const DispatchCommTime dispatch_time = take_dispatch_comm_time();  // MOECORE_COMM_TIMERS=1 only
    const double dispatch_ms = dispatch_time.seconds * 1e3, dispatch_wait_ms = dispatch_time.wait_seconds * 1e3;
    const bool skipped = !std::isfinite(lm_loss) || !std::isfinite(grad_sq);
    if (!skipped) {
      interval_loss += lm_loss;
      interval_aux += aux;
      interval_z += z;
      interval_loss_steps++;
    }
    interval_steps++;

    const double params_norm = log_now ? std::sqrt(optimizer.params_norm_sq()) : 0.0;  // collective
    const std::vector<RegionTime> timers = log_now ? take_region_times() : std::vector<RegionTime>();
    if (logger && log_now) {
      const double avg_ms = interval_ms / static_cast<double>(interval_steps);
      const double steps_in = static_cast<double>(interval_loss_steps);
      const double nan = std::numeric_limits<double>::quiet_NaN();
      const double avg_loss = interval_loss_steps > 0 ? interval_loss / steps_in : nan;
      const double avg_aux = interval_loss_steps > 0 ? interval_aux / steps_in : nan;
      const double avg_z = interval_loss_steps > 0 ? interval_z / steps_in : nan;
      const double logged_lr = learning_rate(args, it - state.skipped_iterations);  // the next step's, as Megatron logs
      const double tflops = flops_per_step / (avg_ms * 1e-3) / 1e12 / static_cast<double>(args.world);  // per GPU
      const double tokens_per_s = static_cast<double>(tokens_per_step) / (avg_ms * 1e-3);
      const AllocatorStats mem = memory_stats(dev);
      std::printf(" [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
                  "throughput per GPU (TFLOP/s/GPU): %.1f | learning rate: %.6E | global batch size: %5lld | "
                  "lm loss: %.6E |",
                  timestamp().c_str(), static_cast<long long>(it), static_cast<long long>(args.train_iters),
                  static_cast<long long>(state.consumed_samples), avg_ms, tflops, logged_lr,
                  static_cast<long long>(args.global_batch_size), avg_loss);
      if (!moe_layers.empty()) std::printf(" load_balancing_loss: %.6E | z_loss: %.6E |", avg_aux, avg_z);
      std::printf(" loss scale: 1.0 | grad norm: %.3f | params norm: %.3f | number of skipped iterations: %3lld | "
                  "number of nan iterations: %3lld | tokens/s: %.0f |",
                  grad_norm, params_norm, static_cast<long long>(interval_skipped),
                  static_cast<long long>(interval_nan), tokens_per_s);
      if (dev.is_cuda()) std::printf(" MFU: %.1f%% |", 100.0 * tflops / 989.0);
      std::printf(" mem allocated/peak (GB): %.2f/%.2f |", mem.allocated_bytes / 1e9, mem.peak_allocated_bytes / 1e9);
      if (dispatch_timers_enabled())
        std::printf(" dispatch communication (ms, last step): %.1f (%.0f%% of the average step; waiting for the "
                    "slowest rank: %.1f) |",
                    dispatch_ms, 100.0 * dispatch_ms / avg_ms, dispatch_wait_ms);
      std::printf("\n");
      print_timers(timers, interval_steps, avg_ms);
      if (cfg.moe.per_layer_logging) {
        for (size_t l = 0; l < layer_stats.size(); ++l) {
          std::printf("   layer %lld (MoE): load_balancing_loss %.6E z_loss %.6E tokens per expert [",
                      static_cast<long long>(moe_numbers[l]),
                      layer_stats[l].aux_loss / static_cast<double>(micro), layer_stats[l].z_loss / static_cast<double>(micro));
          for (size_t e = 0; e < layer_stats[l].tokens_per_expert.size(); ++e)
            std::printf("%s%.0f", e ? " " : "", layer_stats[l].tokens_per_expert[e]);
          std::printf("]\n");
        }
      }
      std::fflush(stdout);
      nlohmann::json j = {{"iteration", it},        {"lm_loss", avg_loss},       {"learning_rate", logged_lr},
                          {"grad_norm", grad_norm}, {"params_norm", params_norm}, {"ms_per_iteration", avg_ms},
                          {"tflops_per_gpu", tflops}, {"tokens_per_s", tokens_per_s},
                          {"consumed_samples", state.consumed_samples},
                          {"skipped_iterations", state.skipped_iterations},
                          {"mem_allocated_bytes", mem.allocated_bytes},
                          {"mem_max_allocated_bytes", mem.peak_allocated_bytes},
                          {"host_syncs_per_iteration",
                           static_cast<double>(interval_syncs) / static_cast<double>(interval_steps)}};
      if (!timers.empty()) {
        nlohmann::json t = nlohmann::json::object();
        for (const RegionTime& r : timers) t[r.name] = r.ms / static_cast<double>(interval_steps);
        j["timers_ms_per_iteration"] = t;
      }
      if (!moe_layers.empty()) {
        j["load_balancing_loss"] = avg_aux;
        j["z_loss"] = avg_z;
        if (cfg.moe.per_layer_logging) {
          nlohmann::json per = nlohmann::json::array();
          for (const MoeStepStats& s : layer_stats) per.push_back(s.tokens_per_expert);
          j["tokens_per_expert"] = per;
        }
      }
      if (metrics.is_open()) metrics << j.dump() << "\n" << std::flush;
      if (tb) {
        tb->add_scalar("learning-rate", logged_lr, it);
        tb->add_scalar("batch-size", static_cast<double>(args.global_batch_size), it);
        tb->add_scalar("lm loss", avg_loss, it);
        tb->add_scalar("grad-norm", grad_norm, it);
        tb->add_scalar("iteration-time", avg_ms / 1000.0, it);
        tb->add_scalar("throughput", tflops, it);
        tb->add_scalar("mem-allocated-bytes", static_cast<double>(mem.allocated_bytes), it);
        tb->add_scalar("mem-max-allocated-bytes", static_cast<double>(mem.peak_allocated_bytes), it);
        if (!moe_layers.empty()) {
          tb->add_scalar("load_balancing_loss", avg_aux, it);
          tb->add_scalar("z_loss", avg_z, it);
          if (cfg.moe.per_layer_logging)
            for (size_t l = 0; l < layer_stats.size(); ++l) {
              tb->add_scalar("moe/load_balancing_loss_layer_" + std::to_string(moe_numbers[l]),
                             layer_stats[l].aux_loss / static_cast<double>(micro), it);
              tb->add_scalar("moe/z_loss_layer_" + std::to_string(moe_numbers[l]),
                             layer_stats[l].z_loss / static_cast<double>(micro), it);
            }
        }
        tb->flush();
      }
      interval_loss = interval_aux = interval_z = 0;
      interval_steps = interval_skipped = interval_nan = interval_loss_steps = 0;
      interval_syncs = 0;
    }
    if (log_now) {  // the next interval starts here (the queue is empty: the params norm above read its result back)
      interval_start = Clock::now();
      interval_excluded_ms = 0;
    }

    const bool evaluate = args.eval_interval > 0 && data.valid && (it % args.eval_interval == 0 || it == args.train_iters);
    const bool save_now = args.save_interval > 0 && it % args.save_interval == 0 && it != args.train_iters;
    if ((evaluate || save_now) && !log_now) synchronize(dev);  // the step's own work counts as training time
    const auto excluded_start = Clock::now();
    if (evaluate) {
      set_timing_level(0);  // the timers cover training steps only
      double vsum = 0;
      for (int64_t e = 0; e < args.eval_iters; ++e) {
        const Batch b = context_parallel_batch(data.valid->batch(e * args.micro_batch_size, args.micro_batch_size, dev));
        GPTModel::Ctx ctx;
        if (!pp) {
          vsum += model.forward(b.tokens, b.labels, false, 0, ctx);
          continue;
        }
        // Forward only, stage to stage; the loss appears on the last stage (where the logger is).
        vsum += pipeline_forward_only(chunks, *pp, b);
      }
      // The evaluation forwards' deferred routing checks (nothing else reads them after the last one).
      for (MoeLayer* l : moe_layers) l->check_evaluation_routing();
      const double vloss = vsum / static_cast<double>(args.eval_iters);
      if (logger)
        std::printf(" validation loss at iteration %lld | lm loss value: %.6E | lm loss PPL: %.6E |\n",
                    static_cast<long long>(it), vloss, std::exp(std::min(vloss, 700.0)));
      std::fflush(stdout);
      if (metrics.is_open()) metrics << nlohmann::json({{"iteration", it}, {"valid_lm_loss", vloss}}).dump() << "\n";
      if (tb) tb->add_scalar("lm loss validation", vloss, it);
      set_timing_level(static_cast<int>(args.timing_log_level));
    }
    if (save_now) save();
    if (evaluate || save_now) {
      synchronize(dev);
      interval_excluded_ms += ms_since(excluded_start);
    }
  }
  save();
  return 0;
}

}  // namespace moecore
