// dist tier: moecore::comm over NCCL on device tensors. The same checks as test_comm.cpp (the
// comm_checks:: functions defined there) run on the NCCL world communicator, rank i on
// cuda:<local rank>. Skipped without the CUDA backend or with fewer GPUs than local ranks
// (every rank of a node takes the same decision, so no rank is left waiting in a collective).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "moecore/comm/bootstrap.h"
#include "moecore/comm/communicator.h"
#include "moecore/core/device.h"
#include "moecore/core/tensor.h"

using namespace moecore;
using namespace moecore::comm;

namespace comm_checks {  // defined in test_comm.cpp
void check_all_reduce(Communicator& c, bool with_f64);
void check_reduce_scatter(Communicator& c);
void check_all_gather(Communicator& c);
void check_all_to_all_uneven(Communicator& c);
void check_broadcast_from_last_rank(Communicator& c);
void check_reduce_to_root(Communicator& c);
void check_send_recv_ring(Communicator& c);
void check_grouped_calls(Communicator& c);
void check_split_even_odd(Communicator& c);
void check_bad_arguments(Communicator& c);
}  // namespace comm_checks
namespace dispatch_checks {  // defined in test_token_dispatcher.cpp
void check_all(Communicator& c);
}  // namespace dispatch_checks

namespace {

class CommNccl : public ::testing::Test {
 protected:
  // One NCCL world for the whole suite (creating one costs a bootstrap round).
  static void SetUpTestSuite() {
    const LaunchEnv env = read_launch_env();
    if (!MOECORE_WITH_CUDA || cuda_device_count() < env.local_world) {
      skip_reason_ = !MOECORE_WITH_CUDA ? "built without CUDA"
                                        : "needs " + std::to_string(env.local_world) + " CUDA devices (one per local rank), found " +
                                              std::to_string(cuda_device_count());
      return;
    }
    world_ = make_nccl_world(Device::cuda(env.local_rank)).release();
  }
  static void TearDownTestSuite() {
    delete world_;
    world_ = nullptr;
  }
  void SetUp() override {
    if (!world_) GTEST_SKIP() << "NCCL tests: " << skip_reason_;
  }
  static Communicator& c() { return *world_; }

  static Communicator* world_;
  static std::string skip_reason_;
};
Communicator* CommNccl::world_ = nullptr;
std::string CommNccl::skip_reason_;

}  // namespace

TEST_F(CommNccl, WorldMatchesLaunch) {
  const LaunchEnv env = read_launch_env();
  EXPECT_EQ(c().size(), env.world);
  EXPECT_EQ(c().rank(), env.rank);
  EXPECT_EQ(c().device(), Device::cuda(env.local_rank));
}
TEST_F(CommNccl, AllReduceEveryDtypeAndOpMatchesFormula) { comm_checks::check_all_reduce(c(), /*with_f64=*/false); }
TEST_F(CommNccl, ReduceScatterMatchesFormula) { comm_checks::check_reduce_scatter(c()); }
TEST_F(CommNccl, AllGatherPlacesRankRowsInOrder) { comm_checks::check_all_gather(c()); }
TEST_F(CommNccl, AllToAllUnevenCountsWithEmptySenderAndReceiver) { comm_checks::check_all_to_all_uneven(c()); }
TEST_F(CommNccl, BroadcastFromNonZeroRoot) { comm_checks::check_broadcast_from_last_rank(c()); }
TEST_F(CommNccl, ReduceToRootInPlace) { comm_checks::check_reduce_to_root(c()); }
TEST_F(CommNccl, SendRecvRing) { comm_checks::check_send_recv_ring(c()); }
TEST_F(CommNccl, GroupedCallsCompleteAtGroupEnd) { comm_checks::check_grouped_calls(c()); }
TEST_F(CommNccl, SplitIntoEvenAndOddRanks) { comm_checks::check_split_even_odd(c()); }
TEST_F(CommNccl, BadArgumentsRaiseErrors) {
  comm_checks::check_bad_arguments(c());
  // Host tensors and FP8 codes are not for the NCCL communicator.
  Tensor host = Tensor::zeros({4}, DType::F32);
  try {
    c().all_reduce(host, ReduceOp::Sum);
    ADD_FAILURE() << "all_reduce of a host tensor on an NCCL communicator did not fail";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("comm all_reduce: t is Tensor(f32, cpu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected a tensor on " + c().device().str()), std::string::npos) << msg;
  }
  // FP8 codes are moved (CommNccl.Fp8CodesMoveAsBytes), never reduced.
  Tensor fp8 = Tensor::zeros({4}, DType::FP8E4M3, c().device());
  try {
    c().all_reduce(fp8, ReduceOp::Max);
    ADD_FAILURE() << "all_reduce of FP8 codes on an NCCL communicator did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FP8 codes are only moved as bytes"), std::string::npos) << e.what();
  }
  c().barrier();
}

