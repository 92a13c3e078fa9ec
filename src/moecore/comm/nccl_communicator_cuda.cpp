#include "moecore/comm/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <numeric>
#include <optional>

#include "moecore/comm/bootstrap.h"
#include "moecore/comm/collective_watchdog.h"
#include "moecore/comm/mpi_communicator.h"
#include "moecore/comm/tcp_rendezvous.h"
#include "moecore/core/cuda_check.h"
#include "moecore/core/mpi_check.h"
#include "moecore/core/nccl_check.h"

namespace moecore::comm {
namespace {

// F64: the step's MoE statistics are summed over the ranks in f64 on the device.
const std::vector<DType> kNcclDtypes = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8};
// The collectives that only move bytes (all_gather, all_to_all, broadcast, send, recv) also take
// FP8 codes (the FP8 token dispatch, moe/token_dispatcher.h): NCCL has no FP8 type, so they travel
// as ncclUint8. Reductions refuse them (refuse_fp8_reduction).
const std::vector<DType> kNcclMoveDtypes = {DType::F32, DType::F64, DType::BF16,    DType::I32,
                                            DType::I64, DType::U8,  DType::FP8E4M3, DType::FP8E5M2};

bool is_fp8(DType t) { return t == DType::FP8E4M3 || t == DType::FP8E5M2; }

void refuse_fp8_reduction(const char* call, const char* name, const Tensor& t) {
  MC_CHECK(!t.defined() || !is_fp8(t.dtype()), "comm ", call, ": ", name, " has dtype ", dtype_name(t.dtype()),
           ", expected one of ", detail::dtypes_str(kNcclDtypes), ": FP8 codes are only moved as bytes (all_gather, "
           "all_to_all, broadcast, send, recv), never reduced; reduce in f32 or bf16");
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: return ncclUint8;
    case DType::FP8E4M3:
    case DType::FP8E5M2: return ncclUint8;  // moved as bytes (never reduced: refuse_fp8_reduction)
    default: MC_FAIL("comm: dtype ", dtype_name(t), " has no NCCL type, expected one of ", detail::dtypes_str(kNcclMoveDtypes));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
    case ReduceOp::Avg: return ncclAvg;
  }
  return ncclSum;
}

size_t count(const Tensor& t) { return static_cast<size_t>(t.numel()); }

}  // namespace

NcclCommunicator::NcclCommunicator(MPI_Comm mpi_comm, Device device) : mpi_(mpi_comm), device_(device) {
  try {
    MC_MPI_CHECK(MPI_Comm_set_errhandler(mpi_, MPI_ERRORS_RETURN));
    MC_MPI_CHECK(MPI_Comm_rank(mpi_, &rank_));
    MC_MPI_CHECK(MPI_Comm_size(mpi_, &size_));
    set_current_device(device_);
    ncclUniqueId id{};
    if (rank_ == 0) MC_NCCL_CHECK(ncclGetUniqueId(&id));
    MC_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, mpi_));
    MC_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  } catch (...) {
    MPI_Comm_free(&mpi_);
    throw;
  }
  world_ranks_ = mpi_world_ranks(mpi_, size_);
  start_watch();
}

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int rank, int size, Device device)
    : device_(device), rank_(rank), size_(size) {
  set_current_device(device_);
  MC_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  for (int r = 0; r < size_; ++r) world_ranks_.push_back(r);  // the world itself
  start_watch();
}

NcclCommunicator::NcclCommunicator(Adopt, ncclComm_t comm, Device device, std::vector<int> world_ranks)
    : comm_(comm), device_(device), world_ranks_(std::move(world_ranks)) {
  MC_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
  MC_NCCL_CHECK(ncclCommCount(comm_, &size_));
  start_watch();
}

void NcclCommunicator::start_watch() {
  if (!collective_watchdog_started()) return;
  group_name_ = detail::describe_group(roles(), world_ranks_);
  in_flight_ = std::make_unique<NcclInFlight>(comm_, device_.index, group_name_);
}

void NcclCommunicator::roles_changed() {
  if (!in_flight_) return;
  group_name_ = detail::describe_group(roles(), world_ranks_);
  in_flight_->set_group(group_name_);
}

