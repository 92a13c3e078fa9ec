// dist tier: moecore::comm over MPI (host tensors) and the launcher-environment bootstrap.
//
// Every rank contributes Philox-derived values that depend on (call key, rank, element); every
// rank recomputes all ranks' contributions locally and checks the collective's result against
// that formula. Float test values are k/64 with |k| <= 256, so f32/f64 sums of a few ranks are
// exact in any order (bf16 sums are checked within a bf16 tolerance).
//
// The comm_checks:: functions take any Communicator and are shared with test_comm_nccl.cpp,
// which runs them on device tensors through NCCL. They use EXPECT (never ASSERT) so that a
// failing rank still takes part in every later collective instead of leaving the others hung.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "moecore/comm/bootstrap.h"
#include "moecore/comm/communicator.h"
#include "moecore/core/mpi_check.h"
#include "moecore/core/philox.h"
#include "moecore/core/tensor.h"

using namespace moecore;
using namespace moecore::comm;

namespace comm_checks {

constexpr uint64_t kSeed = 20240611;

uint32_t word(uint64_t key, int rank, int64_t i) {
  return philox_words(kSeed, key * 1024 + static_cast<uint64_t>(rank), static_cast<uint64_t>(i)).w[0];
}

// Rank `rank`'s contribution to element i of the tensor of call `key`.
template <typename T>
T value(uint64_t key, int rank, int64_t i) {
  const uint32_t w = word(key, rank, i);
  const float f = static_cast<float>(static_cast<int>(w % 513) - 256) / 64.0f;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return static_cast<T>(f);
  if constexpr (std::is_same_v<T, bf16>) return bf16(f);  // exact: at most 8 significant bits
  if constexpr (std::is_same_v<T, int32_t>) return static_cast<int32_t>(w % 2001) - 1000;
  if constexpr (std::is_same_v<T, int64_t>) return (static_cast<int64_t>(w % 2001) - 1000) * 4000000011LL;
  if constexpr (std::is_same_v<T, uint8_t>) return static_cast<uint8_t>(w & 0xff);
}

template <typename T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, bf16>) return static_cast<float>(x);
  else return static_cast<double>(x);
}

template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// [shape] filled with value<T>(key, rank, i), on `device`.
template <typename T>
Tensor make(uint64_t key, int rank, const Shape& shape, Device device) {
  std::vector<T> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = value<T>(key, rank, static_cast<int64_t>(i));
  return Tensor::from_vector(v, shape).to(device);
}

template <typename T>
std::vector<T> host(const Tensor& t) {
  return t.to(Device::cpu()).template to_vector<T>();
}

std::vector<int> all_ranks(int n) {
  std::vector<int> r(static_cast<size_t>(n));
  std::iota(r.begin(), r.end(), 0);
  return r;
}

