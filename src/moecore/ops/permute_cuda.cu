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
#include <type_traits>
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

// ---- 16-byte vector row kernels (the fast path of the row ops) ----
// One block per token; thread i handles packs i, i + blockDim, ... of the row (a pack: 16 bytes,
// 8 bf16 or 4 f32). Sums over j run in ascending j per element, as in the scalar kernels; the
// k source rows of a pack are loaded a group of L at a time so their loads overlap (L = 2, 4 or 8
// after k: a small k keeps the registers, and so the occupancy, of a small group).
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
  T v[N];
};

// out[t] = sum_j w_j * src[row_map[t, j]] (w_j = probs[t, j], or 1 without probs).
template <typename T, int kLoadAhead>
__global__ void gather_sum_vec_kernel(const T* src, const float* probs, const int32_t* row_map, T* out, int k,
                                      int64_t packs) {
  using P = Pack<T>;
  const int64_t t = blockIdx.x;
  const int32_t* rm = row_map + t * k;
  const float* pr = probs ? probs + t * k : nullptr;
  const P* s = reinterpret_cast<const P*>(src);
  P* o = reinterpret_cast<P*>(out) + t * packs;
  for (int64_t u = threadIdx.x; u < packs; u += blockDim.x) {
    float acc[P::N];
#pragma unroll
    for (int e = 0; e < P::N; ++e) acc[e] = 0.0f;
    for (int j0 = 0; j0 < k; j0 += kLoadAhead) {
      P v[kLoadAhead];
      int32_t row[kLoadAhead];
#pragma unroll
      for (int a = 0; a < kLoadAhead; ++a) {
        row[a] = j0 + a < k ? rm[j0 + a] : -1;
        if (row[a] >= 0) v[a] = s[static_cast<int64_t>(row[a]) * packs + u];
      }
#pragma unroll
      for (int a = 0; a < kLoadAhead; ++a) {
        if (row[a] < 0) continue;
        const float w = pr ? pr[j0 + a] : 1.0f;
#pragma unroll
        for (int e = 0; e < P::N; ++e) acc[e] += pr ? w * load(v[a].v[e]) : load(v[a].v[e]);
      }
    }
    P r;
#pragma unroll
    for (int e = 0; e < P::N; ++e) r.v[e] = store<T>(acc[e]);
    o[u] = r;
  }
}

// unpermute_backward: dy[row_map[t, j]] = probs[t, j] * dout[t]; dprobs[t, j] = <dout[t], y[row]>.
// Each warp reduces its lanes' partial dot products per j with shuffles; lane 0 adds them to its
// warp's slot part[warp * k + j] (dynamic shared memory); after the loop thread j sums the warps'
// slots in warp order. Every order is fixed by the launch shape: deterministic.
template <typename T, int kLoadAhead>
__global__ void unpermute_backward_vec_kernel(const T* y, const float* probs, const int32_t* row_map, const T* dout,
                                              T* dy, float* dprobs, int k, int64_t packs) {
  using P = Pack<T>;
  extern __shared__ float part[];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int32_t* rm = row_map + t * k;
  const float* pr = probs + t * k;
  const P* ys = reinterpret_cast<const P*>(y);
  P* dys = reinterpret_cast<P*>(dy);
  const P* d = reinterpret_cast<const P*>(dout) + t * packs;
  if (lane == 0)
    for (int j = 0; j < k; ++j) part[warp * k + j] = 0.0f;
  for (int64_t base = 0; base < packs; base += blockDim.x) {
    const int64_t u = base + threadIdx.x;
    const bool active = u < packs;  // inactive lanes still join the shuffles
    float dv[P::N];
    if (active) {
      const P dp = d[u];
#pragma unroll
      for (int e = 0; e < P::N; ++e) dv[e] = load(dp.v[e]);
    }
    for (int j0 = 0; j0 < k; j0 += kLoadAhead) {
      // The group's rows are uniform over the block; their loads are issued before any use.
      int32_t row[kLoadAhead];
      P yv[kLoadAhead];
#pragma unroll
      for (int a = 0; a < kLoadAhead; ++a) {
        row[a] = j0 + a < k ? rm[j0 + a] : -1;
        if (active && row[a] >= 0) yv[a] = ys[static_cast<int64_t>(row[a]) * packs + u];
      }
#pragma unroll
      for (int a = 0; a < kLoadAhead; ++a) {
        if (row[a] < 0) continue;
        float dot = 0.0f;
        if (active) {
          const float p = pr[j0 + a];
          P g;
#pragma unroll
          for (int e = 0; e < P::N; ++e) {
            dot += dv[e] * load(yv[a].v[e]);
            g.v[e] = store<T>(p * dv[e]);
          }
          dys[static_cast<int64_t>(row[a]) * packs + u] = g;
        }
        dot = warp_sum(dot);
        if (lane == 0) part[warp * k + j0 + a] += dot;
      }
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < warps; ++w) sum += part[w * k + j];
    dprobs[t * k + j] = rm[j] < 0 ? 0.0f : sum;
  }
}