void NcclCommunicator::track(const char* collective) {
  if (group_depth_ > 0) {  // recorded behind the whole group at the outermost group_end
    grouped_ = grouped_ ? "a group of collectives" : collective;
    return;
  }
  in_flight_->issued(collective, static_cast<cudaStream_t>(stream()));
}

NcclCommunicator::~NcclCommunicator() {
  in_flight_.reset();  // the watchdog stops polling comm_ before it goes
  // Unwinding from an error: the peers may never join this rank's last collectives, and
  // ncclCommDestroy would wait for them; ncclCommAbort does not.
  if (comm_) std::uncaught_exceptions() > 0 ? ncclCommAbort(comm_) : ncclCommDestroy(comm_);
  if (mpi_ == MPI_COMM_NULL) return;  // TCP bootstrap: MPI may not even be initialised
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&mpi_);
}

void* NcclCommunicator::stream() const { return current_stream(device_).handle(); }

#define MC_NCCL_STREAM static_cast<cudaStream_t>(stream())
// With the watchdog on, the host's part of a call is watched too (WatchedWait): NCCL connects to
// the peers lazily inside the first collective with them, and a group's end may wait for them.
#define MC_NCCL_WATCH_HOST(collective)  \
  std::optional<WatchedWait> host_wait_; \
  if (in_flight_) host_wait_.emplace(collective, group_name_)

void NcclCommunicator::all_reduce(Tensor& t, ReduceOp op) {
  refuse_fp8_reduction("all_reduce", "t", t);
  detail::check_tensor("all_reduce", "t", t, device_, kNcclDtypes);
  detail::check_reduce_op("all_reduce", t.dtype(), op);
  MC_NCCL_WATCH_HOST("all_reduce");
  MC_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), count(t), nccl_type(t.dtype()), nccl_op(op), comm_,
                              MC_NCCL_STREAM));
  issued("all_reduce");
}

void NcclCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  refuse_fp8_reduction("reduce_scatter", "in", in);
  detail::check_tensor("reduce_scatter", "in", in, device_, kNcclDtypes);
  detail::check_tensor("reduce_scatter", "out", out, device_, kNcclDtypes);
  detail::check_same_dtype("reduce_scatter", in, out);
  detail::check_rows_multiple("reduce_scatter", "in", in, "out", out, size_);
  detail::check_reduce_op("reduce_scatter", in.dtype(), op);
  MC_NCCL_WATCH_HOST("reduce_scatter");
  MC_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), count(out), nccl_type(in.dtype()), nccl_op(op), comm_,
                                  MC_NCCL_STREAM));
  issued("reduce_scatter");
}

void NcclCommunicator::all_gather(const Tensor& in, Tensor& out) {
  detail::check_tensor("all_gather", "in", in, device_, kNcclMoveDtypes);
  detail::check_tensor("all_gather", "out", out, device_, kNcclMoveDtypes);
  detail::check_same_dtype("all_gather", in, out);
  detail::check_rows_multiple("all_gather", "out", out, "in", in, size_);
  MC_NCCL_WATCH_HOST("all_gather");
  MC_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), count(in), nccl_type(in.dtype()), comm_, MC_NCCL_STREAM));
  issued("all_gather");
}

void NcclCommunicator::all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                  const std::vector<int64_t>& recv_counts) {
  detail::check_tensor("all_to_all", "in", in, device_, kNcclMoveDtypes);
  detail::check_tensor("all_to_all", "out", out, device_, kNcclMoveDtypes);
  detail::check_same_dtype("all_to_all", in, out);
  detail::check_all_to_all(in, send_counts, out, recv_counts, size_);
  const int64_t row = std::accumulate(in.shape().begin() + 1, in.shape().end(), int64_t{1}, std::multiplies<>());
  const size_t row_bytes = static_cast<size_t>(row) * dtype_size(in.dtype());
  const ncclDataType_t type = nccl_type(in.dtype());
  const cudaStream_t s = MC_NCCL_STREAM;
  char* src = static_cast<char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  MC_NCCL_WATCH_HOST("all_to_all");
  MC_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < size_; ++r) {
    if (send_counts[r] > 0)
      MC_NCCL_CHECK(ncclSend(src, static_cast<size_t>(send_counts[r] * row), type, r, comm_, s));
    if (recv_counts[r] > 0)
      MC_NCCL_CHECK(ncclRecv(dst, static_cast<size_t>(recv_counts[r] * row), type, r, comm_, s));
    src += send_counts[r] * row_bytes;
    dst += recv_counts[r] * row_bytes;
  }
  MC_NCCL_CHECK(ncclGroupEnd());
  issued("all_to_all");
}

