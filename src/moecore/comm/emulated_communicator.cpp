#include "moecore/comm/emulated_communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "moecore/ops/random.h"

#if MOECORE_WITH_CUDA
#include <cuda_runtime.h>

#include "moecore/core/cuda_check.h"
#endif

namespace moecore::comm {
namespace {

// The dtypes of the backend this one stands in for: MPI's on the CPU, NCCL's on a GPU.
const std::vector<DType> kHostDtypes = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8};
const std::vector<DType> kDeviceDtypes = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8};
// all_gather / all_to_all / broadcast on the CPU also move FP8 codes, as the MPI backend does.
const std::vector<DType> kHostMoveDtypes = {DType::F32, DType::F64, DType::BF16,    DType::I32,
                                            DType::I64, DType::U8,  DType::FP8E4M3, DType::FP8E5M2};
constexpr uint64_t kFillSeed = 0x656d756c61746564ull;  // "emulated"

const char* start_of(const Tensor& t) { return static_cast<const char*>(t.data_ptr()); }

// dst = src unless they are the same memory (an in-place call).
void copy_rows(Tensor dst, const Tensor& src) {
  if (dst.numel() == 0 || start_of(dst) == start_of(src)) return;
  dst.copy_from(src);
}

}  // namespace

EmulatedCommunicator::EmulatedCommunicator(int rank, int size, Device device, std::vector<int> world_ranks)
    : rank_(rank), size_(size), device_(device), world_ranks_(std::move(world_ranks)) {
  MC_CHECK(size >= 1 && rank >= 0 && rank < size, "comm emulated: rank ", rank, " of ", size,
           " ranks, expected 0 <= rank < size");
  if (world_ranks_.empty()) {
    world_ranks_.resize(static_cast<size_t>(size));
    std::iota(world_ranks_.begin(), world_ranks_.end(), 0);
  }
}

void EmulatedCommunicator::fill(Tensor& t) {
  if (t.numel() == 0) return;
  // FP8 codes, and f64 on a GPU (no random fill there): zeros, as integers.
  if (is_floating(t.dtype()) && dtype_size(t.dtype()) > 1 && (t.device().is_cpu() || t.dtype() != DType::F64)) {
    ops::fill_normal(t, kFillSeed, fills_++, 0.0, 1.0);
    return;
  }
  if (t.device().is_cpu()) {
    std::memset(t.data_ptr(), 0, t.nbytes());
    return;
  }
#if MOECORE_WITH_CUDA
  MC_CUDA_CHECK(cudaSetDevice(t.device().index));
  MC_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(),
                                static_cast<cudaStream_t>(current_stream(t.device()).handle())));
#endif
}

void EmulatedCommunicator::scratch(const Shape& shape, DType dtype) {
  if (device_.is_cpu()) scratch_.push_back(Tensor::empty(shape, dtype, device_));
}

void EmulatedCommunicator::complete() {
  if (group_depth_ == 0) scratch_.clear();
}

void EmulatedCommunicator::group_start() { ++group_depth_; }

void EmulatedCommunicator::group_end() {
  MC_CHECK(group_depth_ > 0, "comm group_end: no open group, expected a group_start() before it");
  if (--group_depth_ > 0) return;
  scratch_.clear();
  self_sends_.clear();
}

void EmulatedCommunicator::all_reduce(Tensor& t, ReduceOp op) {
  const auto& dtypes = device_.is_cpu() ? kHostDtypes : kDeviceDtypes;
  detail::check_tensor("all_reduce", "t", t, device_, dtypes);
  detail::check_reduce_op("all_reduce", t.dtype(), op);
  if (t.dtype() == DType::BF16) scratch(t.shape(), DType::F32);  // MPI reduces bf16 in f32
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.push_back(t);  // MPI keeps it until the group ends
  complete();
}

void EmulatedCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  const auto& dtypes = device_.is_cpu() ? kHostDtypes : kDeviceDtypes;
  detail::check_tensor("reduce_scatter", "in", in, device_, dtypes);
  detail::check_tensor("reduce_scatter", "out", out, device_, dtypes);
  detail::check_same_dtype("reduce_scatter", in, out);
  detail::check_rows_multiple("reduce_scatter", "in", in, "out", out, size_);
  detail::check_reduce_op("reduce_scatter", in.dtype(), op);
  const char* in_begin = start_of(in);
  const char* out_begin = start_of(out);
  const bool aliased = out_begin >= in_begin && out_begin < in_begin + in.nbytes();
  if (in.dtype() == DType::BF16) {
    scratch(in.shape(), DType::F32);
    scratch(out.shape(), DType::F32);
  } else if (aliased) {
    scratch(out.shape(), out.dtype());  // MPI's temporary for an in-place reduce_scatter
  }
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.insert(scratch_.end(), {in, out});
  const int64_t rows = out.size(0);
  copy_rows(out, in.slice(0, rank_ * rows, (rank_ + 1) * rows));
  complete();
}

