#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "moecore/data/dataset_info.h"
#include "moecore/data/indexed_dataset.h"

#include "commands.h"  // run_dataset_info (apps/)

using namespace moecore;

TEST(DatasetInfo, UnigramEntropyOfAKnownDistribution) {
  const std::string dir = testing::TempDir() + "/moecore_entropy";
  std::filesystem::create_directories(dir);
  const std::string prefix = dir + "/d";
  IndexedDatasetWriter w(prefix, TokenDType::U16);
  w.add_document({0, 0, 1, 1});  // p = (1/2, 1/4, 1/4): H = 1.5 ln 2
  w.add_document({2, 2, 0, 0});
  w.finalize();
  std::stringstream captured;
  std::streambuf* old = std::cout.rdbuf(captured.rdbuf());
  run_dataset_info({prefix, "--unigram-entropy"});
  std::cout.rdbuf(old);
  const std::string out = captured.str();
  const size_t pos = out.find("\"unigram_entropy_nats\":");
  ASSERT_NE(pos, std::string::npos) << out;
  EXPECT_NEAR(std::stod(out.substr(pos + 23)), 1.5 * std::log(2.0), 1e-12);
  std::filesystem::remove_all(dir);
}
