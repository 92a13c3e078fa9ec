// Collective bandwidth through moecore::comm (NCCL on GPUs, MPI on CPUs), at the sizes the MoE
// dispatch of the preset models moves: `mpirun -np N bench_comm`.
//
// all-to-all (equal splits): bus bandwidth = bytes per rank * (n - 1) / n / time
// all-reduce:                bus bandwidth = 2 * bytes * (n - 1) / n / time      (nccl-tests' definitions)
// all-gather:                bus bandwidth = bytes of the output * (n - 1) / n / time
// bytes: bf16 on GPUs, f32 on CPUs. Dispatch sizes: tokens per micro-batch x top-k x hidden
// (mixtral-small: 4 x 2048 tokens, k 2, h 2048 = 64 MiB bf16 per rank; finegrained-small: k 8,
// h 1024). Timing: 5 warm-up calls, then the median of 5 runs of 10 calls, every rank timed,
// the slowest rank reported. One JSON line per measurement, a table last. With one rank it says
// how to launch it and exits 0.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_ranks.h"
#include "moecore/comm/bootstrap.h"
#include "moecore/comm/communicator.h"
#include "moecore/core/device.h"
#include "moecore/core/mpi_check.h"
#include "moecore/core/tensor.h"
#include "moecore/ops/elementwise.h"

using namespace moecore;

namespace {

struct Case {
  std::string name, op;
  int64_t bytes;  // per rank (all-to-all, all-reduce) or of the output (all-gather)
};

double time_calls(comm::Communicator& c, const Case& k, Tensor& a, Tensor& b, Device dev) {
  const int n = c.size();
  const std::vector<int64_t> split(static_cast<size_t>(n), a.numel() / n);
  auto once = [&] {
    if (k.op == "all_to_all") {
      c.all_to_all(a, split, b, split);
    } else if (k.op == "all_reduce") {
      c.all_reduce(a, comm::ReduceOp::Sum);
    } else {
      Tensor in = a.slice(0, 0, a.numel() / n);
      c.all_gather(in, b);
    }
  };
  return bench::slowest_rank_seconds(c, dev, 5, once);
}

}  // namespace

int main(int argc, char** argv) {
  mpi_init(&argc, &argv);
  const comm::LaunchEnv env = comm::read_launch_env();
  if (env.world < 2) {
    std::printf("bench_comm: needs several ranks: mpirun -np N %s (one GPU per rank when present)\n", argv[0]);
    mpi_finalize();
    return 0;
  }
  const bool gpu = cuda_device_count() >= env.local_world;
  const Device dev = gpu ? Device::cuda(env.local_rank) : Device::cpu();
  if (gpu) set_current_device(dev);
  auto world = gpu ? comm::make_nccl_world(dev) : comm::make_mpi_world();
  const DType dt = gpu ? DType::BF16 : DType::F32;
  const int64_t es = gpu ? 2 : 4, n = world->size();
  const int64_t mib = 1 << 20;
  std::vector<Case> cases = {
      {"mixtral-small dispatch (8192 tok x k2 x h2048)", "all_to_all", 8192 * 2 * 2048 * es},
      {"finegrained-small dispatch (8192 tok x k8 x h1024)", "all_to_all", 8192 * 8 * 1024 * es},
      {"1 MiB", "all_to_all", 1 * mib},
      {"16 MiB", "all_to_all", 16 * mib},
      {"256 MiB", "all_to_all", 256 * mib},
      {"gradients 256 MiB", "all_reduce", 256 * mib},
      {"masters 256 MiB", "all_gather", 256 * mib},
  };
  if (!gpu)
    for (Case& c : cases) c.bytes = std::min<int64_t>(c.bytes, 16 * mib);  // CPU: keep it short
  struct Row {
    Case c;
    double ms, busbw;
  };
  std::vector<Row> rows;
  for (const Case& k : cases) {
    const int64_t elems = (k.bytes / es) / n * n;
    Tensor a = Tensor::zeros({elems}, dt, dev), b = Tensor::zeros({elems}, dt, dev);
    const double s = time_calls(*world, k, a, b, dev);
    const double bytes = static_cast<double>(elems * es);
    const double factor = (k.op == "all_reduce" ? 2.0 : 1.0) * static_cast<double>(n - 1) / static_cast<double>(n);
    rows.push_back({k, s * 1e3, bytes * factor / s / 1e9});
    if (world->rank() == 0)
      std::printf("%s\n", nlohmann::json({{"bench", "comm"}, {"case", k.name}, {"op", k.op}, {"ranks", n},
                                          {"bytes", elems * es}, {"ms", s * 1e3}, {"busbw_GBps", rows.back().busbw},
                                          {"backend", gpu ? "nccl" : "mpi"}})
                              .dump()
                              .c_str());
  }
  if (world->rank() == 0) {
    std::printf("\n%d ranks, %s\n| case | op | MiB | ms | bus GB/s |\n|---|---|---|---|---|\n", static_cast<int>(n),
                gpu ? "NCCL, bf16" : "MPI, f32");
    for (const Row& r : rows)
      std::printf("| %s | %s | %.1f | %.3f | %.1f |\n", r.c.name.c_str(), r.c.op.c_str(),
                  static_cast<double>(r.c.bytes) / mib, r.ms, r.busbw);
  }
  world.reset();
  mpi_finalize();
  return 0;
}