void EmulatedCommunicator::all_gather(const Tensor& in, Tensor& out) {
  const auto& dtypes = device_.is_cpu() ? kHostMoveDtypes : kDeviceDtypes;
  detail::check_tensor("all_gather", "in", in, device_, dtypes);
  detail::check_tensor("all_gather", "out", out, device_, dtypes);
  detail::check_same_dtype("all_gather", in, out);
  detail::check_rows_multiple("all_gather", "out", out, "in", in, size_);
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.insert(scratch_.end(), {in, out});
  const int64_t rows = in.size(0);
  for (int r = 0; r < size_; ++r) copy_rows(out.slice(0, r * rows, (r + 1) * rows), in);
  complete();
}

void EmulatedCommunicator::all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                      const std::vector<int64_t>& recv_counts) {
  const auto& dtypes = device_.is_cpu() ? kHostMoveDtypes : kDeviceDtypes;
  detail::check_tensor("all_to_all", "in", in, device_, dtypes);
  detail::check_tensor("all_to_all", "out", out, device_, dtypes);
  detail::check_same_dtype("all_to_all", in, out);
  detail::check_all_to_all(in, send_counts, out, recv_counts, size_);
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.insert(scratch_.end(), {in, out});
  int64_t at_in = 0, at_out = 0;
  for (int r = 0; r < size_; ++r) {
    const int64_t sc = send_counts[static_cast<size_t>(r)], rc = recv_counts[static_cast<size_t>(r)];
    const int64_t common = std::min(sc, rc);
    copy_rows(out.slice(0, at_out, at_out + common), in.slice(0, at_in, at_in + common));
    if (rc > common) {
      Tensor rest = out.slice(0, at_out + common, at_out + rc);
      fill(rest);
    }
    at_in += sc;
    at_out += rc;
  }
  complete();
}

void EmulatedCommunicator::reduce(Tensor& t, int root, ReduceOp op) {
  const auto& dtypes = device_.is_cpu() ? kHostDtypes : kDeviceDtypes;
  detail::check_tensor("reduce", "t", t, device_, dtypes);
  detail::check_peer("reduce", "root", root, size_);
  detail::check_reduce_op("reduce", t.dtype(), op);
  if (t.dtype() == DType::BF16) scratch(t.shape(), DType::F32);
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.push_back(t);
  complete();
}

void EmulatedCommunicator::broadcast(Tensor& t, int root) {
  const auto& dtypes = device_.is_cpu() ? kHostMoveDtypes : kDeviceDtypes;
  detail::check_tensor("broadcast", "t", t, device_, dtypes);
  detail::check_peer("broadcast", "root", root, size_);
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.push_back(t);
  complete();
}

void EmulatedCommunicator::send(const Tensor& t, int peer) {
  const auto& dtypes = device_.is_cpu() ? kHostDtypes : kDeviceDtypes;
  detail::check_tensor("send", "t", t, device_, dtypes);
  detail::check_peer("send", "peer", peer, size_);
  MC_CHECK(peer != rank_ || group_depth_ > 0, "comm send: peer ", peer,
           " is this rank, expected another rank (sending to itself needs group_start/group_end)");
  if (peer == rank_) self_sends_.push_back(t);
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.push_back(t);
  complete();
}

void EmulatedCommunicator::recv(Tensor& t, int peer) {
  const auto& dtypes = device_.is_cpu() ? kHostDtypes : kDeviceDtypes;
  detail::check_tensor("recv", "t", t, device_, dtypes);
  detail::check_peer("recv", "peer", peer, size_);
  MC_CHECK(peer != rank_ || group_depth_ > 0, "comm recv: peer ", peer,
           " is this rank, expected another rank (receiving from itself needs group_start/group_end)");
  if (peer == rank_) {
    MC_CHECK(!self_sends_.empty(), "comm recv: a receive from this rank (", rank_,
             ") without a send to itself before it in the group, expected the send first");
    const Tensor sent = self_sends_.front();
    self_sends_.erase(self_sends_.begin());
    MC_CHECK(sent.dtype() == t.dtype() && sent.numel() == t.numel(), "comm recv: ", t.describe(),
             " receives the send to itself of ", sent.describe(), ", expected the same dtype and size");
    copy_rows(t, sent.view(t.shape()));
  } else {
    fill(t);
  }
  if (group_depth_ > 0 && device_.is_cpu()) scratch_.push_back(t);
  complete();
}

void EmulatedCommunicator::barrier() {
  MC_CHECK(group_depth_ == 0, "comm barrier: called inside group_start/group_end, expected it outside a group");
}

std::unique_ptr<Communicator> EmulatedCommunicator::split(const std::vector<int64_t>& ranks) {
  MC_CHECK(group_depth_ == 0, "comm split: called inside group_start/group_end, expected it outside a group");
  detail::check_split(ranks, rank_, size_);
  std::vector<int> members;
  int position = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    members.push_back(world_ranks_[static_cast<size_t>(ranks[i])]);
    if (ranks[i] == rank_) position = static_cast<int>(i);
  }
  return std::make_unique<EmulatedCommunicator>(position, static_cast<int>(ranks.size()), device_, members);
}

bool is_emulated(const Communicator* c) { return dynamic_cast<const EmulatedCommunicator*>(c) != nullptr; }

std::unique_ptr<Communicator> make_emulated_world(int rank, int size, Device device) {
  return std::make_unique<EmulatedCommunicator>(rank, size, device);
}

}  // namespace moecore::comm
