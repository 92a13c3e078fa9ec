#include "moecore/comm/bootstrap.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <vector>

#include "moecore/core/error.h"

extern char** environ;

namespace moecore::comm {
namespace {

using Env = std::map<std::string, std::string>;

struct Reader {
  const Env& env;
  std::string launcher;

  bool has(const char* name) const { return env.count(name) != 0; }

  std::string str(const char* name) const {
    auto it = env.find(name);
    MC_CHECK(it != env.end(), "launch environment (", launcher, "): ", name, " is not set, expected it with the other ",
             launcher, " variables");
    return it->second;
  }

  static std::optional<long long> parse(const std::string& s) {
    if (s.empty()) return std::nullopt;
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return std::nullopt;
    return v;
  }

  int integer(const char* name) const {
    const std::string s = str(name);
    const auto v = parse(s);
    MC_CHECK(v && *v >= INT32_MIN && *v <= INT32_MAX, "launch environment (", launcher, "): ", name, "='", s,
             "' is not an integer, expected a decimal number");
    return static_cast<int>(*v);
  }
};

// SLURM_TASKS_PER_NODE: comma-separated "n" or "n(xk)" (k nodes with n tasks); entry for `node`.
int slurm_tasks_on_node(const std::string& spec, int node) {
  int seen = 0;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string::npos) comma = spec.size();
    const std::string item = spec.substr(pos, comma - pos);
    long long n = 0, k = 1;
    const size_t paren = item.find("(x");
    const auto pn = Reader::parse(item.substr(0, paren));
    MC_CHECK(pn && *pn > 0, "launch environment (slurm): SLURM_TASKS_PER_NODE='", spec,
             "' is malformed, expected entries like '4' or '2(x3)'");
    n = *pn;
    if (paren != std::string::npos) {
      MC_CHECK(item.back() == ')', "launch environment (slurm): SLURM_TASKS_PER_NODE='", spec,
               "' is malformed, expected entries like '4' or '2(x3)'");
      const auto pk = Reader::parse(item.substr(paren + 2, item.size() - paren - 3));
      MC_CHECK(pk && *pk > 0, "launch environment (slurm): SLURM_TASKS_PER_NODE='", spec,
               "' is malformed, expected entries like '4' or '2(x3)'");
      k = *pk;
    }
    if (node < seen + k) return static_cast<int>(n);
    seen += static_cast<int>(k);
    pos = comma + 1;
  }
  MC_FAIL("launch environment (slurm): SLURM_NODEID=", node, " is beyond the ", seen,
          " nodes of SLURM_TASKS_PER_NODE='", spec, "', expected 0 <= SLURM_NODEID < ", seen);
}

void check_range(const std::string& launcher, const char* idx_name, int idx, const char* n_name, int n) {
  MC_CHECK(n >= 1, "launch environment (", launcher, "): ", n_name, "=", n, ", expected ", n_name, " >= 1");
  MC_CHECK(idx >= 0, "launch environment (", launcher, "): ", idx_name, "=", idx, " is negative, expected 0 <= ",
           idx_name, " < ", n_name);
  MC_CHECK(idx < n, "launch environment (", launcher, "): ", idx_name, "=", idx, " is not below ", n_name, "=", n,
           ", expected 0 <= ", idx_name, " < ", n_name);
}

}  // namespace

