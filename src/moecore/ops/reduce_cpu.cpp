#include <cmath>
#include <limits>
#include <vector>

#include "moecore/ops/common.h"
#include "moecore/ops/reduce.h"

namespace moecore::ops::cpu {

namespace {
// Writes a double result into out[i] in out's dtype.
void put(const Tensor& out, int64_t i, double v) {
  dispatch_floating(out.dtype(), "reduce", [&](auto tag) {
    using T = decltype(tag);
    out.data<T>()[i] = store<T>(static_cast<Compute<T>>(v));
  });
}
}  // namespace

void reduce_rows(RowReduce kind, const Tensor& x, Tensor& out, int64_t rows, int64_t cols) {
  dispatch_floating(x.dtype(), "reduce_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
    std::vector<double> result(static_cast<size_t>(rows));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = p + r * cols;
      double acc = kind == RowReduce::Sum ? 0.0 : -std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < cols; ++c) {
        const double v = static_cast<double>(load(row[c]));
        acc = kind == RowReduce::Sum ? acc + v : (v > acc || std::isnan(v) ? v : acc);
      }
      result[static_cast<size_t>(r)] = acc;
    }
    for (int64_t r = 0; r < rows; ++r) put(out, r, result[static_cast<size_t>(r)]);
  });
}

void sum_columns(const Tensor& x, Tensor& out, int64_t rows, int64_t cols) {
  dispatch_floating(x.dtype(), "sum_columns", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
    std::vector<double> acc(static_cast<size_t>(cols), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) acc[static_cast<size_t>(c)] += static_cast<double>(load(p[r * cols + c]));
    for (int64_t c = 0; c < cols; ++c) put(out, c, acc[static_cast<size_t>(c)]);
  });
}

void reduce_total(TotalReduce kind, const Tensor& x, Tensor& out) {
  dispatch_floating(x.dtype(), "reduce_total", [&](auto tag) {
    using T = decltype(tag);
    const T* p = x.data<T>();
    const int64_t n = x.numel();
    double acc = 0.0;
#pragma omp parallel for reduction(+ : acc) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(load(p[i]));
      acc += kind == TotalReduce::Sum ? v : v * v;
    }
    put(out, 0, acc);
  });
}

}  // namespace moecore::ops::cpu
