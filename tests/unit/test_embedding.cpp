// Embedding: the gather against direct indexing, the accumulating backward with repeated ids,
// an f64 gradient check of the table, and bad ids / arguments.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "moecore/ops/embedding.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
// Ids drawn from the first `distinct` rows only, so most of them repeat.
std::vector<int32_t> make_ids(int64_t tokens, int64_t distinct) {
  std::mt19937_64 gen(fresh_seed());
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (auto& id : ids) id = static_cast<int32_t>(gen() % distinct);
  return ids;
}
}  // namespace

TEST(Embedding, ForwardGathersRows) {
  const int64_t vocab = 13, hidden = 17, tokens = 29;
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    Tensor table = random_tensor({vocab, hidden}, t);
    std::vector<int32_t> ids = make_ids(tokens, 5);
    ids[0] = vocab - 1;  // the last row too
    Tensor out = poisoned({tokens, hidden}, t);
    ops::embedding_forward(table, Tensor::from_vector(ids, {tokens}), out);
    ASSERT_TRUE(all_written(out));
    const std::vector<double> tv = to_doubles(table);
    std::vector<double> expected;
    for (int64_t i = 0; i < tokens; ++i)
      for (int64_t c = 0; c < hidden; ++c) expected.push_back(tv[ids[i] * hidden + c]);
    EXPECT_TRUE(allclose(out, Tensor::from_vector(expected, {tokens, hidden}), Tolerance{0, 0})) << dtype_name(t);
  }
}

// dtable[ids[t]] += dout[t]: repeated ids add up, and dtable's previous contents are kept.
TEST(Embedding, BackwardAccumulatesRepeatedIds) {
  const int64_t vocab = 11, hidden = 300, tokens = 40;  // hidden > 256: more than one column chunk
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    const DType gt = t == DType::F64 ? DType::F64 : DType::F32;
    const std::vector<int32_t> ids = make_ids(tokens, 6);  // rows 6..10 get nothing
    Tensor dout = random_tensor({tokens, hidden}, t);
    Tensor dtable = random_tensor({vocab, hidden}, gt);
    std::vector<double> expected = to_doubles(dtable);
    const std::vector<double> dv = to_doubles(dout);
    for (int64_t i = 0; i < tokens; ++i)
      for (int64_t c = 0; c < hidden; ++c) expected[ids[i] * hidden + c] += dv[i * hidden + c];
    ops::embedding_backward(Tensor::from_vector(ids, {tokens}), dout, dtable);
    // Up to ~tokens additions of |x| < 1 in fp32 (bf16 dout values are exact in fp32).
    const Tolerance tol = gt == DType::F64 ? default_tolerance(DType::F64) : Tolerance{1e-5, 1e-5};
    EXPECT_TRUE(allclose(dtable, Tensor::from_vector(expected, {vocab, hidden}), tol)) << dtype_name(t);
  }
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  const int64_t vocab = 6, hidden = 5, tokens = 9;
  Tensor table = random_tensor({vocab, hidden}, DType::F64);
  const std::vector<int32_t> ids = make_ids(tokens, 4);
  Tensor ids_f64 = Tensor::from_vector(std::vector<double>(ids.begin(), ids.end()), {tokens});
  const Tensor ids_i32 = Tensor::from_vector(ids, {tokens});
  expect_gradients_match(
      {table, ids_f64},  // ids are integral f64 values (the harness takes f64): no gradient
      [&](const std::vector<Tensor>& in) {
        Tensor out = Tensor::empty({tokens, hidden}, DType::F64);
        ops::embedding_forward(in[0], ids_i32, out);
        return std::vector<Tensor>{out};
      },
      [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor dtable = Tensor::zeros({vocab, hidden}, DType::F64);
        ops::embedding_backward(ids_i32, dout[0], dtable);
        return std::vector<Tensor>{dtable, Tensor()};
      });
}

TEST(Embedding, OutOfRangeIdsNameTheValue) {
  Tensor table = Tensor::zeros({10, 4}, DType::F32);
  Tensor out = Tensor::empty({3, 4}, DType::F32);
  try {
    ops::embedding_forward(table, Tensor::from_vector<int32_t>({0, 12, 3}, {3}), out);
    FAIL() << "id 12 with 10 rows was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "embedding_forward: ids[1] = 12 is out of range for a vocabulary of 10 rows (expected 0 <= id < 10)");
  }
  EXPECT_THROW(ops::embedding_forward(table, Tensor::from_vector<int32_t>({0, 1, -1}, {3}), out), Error);
  // A bad id in backward leaves dtable untouched.
  Tensor dtable = Tensor::zeros({10, 4}, DType::F32);
  Tensor dout = Tensor::from_vector(std::vector<float>(12, 1.0f), {3, 4});
  try {
    ops::embedding_backward(Tensor::from_vector<int32_t>({2, -7, 10}, {3}), dout, dtable);
    FAIL() << "id -7 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embedding_backward: ids[1] = -7"), std::string::npos) << e.what();
  }
  for (float v : dtable.to_vector<float>()) ASSERT_EQ(v, 0.0f);
}

TEST(Embedding, RejectsBadArguments) {
  Tensor table = Tensor::zeros({10, 4}, DType::F32);
  Tensor ids = Tensor::zeros({3}, DType::I32);
  Tensor out_wide = Tensor::empty({3, 5}, DType::F32);
  EXPECT_THROW(ops::embedding_forward(table, ids, out_wide), Error);  // wrong hidden size
  Tensor out_bf16 = Tensor::empty({3, 4}, DType::BF16);
  EXPECT_THROW(ops::embedding_forward(table, ids, out_bf16), Error);  // dtype differs from table
  Tensor out = Tensor::empty({3, 4}, DType::F32);
  EXPECT_THROW(ops::embedding_forward(table, Tensor::zeros({3}, DType::I64), out), Error);  // ids must be i32
  Tensor dout = Tensor::zeros({3, 4}, DType::BF16);
  Tensor dtable_bf16 = Tensor::zeros({10, 4}, DType::BF16);
  try {
    ops::embedding_backward(ids, dout, dtable_bf16);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "embedding_backward: argument 'dtable' has dtype bf16; expected one of f32");
  }
  Tensor dtable_wide = Tensor::zeros({10, 5}, DType::F32);
  EXPECT_THROW(ops::embedding_backward(ids, dout, dtable_wide), Error);  // hidden sizes differ
}
