#include "moecore/data/mock_data.h"

#include <algorithm>
#include <vector>

#include "moecore/core/philox.h"

namespace moecore {

namespace {
constexpr int64_t kMaxStride = 8;
}

MockData::MockData(int64_t vocab_size, int64_t seq_length, uint64_t seed, std::string split)
    : vocab_(vocab_size), seq_(seq_length), seed_(seed), key_(rng_key("mock-data/" + split)) {
  MC_CHECK(vocab_size >= 2, "--mock-data needs --vocab-size >= 2, got ", vocab_size);
}

Batch MockData::batch(int64_t first, int64_t batch, Device device) const {
  std::vector<int32_t> tokens(static_cast<size_t>(batch * seq_)), labels(tokens.size());
  for (int64_t b = 0; b < batch; ++b) {
    const PhiloxWords w = philox_words(seed_, key_, static_cast<uint64_t>(first + b));
    const int64_t start = static_cast<int64_t>(w.w[0] % static_cast<uint32_t>(vocab_));
    const int64_t max_stride = std::min<int64_t>(vocab_ - 1, kMaxStride);
    const int64_t stride = 1 + static_cast<int64_t>(w.w[1] % static_cast<uint32_t>(max_stride));
    for (int64_t j = 0; j < seq_; ++j) {
      tokens[static_cast<size_t>(b * seq_ + j)] = static_cast<int32_t>((start + j * stride) % vocab_);
      labels[static_cast<size_t>(b * seq_ + j)] = static_cast<int32_t>((start + (j + 1) * stride) % vocab_);
    }
  }
  return {Tensor::from_vector(tokens, {batch, seq_}, device), Tensor::from_vector(labels, {batch, seq_}, device)};
}

}  // namespace moecore
