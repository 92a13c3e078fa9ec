#include "moecore/comm/mpi_communicator.h"

#include "moecore/comm/collective_watchdog.h"

#include <algorithm>
#include <climits>
#include <numeric>
#include <set>
#include <utility>

#include "moecore/core/mpi_check.h"

namespace moecore::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
    case ReduceOp::Avg: return "avg";
  }
  return "?";
}

// ---- argument checks (shared with the NCCL backend) -----------------------------------
namespace detail {

std::string dtypes_str(const std::vector<DType>& ds) {
  std::string s;
  for (size_t i = 0; i < ds.size(); ++i) s += (i ? ", " : "") + std::string(dtype_name(ds[i]));
  return s;
}

void check_tensor(const char* call, const char* name, const Tensor& t, Device device,
                  const std::vector<DType>& supported) {
  MC_CHECK(t.defined(), "comm ", call, ": ", name, " is an undefined tensor, expected an allocated tensor");
  MC_CHECK(t.device() == device, "comm ", call, ": ", name, " is ", t.describe(), ", expected a tensor on ",
           device.str(), " (the communicator's device)");
  MC_CHECK(t.is_contiguous(), "comm ", call, ": ", name, " ", t.describe(), " is not contiguous, expected a contiguous tensor");
  MC_CHECK(std::find(supported.begin(), supported.end(), t.dtype()) != supported.end(), "comm ", call, ": ", name,
           " has dtype ", dtype_name(t.dtype()), ", expected one of ", dtypes_str(supported));
}

void check_same_dtype(const char* call, const Tensor& a, const Tensor& b) {
  MC_CHECK(a.dtype() == b.dtype(), "comm ", call, ": in has dtype ", dtype_name(a.dtype()), " and out has dtype ",
           dtype_name(b.dtype()), ", expected the same dtype");
}

void check_reduce_op(const char* call, DType dtype, ReduceOp op) {
  MC_CHECK(op != ReduceOp::Avg || is_floating(dtype), "comm ", call, ": reduce op avg on dtype ", dtype_name(dtype),
           ", expected a floating dtype for avg (use sum for integers)");
}

void check_peer(const char* call, const char* what, int peer, int size) {
  MC_CHECK(peer >= 0 && peer < size, "comm ", call, ": ", what, " ", peer, " is out of range, expected 0 <= ", what,
           " < ", size, " (the communicator's size)");
}

void check_rows_multiple(const char* call, const char* big_name, const Tensor& big, const char* small_name,
                         const Tensor& small, int factor) {
  Shape expected = small.shape();
  if (!expected.empty()) expected[0] *= factor;
  MC_CHECK(small.ndim() >= 1 && big.shape() == expected, "comm ", call, ": ", big_name, " has shape ",
           shape_str(big.shape()), " and ", small_name, " has shape ", shape_str(small.shape()), ", expected ",
           big_name, " to have shape ", small.ndim() >= 1 ? shape_str(expected) : std::string("(n*R, ...)"), " (",
           factor, " ranks x ", small_name, "'s rows, same trailing dims; at least 1 dim)");
}

static void check_counts(const char* which, const std::vector<int64_t>& counts, const char* tname, const Tensor& t,
                         int size) {
  MC_CHECK(static_cast<int>(counts.size()) == size, "comm all_to_all: ", which, " has ", counts.size(),
           " entries, expected one per rank (", size, ")");
  int64_t sum = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    MC_CHECK(counts[r] >= 0, "comm all_to_all: ", which, "[", r, "] = ", counts[r], ", expected a count >= 0");
    sum += counts[r];
  }
  MC_CHECK(sum == t.size(0), "comm all_to_all: ", which, " sum to ", sum, " rows, expected ", tname, "'s ", t.size(0),
           " rows (", tname, " has shape ", shape_str(t.shape()), ")");
}

void check_all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                      const std::vector<int64_t>& recv_counts, int size) {
  MC_CHECK(in.ndim() >= 1 && out.ndim() == in.ndim() &&
               std::equal(in.shape().begin() + 1, in.shape().end(), out.shape().begin() + 1),
           "comm all_to_all: in has shape ", shape_str(in.shape()), " and out has shape ", shape_str(out.shape()),
           ", expected shapes (rows, ...) with the same trailing dims");
  check_counts("send_counts", send_counts, "in", in, size);
  check_counts("recv_counts", recv_counts, "out", out, size);
}

