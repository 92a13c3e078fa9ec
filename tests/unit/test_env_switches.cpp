// The environment switch table (core/env_switches.h): every entry is complete, names are unique
// MOECORE_* names, the accessor returns the environment's value and refuses unlisted names.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>

#include "moecore/core/env_switches.h"
#include "moecore/core/error.h"

using namespace moecore;

TEST(EnvSwitches, TableIsCompleteAndUnique) {
  std::set<std::string> names;
  for (const EnvSwitch& s : env_switches()) {
    const std::string name = s.name;
    EXPECT_EQ(name.rfind("MOECORE_", 0), 0u) << name;
    EXPECT_TRUE(names.insert(name).second) << name << " listed twice";
    EXPECT_FALSE(std::string(s.values).empty()) << name;
    EXPECT_FALSE(std::string(s.unset).empty()) << name;
    EXPECT_FALSE(std::string(s.effect).empty()) << name;
  }
  EXPECT_GE(names.size(), 11u);
}

// The trainer hashes the Checked switches across ranks in table order: the two output-layer
// switches, in this order (the hash must not change).
TEST(EnvSwitches, CheckedSwitchesAreTheOutputLayerOnes) {
  std::vector<std::string> checked;
  for (const EnvSwitch& s : env_switches())
    if (s.agreement == EnvAgreement::Checked) checked.push_back(s.name);
  EXPECT_EQ(checked, (std::vector<std::string>{"MOECORE_FUSED_HEAD", "MOECORE_FUSED_HEAD_ROWS"}));
}

TEST(EnvSwitches, AccessorReadsTheEnvironmentAndRefusesUnlistedNames) {
  ::unsetenv("MOECORE_ATTENTION_SCORE_MB");
  EXPECT_EQ(env_switch("MOECORE_ATTENTION_SCORE_MB"), nullptr);
  ::setenv("MOECORE_ATTENTION_SCORE_MB", "64", 1);
  ASSERT_NE(env_switch("MOECORE_ATTENTION_SCORE_MB"), nullptr);
  EXPECT_STREQ(env_switch("MOECORE_ATTENTION_SCORE_MB"), "64");
  ::setenv("MOECORE_ATTENTION_SCORE_MB", "", 1);
  EXPECT_STREQ(env_switch("MOECORE_ATTENTION_SCORE_MB"), "");  // set but empty is not unset
  ::unsetenv("MOECORE_ATTENTION_SCORE_MB");
  try {
    env_switch("MOECORE_NO_SUCH_SWITCH");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MOECORE_NO_SUCH_SWITCH"), std::string::npos) << e.what();
  }
}
