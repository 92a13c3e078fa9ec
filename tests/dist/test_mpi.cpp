// dist tier: runs under mpirun with several ranks (tests/CMakeLists.txt). Checks that MPI
// starts through moecore's wrapper, that host tensors travel between ranks intact, that
// Philox draws the same numbers on every rank (layout-independent initialisation), and that
// a failing MPI call becomes an Error with MPI's message instead of an abort.
#include <gtest/gtest.h>

#include "moecore/core/mpi_check.h"
#include "moecore/core/philox.h"
#include "moecore/core/tensor.h"
#include "moecore/ops/random.h"
#include "op_harness.h"

using namespace moecore;

namespace {
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}
}  // namespace

TEST(Mpi, AllreduceOfRankTensorsMatchesFormula) {
  const int rank = world_rank(), size = world_size();
  ASSERT_GE(size, 2) << "run this test under mpirun with at least 2 ranks";
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(rank * 1000 + static_cast<int>(i));
  Tensor t = Tensor::from_vector(v, {10, 100});
  MC_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.data<float>(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM,
                             MPI_COMM_WORLD));
  const std::vector<float> got = t.to_vector<float>();
  for (size_t i = 0; i < got.size(); ++i) {
    const double expected = 1000.0 * size * (size - 1) / 2 + static_cast<double>(i) * size;
    ASSERT_EQ(got[i], static_cast<float>(expected)) << "element " << i;
  }
}

TEST(Mpi, ShardedPhiloxInitEqualsTheWholeOnEveryRank) {
  // Each rank initialises its row shard of a [size*8, 16] parameter with the global offset; the
  // gathered shards must equal the whole parameter drawn on one rank.
  const int rank = world_rank(), size = world_size();
  const int64_t rows = 8, cols = 16;
  Tensor shard = Tensor::empty({rows, cols}, DType::F32);
  ops::fill_normal(shard, 42, rng_key("layers.0.mlp.fc1.weight"), 0.0, 0.02, rank * rows * cols);
  Tensor gathered = Tensor::empty({size * rows, cols}, DType::F32);
  MC_MPI_CHECK(MPI_Allgather(shard.data<float>(), static_cast<int>(shard.numel()), MPI_FLOAT,
                             gathered.data<float>(), static_cast<int>(shard.numel()), MPI_FLOAT, MPI_COMM_WORLD));
  Tensor whole = Tensor::empty({size * rows, cols}, DType::F32);
  ops::fill_normal(whole, 42, rng_key("layers.0.mlp.fc1.weight"), 0.0, 0.02);
  EXPECT_EQ(gathered.to_vector<float>(), whole.to_vector<float>());
}

TEST(Mpi, FailingCallRaisesErrorWithMpiMessage) {
  float x = 1;
  try {
    MC_MPI_CHECK(MPI_Send(&x, 1, MPI_FLOAT, world_size() + 5, 0, MPI_COMM_WORLD));  // invalid rank
    FAIL() << "MPI_Send to a rank that does not exist did not fail";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("MPI call failed: MPI_Send"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank"), std::string::npos) << msg;
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mpi_init(&argc, &argv);
  // Only rank 0 prints the test log; every rank's result decides the exit code.
  if (world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0, any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  mpi_finalize();
  return any_failed;
}