void NcclCommunicator::reduce(Tensor& t, int root, ReduceOp op) {
  refuse_fp8_reduction("reduce", "t", t);
  detail::check_tensor("reduce", "t", t, device_, kNcclDtypes);
  detail::check_peer("reduce", "root", root, size_);
  detail::check_reduce_op("reduce", t.dtype(), op);
  // In place at the root; NCCL reads sendbuff everywhere and writes recvbuff only at the root.
  MC_NCCL_WATCH_HOST("reduce");
  MC_NCCL_CHECK(ncclReduce(t.data_ptr(), t.data_ptr(), count(t), nccl_type(t.dtype()), nccl_op(op), root, comm_,
                           MC_NCCL_STREAM));
  issued("reduce");
}

void NcclCommunicator::broadcast(Tensor& t, int root) {
  detail::check_tensor("broadcast", "t", t, device_, kNcclMoveDtypes);
  detail::check_peer("broadcast", "root", root, size_);
  MC_NCCL_WATCH_HOST("broadcast");
  MC_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), count(t), nccl_type(t.dtype()), root, comm_, MC_NCCL_STREAM));
  issued("broadcast");
}

void NcclCommunicator::send(const Tensor& t, int peer) {
  detail::check_tensor("send", "t", t, device_, kNcclMoveDtypes);
  detail::check_peer("send", "peer", peer, size_);
  MC_CHECK(peer != rank_ || group_depth_ > 0, "comm send: peer ", peer,
           " is this rank, expected another rank (sending to itself needs group_start/group_end)");
  MC_NCCL_WATCH_HOST("send");
  MC_NCCL_CHECK(ncclSend(t.data_ptr(), count(t), nccl_type(t.dtype()), peer, comm_, MC_NCCL_STREAM));
  issued("send");
}

void NcclCommunicator::recv(Tensor& t, int peer) {
  detail::check_tensor("recv", "t", t, device_, kNcclMoveDtypes);
  detail::check_peer("recv", "peer", peer, size_);
  MC_CHECK(peer != rank_ || group_depth_ > 0, "comm recv: peer ", peer,
           " is this rank, expected another rank (receiving from itself needs group_start/group_end)");
  MC_NCCL_WATCH_HOST("recv");
  MC_NCCL_CHECK(ncclRecv(t.data_ptr(), count(t), nccl_type(t.dtype()), peer, comm_, MC_NCCL_STREAM));
  issued("recv");
}

void NcclCommunicator::barrier() {
  MC_CHECK(group_depth_ == 0, "comm barrier: called inside group_start/group_end, expected it outside a group");
  if (mpi_ == MPI_COMM_NULL) {  // TCP bootstrap: a 1-element all-reduce stands in for MPI_Barrier
    Tensor token = Tensor::zeros({1}, DType::I32, device_);
    MC_NCCL_WATCH_HOST("barrier");
    MC_NCCL_CHECK(ncclAllReduce(token.data_ptr(), token.data_ptr(), 1, ncclInt32, ncclSum, comm_, MC_NCCL_STREAM));
    issued("barrier");
    count_host_synchronization();
    MC_CUDA_CHECK(cudaStreamSynchronize(MC_NCCL_STREAM));
    return;
  }
  count_host_synchronization();
  MC_CUDA_CHECK(cudaStreamSynchronize(MC_NCCL_STREAM));
  MC_NCCL_WATCH_HOST("barrier");
  MC_MPI_CHECK(MPI_Barrier(mpi_));
}

// TCP bootstrap: ncclCommSplit, collective over every rank of this communicator (see the header).
std::unique_ptr<Communicator> NcclCommunicator::split_without_mpi(const std::vector<int64_t>& ranks) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  const int color = static_cast<int>(ranks.front());
  const int key = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  ncclComm_t sub = nullptr;
  MC_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
  std::vector<int> world_ranks;
  for (int64_t r : ranks) world_ranks.push_back(world_ranks_[static_cast<size_t>(r)]);
  auto out = std::unique_ptr<NcclCommunicator>(new NcclCommunicator(Adopt{}, sub, device_, std::move(world_ranks)));
  MC_CHECK(out->size() == static_cast<int>(ranks.size()) && out->rank() == key, "comm split: NCCL made a group of ",
           out->size(), " ranks in which this rank (", rank_, ") is rank ", out->rank(), ", expected ", ranks.size(),
           " ranks with this rank at position ", key, ": without MPI (torchrun) every rank of the parent must call "
           "split, in the same order, each with the list of its own group");
  return out;
