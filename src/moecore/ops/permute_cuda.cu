// CUDA MoE dispatch. Deterministic: no atomics on values; every sum runs over j in order.
//
// make_moe_routing (n = T * k assignments, E experts):
//   count_kernel     one block per expert counts its kept assignments (block sum of flags);
//                    block 0 also records the first out-of-range index (integer atomicMin in
//                    shared memory) in status[E].
//   position_kernel  one block per expert scans the assignments in token order, 512 at a time;
//                    a block-wide exclusive prefix sum (warp ballots) numbers its kept ones, so
//                    row = expert base + running count + prefix. Base: sum of earlier counts, or
//                    e * C when padded.
//   then the one device->host copy of status ([E] counts + the index check): it synchronises.
// capacity_mask: count_kernel (all assignments), then compact_kernel lists each expert's
//   assignments in token order (the same scan). Position keeps slot < C directly; Probs sorts
//   each expert's list by probability, descending, with CUB's segmented radix sort (stable, so
//   ties keep token order; -0.0 equals +0.0) and keeps the first C of each segment. The index
//   check costs one 4-byte device->host copy (a synchronisation).
// Row ops: one block per token. permute_forward copies x[t] to its rows in 16-byte vectors when
// the row size and pointers allow; the others accumulate in fp32 over j; unpermute_backward
// reduces dprobs[t, j] with a block sum.
#include <climits>
#include <vector>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/permute.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kScanThreads = 512;
constexpr int kRowThreads = 256;

__global__ void count_kernel(const int32_t* idx, const uint8_t* kept, int64_t n, int num_experts, int32_t* status) {
  __shared__ int first_bad;
  const int e = blockIdx.x;
  if (threadIdx.x == 0) first_bad = INT_MAX;
  __syncthreads();
  int count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int v = idx[i];
    if (v == e && (kept == nullptr || kept[i])) ++count;
    if (e == 0 && (v < 0 || v >= num_experts)) atomicMin(&first_bad, static_cast<int>(i));
  }
  count = block_sum(count);  // synchronises the block, so first_bad is final below
  if (threadIdx.x == 0) {
    status[e] = count;
    if (e == 0) status[num_experts] = first_bad;
  }
}

__global__ void position_kernel(const int32_t* idx, const uint8_t* kept, int64_t n, const int32_t* counts,
                                int64_t capacity, int32_t* row_map) {
  __shared__ int warp_total[kScanThreads / 32];
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Base row of expert e.
  int64_t base;
  if (capacity > 0) {
    base = static_cast<int64_t>(e) * capacity;
  } else {
    int partial = 0;
    for (int i = threadIdx.x; i < e; i += blockDim.x) partial += counts[i];
    base = block_sum(partial);
  }
  int64_t running = 0;
  for (int64_t start = 0; start < n; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int v = i < n ? idx[i] : -1;
    const bool mine = v == e;
    const bool keep = mine && (kept == nullptr || kept[i]);
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      before += w < warp ? warp_total[w] : 0;
      total += warp_total[w];
    }
    const int64_t slot = running + before + __popc(ballot & ((1u << lane) - 1u));
    if (mine) {
      // Over capacity (padded): no row; the host reports the error after the count copy.
      const bool fits = keep && (capacity == 0 || slot < capacity);
      row_map[i] = fits ? static_cast<int32_t>(base + slot) : -1;
    } else if (e == 0 && i < n && (v < 0 || v >= static_cast<int>(gridDim.x))) {
      row_map[i] = -1;  // out of range: reported by the host; keep the map defined
    }
    running += total;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
}

