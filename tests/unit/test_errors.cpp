#include <gtest/gtest.h>

#include "moecore/core/error.h"

using moecore::Error;

TEST(Errors, CheckRaisesErrorWithMessageAndLocation) {
  try {
    const int heads = 7;
    MC_CHECK(heads % 2 == 0, "--num-attention-heads ", heads, " must be even");
    FAIL() << "MC_CHECK did not raise";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--num-attention-heads 7 must be even");
    EXPECT_NE(std::string(e.file()).find("test_errors.cpp"), std::string::npos);
    EXPECT_GT(e.line(), 0);
    EXPECT_NE(e.with_location().find("test_errors.cpp:"), std::string::npos);
  }
}

TEST(Errors, CheckPassesSilently) { EXPECT_NO_THROW(MC_CHECK(1 + 1 == 2, "arithmetic")); }
