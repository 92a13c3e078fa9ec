// EmulatedCommunicator: one rank of a larger world, run alone (`moecore train --emulate-world-size N
// --emulate-rank R`), so that the rank's shard and steps, and so its peak memory, are those of the
// real job. No other process exists: every call checks its arguments as the real backends do and
// writes outputs of the shapes and sizes the real call would, built from this rank's data only:
//   all_reduce, reduce, broadcast   t keeps this rank's values (they stand for the result)
//   reduce_scatter                  out = this rank's rows of in
//   all_gather                      this rank's in copied into every rank's rows of out
//   all_to_all                      the rows this rank sends to rank r come back as the rows from r
//                                   (the callers' counts are symmetric in emulation: recv_counts[r]
//                                   = send_counts[r]; where they differ, the rows in common are
//                                   copied and the rest filled as by recv)
//   send                            nothing; to itself inside a group: kept for the matching recv
//   recv                            a self-send's data, else deterministic values: normal(0, 1)
//                                   from Philox for floating dtypes (hidden states that route
//                                   tokens over the experts as real ones do), zeros for integers
//   barrier, group_start/end        nothing to wait for (group_end hands back the group's scratch)
//   split(ranks)                    an emulated communicator of ranks.size() ranks, this rank at
//                                   its position in `ranks`
// The values are not a real job's: losses and norms of an emulated run mean nothing, its memory
// does. Memory: on the CPU the MPI backend allocates scratch tensors (the f32 copies of bf16
// reductions, the temporary of an in-place reduce_scatter) until the call, or the outermost group,
// completes; this backend allocates the same ones for as long, so that a CPU rank's allocator peak
// equals the real rank's. NCCL allocates nothing through moecore's allocator, and on a GPU neither
// does this backend (copies and fills run on the device's current stream).
#pragma once

#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"

namespace moecore::comm {

class EmulatedCommunicator final : public Communicator {
 public:
  // Rank `rank` of `size` on `device` (cpu or cuda:i); world_ranks: the world rank of each rank
  // (empty: 0..size-1, the world itself).
  EmulatedCommunicator(int rank, int size, Device device, std::vector<int> world_ranks = {});

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }

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
  void fill(Tensor& t);                  // recv's stand-in values
  void scratch(const Shape& shape, DType dtype);  // an MPI scratch buffer (CPU only), held until completion
  void complete();                       // outside a group: the call's scratch is released

  int rank_ = 0, size_ = 1;
  Device device_;
  std::vector<int> world_ranks_;
  int group_depth_ = 0;
  uint64_t fills_ = 0;                // Philox key of the next fill
  std::vector<Tensor> scratch_;       // held as the MPI backend holds its buffers
  std::vector<Tensor> self_sends_;    // sends to this rank in the open group, in order
};

// Whether `c` is an EmulatedCommunicator (false for null).
bool is_emulated(const Communicator* c);

// Rank `rank` of an emulated world of `size` ranks on `device`: an Error unless 0 <= rank < size.
std::unique_ptr<Communicator> make_emulated_world(int rank, int size, Device device);

}  // namespace moecore::comm
