// CUDA cross-entropy: one 256-thread block per row (token), fp32 math.
// Forward reads the row once: each thread keeps an online (max, sum of exp(x - max)) pair over
// its strided columns, and the block combines the pairs in a fixed tree, so results are the
// same run to run. Backward reads the row once more and writes the gradient (in place when
// dlogits is logits: each element is read and written by the same thread).
// Out-of-range targets: the block records its row with atomicMin in a device flag (integer,
// so the first bad row is found deterministically); the host reads the flag after the kernel.
// Vocabulary-parallel pieces: the part forward is the forward's kernel writing lse_part and the
// in-part target logit; the backward takes the part's offset; logsumexp_combine and
// combined_loss are one thread per token (the P parts are read in order: deterministic).
#include <cstdint>

#include "moecore/ops/common.h"
#include "moecore/ops/cross_entropy.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

constexpr int kThreads = 256;
// cudaMemsetAsync writes bytes: 0x7F7F7F7F is larger than any row index we launch.
constexpr int kNoBadRow = 0x7F7F7F7F;

struct MaxSum {
  float m;  // running maximum
  float s;  // sum of exp(x - m)
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  // A NaN partial wins outright: fmaxf would drop it against an empty (-inf) partner.
  if (isnan(a.m) || isnan(b.m)) return {NAN, NAN};
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};  // both empty (or all -inf)
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, other);
  }
  return v;
}

// Block-wide combine (blockDim.x a multiple of 32); every thread gets the result.
__device__ MaxSum block_combine(MaxSum v) {
  __shared__ float pm[32], ps[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_combine(v);
  if (lane == 0) {
    pm[warp] = v.m;
    ps[warp] = v.s;
  }
  __syncthreads();
  MaxSum r = lane < warps ? MaxSum{pm[lane], ps[lane]} : MaxSum{-INFINITY, 0.0f};
  return warp_combine(r);
}

template <typename T>
__global__ void cross_entropy_forward_kernel(const T* logits, const int32_t* targets, float* loss, float* lse,
                                             int64_t classes, int* bad_row) {
  const int64_t row = blockIdx.x;
  const T* xr = logits + row * classes;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
    const float x = load(xr[c]);
    // A NaN becomes the running maximum, so the sum turns NaN even as a thread's first value
    // (compared with the empty start's -inf alone it would be skipped).
    if (x > acc.m || isnan(x)) {
      acc.s = acc.s * expf(acc.m - x) + 1.0f;  // rescale to the new maximum (0 * 0 + 1 at the start)
      acc.m = x;
    } else if (acc.m != -INFINITY) {
      acc.s += expf(x - acc.m);
    }
  }
  acc = block_combine(acc);
  if (threadIdx.x == 0) {
    const float log_sum = logf(acc.s);
    lse[row] = acc.m + log_sum;
    const int32_t t = targets[row];
    if (t >= classes) {
      atomicMin(bad_row, static_cast<int>(row));
      loss[row] = NAN;
    } else {
      loss[row] = t < 0 ? 0.0f : (acc.m - load(xr[t])) + log_sum;  // as the CPU: no cancellation
    }
  }
}

// This part's classes are [vocab_start, vocab_start + classes) of vocab_total (the whole
// vocabulary: 0 and classes). Writes lse_part and the target's logit (0 when the target is
// ignored or in another part).
template <typename T>
__global__ void cross_entropy_part_forward_kernel(const T* logits, const int32_t* targets, float* lse_part,
                                                  float* target_logit, int64_t classes, int64_t vocab_start,
                                                  int64_t vocab_total, int* bad_row) {
  const int64_t row = blockIdx.x;
  const T* xr = logits + row * classes;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
    const float x = load(xr[c]);
    if (x > acc.m || isnan(x)) {  // as the forward kernel: a NaN first value is not skipped
      acc.s = acc.s * expf(acc.m - x) + 1.0f;
      acc.m = x;
    } else if (acc.m != -INFINITY) {
      acc.s += expf(x - acc.m);
    }
  }
  acc = block_combine(acc);
  if (threadIdx.x == 0) {
    lse_part[row] = acc.m + logf(acc.s);
    const int32_t t = targets[row];
    const int64_t local = static_cast<int64_t>(t) - vocab_start;
    if (t >= vocab_total) {
      atomicMin(bad_row, static_cast<int>(row));
      target_logit[row] = NAN;
    } else {
      target_logit[row] = t >= 0 && local >= 0 && local < classes ? load(xr[local]) : 0.0f;
    }
  }
}