// For capacity_mask: numbers expert e's assignments in token order like position_kernel.
// Position: kept = slot < C. Probs: writes (prob, flat index) at base + slot for the sort, and the
// segment offsets (offsets[e] = base; the last block also writes offsets[E]).
__global__ void compact_kernel(const int32_t* idx, const float* probs, int64_t n, const int32_t* counts,
                               bool by_position, int64_t capacity, uint8_t* kept, float* keys, int32_t* values,
                               int32_t* offsets) {
  __shared__ int warp_total[kScanThreads / 32];
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int partial = 0;
  for (int i = threadIdx.x; i < e; i += blockDim.x) partial += counts[i];
  const int64_t base = block_sum(partial);
  if (threadIdx.x == 0 && !by_position) {
    offsets[e] = static_cast<int32_t>(base);
    if (e == static_cast<int>(gridDim.x) - 1) offsets[e + 1] = static_cast<int32_t>(base + counts[e]);
  }
  int64_t running = 0;
  for (int64_t start = 0; start < n; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const bool mine = i < n && idx[i] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      before += w < warp ? warp_total[w] : 0;
      total += warp_total[w];
    }
    const int64_t slot = running + before + __popc(ballot & ((1u << lane) - 1u));
    if (mine) {
      if (by_position) {
        kept[i] = slot < capacity ? 1 : 0;
      } else {
        keys[base + slot] = probs[i];
        values[base + slot] = static_cast<int32_t>(i);
      }
    }
    running += total;
    __syncthreads();
  }
}

// Probs policy after the sort: the first C entries of each expert's segment are kept.
__global__ void mark_kernel(const int32_t* sorted_values, const int32_t* offsets, int64_t capacity, uint8_t* kept) {
  const int e = blockIdx.x;
  const int begin = offsets[e], end = offsets[e + 1];
  for (int s = begin + threadIdx.x; s < end; s += blockDim.x) kept[sorted_values[s]] = (s - begin) < capacity ? 1 : 0;
}

__global__ void fill_kernel(int32_t* p, int64_t n, int32_t v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

// out[row] = x[t] for each kept (t, j), in units V (uint4 = 16 bytes, or the element type).
template <typename V>
__global__ void permute_copy_kernel(const V* x, const int32_t* row_map, V* out, int k, int64_t units) {
  const int64_t t = blockIdx.x;
  const V* src = x + t * units;
  for (int j = 0; j < k; ++j) {
    const int32_t row = row_map[t * k + j];
    if (row < 0) continue;
    V* dst = out + static_cast<int64_t>(row) * units;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = src[u];
  }
}

template <typename T>
__global__ void permute_backward_kernel(const T* dout, const int32_t* row_map, T* dx, int k, int64_t H) {
  const int64_t t = blockIdx.x;
  const int32_t* rm = row_map + t * k;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t row = rm[j];
      if (row >= 0) acc += load(dout[static_cast<int64_t>(row) * H + h]);
    }
    dx[t * H + h] = store<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_forward_kernel(const T* y, const float* probs, const int32_t* row_map, T* out, int k,
                                         int64_t H) {
  const int64_t t = blockIdx.x;
  const int32_t* rm = row_map + t * k;
  const float* p = probs + t * k;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t row = rm[j];
      if (row >= 0) acc += p[j] * load(y[static_cast<int64_t>(row) * H + h]);
    }
    out[t * H + h] = store<T>(acc);
  }
}

