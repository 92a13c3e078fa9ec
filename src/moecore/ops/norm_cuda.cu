// CUDA RMSNorm / LayerNorm (fp32 compute).
//   Rows: one warp per row when H <= kWarpMaxCols (8 warps per block), else one block per row
//   (256 threads, 512 from H > 2048). A row is read again for each pass (it stays in L1/L2).
//   Backward: a fixed number of workers (warps or blocks; a function of the row count only)
//   each loop over rows w, w + W, ... and accumulate dy * xhat (and dy) per column into their
//   own row of a [W, H] f32 buffer; a column kernel then adds the W partials in a fixed order
//   into dweight (dbias). Same inputs, same bits: no atomics.
//   bf16 rows of 264..8192 columns in multiples of 8 take vectorised kernels (below).
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/norm.h"

#include <initializer_list>

namespace moecore::ops::cuda {

namespace {

constexpr int64_t kWarpMaxCols = 256;
constexpr int64_t kWarpsPerBlock = 8;
constexpr int64_t kMaxBackwardBlocks = 512;

template <bool kWarp>
__device__ __forceinline__ float row_sum(float v) {
  if constexpr (kWarp) {
    return warp_sum(v);
  } else {
    return block_sum(v);
  }
}

// Row handled by this warp (kWarp) or block, and the number of such workers in the grid.
template <bool kWarp>
__device__ __forceinline__ int64_t worker_id() {
  return kWarp ? int64_t(blockIdx.x) * blockDim.y + threadIdx.y : int64_t(blockIdx.x);
}
template <bool kWarp>
__device__ __forceinline__ int64_t worker_count() {
  return kWarp ? int64_t(gridDim.x) * blockDim.y : int64_t(gridDim.x);
}

// mean (LayerNorm; 0 without `centered`) and rstd of one row; every lane of the worker gets them.
template <typename T, bool kWarp>
__device__ void row_stats(const T* xr, int64_t cols, bool centered, float eps, float& mu, float& rs) {
  const int lane = threadIdx.x, width = blockDim.x;
  mu = 0.0f;
  if (centered) {
    float s = 0.0f;
    for (int64_t c = lane; c < cols; c += width) s += load(xr[c]);
    mu = row_sum<kWarp>(s) / static_cast<float>(cols);
  }
  float ss = 0.0f;
  for (int64_t c = lane; c < cols; c += width) {
    const float d = load(xr[c]) - mu;
    ss += d * d;
  }
  ss = row_sum<kWarp>(ss);
  rs = 1.0f / sqrtf(ss / static_cast<float>(cols) + eps);
}

template <typename T, bool kWarp>
__global__ void norm_forward_kernel(const T* x, const T* w, const T* b, float eps, T* y, float* mean, float* rstd,
                                    int64_t rows, int64_t cols) {
  const int64_t row = worker_id<kWarp>();
  if (row >= rows) return;  // whole warps only (warp mode); never in block mode
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  float mu, rs;
  row_stats<T, kWarp>(xr, cols, mean != nullptr, eps, mu, rs);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = (load(xr[c]) - mu) * rs * load(w[c]);
    if (b) v += load(b[c]);
    yr[c] = store<T>(v);
  }
  if (threadIdx.x == 0) {
    if (mean) mean[row] = mu;
    rstd[row] = rs;
  }
}

// gw, gb: [workers, cols] partial sums, fully written here (gb null for RMSNorm).
template <typename T, bool kWarp>
__global__ void norm_backward_kernel(const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx,
                                     float* gw, float* gb, int64_t rows, int64_t cols) {
  const int64_t worker = worker_id<kWarp>(), workers = worker_count<kWarp>();
  const int lane = threadIdx.x, width = blockDim.x;
  float* gwr = gw + worker * cols;
  float* gbr = gb ? gb + worker * cols : nullptr;
  for (int64_t c = lane; c < cols; c += width) {
    gwr[c] = 0.0f;
    if (gbr) gbr[c] = 0.0f;
  }
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t row = worker; row < rows; row += workers) {  // uniform over the block / warp
    const int64_t o = row * cols;
    const float mu = mean ? mean[row] : 0.0f, rs = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int64_t c = lane; c < cols; c += width) {
      const float g = load(dy[o + c]) * load(w[c]);
      sum_g += g;
      sum_gx += g * ((load(x[o + c]) - mu) * rs);
    }
    const float mean_g = mean ? row_sum<kWarp>(sum_g) * inv_cols : 0.0f;
    const float mean_gx = row_sum<kWarp>(sum_gx) * inv_cols;
    for (int64_t c = lane; c < cols; c += width) {
      const float d = load(dy[o + c]);
      const float g = d * load(w[c]);
      const float xhat = (load(x[o + c]) - mu) * rs;
      dx[o + c] = store<T>(rs * (g - mean_g - xhat * mean_gx));
      gwr[c] += d * xhat;
      if (gbr) gbr[c] += d;
    }
  }
}