// got[j] must be `op` over ranks `ranks` of value<T>(key, r, offset + j).
template <typename T>
void expect_reduced(const std::vector<T>& got, ReduceOp op, uint64_t key, const std::vector<int>& ranks,
                    int64_t offset, const std::string& what) {
  int64_t bad = 0;
  std::string first;
  for (size_t j = 0; j < got.size(); ++j) {
    const int64_t i = offset + static_cast<int64_t>(j);
    bool ok;
    double expected, tol = 0;
    if constexpr (std::is_integral_v<T>) {
      int64_t acc = value<T>(key, ranks[0], i);
      for (size_t k = 1; k < ranks.size(); ++k) {
        const int64_t x = value<T>(key, ranks[k], i);
        acc = op == ReduceOp::Sum ? acc + x : op == ReduceOp::Max ? std::max(acc, x) : std::min(acc, x);
      }
      ok = got[j] == static_cast<T>(acc);  // u8 sums wrap modulo 256
      expected = static_cast<double>(static_cast<T>(acc));
    } else {
      double s = 0, sa = 0, mx = -std::numeric_limits<double>::infinity(), mn = -mx;
      for (int r : ranks) {
        const double x = to_double(value<T>(key, r, i));
        s += x, sa += std::fabs(x), mx = std::max(mx, x), mn = std::min(mn, x);
      }
      const double n = static_cast<double>(ranks.size());
      expected = op == ReduceOp::Sum ? s : op == ReduceOp::Max ? mx : op == ReduceOp::Min ? mn : s / n;
      if (op == ReduceOp::Sum || op == ReduceOp::Avg) {
        // bf16: at most one rounding (2^-8 relative) per rank of partial sums bounded by sum|x|.
        if (std::is_same_v<T, bf16>) tol = n * std::ldexp(sa, -8);
        else if (op == ReduceOp::Avg) tol = 1e-6 * sa;  // sums are exact; the division rounds
        if (op == ReduceOp::Avg) tol /= std::is_same_v<T, bf16> ? n : 1.0;
      }
      ok = std::fabs(to_double(got[j]) - expected) <= tol;
    }
    if (!ok && bad++ == 0)
      first = "element " + std::to_string(i) + ": got " + std::to_string(to_double(got[j])) + ", expected " +
              std::to_string(expected) + " (tolerance " + std::to_string(tol) + ")";
  }
  EXPECT_EQ(bad, 0) << what << " " << reduce_op_name(op) << ": " << bad << " wrong elements; first " << first;
}

template <typename T>
void all_reduce_case(Communicator& c, uint64_t key, ReduceOp op) {
  Tensor t = make<T>(key, c.rank(), {7, 37}, c.device());
  c.all_reduce(t, op);
  expect_reduced(host<T>(t), op, key, all_ranks(c.size()), 0,
                 std::string("all_reduce ") + dtype_name(dtype_of<T>));
}

void check_all_reduce(Communicator& c, bool with_f64) {
  const ReduceOp float_ops[] = {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg};
  const ReduceOp int_ops[] = {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min};
  uint64_t key = 100;
  for (ReduceOp op : float_ops) {
    all_reduce_case<float>(c, ++key, op);
    all_reduce_case<bf16>(c, ++key, op);
    if (with_f64) all_reduce_case<double>(c, ++key, op);
  }
  for (ReduceOp op : int_ops) {
    all_reduce_case<int32_t>(c, ++key, op);
    all_reduce_case<int64_t>(c, ++key, op);
    all_reduce_case<uint8_t>(c, ++key, op);
  }
}

template <typename T>
void reduce_scatter_case(Communicator& c, uint64_t key, ReduceOp op) {
  const int64_t rows = 3, cols = 5;
  Tensor in = make<T>(key, c.rank(), {c.size() * rows, cols}, c.device());
  Tensor out = Tensor::zeros({rows, cols}, dtype_of<T>, c.device());
  c.reduce_scatter(in, out, op);
  expect_reduced(host<T>(out), op, key, all_ranks(c.size()), c.rank() * rows * cols,
                 std::string("reduce_scatter ") + dtype_name(dtype_of<T>));
  // In place: the output is this rank's own rows of the input (NCCL's in-place form).
  Tensor own = in.slice(0, c.rank() * rows, (c.rank() + 1) * rows);
  in.copy_from(make<T>(key, c.rank(), {c.size() * rows, cols}, c.device()));  // the inputs again
  c.reduce_scatter(in, own, op);
  expect_reduced(host<T>(own), op, key, all_ranks(c.size()), c.rank() * rows * cols,
                 std::string("in-place reduce_scatter ") + dtype_name(dtype_of<T>));
}

void check_reduce_scatter(Communicator& c) {
  reduce_scatter_case<float>(c, 200, ReduceOp::Sum);
  reduce_scatter_case<float>(c, 201, ReduceOp::Avg);
  reduce_scatter_case<bf16>(c, 202, ReduceOp::Sum);
  reduce_scatter_case<bf16>(c, 203, ReduceOp::Max);
  reduce_scatter_case<int64_t>(c, 204, ReduceOp::Max);
  reduce_scatter_case<int32_t>(c, 205, ReduceOp::Sum);
  reduce_scatter_case<uint8_t>(c, 206, ReduceOp::Min);
}