// ---- make_moe_routing by token chunks (E <= kChunkMaxExperts) ----
// The assignments are cut into chunks of kChunk in token order.
//   chunk_hist_kernel   block c: kept assignments per expert in chunk c -> cc[c, e] (shared-memory
//                       integer histogram: exact whatever the order), first bad index -> bad[c].
//   chunk_scan_kernel   one block: thread e turns column e of cc into the row where chunk c's
//                       first assignment of expert e goes (expert base + earlier chunks), writes
//                       status[e] = kept count and status[E] = first bad index (INT_MAX if none).
//   chunk_place_kernel  block c walks its chunk blockDim at a time, warp by warp in order: a
//                       warp numbers its lanes per expert (__match_any_sync, lanes below), adds
//                       the expert's running row, then advances the running rows for the next
//                       warp. Rows therefore follow token order inside each expert, as before.
constexpr int kChunk = 1024;
constexpr int kChunkThreads = 256;
constexpr int64_t kChunkMaxExperts = 4096;  // 32 KiB of int64 bases in chunk_scan_kernel

__global__ void chunk_hist_kernel(const int32_t* idx, const uint8_t* kept, int64_t n, int E, int32_t* cc,
                                  int32_t* bad) {
  extern __shared__ int hist[];
  __shared__ int first_bad;
  const int64_t c = blockIdx.x, begin = c * kChunk, end = min(n, begin + kChunk);
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  if (threadIdx.x == 0) first_bad = INT_MAX;
  __syncthreads();
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int v = idx[i];
    if (v < 0 || v >= E) {
      atomicMin(&first_bad, static_cast<int>(i));
    } else if (kept == nullptr || kept[i]) {
      atomicAdd(&hist[v], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) cc[c * E + e] = hist[e];
  if (threadIdx.x == 0) bad[c] = first_bad;
}

__global__ void chunk_scan_kernel(int32_t* cc, const int32_t* bad, int64_t chunks, int E, int64_t capacity,
                                  int32_t* status, int32_t* offsets) {
  extern __shared__ int64_t base[];  // [E]: first row of each expert
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t total = 0;
    for (int64_t c = 0; c < chunks; ++c) total += cc[c * E + e];
    status[e] = static_cast<int32_t>(total);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t at = 0;
    for (int e = 0; e < E; ++e) {
      base[e] = capacity > 0 ? static_cast<int64_t>(e) * capacity : at;
      offsets[e] = static_cast<int32_t>(base[e]);
      at += status[e];
    }
    offsets[E] = static_cast<int32_t>(capacity > 0 ? static_cast<int64_t>(E) * capacity : at);
    int first = INT_MAX;
    for (int64_t c = 0; c < chunks; ++c) first = min(first, bad[c]);
    status[E] = first;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    // With capacity, the slot (not the row) is kept: the placement compares it with C.
    int64_t running = capacity > 0 ? 0 : base[e];
    for (int64_t c = 0; c < chunks; ++c) {
      const int v = cc[c * E + e];
      cc[c * E + e] = static_cast<int32_t>(running);
      running += v;
    }
  }
}

