// --mock-data: synthetic but learnable samples. Sample i (of a split) is an arithmetic
// progression modulo the vocabulary, x_j = (a + j*d) mod V for j = 0..S, with start a in
// [0, V) and stride d in [1, min(V-1, 8)] drawn from Philox keyed by (seed, split, i).
// Learnable in stages: token statistics alone bring the loss from ln V to ln 8 (the next token
// is one of 8 successors); attention to the previous token (which reveals d) takes it towards
// 0. (A stride anywhere in [1, V) would need modular arithmetic from the first step: the loss
// sits at ln V for a long time.) tokens = x[0:S], labels = x[1:S+1]. Stateless: any sample
// can be produced in any order (resumption only needs the sample position).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore {

struct Batch {
  Tensor tokens, labels;  // [B, S] i32
  // Labelled tokens of the whole micro-batch when it was checked on the host before the upload
  // (check_batch_on_host: GPTModel::Ctx::checked_num_labels); -1: not checked.
  int64_t num_labels = -1;
  // Multi-token prediction (model/mtp.h, filled by the trainer for the stage with the output
  // layer): each depth's shifted tokens and labels, and its labelled tokens.
  std::vector<Tensor> mtp_tokens{}, mtp_labels{};
  std::vector<int64_t> mtp_num_labels{};
};

class MockData {
 public:
  MockData(int64_t vocab_size, int64_t seq_length, uint64_t seed, std::string split);
  // Samples [first, first + batch) on `device`.
  Batch batch(int64_t first, int64_t batch, Device device) const;

 private:
  int64_t vocab_, seq_;
  uint64_t seed_, key_;
};

}  // namespace moecore
