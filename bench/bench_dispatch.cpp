// The MoE token dispatcher's bandwidth over expert parallelism (`mpirun -np N bench_dispatch`,
// one GPU per rank when present, else CPU ranks over MPI), beside the plain all-to-all of the
// same bytes in the same run: the ceiling the dispatcher's own work (permutation, the exchange of
// counts, the sort by local expert) is measured against.
//
// Per preset, every rank routes its T tokens to top-k of E experts (uniformly at random, distinct
// per token, seeded by rank; --balanced: token t takes experts (t k + j) mod E, so every rank
// sends every rank the same rows) over EP = N ranks with the alltoall dispatcher (Megatron's
// --moe-token-dispatcher-type alltoall), and times
//   dispatch  dispatch_preprocess + token_dispatch + dispatch_postprocess: x [T, H] to the rows
//             of this rank's experts
//   combine   combine_preprocess + token_combine + combine_postprocess of those rows (the
//             experts left out: their output is their input) back to [T, H]
//   all-to-all  comm::all_to_all with equal splits of the bytes one dispatch sends
// Bandwidth per rank, as DeepEP reports it: the bytes of the rows that leave the rank (to the
// other N - 1 ranks) over the time; the table gives each beside the all-to-all's. Timing: 3
// warm-up calls, then the median of 5 runs of 10 calls, each rank timed, the slowest rank taken.
// Shapes (GPU: bf16; CPU: f32 and T / 8 to keep it short):
//   mixtral-small      T 8192 (micro-batch 4 x 2048), H 2048, E 8,  top-2
//   finegrained-small  T 16384 (micro-batch 8 x 2048), H 1024, E 64, top-8
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_ranks.h"
#include "moecore/cli/flags.h"
#include "moecore/comm/bootstrap.h"
#include "moecore/comm/communicator.h"
#include "moecore/core/device.h"
#include "moecore/core/mpi_check.h"
#include "moecore/core/philox.h"
#include "moecore/core/tensor.h"
#include "moecore/moe/token_dispatcher.h"
#include "moecore/ops/random.h"

using namespace moecore;

namespace {

struct Preset {
  std::string name;
  int64_t tokens, hidden, experts, topk;
};

// [T, k] global expert ids: distinct per token, uniform (seeded by rank) or balanced.
Tensor route(const Preset& p, int64_t tokens, int rank, bool balanced) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens * p.topk));
  std::mt19937 gen(1234u + static_cast<unsigned>(rank));
  std::vector<int32_t> all(static_cast<size_t>(p.experts));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < p.experts; ++e) all[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    if (!balanced) std::shuffle(all.begin(), all.end(), gen);
    for (int64_t j = 0; j < p.topk; ++j)
      ids[static_cast<size_t>(t * p.topk + j)] =
          balanced ? static_cast<int32_t>((t * p.topk + j) % p.experts) : all[static_cast<size_t>(j)];
  }
  return Tensor::from_vector(ids, {tokens, p.topk});
}

struct Row {
  std::string preset;
  double sent_mib, dispatch_ms, combine_ms, a2a_ms, dispatch_gbs, combine_gbs, a2a_gbs;
};

}  // namespace

