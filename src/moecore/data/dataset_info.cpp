#include "moecore/data/dataset_info.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/data/indexed_dataset.h"

namespace moecore {

int dataset_info(std::string prefix, bool entropy) {
  for (const char* ext : {".bin", ".idx"})
    if (prefix.size() > 4 && prefix.compare(prefix.size() - 4, 4, ext) == 0) prefix.resize(prefix.size() - 4);

  const IndexedDataset data(prefix);
  const int64_t S = data.num_sequences();
  int64_t min_len = 0, max_len = 0, empty = 0;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t len = data.sequence_length(i);
    min_len = i == 0 ? len : std::min(min_len, len);
    max_len = std::max(max_len, len);
    empty += len == 0;
  }
  const double mean = S > 0 ? static_cast<double>(data.num_tokens()) / static_cast<double>(S) : 0.0;

  std::printf("dataset      %s\n", prefix.c_str());
  std::printf("files        %s (%lld bytes), %s (%lld bytes)\n", data.idx_path().c_str(),
              static_cast<long long>(data.idx_bytes()), data.bin_path().c_str(), static_cast<long long>(data.bin_bytes()));
  std::printf("dtype        %s (code %d)\n", token_dtype_name(data.dtype()), static_cast<int>(data.dtype()));
  std::printf("sequences    %lld\n", static_cast<long long>(S));
  std::printf("documents    %lld\n", static_cast<long long>(data.num_documents()));
  std::printf("tokens       %lld\n", static_cast<long long>(data.num_tokens()));
  std::printf("length       min %lld, max %lld, mean %.2f tokens per sequence (%lld empty)\n",
              static_cast<long long>(min_len), static_cast<long long>(max_len), mean, static_cast<long long>(empty));
  double unigram_entropy = 0;
  if (entropy) {
    std::vector<int64_t> counts;
    std::vector<int32_t> buf;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t len = data.sequence_length(i);
      buf.resize(static_cast<size_t>(len));
      data.read(i, 0, len, buf.data());
      for (int32_t t : buf) {
        MC_CHECK(t >= 0, "dataset '", prefix, "': negative token ", t, " in sequence ", i);
        if (static_cast<size_t>(t) >= counts.size()) counts.resize(static_cast<size_t>(t) + 1, 0);
        counts[static_cast<size_t>(t)]++;
      }
    }
    const double n = static_cast<double>(data.num_tokens());
    for (int64_t c : counts)
      if (c > 0) unigram_entropy -= static_cast<double>(c) / n * std::log(static_cast<double>(c) / n);
    std::printf("unigram entropy %.4f nats per token\n", unigram_entropy);
  }
  nlohmann::json j = {{"prefix", prefix},
                            {"idx_bytes", data.idx_bytes()},
                            {"bin_bytes", data.bin_bytes()},
                            {"dtype", token_dtype_name(data.dtype())},
                            {"dtype_code", static_cast<int>(data.dtype())},
                            {"sequences", S},
                            {"documents", data.num_documents()},
                            {"tokens", data.num_tokens()},
                            {"min_sequence_length", min_len},
                            {"max_sequence_length", max_len},
                            {"mean_sequence_length", mean},
                            {"empty_sequences", empty}};
  if (entropy) j["unigram_entropy_nats"] = unigram_entropy;
  std::fflush(stdout);
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace moecore