template <typename T>
__global__ void unpermute_backward_kernel(const T* y, const float* probs, const int32_t* row_map, const T* dout,
                                          T* dy, float* dprobs, int k, int64_t H) {
  const int64_t t = blockIdx.x;
  const T* d = dout + t * H;
  for (int j = 0; j < k; ++j) {
    const int32_t row = row_map[t * k + j];  // the same for the whole block: block_sum is uniform
    if (row < 0) {
      if (threadIdx.x == 0) dprobs[t * k + j] = 0.0f;
      continue;
    }
    const float p = probs[t * k + j];
    const T* yr = y + static_cast<int64_t>(row) * H;
    T* dyr = dy + static_cast<int64_t>(row) * H;
    float dot = 0.0f;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const float dv = load(d[h]);
      dot += dv * load(yr[h]);
      dyr[h] = store<T>(p * dv);
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) dprobs[t * k + j] = dot;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

void capacity_mask(const Tensor& indices, const Tensor& probs, int64_t num_experts, int64_t capacity,
                   DropPolicy policy, Tensor& kept) {
  const int64_t n = indices.numel(), E = num_experts;
  if (n == 0) return;
  cudaStream_t s = prepare(indices);
  const Device dev = indices.device();
  const int32_t* idx = indices.data<int32_t>();
  Tensor status = Tensor::empty({E + 1}, DType::I32, dev);
  count_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, s>>>(idx, nullptr, n, static_cast<int>(E),
                                                                  status.data<int32_t>());
  MC_CUDA_CHECK_LAUNCH();
  // The index check: 4 bytes to the host (synchronises).
  const int32_t first_bad = status.slice(0, E, E + 1).to_vector<int32_t>()[0];
  if (first_bad != INT_MAX) {
    const int32_t value = indices.view({-1}).slice(0, first_bad, first_bad + 1).to_vector<int32_t>()[0];
    detail::fail_bad_expert_index("capacity_mask", first_bad / indices.size(1), first_bad % indices.size(1), value, E);
  }
  const bool by_position = policy == DropPolicy::Position;
  if (by_position) {
    compact_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, s>>>(idx, nullptr, n, status.data<int32_t>(), true,
                                                                    capacity, kept.data<uint8_t>(), nullptr, nullptr,
                                                                    nullptr);
    MC_CUDA_CHECK_LAUNCH();
    return;
  }
  Tensor keys = Tensor::empty({n}, DType::F32, dev), values = Tensor::empty({n}, DType::I32, dev);
  Tensor sorted_keys = Tensor::empty({n}, DType::F32, dev), sorted_values = Tensor::empty({n}, DType::I32, dev);
  Tensor offsets = Tensor::empty({E + 1}, DType::I32, dev);
  compact_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, s>>>(
      idx, probs.data<float>(), n, status.data<int32_t>(), false, capacity, nullptr, keys.data<float>(),
      values.data<int32_t>(), offsets.data<int32_t>());
  MC_CUDA_CHECK_LAUNCH();
  const int32_t* off = offsets.data<int32_t>();
  size_t temp_bytes = 0;
  MC_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, temp_bytes, keys.data<float>(), sorted_keys.data<float>(), values.data<int32_t>(),
      sorted_values.data<int32_t>(), static_cast<int>(n), static_cast<int>(E), off, off + 1, 0, 32, s));
  Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes) + 1}, DType::U8, dev);
  MC_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      temp.data_ptr(), temp_bytes, keys.data<float>(), sorted_keys.data<float>(), values.data<int32_t>(),
      sorted_values.data<int32_t>(), static_cast<int>(n), static_cast<int>(E), off, off + 1, 0, 32, s));
  mark_kernel<<<static_cast<unsigned>(E), 256, 0, s>>>(sorted_values.data<int32_t>(), off, capacity,
                                                       kept.data<uint8_t>());
  MC_CUDA_CHECK_LAUNCH();
}

void make_moe_routing(const Tensor& indices, const Tensor& kept, MoeRouting& r) {
  cudaStream_t s = prepare(indices);
  const Device dev = indices.device();
  const int64_t n = indices.numel(), E = r.num_experts, C = r.capacity;
  const int32_t* idx = indices.data<int32_t>();
  const uint8_t* kp = kept.defined() ? kept.data<uint8_t>() : nullptr;
  Tensor status = Tensor::empty({E + 1}, DType::I32, dev);
  r.row_map = Tensor::empty({r.num_tokens, r.topk}, DType::I32, dev);
  const unsigned blocks = static_cast<unsigned>(E);
  count_kernel<<<blocks, kScanThreads, 0, s>>>(idx, kp, n, static_cast<int>(E), status.data<int32_t>());
  MC_CUDA_CHECK_LAUNCH();
  position_kernel<<<blocks, kScanThreads, 0, s>>>(idx, kp, n, status.data<int32_t>(), C, r.row_map.data<int32_t>());
  MC_CUDA_CHECK_LAUNCH();
  // The one synchronisation: the counts (GEMM sizes) and the index check come to the host.
  const std::vector<int32_t> host = status.to_vector<int32_t>();
  if (host[static_cast<size_t>(E)] != INT_MAX) {
    const int64_t pos = host[static_cast<size_t>(E)];
    const int32_t value = indices.view({-1}).slice(0, pos, pos + 1).to_vector<int32_t>()[0];
    detail::fail_bad_expert_index("make_moe_routing", pos / r.topk, pos % r.topk, value, E);
  }
  r.host_tokens_per_expert.assign(static_cast<size_t>(E), 0);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = host[static_cast<size_t>(e)];
    if (C > 0 && c > C) detail::fail_over_capacity(e, c, C);
    r.host_tokens_per_expert[static_cast<size_t>(e)] = C > 0 ? C : c;
    total += c;
  }
  r.num_rows = C > 0 ? E * C : total;
  if (C > 0) {
    r.tokens_per_expert = Tensor::empty({E}, DType::I32, dev);
    fill_kernel<<<grid_for(E), 256, 0, s>>>(r.tokens_per_expert.data<int32_t>(), E, static_cast<int32_t>(C));
    MC_CUDA_CHECK_LAUNCH();
  } else {
    r.tokens_per_expert = status.slice(0, 0, E);
  }
}

