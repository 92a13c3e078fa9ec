#include "moecore/train/checkpoint_transfer.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include <nlohmann/json.hpp>

#include "moecore/comm/communicator.h"

namespace moecore {

bool owns_tensor(const PipelineStage& st, const ModelConfig& cfg, const std::string& name) {
  const std::string layers = "decoder.layers.";
  if (name.rfind(layers, 0) == 0) {
    const int64_t i = std::stoll(name.substr(layers.size()));
    return i >= st.first_layer && i < st.end_layer;
  }
  // Tied embeddings (or MTP): the last stage holds a copy of the word embedding (loaded, never saved).
  if (name.rfind("embedding.word_embeddings.", 0) == 0) return st.has_embedding || (cfg.head_stage_has_embedding() && st.has_head);
  if (name.rfind("embedding.", 0) == 0) return st.has_embedding;
  return st.has_head;  // final norm, output layer, MTP modules
}

bool saves_tensor(const PipelineStage& st, const ModelConfig& cfg, const std::string& name) {
  return owns_tensor(st, cfg, name) && (st.has_embedding || name.rfind("embedding.", 0) != 0);
}

bool chunks_own_tensor(const std::vector<PipelineStage>& chunk_stages, const ModelConfig& cfg, const std::string& name) {
  for (const PipelineStage& st : chunk_stages)
    if (owns_tensor(st, cfg, name)) return true;
  return false;
}

bool chunks_save_tensor(const std::vector<PipelineStage>& chunk_stages, const ModelConfig& cfg,
                        const std::string& name) {
  for (const PipelineStage& st : chunk_stages)
    if (saves_tensor(st, cfg, name)) return true;
  return false;
}

namespace {

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

}  // namespace

TrainingState load_training_checkpoint(const TrainArgs& args, const std::vector<PipelineStage>& chunk_stages,
                                       Optimizer& optimizer) {
  TrainingState state;
  if (!args.load.empty() && !checkpoint_exists(args.load)) {
    MC_CHECK(!args.finetune, "--finetune: no checkpoint in --load ", args.load,
             " (expected a save directory or an iter_* directory with meta.json)");
    // Megatron's behaviour for the first run of a job that passes --load and --save alike.
    std::printf("note: no checkpoint in --load %s; training from scratch\n", args.load.c_str());
  } else if (!args.load.empty()) {
    const TrainingState meta = read_checkpoint_meta(args.load);
    MC_CHECK(!meta.model_only || args.finetune || args.eval_only, "--load ", args.load, ": a model-only checkpoint (weights without ",
             "optimizer state or iteration, as moecore convert writes) cannot be resumed; pass --finetune to train ",
             "from its weights");
    // --finetune: only the model must match; --no-load-optim: the schedule starts afresh too.
    // moecore eval: the weights and the model's flags only.
    check_resume_flags(meta.args, args, /*check_schedule=*/!args.finetune && !args.no_load_optim && !args.eval_only);
    const bool fresh_optimizer = meta.model_only || args.finetune || args.no_load_optim || args.eval_only;
    auto optimizer_tensor = [](const std::string& name) {
      return name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq");
    };
    // Checkpoints hold the whole model: a pipeline stage leaves the other stages' tensors.
    const int64_t stages = args.pp;
    auto elsewhere = [&](const std::string& name) {
      return (stages > 1 && !chunks_own_tensor(chunk_stages, args.model, name)) ||
             (fresh_optimizer && optimizer_tensor(name));
    };
    state = load_checkpoint(
        args.load, [&](const TensorFetch& fetch, bool) { optimizer.load(fetch, fresh_optimizer); }, elsewhere);
    const int64_t loaded_iteration = state.iteration;
    if (args.finetune) state = TrainingState{};
    if (args.no_load_optim && !args.finetune) state.optimizer_offset = state.iteration - state.skipped_iterations;
    if (args.logging_rank())
      std::printf("loaded checkpoint from %s at iteration %lld%s\n", args.load.c_str(),
                  static_cast<long long>(loaded_iteration),
                  args.finetune ? " (--finetune: its weights only; iteration 0, fresh AdamW moments and schedule)"
                  : args.no_load_optim ? " (--no-load-optim: fresh AdamW moments and learning-rate schedule)"
                                       : "");
  }
  return state;
}

void save_training_checkpoint(const TrainArgs& args, const std::vector<PipelineStage>& chunk_stages,
                              const TrainingState& state, Optimizer& optimizer, const parallel::ProcessGroups& groups) {
  if (args.save.empty()) return;
  comm::Communicator* pp = groups.pp();
  const parallel::ProcessGroupLayout& layout = groups.layout();
  const bool writer = args.rank == 0;
  // The ranks that keep checkpoint tensors: the first of each stage's TP, CP and DP groups.
  const bool keeper = layout.dp_rank == 0 && layout.tp_rank == 0 && layout.cp_rank == 0;
  auto saves = [&](const std::string& name) { return chunks_save_tensor(chunk_stages, args.model, name); };
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
  if (groups.world()) groups.world()->barrier();
}

}  // namespace moecore