// out rows [r*R, (r+1)*R) must be rank r's input, bit for bit.
template <typename T>
void all_gather_case(Communicator& c, uint64_t key) {
  const int64_t rows = 2, cols = 9, per_rank = rows * cols;
  Tensor in = make<T>(key, c.rank(), {rows, cols}, c.device());
  Tensor out = Tensor::zeros({c.size() * rows, cols}, dtype_of<T>, c.device());
  c.all_gather(in, out);
  const std::vector<T> got = host<T>(out);
  int64_t bad = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(got.size()); ++g)
    bad += !same_bits(got[g], value<T>(key, static_cast<int>(g / per_rank), g % per_rank));
  EXPECT_EQ(bad, 0) << "all_gather " << dtype_name(dtype_of<T>) << ": wrong elements";
}

void check_all_gather(Communicator& c) {
  all_gather_case<float>(c, 300);
  all_gather_case<bf16>(c, 301);
  all_gather_case<int32_t>(c, 302);
  all_gather_case<int64_t>(c, 303);
  all_gather_case<uint8_t>(c, 304);
}

// Rows rank s sends to rank d: none from rank 0 and none to the last rank, zero for some other
// pairs too, and self-sends included.
int64_t a2a_count(int s, int d, int n) { return (s == 0 || d == n - 1) ? 0 : (s * 3 + d) % 4; }
double a2a_value(int s, int d, int64_t j, int64_t col) { return s * 1e6 + d * 1e4 + static_cast<double>(j * 10 + col); }

template <typename T>
void all_to_all_case(Communicator& c) {
  const int n = c.size(), me = c.rank();
  const int64_t cols = 3;
  std::vector<int64_t> sc(n), rc(n);
  for (int r = 0; r < n; ++r) sc[r] = a2a_count(me, r, n), rc[r] = a2a_count(r, me, n);
  const int64_t srows = std::accumulate(sc.begin(), sc.end(), int64_t{0});
  const int64_t rrows = std::accumulate(rc.begin(), rc.end(), int64_t{0});
  std::vector<T> send;
  for (int d = 0; d < n; ++d)
    for (int64_t j = 0; j < sc[d]; ++j)
      for (int64_t col = 0; col < cols; ++col) send.push_back(static_cast<T>(a2a_value(me, d, j, col)));
  Tensor in = Tensor::from_vector(send, {srows, cols}).to(c.device());
  Tensor out = Tensor::zeros({rrows, cols}, dtype_of<T>, c.device());
  c.all_to_all(in, sc, out, rc);
  const std::vector<T> got = host<T>(out);
  int64_t bad = 0, k = 0;
  for (int s = 0; s < n; ++s)
    for (int64_t j = 0; j < rc[s]; ++j)
      for (int64_t col = 0; col < cols; ++col) bad += got[k++] != static_cast<T>(a2a_value(s, me, j, col));
  EXPECT_EQ(bad, 0) << "all_to_all " << dtype_name(dtype_of<T>) << " on rank " << me << " (" << rrows << " rows)";
  if (me == 0) EXPECT_EQ(srows, 0) << "rank 0 should send nothing";
  if (me == n - 1) EXPECT_EQ(rrows, 0) << "the last rank should receive nothing";
}

void check_all_to_all_uneven(Communicator& c) {
  all_to_all_case<int64_t>(c);
  all_to_all_case<float>(c);
}

void check_broadcast_from_last_rank(Communicator& c) {
  const int root = c.size() - 1;
  Tensor a = make<int32_t>(400, c.rank(), {11, 3}, c.device());
  Tensor b = make<bf16>(401, c.rank(), {5}, c.device());
  c.broadcast(a, root);
  c.broadcast(b, root);
  const auto ga = host<int32_t>(a);
  const auto gb = host<bf16>(b);
  int64_t bad = 0;
  for (size_t i = 0; i < ga.size(); ++i) bad += ga[i] != value<int32_t>(400, root, static_cast<int64_t>(i));
  for (size_t i = 0; i < gb.size(); ++i) bad += !same_bits(gb[i], value<bf16>(401, root, static_cast<int64_t>(i)));
  EXPECT_EQ(bad, 0) << "broadcast from root " << root;
}

