// CUDA reductions. Fixed launch shapes and tree orders make every result reproducible
// run to run: no atomics.
//   rows:    one 256-thread block per row, strided over the row, block tree at the end.
//   columns: a block covers 32 columns with 8 row-groups (32x8 threads); each thread sums
//            rows y, y+8, ...; the 8 partial sums are added in a fixed order.
//   total:   kTotalBlocks blocks write partial sums, one 1024-thread block adds them.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/reduce.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kTotalBlocks = 1024;

template <typename T, typename O>
__global__ void rows_kernel(RowReduce kind, const T* x, O* out, int64_t cols) {
  const T* row = x + blockIdx.x * cols;
  float acc = kind == RowReduce::Sum ? 0.0f : -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = load(row[c]);
    acc = kind == RowReduce::Sum ? acc + v : (v > acc || isnan(v) ? v : acc);
  }
  const float r = kind == RowReduce::Sum ? block_sum(acc) : block_max(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = store<O>(r);
}

template <typename T, typename O>
__global__ void columns_kernel(const T* x, O* out, int64_t rows, int64_t cols) {
  __shared__ float partial[8][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.0f;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < rows; r += 8) acc += load(x[r * cols + c]);
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) s += partial[y][threadIdx.x];
    out[c] = store<O>(s);
  }
}

template <typename T>
__global__ void total_partial_kernel(TotalReduce kind, const T* x, float* partial, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load(x[i]);
    acc += kind == TotalReduce::Sum ? v : v * v;
  }
  const float r = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = r;
}

template <typename O>
__global__ void total_final_kernel(const float* partial, O* out, int count) {
  float acc = 0.0f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  const float r = block_sum(acc);
  if (threadIdx.x == 0) out[0] = store<O>(r);
}

// Calls f(T{}, O{}) for input dtype T and output dtype O.
template <typename F>
void dispatch_in_out(const Tensor& x, const Tensor& out, const char* op, F&& f) {
  dispatch_cuda_floating(x.dtype(), op, [&](auto in_tag) {
    if (out.dtype() == DType::F32) {
      f(in_tag, float{});
    } else {
      f(in_tag, in_tag);
    }
  });
}

}  // namespace

void reduce_rows(RowReduce kind, const Tensor& x, Tensor& out, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  cudaStream_t s = prepare(x);
  MC_CHECK(rows <= 0x7fffffff, "reduce_rows: too many rows (", rows, ")");
  dispatch_in_out(x, out, "reduce_rows", [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using O = decltype(out_tag);
    rows_kernel<T, O><<<static_cast<unsigned>(rows), 256, 0, s>>>(kind, x.data<T>(), out.data<O>(), cols);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void sum_columns(const Tensor& x, Tensor& out, int64_t rows, int64_t cols) {
  if (cols == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_in_out(x, out, "sum_columns", [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using O = decltype(out_tag);
    columns_kernel<T, O><<<static_cast<unsigned>((cols + 31) / 32), dim3(32, 8), 0, s>>>(x.data<T>(), out.data<O>(),
                                                                                          rows, cols);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void reduce_total(TotalReduce kind, const Tensor& x, Tensor& out) {
  cudaStream_t s = prepare(x);
  Tensor partial = Tensor::empty({kTotalBlocks}, DType::F32, x.device());
  dispatch_in_out(x, out, "reduce_total", [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using O = decltype(out_tag);
    total_partial_kernel<T><<<kTotalBlocks, 256, 0, s>>>(kind, x.data<T>(), partial.data<float>(), x.numel());
    MC_CUDA_CHECK_LAUNCH();
    total_final_kernel<O><<<1, 1024, 0, s>>>(partial.data<float>(), out.data<O>(), kTotalBlocks);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