__global__ void chunk_place_kernel(const int32_t* idx, const uint8_t* kept, int64_t n, int E, const int32_t* cc,
                                   int64_t capacity, int32_t* row_map) {
  extern __shared__ int next[];  // [E]: next row (slot when padded) of each expert in this chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t c = blockIdx.x, begin = c * kChunk, end = min(n, begin + kChunk);
  for (int e = threadIdx.x; e < E; e += blockDim.x) next[e] = cc[c * E + e];
  __syncthreads();
  for (int64_t start = begin; start < end; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int v = i < end ? idx[i] : -1;
    const bool keep = i < end && v >= 0 && v < E && (kept == nullptr || kept[i]);
    const unsigned peers = __match_any_sync(0xffffffffu, keep ? v : -1);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    for (int w = 0; w < warps; ++w) {
      if (w == warp) {
        if (keep) {
          const int64_t slot = next[v] + rank;
          const bool fits = capacity == 0 || slot < capacity;
          row_map[i] = fits ? static_cast<int32_t>(capacity > 0 ? v * capacity + slot : slot) : -1;
        } else if (i < end) {
          row_map[i] = -1;
        }
        __syncwarp();
        if (keep && rank == 0) next[v] += __popc(peers);
      }
      __syncthreads();
    }
  }
}

// Threads per block for a row of `packs` packs: one pack per thread up to 512, whole warps.
unsigned vec_threads(int64_t packs) {
  const int64_t w = (packs + 31) / 32 * 32;
  return static_cast<unsigned>(w < 32 ? 32 : (w > 512 ? 512 : w));
}