// reduce to the last rank (in place there), and to rank 0 inside a group with another reduce:
// the root holds the reduction; every other rank's tensor is unchanged.
void check_reduce_to_root(Communicator& c) {
  const int last = c.size() - 1;
  Tensor f = make<float>(410, c.rank(), {7, 5}, c.device());
  Tensor b = make<bf16>(411, c.rank(), {9}, c.device());
  c.reduce(f, last, ReduceOp::Sum);
  c.reduce(b, last, ReduceOp::Max);
  if (c.rank() == last) {
    expect_reduced(host<float>(f), ReduceOp::Sum, 410, all_ranks(c.size()), 0, "reduce f32 sum");
    expect_reduced(host<bf16>(b), ReduceOp::Max, 411, all_ranks(c.size()), 0, "reduce bf16 max");
  } else {
    EXPECT_EQ(host<float>(f), host<float>(make<float>(410, c.rank(), {7, 5}, c.device()))) << "a non-root tensor changed";
  }
  Tensor x = make<float>(412, c.rank(), {4}, c.device()), y = make<int64_t>(413, c.rank(), {3}, c.device());
  c.group_start();
  c.reduce(x, 0, ReduceOp::Avg);
  c.reduce(y, last, ReduceOp::Sum);
  c.group_end();
  if (c.rank() == 0) expect_reduced(host<float>(x), ReduceOp::Avg, 412, all_ranks(c.size()), 0, "grouped reduce avg");
  if (c.rank() == last) expect_reduced(host<int64_t>(y), ReduceOp::Sum, 413, all_ranks(c.size()), 0, "grouped reduce sum");
}

// Ungrouped ring: even ranks send first, odd ranks receive first (no deadlock for even sizes).
void check_send_recv_ring(Communicator& c) {
  const int n = c.size(), me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  Tensor mine = make<float>(500, me, {64, 16}, c.device());
  Tensor got = Tensor::zeros({64, 16}, DType::F32, c.device());
  if (me % 2 == 0) {
    c.send(mine, next);
    c.recv(got, prev);
  } else {
    c.recv(got, prev);
    c.send(mine, next);
  }
  EXPECT_EQ(host<float>(got), host<float>(make<float>(500, prev, {64, 16}, Device::cpu())))
      << "ring: rank " << me << " from " << prev;
}

// Grouped: every rank posts its send before its receive (deadlocks without the group for
// messages past the eager limit: 4 MB here), then a group of collectives, nested groups.
void check_grouped_calls(Communicator& c) {
  const int n = c.size(), me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  Tensor mine = make<float>(600, me, {1024, 1024}, c.device());
  Tensor got = Tensor::zeros({1024, 1024}, DType::F32, c.device());
  c.group_start();
  c.send(mine, next);
  c.recv(got, prev);
  c.group_end();
  EXPECT_TRUE(host<float>(got) == host<float>(make<float>(600, prev, {1024, 1024}, Device::cpu())))
      << "grouped ring: rank " << me << " from " << prev;

  Tensor a = make<float>(601, me, {100}, c.device());
  Tensor b = make<bf16>(602, me, {100}, c.device());
  Tensor d = make<int64_t>(603, me, {2, 50}, c.device());
  Tensor g_in = make<int32_t>(604, me, {4}, c.device());
  Tensor g_out = Tensor::zeros({4 * n}, DType::I32, c.device());
  c.group_start();
  c.all_reduce(a, ReduceOp::Sum);
  c.group_start();  // nested: completes at the outer group_end
  c.all_reduce(b, ReduceOp::Avg);
  c.all_reduce(d, ReduceOp::Max);
  c.group_end();
  c.all_gather(g_in, g_out);
  c.group_end();
  const auto all = all_ranks(n);
  expect_reduced(host<float>(a), ReduceOp::Sum, 601, all, 0, "grouped all_reduce f32");
  expect_reduced(host<bf16>(b), ReduceOp::Avg, 602, all, 0, "grouped all_reduce bf16");
  expect_reduced(host<int64_t>(d), ReduceOp::Max, 603, all, 0, "grouped all_reduce i64");
  const auto gathered = host<int32_t>(g_out);
  int64_t bad = 0;
  for (int64_t g = 0; g < 4 * n; ++g) bad += gathered[g] != value<int32_t>(604, static_cast<int>(g / 4), g % 4);
  EXPECT_EQ(bad, 0) << "grouped all_gather";
}

