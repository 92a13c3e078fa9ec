// MPI backend of Communicator (communicator.h) for host tensors.
//
// Every operation is issued as a non-blocking MPI call (MPI_Iallreduce, MPI_Ireduce_scatter_block,
// MPI_Iallgather, MPI_Ialltoallv, MPI_Ibcast, MPI_Isend, MPI_Irecv) and registered as pending
// together with the tensors it uses (kept alive) and a finisher (bf16 f32->bf16 conversion,
// Avg division). Outside a group the pending work is completed immediately; inside
// group_start()/group_end() it is completed at the outermost group_end() with MPI_Waitall.
// bf16 reductions go through f32 scratch buffers: convert, reduce in f32, round once. u8 sums
// use a user-defined wrapping MPI_Op (Open MPI 4.1's vectorised MPI_SUM on MPI_UINT8_T saturates).
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moecore/comm/communicator.h"

namespace moecore::comm {

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed in the destructor unless it is MPI_COMM_WORLD/SELF).
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }
  MPI_Comm handle() const { return comm_; }

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
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<Tensor> keep_alive;  // user tensors and scratch buffers the request touches
    std::function<void()> finish;    // runs after the request completes (may be empty)
    const char* collective = "";     // its name, for the watchdog (collective_watchdog.h)
  };
  void roles_changed() override;
  void issue(Pending p, const char* collective);  // registers p; completes everything when not in a group
  void complete_all();

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  int group_depth_ = 0;
  std::vector<Pending> pending_;
  std::vector<int> world_ranks_;  // of each rank of this group
  std::string group_name_;        // its roles and world ranks, as the watchdog names it
};

// The MPI_COMM_WORLD rank of each rank of `comm` (empty if MPI cannot tell).
std::vector<int> mpi_world_ranks(MPI_Comm comm, int size);

}  // namespace moecore::comm