// bf16 rows of H = 8 * V columns, V <= 1024 (H <= 8192): a block of round_up(V, 32) threads per
// row, each thread owning 8 consecutive columns in registers (16-byte loads and stores; the row
// is read once). The backward's worker keeps its 8 columns' dweight (dbias) partial sums in
// registers over its rows and writes them once. Same formulas as the kernels above; the per-row
// sums run over another grouping of the columns, so results differ from them in the last bits.
// (kVec = 8: cuda_common.cuh.)

__device__ __forceinline__ void load8(const bf16* p, bool active, float (&x)[kVec]) {
  if (active) {
    load_bf16x8(p, x);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) x[j] = 0.0f;
  }
}

__global__ void __launch_bounds__(1024) norm_forward_bf16x8_kernel(const bf16* x, const bf16* w, const bf16* b, float eps, bf16* y,
                                           float* mean, float* rstd, int64_t cols) {
  const int64_t row = blockIdx.x;
  const int64_t c = int64_t(threadIdx.x) * kVec;
  const bool active = c < cols;
  float xv[kVec];
  load8(x + row * cols + c, active, xv);
  float mu = 0.0f;
  if (mean) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) s += xv[j];
    mu = block_sum(s) / static_cast<float>(cols);
  }
  float ss = 0.0f;
  if (active) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float d = xv[j] - mu;
      ss += d * d;
    }
  }
  const float rs = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  if (active) {
    float wv[kVec], bv[kVec], out[kVec];
    load8(w + c, true, wv);
    load8(b ? b + c : w + c, b != nullptr, bv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      out[j] = (xv[j] - mu) * rs * wv[j];
      if (b) out[j] += bv[j];
    }
    store_bf16x8(y + row * cols + c, out);
  }
  if (threadIdx.x == 0) {
    if (mean) mean[row] = mu;
    rstd[row] = rs;
  }
}

__global__ void __launch_bounds__(1024) norm_backward_bf16x8_kernel(const bf16* x, const bf16* w, const float* mean, const float* rstd,
                                            const bf16* dy, bf16* dx, float* gw, float* gb, int64_t rows,
                                            int64_t cols) {
  const int64_t worker = blockIdx.x, workers = gridDim.x;
  const int64_t c = int64_t(threadIdx.x) * kVec;
  const bool active = c < cols;
  float wv[kVec], gwv[kVec], gbv[kVec];
  load8(w + c, active, wv);
#pragma unroll
  for (int j = 0; j < kVec; ++j) gwv[j] = gbv[j] = 0.0f;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t row = worker; row < rows; row += workers) {  // uniform over the block
    const int64_t o = row * cols + c;
    const float mu = mean ? mean[row] : 0.0f, rs = rstd[row];
    float dv[kVec], xv[kVec], g[kVec], xhat[kVec];
    load8(dy + o, active, dv);
    load8(x + o, active, xv);
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      g[j] = dv[j] * wv[j];
      xhat[j] = (xv[j] - mu) * rs;
      sum_g += g[j];
      sum_gx += g[j] * xhat[j];
    }
    const float mean_g = mean ? block_sum(sum_g) * inv_cols : 0.0f;
    const float mean_gx = block_sum(sum_gx) * inv_cols;
    if (!active) continue;
    float out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      out[j] = rs * (g[j] - mean_g - xhat[j] * mean_gx);
      gwv[j] += dv[j] * xhat[j];
      gbv[j] += dv[j];
    }
    store_bf16x8(dx + o, out);
  }
  if (!active) return;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    gw[worker * cols + c + j] = gwv[j];
    if (gb) gb[worker * cols + c + j] = gbv[j];
  }
}

// The vectorised kernels apply: bf16 rows of a multiple of 8 columns, more than a warp's rows and
// at most 8192, every tensor 16-byte aligned (a weight may sit anywhere in its flat parameter
// buffer). Their block: one thread per 8 columns, rounded up to whole warps.
bool vector_path(DType dtype, int64_t cols, std::initializer_list<const void*> pointers) {
  if (dtype != DType::BF16 || cols % kVec != 0 || cols <= kWarpMaxCols || cols > 1024 * kVec) return false;
  for (const void* p : pointers)
    if (p && !aligned16(p)) return false;
  return true;
}
unsigned vector_threads(int64_t cols) { return static_cast<unsigned>((cols / kVec + 31) / 32 * 32); }

// out[c] += sum_r partial[r, c], in a fixed order: 8 row groups of a 32x8 block, then the 8 sums.
__global__ void add_columns_kernel(const float* partial, int64_t rows, int64_t cols, float* out) {
  __shared__ float s[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.0f;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < rows; r += 8) acc += partial[r * cols + c];
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) t += s[y][threadIdx.x];
    out[c] += t;
  }
}

int block_threads(int64_t cols) { return cols <= 2048 ? 256 : 512; }

}  // namespace