// Even and odd ranks form two groups; collectives stay inside each.
void check_split_even_odd(Communicator& c) {
  const int n = c.size(), me = c.rank();
  std::vector<int64_t> members;
  for (int r = me % 2; r < n; r += 2) members.push_back(r);
  std::unique_ptr<Communicator> sub = c.split(members);
  ASSERT_TRUE(sub) << "split returned null";
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_EQ(sub->device(), c.device());

  const std::vector<int> group(members.begin(), members.end());
  Tensor t = make<float>(700, me, {3, 10}, c.device());
  sub->all_reduce(t, ReduceOp::Sum);
  expect_reduced(host<float>(t), ReduceOp::Sum, 700, group, 0, "split all_reduce f32");

  // all_gather of the global ranks: the group's member list, in order.
  Tensor id = Tensor::from_vector(std::vector<int64_t>{me}, {1}).to(c.device());
  Tensor ids = Tensor::zeros({sub->size()}, DType::I64, c.device());
  sub->all_gather(id, ids);
  EXPECT_EQ(host<int64_t>(ids), members) << "split all_gather of global ranks";

  // broadcast from the group's last member.
  Tensor b = make<int32_t>(701, me, {6}, c.device());
  sub->broadcast(b, sub->size() - 1);
  EXPECT_EQ(host<int32_t>(b), host<int32_t>(make<int32_t>(701, group.back(), {6}, Device::cpu())))
      << "split broadcast";
  sub->barrier();
}

// Message of the Error thrown by f, or "" when nothing is thrown.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(stmt, text)                                                          \
  do {                                                                                        \
    const std::string msg_ = error_of([&] { stmt; });                                         \
    EXPECT_NE(msg_.find(text), std::string::npos) << #stmt << " gave: '" << msg_ << "'";    \
  } while (0)