// No __restrict__: dlogits may be logits.
template <typename T>
__global__ void cross_entropy_backward_kernel(const T* logits, const int32_t* targets, const float* lse,
                                              const float* dloss, T* dlogits, int64_t classes, int64_t vocab_start,
                                              int64_t vocab_total, int* bad_row) {
  const int64_t row = blockIdx.x;
  const int64_t o = row * classes;
  const int32_t t = targets[row];
  if (t >= vocab_total && threadIdx.x == 0) atomicMin(bad_row, static_cast<int>(row));
  if (t < 0 || t >= vocab_total) {
    for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) dlogits[o + c] = store<T>(0.0f);
    return;
  }
  const int64_t local = static_cast<int64_t>(t) - vocab_start;  // outside [0, classes): another part's
  const float l = lse[row], g = dloss[row];
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
    const float p = expf(load(logits[o + c]) - l);
    dlogits[o + c] = store<T>(g * (c == local ? p - 1.0f : p));
  }
}

// Forward and backward in one block per row (bf16, V a multiple of 8, 16-byte aligned rows).
// Pass 1 reads the row in 16-byte loads into an online (max, sum) per thread, combined over the
// block in the same fixed tree as the forward kernel; pass 2 reads the row again (from L2: the
// block read it just before) and writes the gradient, 8 columns per store. Memory traffic: one
// read and one write per element, against two reads and one write for the two kernels.
constexpr int kFusedThreads = 512;

// No __restrict__: dlogits may be logits.
__global__ void __launch_bounds__(kFusedThreads) cross_entropy_fused_bf16_kernel(
    const bf16* logits, const int32_t* targets, const float* dloss, float* loss, float* lse, bf16* dlogits,
    int64_t classes, int* bad_row) {
  const int64_t row = blockIdx.x;
  const bf16* xr = logits + row * classes;
  bf16* dr = dlogits + row * classes;
  const int64_t vectors = classes / 8;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float x[8];
    load_bf16x8(xr + c * 8, x);
    // The vector's maximum, NaN if any lane is NaN (fmaxf would skip it, and next to -inf lanes
    // alone the sum below would never see it); a NaN maximum becomes the running one, so the
    // sum turns NaN.
    float m = x[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) m = x[i] > m || isnan(x[i]) ? x[i] : m;
    if (m > acc.m || isnan(m)) {  // rescale to the new maximum (0 * 0 at the start)
      acc.s *= __expf(acc.m - m);
      acc.m = m;
    }
    if (acc.m != -INFINITY) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc.s += __expf(x[i] - acc.m);  // NaN and +inf end as NaN
    }
  }
  const int32_t t = targets[row];
  // The target's logit, read before the barrier in block_combine: after it, pass 2 may already
  // have overwritten it with its gradient (in place).
  const float target_logit =
      threadIdx.x == 0 && t >= 0 && t < classes ? bf16_bits_to_float(logits[row * classes + t].bits) : 0.0f;
  acc = block_combine(acc);
  const float log_sum = logf(acc.s), l = acc.m + log_sum;
  if (threadIdx.x == 0) {
    lse[row] = l;
    if (t >= classes) {
      atomicMin(bad_row, static_cast<int>(row));
      loss[row] = NAN;
    } else {
      loss[row] = t < 0 ? 0.0f : (acc.m - target_logit) + log_sum;
    }
  }
  const bool ignored = t < 0 || t >= classes;
  const float g = dloss[row];
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float x[8];
    load_bf16x8(xr + c * 8, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float p = __expf(x[i] - l);
      x[i] = ignored ? 0.0f : g * (c * 8 + i == t ? p - 1.0f : p);
    }
    store_bf16x8(dr + c * 8, x);
  }
}

__global__ void logsumexp_combine_kernel(const float* parts, float* lse, int64_t num_parts, int64_t rows) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    float m = -INFINITY;
    bool nan = false;  // fmaxf skips NaNs: a NaN part must still make the row NaN
    for (int64_t p = 0; p < num_parts; ++p) {
      const float v = parts[p * rows + r];
      nan = nan || isnan(v);
      m = fmaxf(m, v);
    }
    if (nan) {
      lse[r] = NAN;
      continue;
    }
    if (isinf(m)) {  // every part empty (-inf), or an infinite part: the max is the answer
      lse[r] = m;
      continue;
    }
    float sum = 0.0f;
    for (int64_t p = 0; p < num_parts; ++p) sum += expf(parts[p * rows + r] - m);
    lse[r] = m + logf(sum);
  }
}

__global__ void combined_loss_kernel(const float* lse, const float* target_logit, const int32_t* targets,
                                     float* loss, int64_t rows) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x)
    loss[r] = targets[r] >= 0 ? lse[r] - target_logit[r] : 0.0f;
}

// A one-element device flag for the first bad row, reset on the op's stream.
Tensor make_flag(const Tensor& like, cudaStream_t s) {
  Tensor flag = Tensor::empty({1}, DType::I32, like.device());
  MC_CUDA_CHECK(cudaMemsetAsync(flag.data_ptr(), 0x7F, sizeof(int), s));
  return flag;
}

