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

// ---- vocabulary-parallel parts ---------------------------------------------------------

namespace {
// Ids over the whole vocabulary, with the part boundaries and both ends present.
std::vector<int32_t> ids_over(int64_t tokens, int64_t vocab, const std::vector<int64_t>& bounds) {
  std::vector<int32_t> ids = make_ids(tokens, vocab);
  size_t k = 0;
  ids[k++] = static_cast<int32_t>(vocab - 1);
  for (int64_t b : bounds)
    if (b > 0 && b < vocab && k + 1 < ids.size()) {
      ids[k++] = static_cast<int32_t>(b - 1);
      ids[k++] = static_cast<int32_t>(b);
    }
  return ids;
}
}  // namespace

// Splitting a 37-row vocabulary into 2 or 3 uneven parts: the sum of the parts' outputs is
// the whole-vocabulary output (each token has one nonzero part), and each part's gradient
// rows are the matching rows of the whole-vocabulary gradient (same additions, same order).
TEST(Embedding, VocabPartsSumToTheWholeVocabulary) {
  const int64_t vocab = 37, hidden = 6, tokens = 50;
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 20, 37}, std::vector<int64_t>{0, 5, 19, 37}}) {
    for (DType t : {DType::F32, DType::F64, DType::BF16}) {
      const DType gt = t == DType::F64 ? DType::F64 : DType::F32;
      const std::vector<int32_t> idv = ids_over(tokens, vocab, bounds);
      const Tensor ids = Tensor::from_vector(idv, {tokens});
      Tensor table = random_tensor({vocab, hidden}, t);
      Tensor dout = random_tensor({tokens, hidden}, t);
      Tensor dtable0 = random_tensor({vocab, hidden}, gt);

      Tensor whole = Tensor::empty({tokens, hidden}, t);
      ops::embedding_forward(table, ids, whole);
      Tensor dwhole = dtable0.clone();
      ops::embedding_backward(ids, dout, dwhole);

      std::vector<double> sum(static_cast<size_t>(tokens * hidden), 0.0);
      for (size_t p = 0; p + 1 < bounds.size(); ++p) {
        const int64_t a = bounds[p], b = bounds[p + 1];
        Tensor out = poisoned({tokens, hidden}, t);
        ops::embedding_forward(table.slice(0, a, b).clone(), ids, out, a, vocab);
        ASSERT_TRUE(all_written(out));
        const std::vector<double> ov = to_doubles(out);
        for (int64_t i = 0; i < tokens; ++i)
          for (int64_t c = 0; c < hidden; ++c) {
            const double v = ov[i * hidden + c];
            if (idv[i] < a || idv[i] >= b) ASSERT_EQ(v, 0.0) << "token " << i << " of another part";
            sum[i * hidden + c] += v;
          }
        Tensor dpart = dtable0.slice(0, a, b).clone();
        ops::embedding_backward(ids, dout, dpart, a, vocab);
        EXPECT_TRUE(allclose(dpart, dwhole.slice(0, a, b).clone(), Tolerance{0, 0}))
            << dtype_name(t) << " part [" << a << ", " << b << ")";
      }
      EXPECT_TRUE(allclose(Tensor::from_vector(sum, {tokens, hidden}), whole, Tolerance{0, 0})) << dtype_name(t);
    }
  }
}

// f64 finite differences of a middle part's table (ids over the whole vocabulary).
TEST(Embedding, VocabPartBackwardMatchesFiniteDifferences) {
  const int64_t vocab = 15, start = 6, rows = 5, hidden = 4, tokens = 12;
  Tensor table = random_tensor({rows, hidden}, DType::F64);
  const std::vector<int32_t> ids = ids_over(tokens, vocab, {start, start + rows});
  const Tensor ids_i32 = Tensor::from_vector(ids, {tokens});
  expect_gradients_match(
      {table},
      [&](const std::vector<Tensor>& in) {
        Tensor out = Tensor::empty({tokens, hidden}, DType::F64);
        ops::embedding_forward(in[0], ids_i32, out, start, vocab);
        return std::vector<Tensor>{out};
      },
      [&](const std::vector<Tensor>&, const std::vector<Tensor>& dout) {
        Tensor dtable = Tensor::zeros({rows, hidden}, DType::F64);
        ops::embedding_backward(ids_i32, dout[0], dtable, start, vocab);
        return std::vector<Tensor>{dtable};
      });
}

TEST(Embedding, VocabPartRejectsOutOfRangeIdsAndBadParts) {
  Tensor table = Tensor::zeros({4, 3}, DType::F32);  // rows [3, 7) of 10
  Tensor out = Tensor::empty({3, 3}, DType::F32);
  ops::embedding_forward(table, Tensor::from_vector<int32_t>({0, 9, 5}, {3}), out, 3, 10);  // other parts' ids: fine
  try {
    ops::embedding_forward(table, Tensor::from_vector<int32_t>({3, 10, 1}, {3}), out, 3, 10);
    FAIL() << "id 10 of a 10-row vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "embedding_forward: ids[1] = 10 is out of range for a vocabulary of 10 rows (expected 0 <= id < 10)");
  }
  EXPECT_THROW(ops::embedding_forward(table, Tensor::from_vector<int32_t>({3, 4, -1}, {3}), out, 3, 10), Error);
  Tensor dtable = Tensor::zeros({4, 3}, DType::F32);
  Tensor dout = Tensor::from_vector(std::vector<float>(9, 1.0f), {3, 3});
  try {
    ops::embedding_backward(Tensor::from_vector<int32_t>({4, 5, 12}, {3}), dout, dtable, 3, 10);
    FAIL() << "backward accepted id 12";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embedding_backward: ids[2] = 12"), std::string::npos) << e.what();
  }
  for (float v : dtable.to_vector<float>()) ASSERT_EQ(v, 0.0f) << "dtable was modified before the error";
  // The part must fit the vocabulary.
  try {
    ops::embedding_forward(table, Tensor::from_vector<int32_t>({0, 1, 2}, {3}), out, 7, 10);
    FAIL() << "part [7, 11) of 10 rows was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "embedding_forward: the part [7, 11) of 4 rows does not fit in a vocabulary of 10 rows (expected 0 "
                 "<= vocab_start and vocab_start + V <= vocab_total)");
  }
  Tensor ids = Tensor::zeros({3}, DType::I32);
  EXPECT_THROW(ops::embedding_forward(table, ids, out, -1, 10), Error);
  EXPECT_THROW(ops::embedding_forward(table, ids, out, 2, -1), Error);  // whole vocabulary starts at 0
  EXPECT_THROW(ops::embedding_backward(ids, dout, dtable, 0, 3), Error);  // 4 rows in a 3-row vocabulary
}