#else
  MC_FAIL("comm split: this NCCL (", NCCL_MAJOR, ".", NCCL_MINOR, ") has no ncclCommSplit, expected NCCL >= 2.18 "
          "for split() without MPI (torchrun); launch with mpirun or srun instead");
#endif
}

std::unique_ptr<Communicator> NcclCommunicator::split(const std::vector<int64_t>& ranks) {
  MC_CHECK(group_depth_ == 0, "comm split: called inside group_start/group_end, expected it outside a group");
  detail::check_split(ranks, rank_, size_);
  if (mpi_ == MPI_COMM_NULL) return split_without_mpi(ranks);
  std::vector<int> members(ranks.begin(), ranks.end());
  MPI_Group parent = MPI_GROUP_NULL, sub = MPI_GROUP_NULL;
  MC_MPI_CHECK(MPI_Comm_group(mpi_, &parent));
  MC_MPI_CHECK(MPI_Group_incl(parent, static_cast<int>(members.size()), members.data(), &sub));
  MPI_Comm sub_comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(mpi_, sub, /*tag=*/0, &sub_comm);
  MPI_Group_free(&sub);
  MPI_Group_free(&parent);
  MC_MPI_CHECK(rc);
  return std::make_unique<NcclCommunicator>(sub_comm, device_);
}

void NcclCommunicator::group_start() {
  MC_NCCL_CHECK(ncclGroupStart());
  ++group_depth_;
}

void NcclCommunicator::group_end() {
  MC_CHECK(group_depth_ > 0, "comm group_end: no open group, expected a group_start() before it");
  --group_depth_;
  MC_NCCL_WATCH_HOST(group_depth_ == 0 && grouped_ ? grouped_ : "a group of collectives");
  MC_NCCL_CHECK(ncclGroupEnd());
  if (group_depth_ == 0 && grouped_) {
    const char* collective = grouped_;
    grouped_ = nullptr;
    issued(collective);
  }
}

std::unique_ptr<Communicator> make_nccl_world(Device device) {
  MC_CHECK(device.is_cuda() && device.index < cuda_device_count(), "comm make_nccl_world: device ", device.str(),
           ", expected a CUDA device cuda:i with i < ", cuda_device_count(), " (the devices present)");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // torchrun: no MPI; rank 0's NCCL id goes to the others over TCP (tcp_rendezvous.h).
    const LaunchEnv env = read_launch_env();
    MC_CHECK(env.launcher == "torchrun", "comm make_nccl_world: MPI is not initialised and the launcher is '",
             env.launcher, "', expected moecore::mpi_init() first (mpirun / srun) or a torchrun environment (RANK, ",
             "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
    const RendezvousEndpoint ep = rendezvous_endpoint(env);
    set_current_device(device);
    ncclUniqueId id{};
    std::vector<uint8_t> bytes;
    if (env.rank == 0) {
      MC_NCCL_CHECK(ncclGetUniqueId(&id));
      bytes.resize(sizeof id);
      std::memcpy(bytes.data(), &id, sizeof id);
    }
    try {
      bytes = tcp_broadcast(ep.addr, ep.port, env.rank, env.world, bytes, ep.timeout_s, ep.ports, ep.job_key);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " [rendezvous port from " + ep.port_rule + "]", e.file(), e.line());
    }
    MC_CHECK(bytes.size() == sizeof id, "comm make_nccl_world: rank 0 sent ", bytes.size(),
             " bytes, expected an NCCL unique id of ", sizeof id, " bytes (same NCCL version on every rank?)");
    std::memcpy(&id, bytes.data(), sizeof id);
    return std::make_unique<NcclCommunicator>(id, env.rank, env.world, device);
  }
  MPI_Comm comm = MPI_COMM_NULL;
  MC_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  return std::make_unique<NcclCommunicator>(comm, device);
}

}  // namespace moecore::comm