void check_split(const std::vector<int64_t>& ranks, int rank, int size) {
  MC_CHECK(!ranks.empty(), "comm split: empty rank list, expected the ranks of the new group");
  std::set<int64_t> seen;
  for (int64_t r : ranks) {
    MC_CHECK(r >= 0 && r < size, "comm split: rank ", r, " is out of range, expected 0 <= rank < ", size);
    MC_CHECK(seen.insert(r).second, "comm split: rank ", r, " is listed twice, expected distinct ranks");
  }
  MC_CHECK(seen.count(rank) == 1, "comm split: this rank (", rank,
           ") is not in the rank list, expected only members of the new group to call split");
}

std::string describe_group(const std::string& roles, const std::vector<int>& world_ranks) {
  std::string text = "the " + (roles.empty() ? std::string() : roles + " ") + "group of ";
  if (world_ranks.empty()) return text + "ranks unknown to MPI";
  text += "world ranks ";
  for (size_t i = 0; i < world_ranks.size() && i < 16; ++i) {
    if (i > 0) text += ',';
    text += std::to_string(world_ranks[i]);
  }
  if (world_ranks.size() > 16) text += ",... (" + std::to_string(world_ranks.size()) + " ranks)";
  return text;
}
}  // namespace detail

void Communicator::add_role(const std::string& role) {
  if (("/" + roles_ + "/").find("/" + role + "/") != std::string::npos) return;
  roles_ += (roles_.empty() ? "" : "/") + role;
  roles_changed();
}

// ---- MPI backend ------------------------------------------------------------------------
namespace {

const std::vector<DType> kMpiDtypes = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8};
// The collectives that only move bytes (all_gather, all_to_all, broadcast) also take FP8 codes (the
// FP8 token dispatch, moe/token_dispatcher.h; --fp8-param-gather); reductions do not.
const std::vector<DType> kMpiMoveDtypes = {DType::F32, DType::F64,      DType::BF16,    DType::I32,
                                           DType::I64, DType::U8, DType::FP8E4M3, DType::FP8E5M2};

// Transport type: bf16 travels as its 16-bit pattern (reductions convert to f32 first).
MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::BF16: return MPI_UINT16_T;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8: return MPI_UINT8_T;
    case DType::FP8E4M3:
    case DType::FP8E5M2: return MPI_UINT8_T;  // moved as bytes (never reduced: kMpiMoveDtypes)
    default: MC_FAIL("comm: dtype ", dtype_name(t), " has no MPI type, expected one of ", detail::dtypes_str(kMpiMoveDtypes));
  }
}

// u8 sums must wrap modulo 256, but Open MPI 4.1's vectorised MPI_SUM on MPI_UINT8_T saturates
// at 255: u8 sums use this user-defined op instead.
void u8_sum_wrapping(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint8_t* a = static_cast<const uint8_t*>(in);
  uint8_t* b = static_cast<uint8_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<uint8_t>(a[i] + b[i]);
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  if (dtype == DType::U8 && op == ReduceOp::Sum) {
    static const MPI_Op u8_sum = [] {
      MPI_Op o = MPI_OP_NULL;
      MC_MPI_CHECK(MPI_Op_create(&u8_sum_wrapping, /*commute=*/1, &o));
      return o;
    }();
    return u8_sum;
  }
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return MPI_SUM;  // Avg divides afterwards
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_SUM;
}

int count_of(const char* call, int64_t n) {
  MC_CHECK(n <= INT_MAX, "comm ", call, ": ", n, " elements in one message, expected at most ", INT_MAX,
           " (MPI's int counts)");
  return static_cast<int>(n);
}

Tensor bf16_to_f32(const Tensor& t) {
  Tensor f = Tensor::empty(t.shape(), DType::F32);
  const bf16* src = t.data<bf16>();
  float* dst = f.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) dst[i] = static_cast<float>(src[i]);
  return f;
}

// dst (bf16) = round(src (f32) * scale)
void f32_to_bf16(const Tensor& src, const Tensor& dst, float scale) {
  const float* s = src.data<float>();
  bf16* d = dst.data<bf16>();
  for (int64_t i = 0; i < src.numel(); ++i) d[i] = bf16(scale == 1.0f ? s[i] : s[i] / scale);
}

