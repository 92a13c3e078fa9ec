// core/step_timers.h on the CPU (host clock): levels, nesting, order, totals and their reset.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "moecore/core/error.h"
#include "moecore/core/step_timers.h"

namespace moecore {
namespace {

// Restores timing level 0 and empty totals whatever a test leaves behind.
class StepTimersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_timing_level(0);
    (void)take_region_times();
  }
  void TearDown() override { SetUp(); }
};

const RegionTime* find(const std::vector<RegionTime>& times, const std::string& name) {
  for (const RegionTime& t : times)
    if (t.name == name) return &t;
  return nullptr;
}

TEST_F(StepTimersTest, LevelZeroTimesNothing) {
  { const TimedRegion r("phase", 1, Device::cpu()); }
  const std::vector<RegionTime> times = take_region_times();
  EXPECT_EQ(find(times, "phase"), nullptr);
}

TEST_F(StepTimersTest, RegionsAboveTheLevelAreSkipped) {
  set_timing_level(1);
  {
    const TimedRegion outer("outer", 1, Device::cpu());
    const TimedRegion inner("inner", 2, Device::cpu());
  }
  const std::vector<RegionTime> times = take_region_times();
  ASSERT_NE(find(times, "outer"), nullptr);
  EXPECT_EQ(find(times, "outer")->calls, 1);
  EXPECT_EQ(find(times, "inner"), nullptr);
}

TEST_F(StepTimersTest, NestedRegionsSumTheirCallsAndKeepFirstOpenedOrder) {
  set_timing_level(2);
  for (int step = 0; step < 3; ++step) {
    const TimedRegion outer("step", 1, Device::cpu());
    for (int layer = 0; layer < 2; ++layer) {
      const TimedRegion a("layer", 2, Device::cpu());
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const TimedRegion b("tail", 2, Device::cpu());
  }
  collect_region_times();
  const std::vector<RegionTime> times = take_region_times();
  ASSERT_EQ(times.size(), 3u);
  EXPECT_EQ(times[0].name, "step");
  EXPECT_EQ(times[1].name, "layer");
  EXPECT_EQ(times[2].name, "tail");
  EXPECT_EQ(times[0].depth, 0);
  EXPECT_EQ(times[1].depth, 1);
  EXPECT_EQ(times[0].calls, 3);
  EXPECT_EQ(times[1].calls, 6);
  // Six sleeps of 2 ms inside "layer", all of them inside "step" (inclusive times).
  EXPECT_GE(times[1].ms, 6 * 2.0 * 0.95);
  EXPECT_GE(times[0].ms, times[1].ms + times[2].ms - 1e-6);
}

TEST_F(StepTimersTest, TakeResetsTheTotals) {
  set_timing_level(1);
  { const TimedRegion r("phase", 1, Device::cpu()); }
  EXPECT_EQ(find(take_region_times(), "phase")->calls, 1);
  EXPECT_EQ(find(take_region_times(), "phase"), nullptr);  // not timed since the last take
  { const TimedRegion r("phase", 1, Device::cpu()); }
  EXPECT_EQ(find(take_region_times(), "phase")->calls, 1);
}

TEST_F(StepTimersTest, CollectingInsideAnOpenRegionIsRefused) {
  set_timing_level(1);
  const TimedRegion r("open", 1, Device::cpu());
  EXPECT_THROW(collect_region_times(), Error);
}

TEST_F(StepTimersTest, LevelOutOfRangeIsRefused) {
  EXPECT_THROW(set_timing_level(3), Error);
  EXPECT_THROW(set_timing_level(-1), Error);
}

}  // namespace
}  // namespace moecore
