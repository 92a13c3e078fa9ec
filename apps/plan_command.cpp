// `moecore plan`: the predicted per-rank memory (the parts of --memory-report) and step time of a
// training layout, or with --search the best layouts of a cluster. It takes every train flag
// (apps/train_command.cpp) and runs the train command's parsing and checks against --gpus ranks,
// so a layout the train command refuses is refused here with the same message; the models are in
// src/moecore/plan/. The last line of the output is one JSON object.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "moecore/core/error.h"
#include "moecore/model/config.h"
#include "moecore/plan/calibrate.h"
#include "moecore/plan/hardware.h"
#include "moecore/plan/layout_search.h"
#include "moecore/plan/memory_model.h"
#include "moecore/plan/step_time.h"
#include "moecore/train/memory_estimate.h"
#include "train_command.h"

namespace moecore {

namespace {

struct PlanFlags {
  int64_t gpus = 0, nodes = 0, gpus_per_node = 0;
  std::string gpu = "h100", profile;
  double nvlink_gbps = 0, network_gbps = 0;
  bool search = false, calibrate = false, embedding_slot = false, loss_slot = false;
  int64_t search_top = 10;
  std::string out;
};

// --account-for-{embedding,loss}-in-pipeline-split: num_layers + the slots split over the stages;
// a slot's layer kind (dense / MoE) is its neighbour's, for the memory model's upper bound.
void add_pipeline_slots(TrainArgs& a, const PlanFlags& pf, plan::PlanOptions* o) {
  MC_CHECK(!pf.calibrate, "moecore plan --calibrate: --account-for-*-in-pipeline-split are predictions only; drop them");
  const int64_t layers = a.model.num_layers;
  MC_CHECK(layers >= 1, "--num-layers ", layers, " must be >= 1");
  const std::vector<bool> kinds = parse_moe_layer_freq(a.moe_layer_freq.empty() ? "1" : a.moe_layer_freq, layers);
  std::string list;
  auto put = [&](bool moe) { list += std::string(list.empty() ? "[" : ",") + (moe ? "1" : "0"); };
  if (pf.embedding_slot) put(kinds.front());
  for (bool moe : kinds) put(moe);
  if (pf.loss_slot) put(kinds.back());
  a.moe_layer_freq = list + "]";
  a.model.num_layers = layers + (pf.embedding_slot ? 1 : 0) + (pf.loss_slot ? 1 : 0);
  o->embedding_slot = pf.embedding_slot;
  o->loss_slot = pf.loss_slot;
}

// The train flags of argv with the planner's own flags, parsed and checked for `world` ranks.
TrainArgs parse_for_plan(const std::vector<std::string>& argv, PlanFlags& pf, plan::PlanOptions* o, bool* help,
                         std::string* help_text) {
  TrainFlagsUse use;
  use.command = "moecore plan";
  use.summary = "Predicted per-rank memory and step time of a training layout (the train flags), or --search "
                "for the best layouts of a cluster.";
  use.extra_flags = [&](cli::FlagSet& f) {
    f.add_int("gpus", &pf.gpus, "GPUs (ranks) of the layout; --search: default --nodes x --gpus-per-node");
    f.add_string("gpu", &pf.gpu, "hardware profile: h100, h200 or cpu (the CPU ranks of the tests)");
    f.add_string("profile", &pf.profile, "JSON file overriding the profile's fields (docs/planning.md)");
    f.add_bool("search", &pf.search, "rank every valid layout of the cluster by predicted tokens/s");
    f.add_bool("calibrate", &pf.calibrate, "time moecore's kernels on --device (a GPU, or the CPU) at the layout's "
               "rank-local shapes and write a profile (--out) that --profile reads");
    f.add_bool("account-for-embedding-in-pipeline-split", &pf.embedding_slot, "a prediction (Megatron's flag): "
               "the embedding takes a layer's place in the pipeline split");
    f.add_bool("account-for-loss-in-pipeline-split", &pf.loss_slot, "a prediction (Megatron's flag): the output "
               "layer and loss take a layer's place in the pipeline split");
    f.add_string("out", &pf.out, "--calibrate: the profile file to write (default: print it)");
    f.add_int("search-top", &pf.search_top, "--search: how many of the best layouts to print (default 10)");
    f.add_int("nodes", &pf.nodes, "nodes of the cluster (default: --gpus / --gpus-per-node)");
    f.add_int("gpus-per-node", &pf.gpus_per_node, "GPUs per node (default: the profile's)");
    f.add_double("nvlink-gbps", &pf.nvlink_gbps, "GB/s per GPU inside a node (default: the profile's)");
    f.add_double("network-gbps", &pf.network_gbps, "GB/s per GPU between nodes (default: the profile's)");
  };
  use.defaults = {{"train-iters", "1"}};  // the schedule does not change a step
  use.before_finalize = [&](TrainArgs& a) {
    if (pf.gpus == 0 && pf.nodes > 0 && pf.gpus_per_node > 0) pf.gpus = pf.nodes * pf.gpus_per_node;
    if (pf.gpus <= 0)
      throw cli::UsageError("moecore plan needs --gpus N (the GPUs of the layout), or --nodes and --gpus-per-node",
                            __FILE__, __LINE__);
    // Flags training takes that the models leave out: refused, not ignored.
    MC_CHECK(!a.moe_shared_expert_overlap, "moecore plan: --moe-shared-expert-overlap is not in the planner's step-time "
             "or memory model; plan without it (the step then counts the shared expert in full)");
    MC_CHECK(!a.tp_comm_overlap, "moecore plan: --tp-comm-overlap is not in the planner's step-time model; plan without "
             "it (the step then counts the tensor-parallel collectives unoverlapped)");
    MC_CHECK(!a.moe_router_padding_for_fp8, "moecore plan: --moe-router-padding-for-fp8 is not in the planner's model "
             "(at most 15 padded rows per expert); plan without it");
    // FP8: a prediction of the blockwise recipe (the one recipe the model prices).
    if (!a.fp8_recipe.empty() || !a.fp8_format.empty() || a.fp8) {
      MC_CHECK(a.fp8_recipe == "blockwise", a.fp8_recipe.empty() ? std::string("--fp8 / --fp8-format without --fp8-recipe (training's default: delayed)")
                                                                  : "--fp8-recipe '" + a.fp8_recipe + "'",
               ": the planner models FP8 as --fp8-recipe blockwise only (a prediction)");
      o->fp8 = true;
      a.fp8_recipe.clear();
      a.fp8_format.clear();
      a.fp8 = false;
    }
    // Activation offloading: the modules whose tensors the memory model follows (memory_model.cpp).
    for (const std::string& name : a.offload_modules)
      MC_CHECK(name == "mlp_norm" || name == "expert_fc1" || name == "moe_act", "moecore plan: --offload-modules ",
               name, " is not in the planner's memory model (it models mlp_norm, expert_fc1 and moe_act); plan "
               "without it and measure the run with --memory-report");
    MC_CHECK(a.offload_modules.empty() || a.virtual_stages() == 1, "moecore plan: --offload-modules with an "
             "interleaved pipeline (--num-virtual-stages-per-pipeline-rank ", a.virtual_stages(), ") is not in the "
             "planner's memory model; plan without it and measure the run with --memory-report");
    MC_CHECK(a.emulate_world_size == 0 && a.emulate_rank == -1,
             "moecore plan: --emulate-world-size / --emulate-rank belong to `moecore train` (they run one rank of a "
             "job); the planner takes the job's size as --gpus");
    // The dispatch / combine overlapped with another micro-batch's computation (Megatron's
    // --overlap-moe-expert-parallel-comm, with or without --delay-wgrad-compute): a prediction.
    if (a.overlap_moe_ep_comm) {
      o->ep_overlap = true;
      a.overlap_moe_ep_comm = a.delay_wgrad_compute = false;
    }
    // The flex dispatcher (DeepEP: a token crosses the network once per node it goes to): a
    // prediction, with --moe-enable-deepep or --moe-flex-dispatcher-backend deepep as Megatron takes it.
    if (a.token_dispatcher == "flex" || a.moe_enable_deepep || !a.flex_dispatcher_backend.empty()) {
      MC_CHECK(a.token_dispatcher == "flex", "moecore plan: --moe-enable-deepep / --moe-flex-dispatcher-backend go "
               "with --moe-token-dispatcher-type flex");
      MC_CHECK(a.flex_dispatcher_backend.empty() || a.flex_dispatcher_backend == "deepep", "moecore plan: "
               "--moe-flex-dispatcher-backend ", a.flex_dispatcher_backend, " is not in the planner's model (it models "
               "deepep: one network copy per node)");
      MC_CHECK(!pf.calibrate, "moecore plan --calibrate: the flex dispatcher is a prediction only; calibrate with "
               "--moe-token-dispatcher-type alltoall");
      o->flex_dispatch = true;
      a.token_dispatcher = "alltoall";
      a.moe_enable_deepep = false;
      a.flex_dispatcher_backend.clear();
    }
    if (pf.embedding_slot || pf.loss_slot) add_pipeline_slots(a, pf, o);
    // --calibrate measures on the device training would use (--device); a plan runs on the host.
    MC_CHECK(pf.calibrate || a.device_text.empty() || a.device_text == "cpu", "moecore plan: --device ",
             a.device_text, " is not for the planner (it runs on the host); name the predicted hardware with --gpu "
             "(--device cpu goes with --calibrate)");
    if (!pf.calibrate) a.device_text = "cpu";
    if (a.data_path.empty()) a.mock_data = true;  // the planner reads no data
    comm::LaunchEnv env;
    env.world = static_cast<int>(pf.gpus);
    env.local_world = static_cast<int>(std::min<int64_t>(pf.gpus, pf.gpus_per_node > 0 ? pf.gpus_per_node : 8));
    env.launcher = "none";
    use.launch_env = env;
  };
  return parse_train_args(argv, help, help_text, use);
}

plan::Cluster cluster_of(const PlanFlags& pf, const plan::HardwareProfile& hw) {
  plan::Cluster c;
  c.gpus = pf.gpus;
  c.gpus_per_node = pf.gpus_per_node > 0 ? pf.gpus_per_node : hw.gpus_per_node;
  c.nvlink_gbps = pf.nvlink_gbps > 0 ? pf.nvlink_gbps : hw.nvlink_gbps;
  c.network_gbps = pf.network_gbps > 0 ? pf.network_gbps : hw.network_gbps;
  MC_CHECK(pf.nodes <= 0 || pf.nodes * c.gpus_per_node == pf.gpus, "--nodes ", pf.nodes, " x --gpus-per-node ",
           c.gpus_per_node, " is not --gpus ", pf.gpus);
  return c;
}

double memory_limit(const plan::HardwareProfile& hw, int64_t local_ranks) {
  if (hw.cpu) return device_memory_bytes(false, 0, local_ranks);
  return (hw.memory_gb - hw.reserved_gb) * 1e9;  // what the allocator can have
}

void print_plan(const TrainArgs& a, const plan::PlanOptions& o, const plan::HardwareProfile& hw,
                const plan::Cluster& cl, const std::vector<plan::StageMemory>& mem, const plan::StepTime& t) {
  const double limit = memory_limit(hw, std::min<int64_t>(cl.gpus, cl.gpus_per_node));
  const double unit = 1e9;
  std::printf("moecore plan: %lld GPUs (%s), TP %lld CP %lld PP %lld VPP %lld DP %lld | EP %lld ETP %lld EDP %lld, "
              "micro-batch %lld, global batch %lld, seq %lld%s\n",
              static_cast<long long>(cl.gpus), hw.name.c_str(), static_cast<long long>(a.tp),
              static_cast<long long>(a.cp), static_cast<long long>(a.pp), static_cast<long long>(a.virtual_stages()),
              static_cast<long long>(a.data_parallel_size()), static_cast<long long>(a.ep), static_cast<long long>(a.etp),
              static_cast<long long>(a.world / (a.pp * a.ep * a.etp)), static_cast<long long>(a.micro_batch_size),
              static_cast<long long>(a.global_batch_size), static_cast<long long>(a.model.seq_length),
              o.fp8 ? ", FP8 blockwise (prediction)" : "");
  if (o.ep_overlap) std::printf(" dispatch / combine overlapped with computation (--overlap-moe-expert-parallel-comm: "
                                "trained without pipeline stages; the step's overlap is a prediction)\n");
  std::printf(" predicted memory per rank (GB; expected, balanced expert routing):\n");
  std::printf("   %-20s", "stage");
  for (const auto& s : mem) std::printf(" %10lld", static_cast<long long>(s.stage));
  std::printf("\n");
  auto row = [&](const char* name, auto get) {
    std::printf("   %-20s", name);
    for (const auto& s : mem) std::printf(" %10.4f", get(s) / unit);
    std::printf("\n");
  };
  for (MemoryCategory c : {MemoryCategory::kWeights, MemoryCategory::kGradients, MemoryCategory::kOptimizerState,
                           MemoryCategory::kActivations}) {
    row(memory_category_name(c), [&](const plan::StageMemory& s) { return s.parts.category(c); });
    if (c != MemoryCategory::kActivations) continue;
    for (int t = 0; t < kNumMemoryTags; ++t) {
      const MemoryTag tag = static_cast<MemoryTag>(t);
      if (memory_tag_category(tag) != MemoryCategory::kActivations) continue;
      bool any = false;
      for (const auto& s : mem) any = any || s.parts.by_tag[tag] > 0;
      if (!any) continue;
      std::string name = std::string("  ") + memory_tag_name(tag);
      row(name.c_str(), [&](const plan::StageMemory& s) { return s.parts.by_tag[tag]; });
    }
  }
  row("communication", [](const plan::StageMemory& s) { return s.parts.category(MemoryCategory::kCommunication); });
  row("workspace", [](const plan::StageMemory& s) { return s.parts.category(MemoryCategory::kWorkspace); });
  row("allocator_overhead", [](const plan::StageMemory& s) { return s.parts.rounding; });
  row("peak", [](const plan::StageMemory& s) { return s.parts.total(); });
  if (!a.offload_modules.empty())
    row("host_offloaded", [](const plan::StageMemory& s) { return s.host_offloaded; });  // not in the peak
  if (a.optimizer_cpu_offload) {  // as --memory-report prints it (train/memory_report.cpp)
    auto host_row = [&](const char* name, MemoryCategory c) {
      row(name, [c](const plan::StageMemory& s) { return s.host.by_tag[memory_tag(c)]; });
    };
    std::printf("   host memory (not in the peak; --optimizer-cpu-offload):\n");
    host_row("  host weights", MemoryCategory::kWeights);
    host_row("  host gradients", MemoryCategory::kGradients);
    host_row("  host optim_state", MemoryCategory::kOptimizerState);
  }
  std::printf("   %-20s", "in flight / peak at");
  for (const auto& s : mem) std::printf(" %6lld/%-3s", static_cast<long long>(s.in_flight), s.peak_at == "step" ? "stp" : "set");
  std::printf("\n");
  double worst = 0;
  for (const auto& s : mem) worst = std::max(worst, s.parts.total());
  std::printf(" largest rank: %.4f GB of %.4f GB: %s\n", worst / unit, limit / unit,
              limit <= 0 ? "unknown" : worst <= limit ? "fits" : "DOES NOT FIT");
  std::printf(" predicted step: %.4f s (compute %.4f, small kernels %.4f, EP dispatch/combine %.4f, TP/CP %.4f, PP %.4f, "
              "bubble %.4f, DP %.4f, optimizer %.4f)\n",
              t.step_s, t.compute_s, t.small_kernels_s, t.ep_comm_s, t.tp_cp_comm_s, t.pp_comm_s, t.bubble_s, t.dp_comm_s, t.optimizer_s);
  std::printf(" %.0f tokens/s, %.1f TFLOP/s/GPU, MFU %.1f%% of %.0f TFLOP/s bf16\n", t.tokens_per_s, t.tflops_per_gpu,
              100 * t.mfu, hw.peak_bf16_tflops);
  for (const std::string& n : t.notes) std::printf(" note: %s\n", n.c_str());
  if (a.optimizer_cpu_offload || !a.offload_modules.empty())
    std::printf(" note: offloading is in the memory model only; the step time leaves out its copies and the host's "
                "optimizer step\n");
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& s : mem) {
    nlohmann::json j = {{"stage", s.stage}, {"peak_bytes", s.parts.total()}, {"peak_at", s.peak_at},
                        {"in_flight", s.in_flight}, {"allocator_overhead", s.parts.rounding}};
    for (int c = 0; c < kNumMemoryCategories; ++c)
      j[memory_category_name(static_cast<MemoryCategory>(c))] = s.parts.category(static_cast<MemoryCategory>(c));
    nlohmann::json modules = nlohmann::json::object();
    for (int t2 = 0; t2 < kNumMemoryTags; ++t2) {
      const MemoryTag tag = static_cast<MemoryTag>(t2);
      if (memory_tag_category(tag) == MemoryCategory::kActivations && s.parts.by_tag[tag] > 0)
        modules[memory_tag_name(tag)] = s.parts.by_tag[tag];
    }
    j["activation_modules"] = modules;
    if (!a.offload_modules.empty()) j["host_offloaded_bytes"] = s.host_offloaded;
    if (a.optimizer_cpu_offload)
      j["host"] = {{"weights", s.host.by_tag[memory_tag(MemoryCategory::kWeights)]},
                   {"gradients", s.host.by_tag[memory_tag(MemoryCategory::kGradients)]},
                   {"optimizer_state", s.host.by_tag[memory_tag(MemoryCategory::kOptimizerState)]}};
    stages.push_back(j);
  }
  const nlohmann::json out = {{"gpus", cl.gpus},       {"gpu", hw.name},          {"fits", limit <= 0 || worst <= limit},
                              {"memory_limit_bytes", limit}, {"peak_bytes", worst}, {"stages", stages},
                              {"step_s", t.step_s},    {"tokens_per_s", t.tokens_per_s},
                              {"step_parts_s", {{"compute", t.compute_s}, {"small_kernels", t.small_kernels_s},
                                                {"ep_dispatch_combine", t.ep_comm_s},
                                                {"tp_cp", t.tp_cp_comm_s}, {"pp", t.pp_comm_s}, {"bubble", t.bubble_s},
                                                {"dp", t.dp_comm_s}, {"optimizer", t.optimizer_s}}},
                              {"tflops_per_gpu", t.tflops_per_gpu}, {"mfu", t.mfu}, {"fp8_prediction", o.fp8},
                              {"ep_overlap_prediction", o.ep_overlap}};
  std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
}

// --calibrate: the measured profile to `out` (or stdout), and the step it predicts for the layout.
int calibrate_and_write(const TrainArgs& a, const plan::PlanOptions& o, const plan::HardwareProfile& hw,
                        const plan::Cluster& cl, const std::string& out) {
  // Measured first, then written through a temporary file renamed over `out`: a refused or failed
  // calibration leaves an existing profile as it was.
  const plan::Calibration cal = plan::calibrate(a, o, hw);
  const std::string tmp = out + ".tmp";
  std::ofstream f;
  if (!out.empty()) {
    f.open(tmp);
    MC_CHECK(f.good(), "--out: cannot write '", out, "' (tried '", tmp, "' first)");
  }
  nlohmann::json j = plan::profile_json(cal.profile);
  j["measured"] = cal.measured;
  const std::string text = j.dump(2) + "\n";
  if (!out.empty()) {
    f << text;
    f.close();
    MC_CHECK(f.good(), "--out: writing '", tmp, "' failed");
    MC_CHECK(std::rename(tmp.c_str(), out.c_str()) == 0, "--out: cannot replace '", out, "' with '", tmp, "'");
  } else {
    std::cout << text;
  }
  const plan::StepTime before = plan::predict_step_time(a, o, hw, cl);
  const plan::StepTime after = plan::predict_step_time(a, o, cal.profile, cl);
  std::printf("moecore plan --calibrate on %s: gemm %.3f, grouped gemm %.3f at %.0f rows per expert, attention %.3f "
              "of %.3g TFLOP/s; small kernels %.3f of %.3g GB/s\n",
              a.device.str().c_str(), cal.profile.gemm_efficiency, cal.profile.grouped_gemm_efficiency,
              cal.profile.grouped_gemm_reference_rows, cal.profile.attention_efficiency, hw.peak_bf16_tflops,
              cal.profile.small_kernel_efficiency, hw.hbm_gbps);
  const nlohmann::json last = {{"profile", out.empty() ? "-" : out}, {"step_s", after.step_s},
                               {"step_s_uncalibrated", before.step_s}, {"measured", cal.measured}};
  std::printf("%s\n", last.dump().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int run_plan(const std::vector<std::string>& argv) {
  PlanFlags pf;
  plan::PlanOptions o;
  bool help = false;
  std::string help_text;
  const TrainArgs a = parse_for_plan(argv, pf, &o, &help, &help_text);
  if (help) {
    std::cout << help_text;
    return 0;
  }
  plan::HardwareProfile hw = plan::builtin_hardware_profile(pf.gpu);
  if (!pf.profile.empty()) plan::apply_profile_file(hw, pf.profile);
  const plan::Cluster cl = cluster_of(pf, hw);
  MC_CHECK(pf.out.empty() || pf.calibrate, "moecore plan: --out is the profile --calibrate writes; add --calibrate "
           "or drop --out");
  if (pf.calibrate) {
    MC_CHECK(!pf.search, "moecore plan: --calibrate measures one layout; drop --search (search with the written "
             "profile: --profile FILE.json --search)");
    MC_CHECK(!hw.cpu || a.device.is_cpu(), "moecore plan --calibrate: --gpu cpu goes with --device cpu (the device "
             "measured is ", a.device.str(), ")");
    MC_CHECK(hw.cpu || !a.device.is_cpu(), "moecore plan --calibrate: --gpu ", pf.gpu, " names a GPU but the device "
             "measured is the CPU; add --device cuda, or --gpu cpu to calibrate the CPU profile");
    return calibrate_and_write(a, o, hw, cl, pf.out);
  }
  o.whole_run_peak = hw.cpu;
  o.offload_copies_synchronous = hw.cpu;  // the CPU copies offloaded activations at once
  o.gpu_head_chunks = !hw.cpu;
  if (pf.search) {
    plan::SearchSpace space;
    space.base_argv = argv;
    space.parse = [&](const std::vector<std::string>& candidate) {
      PlanFlags p2 = pf;
      plan::PlanOptions o2;
      bool h = false;
      std::string ht;
      return parse_for_plan(candidate, p2, &o2, &h, &ht);
    };
    const std::vector<plan::Candidate> ranked =
        plan::search_layouts(space, o, hw, cl, memory_limit(hw, std::min<int64_t>(cl.gpus, cl.gpus_per_node)));
    MC_CHECK(pf.search_top >= 1, "--search-top ", pf.search_top, " must be >= 1");
    std::cout << plan::format_search(ranked, cl, hw, static_cast<size_t>(pf.search_top));
    return 0;
  }
  print_plan(a, o, hw, cl, plan::predict_memory(a, o), plan::predict_step_time(a, o, hw, cl));
  return 0;
}

}  // namespace moecore