LaunchEnv read_launch_env(const std::map<std::string, std::string>& env) {
  LaunchEnv out;
  const char *rank_v = nullptr, *world_v = nullptr, *lrank_v = nullptr, *lworld_v = nullptr;
  Reader rd{env, ""};
  auto has = [&](const char* n) { return env.count(n) != 0; };
  bool addr_required = false;

  if (has("OMPI_COMM_WORLD_RANK") || has("OMPI_COMM_WORLD_SIZE")) {
    rd.launcher = "openmpi";
    rank_v = "OMPI_COMM_WORLD_RANK", world_v = "OMPI_COMM_WORLD_SIZE";
    lrank_v = "OMPI_COMM_WORLD_LOCAL_RANK", lworld_v = "OMPI_COMM_WORLD_LOCAL_SIZE";
  } else if (has("RANK") || has("WORLD_SIZE")) {
    rd.launcher = "torchrun";
    rank_v = "RANK", world_v = "WORLD_SIZE", lrank_v = "LOCAL_RANK", lworld_v = "LOCAL_WORLD_SIZE";
    addr_required = true;
  } else if (has("PMI_RANK") || has("PMI_SIZE")) {
    rd.launcher = "pmi";
    rank_v = "PMI_RANK", world_v = "PMI_SIZE";
    if (has("PMI_LOCAL_RANK") && !has("MPI_LOCALRANKID")) {
      lrank_v = "PMI_LOCAL_RANK", lworld_v = "PMI_LOCAL_SIZE";
    } else {
      lrank_v = "MPI_LOCALRANKID", lworld_v = "MPI_LOCALNRANKS";
    }
  } else if (has("SLURM_PROCID")) {
    rd.launcher = "slurm";
    rank_v = "SLURM_PROCID", world_v = "SLURM_NTASKS", lrank_v = "SLURM_LOCALID";
  } else {
    out.launcher = "none";
    return out;
  }
  out.launcher = rd.launcher;
  out.rank = rd.integer(rank_v);
  out.world = rd.integer(world_v);
  out.local_rank = rd.integer(lrank_v);
  if (lworld_v) {
    out.local_world = rd.integer(lworld_v);
  } else if (has("SLURM_TASKS_PER_NODE")) {
    lworld_v = "SLURM_TASKS_PER_NODE";
    out.local_world = slurm_tasks_on_node(rd.str("SLURM_TASKS_PER_NODE"), rd.integer("SLURM_NODEID"));
  } else {
    lworld_v = "SLURM_NTASKS_PER_NODE";
    MC_CHECK(has("SLURM_NTASKS_PER_NODE"), "launch environment (slurm): SLURM_TASKS_PER_NODE is not set (nor ",
             "SLURM_NTASKS_PER_NODE), expected the number of tasks per node");
    out.local_world = rd.integer("SLURM_NTASKS_PER_NODE");
  }
  check_range(rd.launcher, rank_v, out.rank, world_v, out.world);
  check_range(rd.launcher, lrank_v, out.local_rank, lworld_v, out.local_world);
  MC_CHECK(out.local_world <= out.world, "launch environment (", rd.launcher, "): ", lworld_v, "=", out.local_world,
           " exceeds ", world_v, "=", out.world, ", expected ", lworld_v, " <= ", world_v);

  if (addr_required || has("MASTER_ADDR")) {
    out.master_addr = rd.str("MASTER_ADDR");
    MC_CHECK(!out.master_addr.empty(), "launch environment (", rd.launcher,
             "): MASTER_ADDR is empty, expected a host name or address");
  }
  if (addr_required || has("MASTER_PORT")) {
    out.master_port = rd.integer("MASTER_PORT");
    MC_CHECK(out.master_port >= 1 && out.master_port <= 65535, "launch environment (", rd.launcher,
             "): MASTER_PORT=", out.master_port, ", expected a port in 1..65535");
  }
  return out;
}

void check_torchrun_devices(const LaunchEnv& env, int visible_gpus, Device device, bool device_from_flag) {
  if (env.launcher != "torchrun" || env.world <= 1) return;
  MC_CHECK(device.is_cuda(), "torchrun with WORLD_SIZE=", env.world, " needs CUDA devices (this rank would run on ",
           device.str(), visible_gpus == 0 ? ": " + cuda_unavailable_reason() : std::string(" (--device)"),
           "): torchrun ranks communicate through NCCL; launch CPU ranks with mpirun or srun");
  if (device_from_flag) return;
  const bool virtual_local_rank = visible_gpus == 1 && env.local_rank == 0;
  MC_CHECK(env.local_world <= visible_gpus || virtual_local_rank, "torchrun started LOCAL_WORLD_SIZE=",
           env.local_world, " ranks on this node but ", visible_gpus, " CUDA device(s) are visible (LOCAL_RANK=",
           env.local_rank, "); expected one GPU per local rank: --nproc-per-node <= ", visible_gpus,
           " (or set CUDA_VISIBLE_DEVICES)");
}

LaunchEnv read_launch_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return read_launch_env(env);
}

}  // namespace moecore::comm