// FP8 codes (the FP8 token dispatch) travel as bytes: all_gather, all_to_all, broadcast and
// send/recv deliver every code unchanged, E4M3 and E5M2.
TEST_F(CommNccl, Fp8CodesMoveAsBytes) {
  const int n = c().size(), r = c().rank();
  auto codes = [](int rank, int64_t count, DType dt) {
    std::vector<uint8_t> v(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = static_cast<uint8_t>(37 * rank + 5 * i + 1);
    Tensor t = Tensor::empty({count}, dt);
    std::copy(v.begin(), v.end(), static_cast<uint8_t*>(t.data_ptr()));
    return t;
  };
  auto bytes = [](const Tensor& t) {
    const Tensor h = t.to(Device::cpu());
    const auto* p = static_cast<const uint8_t*>(h.data_ptr());
    return std::vector<uint8_t>(p, p + h.numel());
  };
  for (const DType dt : {DType::FP8E4M3, DType::FP8E5M2}) {
    const Tensor mine = codes(r, 6, dt).to(c().device());
    Tensor gathered = Tensor::empty({6 * n}, dt, c().device());
    c().all_gather(mine, gathered);
    std::vector<uint8_t> want;
    for (int q = 0; q < n; ++q) {
      const std::vector<uint8_t> b = bytes(codes(q, 6, dt));
      want.insert(want.end(), b.begin(), b.end());
    }
    EXPECT_EQ(bytes(gathered), want) << dtype_name(dt) << " all_gather";
    // all_to_all: rank r sends 3 codes to every rank; receives rank q's codes [3r, 3r + 3).
    const Tensor send = codes(r, 3 * n, dt).to(c().device());
    Tensor recv = Tensor::empty({3 * n}, dt, c().device());
    c().all_to_all(send, std::vector<int64_t>(static_cast<size_t>(n), 3), recv, std::vector<int64_t>(static_cast<size_t>(n), 3));
    std::vector<uint8_t> want_a2a;
    for (int q = 0; q < n; ++q) {
      const std::vector<uint8_t> b = bytes(codes(q, 3 * n, dt));
      want_a2a.insert(want_a2a.end(), b.begin() + 3 * r, b.begin() + 3 * r + 3);
    }
    EXPECT_EQ(bytes(recv), want_a2a) << dtype_name(dt) << " all_to_all";
    Tensor b = codes(r, 5, dt).to(c().device());
    c().broadcast(b, n - 1);
    EXPECT_EQ(bytes(b), bytes(codes(n - 1, 5, dt))) << dtype_name(dt) << " broadcast";
    // send/recv around the ring
    const Tensor out = codes(r, 4, dt).to(c().device());  // alive until the group ends
    Tensor got = Tensor::empty({4}, dt, c().device());
    c().group_start();
    c().send(out, (r + 1) % n);
    c().recv(got, (r + n - 1) % n);
    c().group_end();
    EXPECT_EQ(bytes(got), bytes(codes((r + n - 1) % n, 4, dt))) << dtype_name(dt) << " send/recv";
  }
  c().barrier();
}

// f64 sums (the step's MoE statistics are reduced in f64 on the device).
TEST_F(CommNccl, F64AllReduceSums) {
  Tensor t = Tensor::from_vector(std::vector<double>{1.5, -2.0, 1e-300}, {3}).to(c().device());
  c().all_reduce(t, ReduceOp::Sum);
  const std::vector<double> got = t.to(Device::cpu()).to_vector<double>();
  const double n = static_cast<double>(c().size());
  EXPECT_EQ(got, (std::vector<double>{1.5 * n, -2.0 * n, 1e-300 * n}));
}

// The expert-parallel dispatchers (alltoall, allgather) on device tensors through NCCL.
TEST_F(CommNccl, TokenDispatchersMatchTheClosedForm) { dispatch_checks::check_all(c()); }