// Reads the flag (a copy to pageable memory on the current stream: waits for the kernel).
int64_t read_flag(const Tensor& flag) {
  if (TargetsValidated::active()) return -1;  // the caller checked the targets on the host
  const int32_t v = flag.to_vector<int32_t>()[0];
  return v == kNoBadRow ? -1 : v;
}

}  // namespace

int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse, int64_t rows,
                              int64_t classes) {
  if (rows == 0) return -1;
  MC_CHECK(rows < kNoBadRow, "cross_entropy_forward: too many rows (", rows, ") for one launch");
  cudaStream_t s = prepare(logits);
  Tensor flag = make_flag(logits, s);
  dispatch_cuda_floating(logits.dtype(), "cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_forward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
        logits.data<T>(), targets.data<int32_t>(), loss.data<float>(), lse.data<float>(), classes,
        flag.data<int32_t>());
  });
  MC_CUDA_CHECK_LAUNCH();
  return read_flag(flag);
}

int64_t cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                               Tensor& dlogits, int64_t rows, int64_t classes, int64_t vocab_start,
                               int64_t vocab_total) {
  if (rows == 0) return -1;
  MC_CHECK(rows < kNoBadRow, "cross_entropy_backward: too many rows (", rows, ") for one launch");
  cudaStream_t s = prepare(logits);
  Tensor flag = make_flag(logits, s);
  dispatch_cuda_floating(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_backward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
        logits.data<T>(), targets.data<int32_t>(), lse.data<float>(), dloss.data<float>(), dlogits.data<T>(),
        classes, vocab_start, vocab_total, flag.data<int32_t>());
  });
  MC_CUDA_CHECK_LAUNCH();
  return read_flag(flag);
}

int64_t cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, const Tensor& dloss, Tensor& loss,
                                       Tensor& lse, Tensor& dlogits, int64_t rows, int64_t classes) {
  const bool aligned = aligned16(logits.data_ptr()) && aligned16(dlogits.data_ptr());
  if (logits.dtype() != DType::BF16 || classes % 8 != 0 || !aligned) {  // the two kernels
    const int64_t bad = cross_entropy_forward(logits, targets, loss, lse, rows, classes);
    if (bad >= 0) return bad;
    return cross_entropy_backward(logits, targets, lse, dloss, dlogits, rows, classes, 0, classes);
  }
  if (rows == 0) return -1;
  MC_CHECK(rows < kNoBadRow, "cross_entropy_forward_backward: too many rows (", rows, ") for one launch");
  cudaStream_t s = prepare(logits);
  Tensor flag = make_flag(logits, s);
  cross_entropy_fused_bf16_kernel<<<static_cast<unsigned>(rows), kFusedThreads, 0, s>>>(
      logits.data<bf16>(), targets.data<int32_t>(), dloss.data<float>(), loss.data<float>(), lse.data<float>(),
      dlogits.data<bf16>(), classes, flag.data<int32_t>());
  MC_CUDA_CHECK_LAUNCH();
  return read_flag(flag);
}

int64_t cross_entropy_part_forward(const Tensor& logits, const Tensor& targets, Tensor& lse_part,
                                   Tensor& target_logit, int64_t rows, int64_t classes, int64_t vocab_start,
                                   int64_t vocab_total) {
  if (rows == 0) return -1;
  MC_CHECK(rows < kNoBadRow, "cross_entropy_part_forward: too many rows (", rows, ") for one launch");
  cudaStream_t s = prepare(logits);
  Tensor flag = make_flag(logits, s);
  dispatch_cuda_floating(logits.dtype(), "cross_entropy_part_forward", [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_part_forward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
        logits.data<T>(), targets.data<int32_t>(), lse_part.data<float>(), target_logit.data<float>(), classes,
        vocab_start, vocab_total, flag.data<int32_t>());
  });
  MC_CUDA_CHECK_LAUNCH();
  return read_flag(flag);
}

void logsumexp_combine(const Tensor& parts, Tensor& lse, int64_t num_parts, int64_t rows) {
  if (rows == 0) return;
  cudaStream_t s = prepare(parts);
  logsumexp_combine_kernel<<<grid_for(rows), kThreads, 0, s>>>(parts.data<float>(), lse.data<float>(), num_parts,
                                                                rows);
  MC_CUDA_CHECK_LAUNCH();
}

void cross_entropy_combined_loss(const Tensor& lse, const Tensor& target_logit, const Tensor& targets, Tensor& loss,
                                 int64_t rows) {
  if (rows == 0) return;
  cudaStream_t s = prepare(lse);
  combined_loss_kernel<<<grid_for(rows), kThreads, 0, s>>>(lse.data<float>(), target_logit.data<float>(),
                                                            targets.data<int32_t>(), loss.data<float>(), rows);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