// Calls f(std::integral_constant<int, L>{}) with the load-ahead group for k.
template <typename F>
void with_load_ahead(int k, F&& f) {
  if (k <= 2) f(std::integral_constant<int, 2>{});
  else if (k <= 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

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

// offsets [E + 1] from the counts in status (the path without chunks; one thread: E is small
// next to the kernels around it).
__global__ void row_offsets_kernel(const int32_t* status, int E, int64_t capacity, int32_t* offsets) {
  int64_t at = 0;
  for (int e = 0; e < E; ++e) {
    offsets[e] = static_cast<int32_t>(capacity > 0 ? static_cast<int64_t>(e) * capacity : at);
    at += status[e];
  }
  offsets[E] = static_cast<int32_t>(capacity > 0 ? static_cast<int64_t>(E) * capacity : at);
}

void make_moe_routing(const Tensor& indices, const Tensor& kept, MoeRouting& r, bool copy_counts) {
  cudaStream_t s = prepare(indices);
  const Device dev = indices.device();
  const int64_t n = indices.numel(), E = r.num_experts, C = r.capacity;
  const int32_t* idx = indices.data<int32_t>();
  const uint8_t* kp = kept.defined() ? kept.data<uint8_t>() : nullptr;
  Tensor status = Tensor::empty({E + 1}, DType::I32, dev);
  r.row_map = Tensor::empty({r.num_tokens, r.topk}, DType::I32, dev);
  r.row_offsets = Tensor::empty({E + 1}, DType::I32, dev);
  const unsigned blocks = static_cast<unsigned>(E);
  if (E <= kChunkMaxExperts && n > 0 && n < INT_MAX) {
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    Tensor cc = Tensor::empty({chunks, E}, DType::I32, dev), bad = Tensor::empty({chunks}, DType::I32, dev);
    const size_t hist_bytes = sizeof(int) * static_cast<size_t>(E);
    chunk_hist_kernel<<<static_cast<unsigned>(chunks), kChunkThreads, hist_bytes, s>>>(
        idx, kp, n, static_cast<int>(E), cc.data<int32_t>(), bad.data<int32_t>());
    MC_CUDA_CHECK_LAUNCH();
    chunk_scan_kernel<<<1, 1024, sizeof(int64_t) * static_cast<size_t>(E), s>>>(
        cc.data<int32_t>(), bad.data<int32_t>(), chunks, static_cast<int>(E), C, status.data<int32_t>(),
        r.row_offsets.data<int32_t>());
    MC_CUDA_CHECK_LAUNCH();
    chunk_place_kernel<<<static_cast<unsigned>(chunks), kChunkThreads, hist_bytes, s>>>(
        idx, kp, n, static_cast<int>(E), cc.data<int32_t>(), C, r.row_map.data<int32_t>());
    MC_CUDA_CHECK_LAUNCH();
  } else {
    count_kernel<<<blocks, kScanThreads, 0, s>>>(idx, kp, n, static_cast<int>(E), status.data<int32_t>());
    MC_CUDA_CHECK_LAUNCH();
    position_kernel<<<blocks, kScanThreads, 0, s>>>(idx, kp, n, status.data<int32_t>(), C,
                                                    r.row_map.data<int32_t>());
    MC_CUDA_CHECK_LAUNCH();
    row_offsets_kernel<<<1, 1, 0, s>>>(status.data<int32_t>(), static_cast<int>(E), C, r.row_offsets.data<int32_t>());
    MC_CUDA_CHECK_LAUNCH();
  }
  r.kept_per_expert = status.slice(0, 0, E);
  if (!copy_counts) {
    // No host copy: the row count follows from the shapes (dropless: every assignment has a row;
    // padded: E*C); the checks are deferred to the status word (check_moe_routing, or the flags
    // of accumulate_routing_counts).
    r.num_rows = C > 0 ? E * C : n;
    r.status = status;
    if (C > 0) {
      r.tokens_per_expert = Tensor::empty({E}, DType::I32, dev);
      fill_kernel<<<grid_for(E), 256, 0, s>>>(r.tokens_per_expert.data<int32_t>(), E, static_cast<int32_t>(C));
      MC_CUDA_CHECK_LAUNCH();
    } else {
      r.tokens_per_expert = r.kept_per_expert;
    }
    return;
  }
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

// Rows of one f32 element under a one-assignment plan (the alltoall and ETP sort plans moving the
// [rows, 1] probabilities and their gradient): the copy is permute_probs', a thread per row, where
// the row kernels would spend a block on each element.
namespace {
bool single_f32_elements(const Tensor& t, const MoeRouting& r) {
  return r.topk == 1 && t.size(1) == 1 && t.dtype() == DType::F32;
}
}  // namespace

void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out) {
  if (single_f32_elements(x, r)) return cuda::moe_permute_probs_forward(x, r, out);
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
  if (single_f32_elements(dout, r)) return cuda::moe_permute_probs_backward(dout, r, dx);  // dx [T, 1] = [T, k]
  cudaStream_t s = prepare(dout);
  const int64_t T = r.num_tokens, H = dout.size(1);
  if (T == 0 || H == 0) return;
  dispatch_cuda_floating(dout.dtype(), "moe_permute_backward", [&](auto tag) {
    using T_ = decltype(tag);
    if (H % Pack<T_>::N == 0 && aligned16(dout.data_ptr()) && aligned16(dx.data_ptr())) {
      const int64_t packs = H / Pack<T_>::N;
      with_load_ahead(static_cast<int>(r.topk), [&](auto la) {
        gather_sum_vec_kernel<T_, decltype(la)::value><<<static_cast<unsigned>(T), vec_threads(packs), 0, s>>>(
            dout.data<T_>(), nullptr, r.row_map.data<int32_t>(), dx.data<T_>(), static_cast<int>(r.topk), packs);
      });
      return;
    }
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
    if (H % Pack<T_>::N == 0 && aligned16(y.data_ptr()) && aligned16(out.data_ptr())) {
      const int64_t packs = H / Pack<T_>::N;
      with_load_ahead(static_cast<int>(r.topk), [&](auto la) {
        gather_sum_vec_kernel<T_, decltype(la)::value><<<static_cast<unsigned>(T), vec_threads(packs), 0, s>>>(
            y.data<T_>(), probs.data<float>(), r.row_map.data<int32_t>(), out.data<T_>(), static_cast<int>(r.topk),
            packs);
      });
      return;
    }
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
    const int k = static_cast<int>(r.topk);
    if (H > 0 && H % Pack<T_>::N == 0 && aligned16(y.data_ptr()) && aligned16(dout.data_ptr()) &&
        aligned16(dy.data_ptr()) && k <= 512) {
      const int64_t packs = H / Pack<T_>::N;
      const unsigned threads = vec_threads(packs);
      const size_t shared = sizeof(float) * (threads / 32) * static_cast<size_t>(k);
      with_load_ahead(k, [&](auto la) {
        unpermute_backward_vec_kernel<T_, decltype(la)::value><<<static_cast<unsigned>(T), threads, shared, s>>>(
            y.data<T_>(), probs.data<float>(), r.row_map.data<int32_t>(), dout.data<T_>(), dy.data<T_>(),
            dprobs.data<float>(), k, packs);
      });
      return;
    }
    unpermute_backward_kernel<T_><<<static_cast<unsigned>(T), kRowThreads, 0, s>>>(
        y.data<T_>(), probs.data<float>(), r.row_map.data<int32_t>(), dout.data<T_>(), dy.data<T_>(),
        dprobs.data<float>(), static_cast<int>(r.topk), H);
  });
  MC_CUDA_CHECK_LAUNCH();
}

namespace {
// One thread per assignment i = t * k + j (row_map is [T, k] row-major).
__global__ void permute_probs_forward_kernel(const float* probs, const int32_t* row_map, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t row = row_map[i];
    if (row >= 0) out[row] = probs[i];
  }
}

__global__ void permute_probs_backward_kernel(const float* dout, const int32_t* row_map, float* dprobs, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t row = row_map[i];
    dprobs[i] = row >= 0 ? dout[row] : 0.0f;
  }
}
}  // namespace