// Argument errors raised before any communication (the same on every rank).
void check_bad_arguments(Communicator& c) {
  const Device dev = c.device();
  const int n = c.size();
  Tensor f = Tensor::zeros({2 * n, 4}, DType::F32, dev);
  Tensor f_small = Tensor::zeros({2, 4}, DType::F32, dev);
  Tensor i = Tensor::zeros({2, 4}, DType::I32, dev);
  Tensor fp8 = Tensor::zeros({4}, DType::FP8E4M3, dev);

  EXPECT_ERROR_HAS(c.all_reduce(i, ReduceOp::Avg), "comm all_reduce: reduce op avg on dtype i32");
  EXPECT_ERROR_HAS(c.all_reduce(fp8, ReduceOp::Sum), "comm all_reduce: t has dtype fp8e4m3, expected one of");
  Tensor wrong_rows = Tensor::zeros({2 * n + 1, 4}, DType::F32, dev);
  EXPECT_ERROR_HAS(c.reduce_scatter(wrong_rows, f_small, ReduceOp::Sum), "comm reduce_scatter: in has shape");
  EXPECT_ERROR_HAS(c.reduce_scatter(f, i, ReduceOp::Sum), "comm reduce_scatter: in has dtype f32 and out has dtype i32");
  EXPECT_ERROR_HAS(c.all_gather(f_small, wrong_rows), "comm all_gather: out has shape");
  Tensor wrong_cols = Tensor::zeros({2 * n, 5}, DType::F32, dev);
  EXPECT_ERROR_HAS(c.all_gather(f_small, wrong_cols), "expected out to have shape");

  std::vector<int64_t> counts(n, 0);
  counts[0] = 2 * n - 1;  // one row short of f's 2n rows
  std::vector<int64_t> full(n, 2);
  EXPECT_ERROR_HAS(c.all_to_all(f, counts, f, full),
                   "comm all_to_all: send_counts sum to " + std::to_string(2 * n - 1) + " rows, expected in's " +
                       std::to_string(2 * n) + " rows");
  EXPECT_ERROR_HAS(c.all_to_all(f, full, f, std::vector<int64_t>(n + 1, 0)),
                   "recv_counts has " + std::to_string(n + 1) + " entries, expected one per rank");
  std::vector<int64_t> negative = full;
  negative[0] = -1, negative[n - 1] += 3;
  EXPECT_ERROR_HAS(c.all_to_all(f, negative, f, full), "send_counts[0] = -1");
  EXPECT_ERROR_HAS(c.all_to_all(f, full, wrong_cols, full), "same trailing dims");

  EXPECT_ERROR_HAS(c.send(f, n + 3), "comm send: peer " + std::to_string(n + 3) + " is out of range");
  EXPECT_ERROR_HAS(c.recv(f, -1), "comm recv: peer -1 is out of range");
  EXPECT_ERROR_HAS(c.send(f, c.rank()), "sending to itself needs group_start/group_end");
  EXPECT_ERROR_HAS(c.broadcast(f, n), "comm broadcast: root " + std::to_string(n) + " is out of range");
  Tensor t = Tensor::zeros({4, 3}, DType::F32, dev).transpose(0, 1);
  EXPECT_ERROR_HAS(c.all_reduce(t, ReduceOp::Sum), "is not contiguous");
  EXPECT_ERROR_HAS(c.group_end(), "comm group_end: no open group");
  EXPECT_ERROR_HAS(c.split({}), "comm split: empty rank list");
  EXPECT_ERROR_HAS(c.split({c.rank(), c.rank()}), "listed twice");
  EXPECT_ERROR_HAS(c.split({(c.rank() + 1) % n}), "is not in the rank list");
  EXPECT_ERROR_HAS(c.split({0, n}), "comm split: rank " + std::to_string(n) + " is out of range");
  Tensor undefined;
  EXPECT_ERROR_HAS(c.broadcast(undefined, 0), "comm broadcast: t is an undefined tensor");
}

}  // namespace comm_checks

// ---- MPI backend ---------------------------------------------------------------------------
namespace {
using namespace comm_checks;

std::unique_ptr<Communicator> world() {
  auto c = make_mpi_world();
  int r = 0, s = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  EXPECT_EQ(c->rank(), r);
  EXPECT_EQ(c->size(), s);
  EXPECT_EQ(c->device(), Device::cpu());
  return c;
}
}  // namespace

TEST(CommMpi, AllReduceEveryDtypeAndOpMatchesFormula) { check_all_reduce(*world(), /*with_f64=*/true); }
TEST(CommMpi, ReduceScatterMatchesFormula) { check_reduce_scatter(*world()); }
TEST(CommMpi, AllGatherPlacesRankRowsInOrder) { check_all_gather(*world()); }
TEST(CommMpi, AllToAllUnevenCountsWithEmptySenderAndReceiver) { check_all_to_all_uneven(*world()); }
TEST(CommMpi, BroadcastFromNonZeroRoot) { check_broadcast_from_last_rank(*world()); }
TEST(CommMpi, ReduceToRootInPlace) { check_reduce_to_root(*world()); }
TEST(CommMpi, SendRecvRing) { check_send_recv_ring(*world()); }
TEST(CommMpi, GroupedCallsCompleteAtGroupEnd) { check_grouped_calls(*world()); }
TEST(CommMpi, SplitIntoEvenAndOddRanks) { check_split_even_odd(*world()); }
TEST(CommMpi, BadArgumentsRaiseErrors) {
  auto c = world();
  check_bad_arguments(*c);
  Tensor fp8 = Tensor::zeros({2}, DType::FP8E5M2);
  EXPECT_ERROR_HAS(c->all_reduce(fp8, ReduceOp::Max), "expected one of f32, f64, bf16, i32, i64, u8");
#if !MOECORE_WITH_CUDA
  EXPECT_ERROR_HAS(make_nccl_world(Device::cuda(0)), "comm make_nccl_world: this build has no CUDA backend");
#endif
  c->barrier();  // the communicator still works after the errors
}

