// The EP load report (moe/dispatch_load.h) under mpirun (2 or 4 ranks, the world as the EP
// group): received rows min / mean / max and their ratio; the wait for the slowest rank as each
// collective's time on this rank minus the fastest rank's, summed; a group whose ranks timed a
// different number of collectives reports no wait; the clocks record only when armed and asked.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "moecore/comm/communicator.h"
#include "moecore/moe/dispatch_load.h"

using namespace moecore;

TEST(DispatchLoad, RowsAndWaitOverTheGroup) {
  auto world = comm::make_mpi_world();
  const double r = world->rank(), n = world->size();
  DispatchLoadSample s;
  s.any_layer = true;
  s.received_rows = static_cast<int64_t>(100 * (r + 1));
  // Collective 0: rank r takes 1 + r ms (rank 0 is the fastest); collective 1: 5 + 2r ms. Rank r
  // waits r + 2r = 3r ms in all.
  s.collective_ms = {1.0 + r, 5.0 + 2.0 * r};
  const DispatchLoadReport rep = reduce_dispatch_load(s, world.get());
  ASSERT_TRUE(rep.valid);
  ASSERT_TRUE(rep.timed);
  EXPECT_DOUBLE_EQ(rep.rows_min, 100);
  EXPECT_DOUBLE_EQ(rep.rows_max, 100 * n);
  EXPECT_DOUBLE_EQ(rep.rows_mean, 100 * (n + 1) / 2);
  EXPECT_DOUBLE_EQ(rep.imbalance, 2 * n / (n + 1));
  EXPECT_DOUBLE_EQ(rep.wait_ms_mean, 3 * (n - 1) / 2);
  EXPECT_DOUBLE_EQ(rep.wait_ms_max, 3 * (n - 1));
  EXPECT_DOUBLE_EQ(rep.comm_ms_mean, 6 + 3 * (n - 1) / 2);
}

TEST(DispatchLoad, DifferentCollectiveCountsReportNoWait) {
  auto world = comm::make_mpi_world();
  DispatchLoadSample s;
  s.any_layer = true;
  s.received_rows = 10;
  s.collective_ms.assign(world->rank() == 0 ? 3 : 2, 1.0);
  const DispatchLoadReport rep = reduce_dispatch_load(s, world.get());
  EXPECT_TRUE(rep.valid);
  EXPECT_FALSE(rep.timed);
  EXPECT_DOUBLE_EQ(rep.imbalance, 1.0);
}

TEST(DispatchLoad, ClocksRecordOnlyWhenArmedAndAsked) {
  (void)take_dispatch_load();
  { const CollectiveClock c(Device::cpu(), true); }  // not armed
  arm_dispatch_clocks(true);
  { const CollectiveClock c(Device::cpu(), false); }  // not an EP collective
  {
    const CollectiveClock c(Device::cpu(), true);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  add_received_rows(7);
  arm_dispatch_clocks(false);
  const DispatchLoadSample s = take_dispatch_load();
  ASSERT_EQ(s.collective_ms.size(), 1u);
  EXPECT_GE(s.collective_ms[0], 19.0);
  EXPECT_EQ(s.received_rows, 7);
  EXPECT_TRUE(s.any_layer);
  const DispatchLoadSample empty = take_dispatch_load();
  EXPECT_TRUE(empty.collective_ms.empty());
  EXPECT_EQ(empty.received_rows, 0);
}
