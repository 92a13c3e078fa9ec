// Launcher environment -> this process's place in the job.
//
// Detected in this order (the first launcher whose variables are present wins):
//   launcher "openmpi":  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
//                        OMPI_COMM_WORLD_LOCAL_SIZE (mpirun / Open MPI)
//   launcher "torchrun": RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//                        (all required once RANK or WORLD_SIZE is set)
//   launcher "pmi":      PMI_RANK, PMI_SIZE, and MPI_LOCALRANKID/MPI_LOCALNRANKS (MPICH Hydra) or
//                        PMI_LOCAL_RANK/PMI_LOCAL_SIZE
//   launcher "slurm":    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the local task count from
//                        SLURM_TASKS_PER_NODE ("2(x3),1", indexed by SLURM_NODEID) or
//                        SLURM_NTASKS_PER_NODE
//   launcher "none":     none of the above: a single process (rank 0 of 1)
// MASTER_ADDR / MASTER_PORT are optional for the launchers other than torchrun (read when set;
// under MPI launchers moecore bootstraps NCCL over MPI and needs neither). Under torchrun no MPI
// is started: the NCCL id travels over TCP from rank 0 (tcp_rendezvous.h gives the port rule).
//
// Every value is checked: integers must parse completely, 0 <= rank < world,
// 0 <= local_rank < local_world <= world, 1 <= master_port <= 65535. A missing or inconsistent
// value is an Error naming the launcher and the variable(s), e.g.
//   "launch environment (torchrun): RANK=4 is not below WORLD_SIZE=4, expected 0 <= RANK < WORLD_SIZE".
#pragma once

#include <map>
#include <string>

#include "moecore/core/device.h"

namespace moecore::comm {

struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr;
  int master_port = 0;
  std::string launcher;  // "openmpi", "torchrun", "pmi", "slurm", "none"
};

LaunchEnv read_launch_env();                                                // the process environment
LaunchEnv read_launch_env(const std::map<std::string, std::string>& env);  // testable

// torchrun with WORLD_SIZE > 1: the ranks talk through NCCL only (no MPI), so each needs a CUDA
// device: `device` must be CUDA (CPU ranks: launch with mpirun or srun), and unless it was chosen
// with --device (`device_from_flag`) one GPU per local rank must be visible: LOCAL_WORLD_SIZE <=
// visible_gpus, or exactly one visible GPU with LOCAL_RANK=0 (torchrun --virtual-local-rank gives
// each worker its own GPU as cuda:0). An Error naming both counts otherwise; nothing for other
// launchers or a single rank.
void check_torchrun_devices(const LaunchEnv& env, int visible_gpus, Device device, bool device_from_flag);

}  // namespace moecore::comm
