// comm/collective_watchdog.h and comm/in_flight_queue.h on the CPU: the watchdog's checks against
// fake in-flight sources (a stuck collective past the timeout, one within it, an async error), the
// group names it prints, and the in-flight queue that the NCCL source uses (issue order, the age
// of the oldest unfinished collective, markers reused from the pool). The watchdog thread itself
// is not started here (it would end the test process).
#include <gtest/gtest.h>

#include <set>

#include "moecore/comm/collective_watchdog.h"
#include "moecore/comm/communicator.h"
#include "moecore/comm/in_flight_queue.h"

using namespace moecore::comm;

namespace {

class FakeSource final : public WatchedSource {
 public:
  std::optional<InFlight> in_flight;
  std::string error;
  int aborts = 0;
  std::optional<InFlight> oldest_in_flight() override { return in_flight; }
  std::string async_error() override { return error; }
  void abort() override { ++aborts; }
};

// Registered for one test only.
struct Watched {
  explicit Watched(WatchedSource* s) : source(s) { watch_source(s); }
  ~Watched() { unwatch_source(source); }
  WatchedSource* source;
};

}  // namespace

TEST(CollectiveWatchdog, QuietWithoutSourcesOrWithinTheTimeout) {
  EXPECT_EQ(check_collectives(3.0, 0), "");
  FakeSource s;
  const Watched w(&s);
  EXPECT_EQ(check_collectives(3.0, 0), "");  // nothing in flight
  s.in_flight = WatchedSource::InFlight{"all_reduce", "the dp group of world ranks 0,1", 2.5};
  EXPECT_EQ(check_collectives(3.0, 0), "");  // in flight, within the timeout
}

TEST(CollectiveWatchdog, NamesTheStuckCollectiveItsGroupTheRankAndTheFlag) {
  FakeSource quiet, stuck;
  const Watched w1(&quiet), w2(&stuck);
  quiet.in_flight = WatchedSource::InFlight{"all_gather", "the tp group of world ranks 0,1", 1.0};
  stuck.in_flight = WatchedSource::InFlight{"all_to_all", "the ep group of world ranks 2,3", 4.3};
  EXPECT_EQ(check_collectives(3.0, 3),
            "moecore: error: rank 3: all_to_all on the ep group of world ranks 2,3 waited 4.3 s, more than "
            "--distributed-timeout-minutes 0.05: another rank is stuck, stopped or gone; ending the job");
  EXPECT_EQ(stuck.aborts, 0);  // checking aborts nothing; the watchdog thread does, then exits
}

TEST(CollectiveWatchdog, ReportsAnAsyncErrorAtOnce) {
  FakeSource s;
  const Watched w(&s);
  s.error = "NCCL reported 'remote process exited or there was a network error' on the dp group of world ranks 0,1";
  const std::string line = check_collectives(600.0, 1);
  EXPECT_EQ(line.rfind("moecore: error: rank 1: NCCL reported 'remote process exited", 0), 0u) << line;
  EXPECT_NE(line.find("on the dp group of world ranks 0,1"), std::string::npos) << line;
  EXPECT_NE(line.find("--distributed-timeout-minutes"), std::string::npos) << line;
}

TEST(CollectiveWatchdog, AnUnwatchedSourceIsNoLongerChecked) {
  FakeSource s;
  s.in_flight = WatchedSource::InFlight{"broadcast", "the pp group of world ranks 0,1", 100};
  {
    const Watched w(&s);
    EXPECT_NE(check_collectives(3.0, 0), "");
  }
  EXPECT_EQ(check_collectives(3.0, 0), "");
}

TEST(CollectiveWatchdog, GroupNamesCarryTheRoles) {
  EXPECT_EQ(detail::describe_group("", {0, 2, 4}), "the group of world ranks 0,2,4");
  EXPECT_EQ(detail::describe_group("dp/edp", {1, 3}), "the dp/edp group of world ranks 1,3");
  std::vector<int> many(20);
  for (int i = 0; i < 20; ++i) many[static_cast<size_t>(i)] = i;
  EXPECT_EQ(detail::describe_group("ep", many),
            "the ep group of world ranks 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,... (20 ranks)");
}

TEST(InFlightQueue, ReportsTheOldestUnfinishedCollectiveAndItsAge) {
  using Clock = InFlightQueue::Clock;
  InFlightQueue q;
  int a = 0, b = 0, c = 0;  // fake markers: their addresses
  std::set<void*> done;
  const auto finished = [&](void* m) { return done.count(m) > 0; };
  const Clock::time_point t0 = Clock::now();
  EXPECT_FALSE(q.oldest(t0, finished));
  q.push(&a, "all_reduce", t0);
  q.push(&b, "all_to_all", t0 + std::chrono::seconds(2));
  q.push(&c, "all_gather", t0 + std::chrono::seconds(3));
  auto o = q.oldest(t0 + std::chrono::seconds(5), finished);
  ASSERT_TRUE(o);
  EXPECT_STREQ(o->collective, "all_reduce");
  EXPECT_DOUBLE_EQ(o->waited_s, 5.0);
  done.insert(&a);
  o = q.oldest(t0 + std::chrono::seconds(5), finished);
  ASSERT_TRUE(o);
  EXPECT_STREQ(o->collective, "all_to_all");
  EXPECT_DOUBLE_EQ(o->waited_s, 3.0);  // its age counts from its own issue
  EXPECT_EQ(q.pooled(), 1u);
  EXPECT_EQ(q.in_flight(), 2u);
  // A later collective finished first (another stream) waits behind the unfinished one.
  done.insert(&c);
  o = q.oldest(t0 + std::chrono::seconds(6), finished);
  ASSERT_TRUE(o);
  EXPECT_STREQ(o->collective, "all_to_all");
  done.insert(&b);
  EXPECT_FALSE(q.oldest(t0 + std::chrono::seconds(6), finished));
  EXPECT_EQ(q.pooled(), 3u);
  EXPECT_EQ(q.in_flight(), 0u);
}

TEST(InFlightQueue, ReusesFinishedMarkers) {
  InFlightQueue q;
  EXPECT_EQ(q.take(), nullptr);  // empty pool: the caller makes a marker
  int a = 0;
  q.push(&a, "all_reduce", InFlightQueue::Clock::now());
  EXPECT_EQ(q.take(), nullptr);  // still in flight
  EXPECT_FALSE(q.oldest(InFlightQueue::Clock::now(), [](void*) { return true; }));
  void* again = q.take();
  EXPECT_EQ(again, &a);  // the finished marker comes back
  q.give_back(again);
  const std::vector<void*> all = q.release_all();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0], &a);
  EXPECT_EQ(q.take(), nullptr);
}