// MPI reduces bf16 in fp32 and rounds once: the result is bf16(exact fp32 sum), bit for bit,
// for values that are not exact bf16 sums.
TEST(CommMpi, Bf16SumIsTheFp32SumRoundedOnce) {
  auto c = world();
  const int64_t n = 257;
  auto contribution = [](int rank, int64_t i) {
    return bf16(philox_uniform(kSeed, 900 + rank, i) * 3.0f - 1.5f);
  };
  std::vector<bf16> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = contribution(c->rank(), i);
  Tensor t = Tensor::from_vector(v, {n});
  Tensor avg = t.clone();
  c->all_reduce(t, ReduceOp::Sum);
  c->all_reduce(avg, ReduceOp::Avg);
  const auto got = t.to_vector<bf16>();
  const auto got_avg = avg.to_vector<bf16>();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;  // bf16 values have 8 significant bits: this sum of a few is exact in fp32 and fp64
    for (int r = 0; r < c->size(); ++r) s += static_cast<float>(contribution(r, i));
    bad += got[i].bits != bf16(static_cast<float>(s)).bits;
    bad += got_avg[i].bits != bf16(static_cast<float>(s) / static_cast<float>(c->size())).bits;
  }
  EXPECT_EQ(bad, 0);
}

// Host tensors of any origin: a view with an offset into a larger storage works like any other.
TEST(CommMpi, ContiguousSliceWithOffset) {
  auto c = world();
  Tensor big = make<float>(950, c->rank(), {6, 8}, Device::cpu());
  Tensor rows = big.slice(0, 2, 5);  // contiguous, offset 16 elements
  c->all_reduce(rows, ReduceOp::Sum);
  const auto got = big.to_vector<float>();
  int64_t bad = 0;
  for (int64_t i = 0; i < 48; ++i) {
    double expected = value<float>(950, c->rank(), i);
    if (i >= 16 && i < 40) {
      expected = 0;
      for (int r = 0; r < c->size(); ++r) expected += value<float>(950, r, i);
    }
    bad += got[i] != static_cast<float>(expected);
  }
  EXPECT_EQ(bad, 0) << "rows 2..4 reduced, the others untouched";
}

// ---- launcher environment ---------------------------------------------------------------------
TEST(LaunchEnv, OpenMpiVariables) {
  const LaunchEnv e = read_launch_env({{"OMPI_COMM_WORLD_RANK", "5"},
                                       {"OMPI_COMM_WORLD_SIZE", "8"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(e.launcher, "openmpi");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world, 4);
  EXPECT_EQ(e.master_addr, "");
  EXPECT_EQ(e.master_port, 0);
}

TEST(LaunchEnv, TorchrunVariables) {
  const LaunchEnv e = read_launch_env({{"RANK", "3"},
                                       {"WORLD_SIZE", "16"},
                                       {"LOCAL_RANK", "3"},
                                       {"LOCAL_WORLD_SIZE", "8"},
                                       {"MASTER_ADDR", "node017"},
                                       {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world, 16);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.local_world, 8);
  EXPECT_EQ(e.master_addr, "node017");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, PmiVariables) {
  const LaunchEnv e = read_launch_env(
      {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "2"}});
  EXPECT_EQ(e.launcher, "pmi");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world, 2);
  const LaunchEnv p = read_launch_env(
      {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"PMI_LOCAL_RANK", "1"}, {"PMI_LOCAL_SIZE", "2"}});
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(p.local_world, 2);
}

