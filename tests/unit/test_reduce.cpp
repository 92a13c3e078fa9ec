#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/reduce.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

TEST(Reduce, AllReductionsMatchLoops) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    const int64_t r = 6, c = 37;
    Tensor x = random_tensor({2, 3, c}, t);  // leading dims flatten into rows
    const std::vector<double> v = to_doubles(x);
    std::vector<double> rs(r, 0), rm(r, -INFINITY), cs(c, 0);
    double total = 0, sq = 0;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        const double e = v[i * c + j];
        rs[i] += e;
        rm[i] = std::max(rm[i], e);
        cs[j] += e;
        total += e;
        sq += e * e;
      }
    const DType acc = t == DType::F64 ? DType::F64 : DType::F32;
    Tensor o_rs = poisoned({2, 3}, acc), o_rm = poisoned({2, 3}, t), o_cs = poisoned({c}, acc);
    Tensor o_total = poisoned({1}, acc), o_sq = poisoned({1}, acc);
    ops::sum_last_dim(x, o_rs);
    ops::max_last_dim(x, o_rm);
    ops::sum_leading_dims(x, o_cs);
    ops::sum_all(x, o_total);
    ops::sum_squares(x, o_sq);
    const Tolerance tol{1e-5, 1e-5};
    EXPECT_TRUE(allclose(o_rs, Tensor::from_vector(rs, {2, 3}), tol)) << dtype_name(t);
    EXPECT_TRUE(allclose(o_rm, Tensor::from_vector(rm, {2, 3}), {0, 0})) << dtype_name(t);
    EXPECT_TRUE(allclose(o_cs, Tensor::from_vector(cs, {c}), tol)) << dtype_name(t);
    EXPECT_TRUE(allclose(o_total, Tensor::from_vector(std::vector<double>{total}, {1}), tol)) << dtype_name(t);
    EXPECT_TRUE(allclose(o_sq, Tensor::from_vector(std::vector<double>{sq}, {1}), tol)) << dtype_name(t);
  }
}

TEST(Reduce, RejectsBadOutputs) {
  Tensor x = Tensor::zeros({4, 5}, DType::BF16);
  Tensor wrong_shape = Tensor::zeros({5}, DType::F32);
  try {
    ops::sum_last_dim(x, wrong_shape);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "sum_last_dim: argument 'out' has shape (5); expected (4)");
  }
  Tensor f64_out = Tensor::zeros({4}, DType::F64);
  EXPECT_THROW(ops::sum_last_dim(x, f64_out), Error);
  Tensor empty_rows = Tensor::zeros({4, 0}, DType::F32), out4 = Tensor::zeros({4}, DType::F32);
  EXPECT_THROW(ops::max_last_dim(empty_rows, out4), Error);
  ops::sum_last_dim(empty_rows, out4);  // the empty sum is 0
  EXPECT_EQ(out4.to_vector<float>(), std::vector<float>(4, 0.0f));
}
