// meta.json parsed from its text (train/checkpoint_meta.h, also fuzzed by
// tests/fuzz/fuzz_checkpoint_meta.cpp): a valid file gives its state; bad ones an Error naming the file.
#include <gtest/gtest.h>

#include <string>

#include "moecore/core/error.h"
#include "moecore/train/checkpoint_meta.h"

using namespace moecore;

namespace {
std::string error_of(const std::string& text) {
  try {
    parse_checkpoint_meta(text, "ckpt/meta.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(CheckpointMeta, ParsesTheTrainingState) {
  const TrainingState s = parse_checkpoint_meta(
      R"({"format": "moecore-checkpoint-v1", "iteration": 7, "consumed_samples": 112, "skipped_iterations": 1,
          "nan_iterations": 1, "optimizer_offset": 3, "args": [["--lr", "0.001"]], "crc32c": {"w": 4294967295}})",
      "ckpt/meta.json");
  EXPECT_EQ(s.iteration, 7);
  EXPECT_EQ(s.consumed_samples, 112);
  EXPECT_EQ(s.optimizer_offset, 3);
  ASSERT_EQ(s.args.size(), 1u);
  EXPECT_EQ(s.args[0].second, "0.001");
  EXPECT_FALSE(s.model_only);
}

TEST(CheckpointMeta, RefusesBadFieldsNamingTheFile) {
  const std::string head = R"({"format": "moecore-checkpoint-v1", "consumed_samples": 0, "args": [], )";
  for (const auto& [text, needle] : std::vector<std::pair<std::string, std::string>>{
           {"{", "is not valid JSON"},
           {"[]", "expected a JSON object"},
           {head + R"("iteration": -1})", "\"iteration\" is -1; expected >= 0"},
           {head + R"("iteration": 1, "optimizer_offset": -2})", "\"optimizer_offset\" is -2; expected >= 0"},
           {head + R"("iteration": 1, "optimizer_offset": "x"})", "\"optimizer_offset\" must be an integer"},
           {head + R"("iteration": 1, "crc32c": {"w": 4294967296}})", "32-bit checksums"},
           {R"({"format": "other", "iteration": 1, "consumed_samples": 0, "args": []})", "unknown checkpoint format"}}) {
    const std::string msg = error_of(text);
    EXPECT_NE(msg.find("'ckpt/meta.json'"), std::string::npos) << text << ": " << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << text << ": " << msg;
  }
}