void norm_forward(const Tensor& x, const Tensor& weight, const Tensor* bias, double eps, Tensor& y, Tensor* mean,
                  Tensor& rstd, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  cudaStream_t s = prepare(x);
  if (vector_path(x.dtype(), cols, {x.data_ptr(), weight.data_ptr(), bias ? bias->data_ptr() : nullptr, y.data_ptr()})) {
    MC_CHECK(rows <= 0x7fffffff, "norm_forward: too many rows (", rows, ")");
    norm_forward_bf16x8_kernel<<<static_cast<unsigned>(rows), vector_threads(cols), 0, s>>>(
        x.data<bf16>(), weight.data<bf16>(), bias ? bias->data<bf16>() : nullptr, static_cast<float>(eps),
        y.data<bf16>(), mean ? mean->data<float>() : nullptr, rstd.data<float>(), cols);
    MC_CUDA_CHECK_LAUNCH();
    return;
  }
  dispatch_cuda_floating(x.dtype(), "norm_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* pb = bias ? bias->data<T>() : nullptr;
    float* pmean = mean ? mean->data<float>() : nullptr;
    if (cols <= kWarpMaxCols) {
      const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
      MC_CHECK(blocks <= 0x7fffffff, "norm_forward: too many rows (", rows, ")");
      norm_forward_kernel<T, true><<<static_cast<unsigned>(blocks), dim3(32, kWarpsPerBlock), 0, s>>>(
          x.data<T>(), weight.data<T>(), pb, static_cast<float>(eps), y.data<T>(), pmean, rstd.data<float>(), rows,
          cols);
    } else {
      MC_CHECK(rows <= 0x7fffffff, "norm_forward: too many rows (", rows, ")");
      norm_forward_kernel<T, false><<<static_cast<unsigned>(rows), block_threads(cols), 0, s>>>(
          x.data<T>(), weight.data<T>(), pb, static_cast<float>(eps), y.data<T>(), pmean, rstd.data<float>(), rows,
          cols);
    }
  });
  MC_CUDA_CHECK_LAUNCH();
}

void norm_backward(const Tensor& x, const Tensor& weight, const Tensor* mean, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx, Tensor& dweight, Tensor* dbias, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  cudaStream_t s = prepare(x);
  const bool warp = cols <= kWarpMaxCols;
  const int64_t per_block = warp ? kWarpsPerBlock : 1;
  const int64_t needed = (rows + per_block - 1) / per_block;
  const int64_t blocks = needed < kMaxBackwardBlocks ? needed : kMaxBackwardBlocks;
  const int64_t workers = blocks * per_block;
  // Freed at return: the caching allocator reuses it only in this stream's order.
  Tensor gw = Tensor::empty({workers, cols}, DType::F32, x.device());
  Tensor gb = dbias ? Tensor::empty({workers, cols}, DType::F32, x.device()) : Tensor();
  float* pgb = dbias ? gb.data<float>() : nullptr;
  const float* pmean = mean ? mean->data<float>() : nullptr;
  if (vector_path(x.dtype(), cols, {x.data_ptr(), weight.data_ptr(), dy.data_ptr(), dx.data_ptr()})) {
    norm_backward_bf16x8_kernel<<<static_cast<unsigned>(blocks), vector_threads(cols), 0, s>>>(
        x.data<bf16>(), weight.data<bf16>(), pmean, rstd.data<float>(), dy.data<bf16>(), dx.data<bf16>(),
        gw.data<float>(), pgb, rows, cols);
  } else {
    dispatch_cuda_floating(x.dtype(), "norm_backward", [&](auto tag) {
      using T = decltype(tag);
      if (warp) {
        norm_backward_kernel<T, true><<<static_cast<unsigned>(blocks), dim3(32, kWarpsPerBlock), 0, s>>>(
            x.data<T>(), weight.data<T>(), pmean, rstd.data<float>(), dy.data<T>(), dx.data<T>(), gw.data<float>(),
            pgb, rows, cols);
      } else {
        norm_backward_kernel<T, false><<<static_cast<unsigned>(blocks), block_threads(cols), 0, s>>>(
            x.data<T>(), weight.data<T>(), pmean, rstd.data<float>(), dy.data<T>(), dx.data<T>(), gw.data<float>(),
            pgb, rows, cols);
      }
    });
  }
  MC_CUDA_CHECK_LAUNCH();
  const unsigned col_blocks = static_cast<unsigned>((cols + 31) / 32);
  add_columns_kernel<<<col_blocks, dim3(32, 8), 0, s>>>(gw.data<float>(), workers, cols, dweight.data<float>());
  MC_CUDA_CHECK_LAUNCH();
  if (dbias) {
    add_columns_kernel<<<col_blocks, dim3(32, 8), 0, s>>>(pgb, workers, cols, dbias->data<float>());
    MC_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moecore::ops::cuda