// Avg: the summed tensor divided by the number of ranks, in its own precision.
void divide(const Tensor& t, int n) {
  if (t.dtype() == DType::F32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] /= static_cast<float>(n);
  } else if (t.dtype() == DType::F64) {
    double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] /= static_cast<double>(n);
  }
}

}  // namespace

std::vector<int> mpi_world_ranks(MPI_Comm comm, int size) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  std::vector<int> mine(static_cast<size_t>(size)), in_world(static_cast<size_t>(size), -1);
  for (int i = 0; i < size; ++i) mine[static_cast<size_t>(i)] = i;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS || MPI_Comm_group(MPI_COMM_WORLD, &world) != MPI_SUCCESS) return {};
  MPI_Group_translate_ranks(group, size, mine.data(), world, in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return in_world;
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MC_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  MC_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MC_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  world_ranks_ = mpi_world_ranks(comm_, size_);
  roles_changed();
}

void MpiCommunicator::roles_changed() { group_name_ = detail::describe_group(roles(), world_ranks_); }

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || comm_ == MPI_COMM_NULL || comm_ == MPI_COMM_WORLD || comm_ == MPI_COMM_SELF) return;
  // Unfinished group: wait so that MPI does not write into freed buffers (errors ignored).
  for (Pending& p : pending_) MPI_Wait(&p.request, MPI_STATUS_IGNORE);
  MPI_Comm_free(&comm_);
}

void MpiCommunicator::issue(Pending p, const char* collective) {
  p.collective = collective;
  pending_.push_back(std::move(p));
  if (group_depth_ == 0) complete_all();
}

void MpiCommunicator::complete_all() {
  std::vector<Pending> work = std::move(pending_);
  pending_.clear();
  std::vector<MPI_Request> requests;
  requests.reserve(work.size());
  for (const Pending& p : work) requests.push_back(p.request);
  const WatchedWait watched(work.size() == 1 ? work[0].collective : "a group of collectives", group_name_);
  MC_MPI_CHECK(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
  for (const Pending& p : work)
    if (p.finish) p.finish();
}

void MpiCommunicator::group_start() { ++group_depth_; }

void MpiCommunicator::group_end() {
  MC_CHECK(group_depth_ > 0, "comm group_end: no open group, expected a group_start() before it");
  if (--group_depth_ == 0) complete_all();
}

void MpiCommunicator::all_reduce(Tensor& t, ReduceOp op) {
  detail::check_tensor("all_reduce", "t", t, device(), kMpiDtypes);
  detail::check_reduce_op("all_reduce", t.dtype(), op);
  const int n = count_of("all_reduce", t.numel());
  Pending p;
  p.keep_alive.push_back(t);
  if (t.dtype() == DType::BF16) {
    Tensor s = bf16_to_f32(t);
    MC_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, s.data_ptr(), n, MPI_FLOAT, mpi_op(op, DType::F32), comm_, &p.request));
    p.keep_alive.push_back(s);
    const float scale = op == ReduceOp::Avg ? static_cast<float>(size_) : 1.0f;
    p.finish = [s, t, scale] { f32_to_bf16(s, t, scale); };
  } else {
    MC_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), n, mpi_type(t.dtype()), mpi_op(op, t.dtype()), comm_, &p.request));
    if (op == ReduceOp::Avg) p.finish = [t, size = size_] { divide(t, size); };
  }
  issue(std::move(p), "all_reduce");
}

void MpiCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  detail::check_tensor("reduce_scatter", "in", in, device(), kMpiDtypes);
  detail::check_tensor("reduce_scatter", "out", out, device(), kMpiDtypes);
  detail::check_same_dtype("reduce_scatter", in, out);
  detail::check_rows_multiple("reduce_scatter", "in", in, "out", out, size_);
  detail::check_reduce_op("reduce_scatter", in.dtype(), op);
  count_of("reduce_scatter", in.numel());
  const int n = count_of("reduce_scatter", out.numel());
  Pending p;
  p.keep_alive = {in, out};
  if (in.dtype() == DType::BF16) {
    Tensor s_in = bf16_to_f32(in), s_out = Tensor::empty(out.shape(), DType::F32);
    MC_MPI_CHECK(MPI_Ireduce_scatter_block(s_in.data_ptr(), s_out.data_ptr(), n, MPI_FLOAT, mpi_op(op, DType::F32), comm_,
                                           &p.request));
    p.keep_alive.push_back(s_in);
    p.keep_alive.push_back(s_out);
    const float scale = op == ReduceOp::Avg ? static_cast<float>(size_) : 1.0f;
    p.finish = [s_out, out, scale] { f32_to_bf16(s_out, out, scale); };
  } else {
    // In place (out = this rank's rows of in): MPI forbids overlapping buffers, so the result
    // goes through a temporary.
    const char* in_begin = static_cast<const char*>(in.data_ptr());
    const char* out_begin = static_cast<const char*>(out.data_ptr());
    const bool aliased = out_begin >= in_begin && out_begin < in_begin + in.nbytes();
    Tensor result = aliased ? Tensor::empty(out.shape(), out.dtype()) : out;
    MC_MPI_CHECK(MPI_Ireduce_scatter_block(in.data_ptr(), result.data_ptr(), n, mpi_type(in.dtype()),
                                           mpi_op(op, in.dtype()), comm_, &p.request));
    p.keep_alive.push_back(result);
    p.finish = [out, result, aliased, avg = op == ReduceOp::Avg, size = size_]() mutable {
      if (aliased) out.copy_from(result);
      if (avg) divide(out, size);
    };
  }
  issue(std::move(p), "reduce_scatter");
}

void MpiCommunicator::all_gather(const Tensor& in, Tensor& out) {
  detail::check_tensor("all_gather", "in", in, device(), kMpiMoveDtypes);
  detail::check_tensor("all_gather", "out", out, device(), kMpiMoveDtypes);
  detail::check_same_dtype("all_gather", in, out);
  detail::check_rows_multiple("all_gather", "out", out, "in", in, size_);
  count_of("all_gather", out.numel());
  const int n = count_of("all_gather", in.numel());
  Pending p;
  p.keep_alive = {in, out};
  const MPI_Datatype type = mpi_type(in.dtype());
  MC_MPI_CHECK(MPI_Iallgather(in.data_ptr(), n, type, out.data_ptr(), n, type, comm_, &p.request));
  issue(std::move(p), "all_gather");
}

void MpiCommunicator::all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                 const std::vector<int64_t>& recv_counts) {
  detail::check_tensor("all_to_all", "in", in, device(), kMpiMoveDtypes);
  detail::check_tensor("all_to_all", "out", out, device(), kMpiMoveDtypes);
  detail::check_same_dtype("all_to_all", in, out);
  detail::check_all_to_all(in, send_counts, out, recv_counts, size_);
  const int64_t row = std::accumulate(in.shape().begin() + 1, in.shape().end(), int64_t{1}, std::multiplies<>());
  count_of("all_to_all", in.numel());
  count_of("all_to_all", out.numel());
  // Counts and displacements in elements; the vectors must outlive the request.
  auto v = std::make_shared<std::vector<int>>(4 * size_);
  int* sc = v->data();
  int* sd = sc + size_;
  int* rc = sd + size_;
  int* rd = rc + size_;
  int64_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    sc[r] = static_cast<int>(send_counts[r] * row);
    sd[r] = static_cast<int>(so);
    rc[r] = static_cast<int>(recv_counts[r] * row);
    rd[r] = static_cast<int>(ro);
    so += send_counts[r] * row;
    ro += recv_counts[r] * row;
  }
  Pending p;
  p.keep_alive = {in, out};
  const MPI_Datatype type = mpi_type(in.dtype());
  MC_MPI_CHECK(MPI_Ialltoallv(in.data_ptr(), sc, sd, type, out.data_ptr(), rc, rd, type, comm_, &p.request));
  p.finish = [v] {};
  issue(std::move(p), "all_to_all");
}