TEST(LaunchEnv, SlurmVariables) {
  std::map<std::string, std::string> env = {{"SLURM_PROCID", "6"},        {"SLURM_NTASKS", "7"},
                                            {"SLURM_LOCALID", "0"},       {"SLURM_NODEID", "3"},
                                            {"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"MASTER_ADDR", "n0"},
                                            {"MASTER_PORT", "1234"}};
  LaunchEnv e = read_launch_env(env);
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world, 7);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world, 1);  // node 3 is the one with a single task
  EXPECT_EQ(e.master_addr, "n0");
  EXPECT_EQ(e.master_port, 1234);
  env["SLURM_PROCID"] = "3", env["SLURM_LOCALID"] = "1", env["SLURM_NODEID"] = "1";
  e = read_launch_env(env);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world, 2);
  env["SLURM_NODEID"] = "4";
  EXPECT_ERROR_HAS(read_launch_env(env), "SLURM_NODEID=4 is beyond the 4 nodes");
}

TEST(LaunchEnv, NoLauncherIsASingleProcess) {
  const LaunchEnv e = read_launch_env(std::map<std::string, std::string>{{"HOME", "/root"}});
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world, 1);
}

TEST(LaunchEnv, InconsistentOrMissingValuesNameTheVariable) {
  std::map<std::string, std::string> torch = {{"RANK", "4"},       {"WORLD_SIZE", "4"},     {"LOCAL_RANK", "0"},
                                              {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  EXPECT_ERROR_HAS(read_launch_env(torch), "launch environment (torchrun): RANK=4 is not below WORLD_SIZE=4");
  torch["RANK"] = "1";
  torch.erase("MASTER_PORT");
  EXPECT_ERROR_HAS(read_launch_env(torch), "launch environment (torchrun): MASTER_PORT is not set");
  torch["MASTER_PORT"] = "70000";
  EXPECT_ERROR_HAS(read_launch_env(torch), "MASTER_PORT=70000, expected a port in 1..65535");
  torch["MASTER_PORT"] = "29500";
  torch["LOCAL_RANK"] = "x1";
  EXPECT_ERROR_HAS(read_launch_env(torch), "LOCAL_RANK='x1' is not an integer");
  torch["LOCAL_RANK"] = "0";
  torch["LOCAL_WORLD_SIZE"] = "8";
  EXPECT_ERROR_HAS(read_launch_env(torch), "LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4");
  torch.erase("RANK");
  EXPECT_ERROR_HAS(read_launch_env(torch), "launch environment (torchrun): RANK is not set");

  EXPECT_ERROR_HAS(read_launch_env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}),
                   "(openmpi): OMPI_COMM_WORLD_LOCAL_SIZE is not set");
  EXPECT_ERROR_HAS(read_launch_env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "-1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                   "OMPI_COMM_WORLD_LOCAL_RANK=-1 is negative");
  EXPECT_ERROR_HAS(read_launch_env({{"PMI_RANK", "0"}, {"PMI_SIZE", "0"}, {"MPI_LOCALRANKID", "0"},
                                    {"MPI_LOCALNRANKS", "1"}}),
                   "PMI_SIZE=0, expected PMI_SIZE >= 1");
  EXPECT_ERROR_HAS(read_launch_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}),
                   "SLURM_TASKS_PER_NODE is not set");
}

// Under mpirun the real environment agrees with MPI.
TEST(LaunchEnv, ProcessEnvironmentMatchesMpi) {
  if (!std::getenv("OMPI_COMM_WORLD_RANK")) GTEST_SKIP() << "not launched by Open MPI's mpirun";
  const LaunchEnv e = read_launch_env();
  int r = 0, s = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  EXPECT_EQ(e.launcher, "openmpi");
  EXPECT_EQ(e.rank, r);
  EXPECT_EQ(e.world, s);
  EXPECT_LT(e.local_rank, e.local_world);
}
