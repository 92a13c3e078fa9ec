// NCCL backend of Communicator (communicator.h) for device tensors (CUDA backend only; the
// implementation is nccl_communicator_cuda.cpp, and nccl_communicator.cpp makes
// make_nccl_world an Error on CPU-only builds).
//
// Each NcclCommunicator pairs an ncclComm_t with an MPI communicator over the same ranks in the
// same order: the MPI one carries the NCCL unique id at creation and at split(), and
// implements barrier() (stream synchronise, then MPI_Barrier). Operations run on the current
// stream of the communicator's device (current_stream(device())) and return without waiting
// for the device. all_to_all is a group of ncclSend/ncclRecv, one pair per peer with a
// non-zero count. Avg uses ncclAvg.
#pragma once

#if MOECORE_WITH_CUDA
#include <mpi.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"

namespace moecore::comm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `mpi_comm` (taken over and freed in the destructor): rank 0 creates the
  // NCCL id and broadcasts it; every rank joins with its MPI rank on `device`.
  NcclCommunicator(MPI_Comm mpi_comm, Device device);
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
  void broadcast(Tensor& t, int root) override;
  void send(const Tensor& t, int peer) override;
  void recv(Tensor& t, int peer) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(const std::vector<int64_t>& ranks) override;
  void group_start() override;
  void group_end() override;

 private:
  void* stream() const;  // cudaStream_t of the current stream of device_

  MPI_Comm mpi_ = MPI_COMM_NULL;
  ncclComm_t comm_ = nullptr;
  Device device_;
  int rank_ = 0, size_ = 1;
  int group_depth_ = 0;
};

}  // namespace moecore::comm
#endif
