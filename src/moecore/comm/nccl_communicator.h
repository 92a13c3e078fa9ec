// NCCL backend of Communicator (communicator.h) for device tensors (CUDA backend only; the
// implementation is nccl_communicator_cuda.cpp, and nccl_communicator.cpp makes
// make_nccl_world an Error on CPU-only builds).
//
// Two bootstraps:
//  * MPI (mpirun / srun): each NcclCommunicator pairs an ncclComm_t with an MPI communicator
//    over the same ranks in the same order: the MPI one carries the NCCL unique id at creation
//    and at split(), and implements barrier() (stream synchronise, then MPI_Barrier). split()
//    is called by the members only (MPI_Comm_create_group).
//  * TCP (torchrun, MPI not initialised): rank 0's NCCL unique id reaches the other ranks through
//    tcp_broadcast (tcp_rendezvous.h); mpi_ == MPI_COMM_NULL and no MPI call is made. barrier()
//    is a 1-element NCCL all-reduce followed by a stream synchronise. split() is ncclCommSplit
//    (NCCL >= 2.18) with color = the first rank of the list and key = this rank's position in
//    it, so it is COLLECTIVE OVER ALL RANKS OF THE PARENT: every rank calls it, in the same
//    order, each with the list of its own group (the groups of one call partition the parent).
//    The trainer does exactly that (every rank splits for its EP group, then its EDP group).
//    A rank missing from the call hangs the others; a list inconsistent with the other ranks'
//    lists is an Error when NCCL builds a group of another size.
// Operations run on the current stream of the communicator's device (current_stream(device()))
// and return without waiting for the device. all_to_all is a group of ncclSend/ncclRecv, one
// pair per peer with a non-zero count. Avg uses ncclAvg. A communicator destroyed while an
// exception unwinds is aborted (ncclCommAbort) instead of destroyed, so a failing rank does
// not wait for peers that will never join its last collective.
// Watchdog (--distributed-timeout-minutes): a communicator created after set_collective_timeout
// (collective_watchdog.h) records a CUDA event behind each collective it enqueues (behind a whole
// group at the outermost group_end) through NcclInFlight (nccl_in_flight.h), whose watchdog thread
// ends the job, after ncclCommAbort, when one runs longer than the timeout or NCCL reports an
// asynchronous error; the host's part of each call is watched too (WatchedWait: NCCL connects to
// peers lazily inside the first call). A communicator created before set_collective_timeout, or
// without it, records nothing.
#pragma once

#if MOECORE_WITH_CUDA
#include <mpi.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/comm/nccl_in_flight.h"

namespace moecore::comm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `mpi_comm` (taken over and freed in the destructor): rank 0 creates the
  // NCCL id and broadcasts it; every rank joins with its MPI rank on `device`.
  NcclCommunicator(MPI_Comm mpi_comm, Device device);
  // Without MPI: every rank of the job calls this with the same id (from rank 0's
  // ncclGetUniqueId, distributed by tcp_broadcast), its rank and the job's size.
  NcclCommunicator(const ncclUniqueId& id, int rank, int size, Device device);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  ncclComm_t handle() const { return comm_; }

  void all_reduce(Tensor& t, ReduceOp op) override;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                  const std::vector<int64_t>& recv_counts) override;
  void reduce(Tensor& t, int root, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  void send(const Tensor& t, int peer) override;
  void recv(Tensor& t, int peer) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(const std::vector<int64_t>& ranks) override;
  void group_start() override;
  void group_end() override;

 private:
  struct Adopt {};
  // Takes over a split's ncclComm_t; world_ranks: the world rank of each of its ranks.
  NcclCommunicator(Adopt, ncclComm_t comm, Device device, std::vector<int> world_ranks);
  void* stream() const;  // cudaStream_t of the current stream of device_
  void start_watch();    // creates in_flight_ when the watchdog runs
  void roles_changed() override;
  // After `collective` was enqueued: tracked now, or at the outermost group_end inside a group.
  void issued(const char* collective) {
    if (in_flight_) track(collective);
  }
  void track(const char* collective);
  std::unique_ptr<Communicator> split_without_mpi(const std::vector<int64_t>& ranks);

  MPI_Comm mpi_ = MPI_COMM_NULL;
  ncclComm_t comm_ = nullptr;
  Device device_;
  int rank_ = 0, size_ = 1;
  int group_depth_ = 0;
  std::vector<int> world_ranks_;            // of each rank of this communicator
  std::unique_ptr<NcclInFlight> in_flight_;  // null unless the watchdog runs
  std::string group_name_;                  // its roles and world ranks (set while watched)
  const char* grouped_ = nullptr;           // the collective(s) issued in the open group
};

}  // namespace moecore::comm
#endif