int main(int argc, char** argv) {
  mpi_init(&argc, &argv);
  int code = 0;
  try {
    bool balanced = false;
    cli::FlagSet flags("bench_dispatch", "MoE dispatch + combine bandwidth over EP beside the plain all-to-all.");
    flags.add_bool("balanced", &balanced, "route every token to experts (t k + j) mod E (no imbalance)");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    const comm::LaunchEnv env = comm::read_launch_env();
    if (flags.help_requested() || env.world < 2) {
      if (env.rank == 0)
        std::printf("%sbench_dispatch needs several ranks: mpirun -np N %s (one GPU per rank when present)\n",
                    flags.help_requested() ? flags.help().c_str() : "", argv[0]);
      mpi_finalize();
      return 0;
    }
    const bool gpu = cuda_device_count() >= env.local_world;
    const Device dev = gpu ? Device::cuda(env.local_rank) : Device::cpu();
    if (gpu) set_current_device(dev);
    auto world = gpu ? comm::make_nccl_world(dev) : comm::make_mpi_world();
    const int n = world->size(), rank = world->rank();
    const DType dt = gpu ? DType::BF16 : DType::F32;
    const int64_t es = gpu ? 2 : 4;
    const std::vector<Preset> presets = {{"mixtral-small", 8192, 2048, 8, 2}, {"finegrained-small", 16384, 1024, 64, 8}};
    std::vector<Row> rows;
    for (const Preset& p : presets) {
      if (p.experts % n != 0) continue;  // EP must divide the experts
      const int64_t T = gpu ? p.tokens : p.tokens / 8;
      Tensor x = Tensor::empty({T, p.hidden}, dt, dev);
      ops::fill_normal(x, 1234, rng_key("bench-dispatch-x"), 0.0, 1.0);
      DispatchInput in;
      in.x = x;
      in.indices = route(p, T, rank, balanced).to(dev);
      auto dispatcher = make_token_dispatcher(DispatcherType::AllToAll, p.experts, world.get());
      TokenDispatcher::Ctx ctx;
      TokenRows expert_in;
      const double dispatch_s = bench::slowest_rank_seconds(*world, dev, 3, [&] {
        ctx = TokenDispatcher::Ctx{};
        expert_in = dispatcher->dispatch(in, ctx);
      });
      const double combine_s = bench::slowest_rank_seconds(*world, dev, 3, [&] { (void)dispatcher->combine(expert_in.rows, ctx); });
      // The rows this rank sends to the other ranks (the combine returns as many).
      int64_t sent = 0;
      for (int r = 0; r < n; ++r)
        if (r != rank) sent += ctx.send_rows[static_cast<size_t>(r)];
      double sent_bytes = static_cast<double>(sent * p.hidden * es);
      MPI_Allreduce(MPI_IN_PLACE, &sent_bytes, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);  // the busiest rank's
      // The plain all-to-all of those bytes on every rank, equal splits (self's share included).
      const int64_t per_peer = std::max<int64_t>(1, static_cast<int64_t>(sent_bytes) / es / std::max(1, n - 1));
      Tensor a = Tensor::zeros({per_peer * n}, dt, dev), b = Tensor::zeros({per_peer * n}, dt, dev);
      const std::vector<int64_t> split(static_cast<size_t>(n), per_peer);
      const double a2a_s = bench::slowest_rank_seconds(*world, dev, 3, [&] { world->all_to_all(a, split, b, split); });
      // Per-rank figures: the slowest rank's time and the busiest rank's bytes.
      const double a2a_bytes = static_cast<double>(per_peer * (n - 1) * es);
      rows.push_back({p.name, sent_bytes / (1 << 20), dispatch_s * 1e3, combine_s * 1e3, a2a_s * 1e3,
                      sent_bytes / dispatch_s / 1e9, sent_bytes / combine_s / 1e9, a2a_bytes / a2a_s / 1e9});
      const Row& r = rows.back();
      if (rank == 0)
        std::printf("%s\n", nlohmann::json({{"bench", "dispatch"}, {"preset", p.name}, {"ranks", n},
                                            {"tokens", T}, {"balanced", balanced}, {"backend", gpu ? "nccl" : "mpi"},
                                            {"sent_bytes_max_rank", sent_bytes}, {"dispatch_ms", r.dispatch_ms},
                                            {"combine_ms", r.combine_ms}, {"all_to_all_ms", r.a2a_ms},
                                            {"dispatch_GBps", r.dispatch_gbs}, {"combine_GBps", r.combine_gbs},
                                            {"all_to_all_GBps", r.a2a_gbs}})
                                .dump()
                                .c_str());
    }
    if (rank == 0) {
      std::printf("\nEP %d (%s, %s routing), GB/s per rank of the rows leaving it\n", n, gpu ? "NCCL, bf16" : "MPI, f32",
                  balanced ? "balanced" : "random");
      std::printf("| preset | MiB sent | dispatch ms | combine ms | all-to-all ms | dispatch GB/s | combine GB/s | all-to-all GB/s |\n");
      std::printf("|---|---|---|---|---|---|---|---|\n");
      for (const Row& r : rows)
        std::printf("| %s | %.1f | %.3f | %.3f | %.3f | %.1f | %.1f | %.1f |\n", r.preset.c_str(), r.sent_mib, r.dispatch_ms,
                    r.combine_ms, r.a2a_ms, r.dispatch_gbs, r.combine_gbs, r.a2a_gbs);
    }
    world.reset();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_dispatch: %s\n", e.what());
    code = 1;
  }
  mpi_finalize();
  return code;
}