void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out) {
  cudaStream_t s = prepare(x);
  if (r.capacity > 0 && out.nbytes() > 0) MC_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), s));
  const int64_t T = r.num_tokens, H = x.size(1);
  if (T == 0 || H == 0) return;
  const int k = static_cast<int>(r.topk);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(x.dtype());
  const int32_t* rm = r.row_map.data<int32_t>();
  if (row_bytes % 16 == 0 && aligned16(x.data_ptr()) && aligned16(out.data_ptr())) {
    permute_copy_kernel<uint4><<<static_cast<unsigned>(T), kRowThreads, 0, s>>>(
        static_cast<const uint4*>(x.data_ptr()), rm, static_cast<uint4*>(out.data_ptr()), k,
        static_cast<int64_t>(row_bytes / 16));
  } else {
    dispatch_cuda_floating(x.dtype(), "moe_permute_forward", [&](auto tag) {
      using T_ = decltype(tag);
      permute_copy_kernel<T_><<<static_cast<unsigned>(T), kRowThreads, 0, s>>>(x.data<T_>(), rm, out.data<T_>(), k, H);
    });
  }
  MC_CUDA_CHECK_LAUNCH();
}

void moe_permute_backward(const Tensor& dout, const MoeRouting& r, Tensor& dx) {
  cudaStream_t s = prepare(dout);
  const int64_t T = r.num_tokens, H = dout.size(1);
  if (T == 0 || H == 0) return;
  dispatch_cuda_floating(dout.dtype(), "moe_permute_backward", [&](auto tag) {
    using T_ = decltype(tag);
    permute_backward_kernel<T_><<<static_cast<unsigned>(T), kRowThreads, 0, s>>>(
        dout.data<T_>(), r.row_map.data<int32_t>(), dx.data<T_>(), static_cast<int>(r.topk), H);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_forward(const Tensor& y, const Tensor& probs, const MoeRouting& r, Tensor& out) {
  cudaStream_t s = prepare(y);
  const int64_t T = r.num_tokens, H = y.size(1);
  if (T == 0 || H == 0) return;
  dispatch_cuda_floating(y.dtype(), "moe_unpermute_forward", [&](auto tag) {
    using T_ = decltype(tag);
    unpermute_forward_kernel<T_><<<static_cast<unsigned>(T), kRowThreads, 0, s>>>(
        y.data<T_>(), probs.data<float>(), r.row_map.data<int32_t>(), out.data<T_>(), static_cast<int>(r.topk), H);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_backward(const Tensor& y, const Tensor& probs, const MoeRouting& r, const Tensor& dout,
                            Tensor& dy, Tensor& dprobs) {
  cudaStream_t s = prepare(y);
  if (r.capacity > 0 && dy.nbytes() > 0) MC_CUDA_CHECK(cudaMemsetAsync(dy.data_ptr(), 0, dy.nbytes(), s));
  const int64_t T = r.num_tokens, H = y.size(1);
  if (T == 0) return;
  dispatch_cuda_floating(y.dtype(), "moe_unpermute_backward", [&](auto tag) {
    using T_ = decltype(tag);
    unpermute_backward_kernel<T_><<<static_cast<unsigned>(T), kRowThreads, 0, s>>>(
        y.data<T_>(), probs.data<float>(), r.row_map.data<int32_t>(), dout.data<T_>(), dy.data<T_>(),
        dprobs.data<float>(), static_cast<int>(r.topk), H);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
