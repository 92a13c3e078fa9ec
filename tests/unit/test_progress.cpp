// core/progress.h: the progress line's text (counts, percentage, rate, time left) and its pacing.
#include <gtest/gtest.h>

#include <sstream>

#include "moecore/core/progress.h"

using namespace moecore;

TEST(Progress, FormatsDurations) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(44.6), "45s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(2 * 3600 + 7 * 60 + 3), "2h07m");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_count(999), "999");
  EXPECT_EQ(format_count(12345), "12.3k");
  EXPECT_EQ(format_count(4.56e9), "4.6G");
}

TEST(Progress, LineHasRateAndTimeLeft) {
  ProgressLine p("job", 100, "steps", nullptr, 1.0);
  // 25 of 100 in 50 s: 0.5 steps/s, 75 left -> 150 s.
  EXPECT_EQ(p.line(25, 50, "iteration 26"), "job: 25/100 steps (25.0%), 0.5 steps/s, ETA 2m30s, iteration 26");
  EXPECT_EQ(p.line(0, 10, ""), "job: 0/100 steps (0.0%), 0 steps/s, ETA ?");
  ProgressLine open_ended("job", 0, "B", nullptr, 1.0);
  EXPECT_EQ(open_ended.line(3000, 2, ""), "job: 3.0k B, 1.5k B/s");
}

TEST(Progress, QuietBeforeTheIntervalAndWhenOff) {
  std::ostringstream out;
  ProgressLine slow("job", 10, "steps", &out, 3600.0);
  EXPECT_FALSE(slow.update(1));
  ProgressLine off("job", 10, "steps", &out, 0.0);
  EXPECT_FALSE(off.update(1));
  EXPECT_TRUE(out.str().empty());
  ProgressLine now("job", 10, "steps", &out, 1e-9);
  EXPECT_TRUE(now.update(5, "x"));
  EXPECT_NE(out.str().find("job: 5/10 steps (50.0%)"), std::string::npos) << out.str();
}