void MpiCommunicator::reduce(Tensor& t, int root, ReduceOp op) {
  detail::check_tensor("reduce", "t", t, device(), kMpiDtypes);
  detail::check_peer("reduce", "root", root, size_);
  detail::check_reduce_op("reduce", t.dtype(), op);
  const int n = count_of("reduce", t.numel());
  const bool is_root = rank_ == root;
  Pending p;
  p.keep_alive.push_back(t);
  // The root reduces in place; the others only send (their t is not written).
  if (t.dtype() == DType::BF16) {
    Tensor s = bf16_to_f32(t);
    MC_MPI_CHECK(MPI_Ireduce(is_root ? MPI_IN_PLACE : s.data_ptr(), is_root ? s.data_ptr() : nullptr, n, MPI_FLOAT,
                             mpi_op(op, DType::F32), root, comm_, &p.request));
    p.keep_alive.push_back(s);
    const float scale = op == ReduceOp::Avg ? static_cast<float>(size_) : 1.0f;
    if (is_root) p.finish = [s, t, scale] { f32_to_bf16(s, t, scale); };
  } else {
    MC_MPI_CHECK(MPI_Ireduce(is_root ? MPI_IN_PLACE : t.data_ptr(), is_root ? t.data_ptr() : nullptr, n,
                             mpi_type(t.dtype()), mpi_op(op, t.dtype()), root, comm_, &p.request));
    if (is_root && op == ReduceOp::Avg) p.finish = [t, size = size_] { divide(t, size); };
  }
  issue(std::move(p), "reduce");
}

void MpiCommunicator::broadcast(Tensor& t, int root) {
  detail::check_tensor("broadcast", "t", t, device(), kMpiMoveDtypes);  // moves bytes: FP8 codes too
  detail::check_peer("broadcast", "root", root, size_);
  Pending p;
  p.keep_alive = {t};
  MC_MPI_CHECK(MPI_Ibcast(t.data_ptr(), count_of("broadcast", t.numel()), mpi_type(t.dtype()), root, comm_, &p.request));
  issue(std::move(p), "broadcast");
}

void MpiCommunicator::send(const Tensor& t, int peer) {
  detail::check_tensor("send", "t", t, device(), kMpiDtypes);
  detail::check_peer("send", "peer", peer, size_);
  MC_CHECK(peer != rank_ || group_depth_ > 0, "comm send: peer ", peer,
           " is this rank, expected another rank (sending to itself needs group_start/group_end)");
  Pending p;
  p.keep_alive = {t};
  MC_MPI_CHECK(MPI_Isend(t.data_ptr(), count_of("send", t.numel()), mpi_type(t.dtype()), peer, 0, comm_, &p.request));
  issue(std::move(p), "send");
}

void MpiCommunicator::recv(Tensor& t, int peer) {
  detail::check_tensor("recv", "t", t, device(), kMpiDtypes);
  detail::check_peer("recv", "peer", peer, size_);
  MC_CHECK(peer != rank_ || group_depth_ > 0, "comm recv: peer ", peer,
           " is this rank, expected another rank (receiving from itself needs group_start/group_end)");
  Pending p;
  p.keep_alive = {t};
  MC_MPI_CHECK(MPI_Irecv(t.data_ptr(), count_of("recv", t.numel()), mpi_type(t.dtype()), peer, 0, comm_, &p.request));
  issue(std::move(p), "recv");
}

void MpiCommunicator::barrier() {
  MC_CHECK(group_depth_ == 0, "comm barrier: called inside group_start/group_end, expected it outside a group");
  const WatchedWait watched("barrier", group_name_);
  MC_MPI_CHECK(MPI_Barrier(comm_));
}

std::unique_ptr<Communicator> MpiCommunicator::split(const std::vector<int64_t>& ranks) {
  MC_CHECK(group_depth_ == 0, "comm split: called inside group_start/group_end, expected it outside a group");
  detail::check_split(ranks, rank_, size_);
  std::vector<int> members(ranks.begin(), ranks.end());
  MPI_Group parent = MPI_GROUP_NULL, sub = MPI_GROUP_NULL;
  MC_MPI_CHECK(MPI_Comm_group(comm_, &parent));
  MC_MPI_CHECK(MPI_Group_incl(parent, static_cast<int>(members.size()), members.data(), &sub));
  MPI_Comm sub_comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(comm_, sub, /*tag=*/0, &sub_comm);
  MPI_Group_free(&sub);
  MPI_Group_free(&parent);
  MC_MPI_CHECK(rc);
  return std::make_unique<MpiCommunicator>(sub_comm);
}

std::unique_ptr<Communicator> make_mpi_world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  MC_CHECK(initialized, "comm make_mpi_world: MPI is not initialised, expected moecore::mpi_init() first");
  MPI_Comm comm = MPI_COMM_NULL;
  MC_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace moecore::comm