void moe_permute_probs_forward(const Tensor& probs, const MoeRouting& r, Tensor& out) {
  cudaStream_t s = prepare(probs);
  if (r.capacity > 0 && out.nbytes() > 0) MC_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), s));
  const int64_t n = r.num_tokens * r.topk;
  if (n == 0) return;
  permute_probs_forward_kernel<<<grid_for(n), 256, 0, s>>>(probs.data<float>(), r.row_map.data<int32_t>(),
                                                           out.data<float>(), n);
  MC_CUDA_CHECK_LAUNCH();
}

void moe_permute_probs_backward(const Tensor& dout, const MoeRouting& r, Tensor& dprobs) {
  cudaStream_t s = prepare(dout);
  const int64_t n = r.num_tokens * r.topk;
  if (n == 0) return;
  permute_probs_backward_kernel<<<grid_for(n), 256, 0, s>>>(dout.data<float>(), r.row_map.data<int32_t>(),
                                                            dprobs.data<float>(), n);
  MC_CUDA_CHECK_LAUNCH();
}

namespace {
// One block: acc[e] += counts[e]; acc[E] += 1 if status[E] names a bad id; acc[E + 1] += 1 if a
// padded expert went over capacity (status: the plan's deferred-check word, or null).
__global__ void accumulate_routing_counts_kernel(const int32_t* counts, const int32_t* status, int E,
                                                 int64_t capacity, int64_t* acc) {
  __shared__ int over;
  if (threadIdx.x == 0) over = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    acc[e] += counts[e];
    if (status != nullptr && capacity > 0 && status[e] > capacity) over = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (status != nullptr && status[E] != INT_MAX) acc[E] += 1;
    if (over) acc[E + 1] += 1;
  }
}
}  // namespace

void accumulate_routing_counts(const MoeRouting& r, Tensor& acc) {
  cudaStream_t s = prepare(acc);
  const int E = static_cast<int>(r.num_experts);
  const int32_t* status = r.status.defined() ? r.status.data<int32_t>() : nullptr;
  accumulate_routing_counts_kernel<<<1, 256, 0, s>>>(r.kept_per_expert.data<int32_t>(), status, E, r.capacity,
                                                     acc.data<int64_t>());
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
