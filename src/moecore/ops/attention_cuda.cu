// CUDA causal GQA attention: tiled flash-attention kernels in plain CUDA C++ (fp32 FMA, no
// tensor cores), templated on the head dim D (32, 64, 128; with Dv = D). Other head dims, and a
// value head dim Dv != D, run the runtime-sized kernels of attention_any_cuda.cu.
//
// Tiles are 64 queries x 64 keys; a block has 8 warps and each warp owns 8 rows of the tile
// (query rows in the forward and dQ kernels, key rows in the dK/dV kernel). For a row, lane
// l computes the scores of columns l and l + 32 and accumulates output dims l + 32 i
// (i < D / 32); the probabilities reach every lane through warp shuffles. Tiles are stored in
// shared memory as fp32; a tile that lanes read by column (one row per lane) is padded to
// D + 1 floats a row so that the 32 lanes hit 32 different banks.
//
// Keys may outnumber queries (Sk >= Sq, attention.h): with o = Sk - Sq, query qi sees keys
// ki <= qi + o, so "the diagonal" below is the key tile holding the tile's last query + o
// (for Sk == Sq every loop bound and mask is the one of plain causal attention).
//
//   forward  grid (query tiles, Hq, B): Q tile resident; loop over key tiles 0..diagonal
//            with online softmax (running max m, running sum l, rescaled accumulators).
//   backward 1. Dr = rowsum(dO * O), one warp per row.
//            2. dQ  grid (query tiles, Hq, B): loop over key tiles 0..diagonal.
//            3. dK, dV grid (key tiles, Hkv, B): loop over the group's query heads and the
//               query tiles from the one holding the key tile's first key - o on. Each block
//               owns the rows it writes: no atomics, deterministic results.
//
// This file also holds the dispatcher (cuda::attention_forward / attention_backward): the
// flash path of attention_flash_cuda.cu where it applies, else the GEMM path of
// attention_gemm_cuda.cu, else these kernels; the environment variable
// MOECORE_ATTENTION=auto|tiled|gemm|flash overrides the choice (see attention.h).
#include <cstdlib>
#include <string>
#include <type_traits>

#include "moecore/ops/attention.h"
#include "moecore/core/env_switches.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

constexpr int kTile = 64;                           // queries or keys per tile
constexpr int kThreads = 256;                       // 8 warps
constexpr int kRows = kTile / (kThreads / 32);      // rows of the tile per warp
constexpr unsigned kFull = 0xffffffffu;

struct Geometry {
  int S, Hq, Hkv, group;  // S: queries Sq
  float scale;
  int Sk, off;            // keys Sk >= S and off = Sk - S: query qi sees keys ki <= qi + off
};

// The last key tile that the query tile starting at q0 sees.
__device__ __forceinline__ int last_key_tile(const Geometry& g, int q0) {
  return min(q0 + kTile - 1 + g.off, g.Sk - 1) / kTile;
}

// Copies rows [row0, row0 + kTile) of a [S, stride] matrix (only the D columns starting at
// `src`) into dst[kTile][ld] as fp32, with zeros past row S.
template <typename T, int D>
__device__ void load_tile(float* dst, int ld, const T* src, int64_t stride, int row0, int S) {
  for (int i = threadIdx.x; i < kTile * D; i += kThreads) {
    const int r = i / D, c = i % D;
    dst[r * ld + c] = row0 + r < S ? load(src[static_cast<int64_t>(row0 + r) * stride + c]) : 0.0f;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(const T* q, const T* k, const T* v, T* out,
                                                                     float* lse, Geometry g) {
  constexpr int P = D / 32;  // output dims per lane
  extern __shared__ float smem[];
  float* sq = smem;                  // [kTile][D]      read by row (broadcast)
  float* sk = sq + kTile * D;        // [kTile][D + 1]  read by column
  float* sv = sk + kTile * (D + 1);  // [kTile][D]      read by row

  const int tile = gridDim.x - 1 - blockIdx.x;  // the longest (last) tiles start first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kRows;
  const int q0 = tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * D, kv_stride = static_cast<int64_t>(g.Hkv) * D;
  const T* qb = q + (static_cast<int64_t>(b) * g.S * g.Hq + h) * D;
  const T* kb = k + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;
  const T* vb = v + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;

  load_tile<T, D>(sq, D, qb, q_stride, q0, g.S);
  float o[kRows][P], m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) o[r][i] = 0.0f;
  }

  const int kt_end = last_key_tile(g, q0);
  for (int kt = 0; kt <= kt_end; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous K/V tiles are no longer read
    load_tile<T, D>(sk, D + 1, kb, kv_stride, k0, g.Sk);
    load_tile<T, D>(sv, D, vb, kv_stride, k0, g.Sk);
    __syncthreads();

    // s[r][j]: score of query row r0 + r with key column lane + 32 j.
    float s[kRows][2];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < D; ++c) {
      const float ka = sk[lane * (D + 1) + c], kb2 = sk[(lane + 32) * (D + 1) + c];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float qv = sq[(r0 + r) * D + c];
        s[r][0] += qv * ka;
        s[r][1] += qv * kb2;
      }
    }
    // Online softmax. Key 0 is visible to every row, so m is finite after the first tile and
    // exp(-inf - m) = 0 masks; corr = exp(-inf) = 0 on the first tile.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int qi = q0 + r0 + r;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ki = k0 + lane + 32 * j;
        s[r][j] = (ki <= qi + g.off && ki < g.Sk) ? s[r][j] * g.scale : -INFINITY;
      }
      const float m_new = fmaxf(m[r], warp_max(fmaxf(s[r][0], s[r][1])));
      const float corr = expf(m[r] - m_new);
      s[r][0] = expf(s[r][0] - m_new);
      s[r][1] = expf(s[r][1] - m_new);
      l[r] = l[r] * corr + warp_sum(s[r][0] + s[r][1]);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < P; ++i) o[r][i] *= corr;
    }
    // o += P V
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll 4
      for (int jj = 0; jj < 32; ++jj) {
        const int j = half * 32 + jj;
        float vv[P];
#pragma unroll
        for (int i = 0; i < P; ++i) vv[i] = sv[j * D + lane + 32 * i];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float p = __shfl_sync(kFull, s[r][half], jj);
#pragma unroll
          for (int i = 0; i < P; ++i) o[r][i] += p * vv[i];
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = q0 + r0 + r;
    if (qi >= g.S) continue;
    const float inv = 1.0f / l[r];
    T* orow = out + (static_cast<int64_t>(b) * g.S * g.Hq + h) * D + static_cast<int64_t>(qi) * q_stride;
#pragma unroll
    for (int i = 0; i < P; ++i) orow[lane + 32 * i] = store<T>(o[r][i] * inv);
    if (lane == 0) lse[(static_cast<int64_t>(b) * g.Hq + h) * g.S + qi] = m[r] + logf(l[r]);
  }
}

// Dr[b, h, s] = dO . O, one warp per row of the [B, S, Hq] row order of out.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_dr_kernel(const T* out, const T* dout, float* dr, int64_t rows,
                                                                Geometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc += load(dout[row * D + lane + 32 * i]) * load(out[row * D + lane + 32 * i]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = row % g.Hq, bs = row / g.Hq, s = bs % g.S, b = bs / g.S;
    dr[(b * g.Hq + h) * g.S + s] = acc;
  }
}

// dQ for one (b, h, query tile): dQ_s = scale sum_t dS[s, t] K_t over key tiles up to the diagonal.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_dq_kernel(const T* q, const T* k, const T* v, const T* dout,
                                                                const float* lse, const float* dr, T* dq, Geometry g) {
  constexpr int P = D / 32;
  extern __shared__ float smem[];
  float* sq = smem;                   // [kTile][D]      by row
  float* sdo = sq + kTile * D;        // [kTile][D]      by row
  float* sk = sdo + kTile * D;        // [kTile][D + 1]  by column (scores) and by row (dQ)
  float* sv = sk + kTile * (D + 1);   // [kTile][D + 1]  by column

  const int tile = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kRows;
  const int q0 = tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * D, kv_stride = static_cast<int64_t>(g.Hkv) * D;
  const int64_t q_base = (static_cast<int64_t>(b) * g.S * g.Hq + h) * D;
  const T* kb = k + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;
  const T* vb = v + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;
  const int64_t row_base = (static_cast<int64_t>(b) * g.Hq + h) * g.S;

  load_tile<T, D>(sq, D, q + q_base, q_stride, q0, g.S);
  load_tile<T, D>(sdo, D, dout + q_base, q_stride, q0, g.S);
  float acc[kRows][P], row_lse[kRows], row_dr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = q0 + r0 + r;
    row_lse[r] = qi < g.S ? lse[row_base + qi] : 0.0f;
    row_dr[r] = qi < g.S ? dr[row_base + qi] : 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) acc[r][i] = 0.0f;
  }

  const int kt_end = last_key_tile(g, q0);
  for (int kt = 0; kt <= kt_end; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();
    load_tile<T, D>(sk, D + 1, kb, kv_stride, k0, g.Sk);
    load_tile<T, D>(sv, D + 1, vb, kv_stride, k0, g.Sk);
    __syncthreads();

    float s[kRows][2], dp[kRows][2];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = dp[r][0] = dp[r][1] = 0.0f;
#pragma unroll 4
    for (int c = 0; c < D; ++c) {
      const float ka = sk[lane * (D + 1) + c], kb2 = sk[(lane + 32) * (D + 1) + c];
      const float va = sv[lane * (D + 1) + c], vb2 = sv[(lane + 32) * (D + 1) + c];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float qv = sq[(r0 + r) * D + c], dov = sdo[(r0 + r) * D + c];
        s[r][0] += qv * ka;
        s[r][1] += qv * kb2;
        dp[r][0] += dov * va;
        dp[r][1] += dov * vb2;
      }
    }
    // s becomes dS = P (dP - Dr), with P = 0 above the (shifted) diagonal and past Sk.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int qi = q0 + r0 + r;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ki = k0 + lane + 32 * j;
        const float p = (ki <= qi + g.off && ki < g.Sk) ? expf(s[r][j] * g.scale - row_lse[r]) : 0.0f;
        s[r][j] = p * (dp[r][j] - row_dr[r]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll 4
      for (int jj = 0; jj < 32; ++jj) {
        const int j = half * 32 + jj;
        float kv[P];
#pragma unroll
        for (int i = 0; i < P; ++i) kv[i] = sk[j * (D + 1) + lane + 32 * i];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float ds = __shfl_sync(kFull, s[r][half], jj);
#pragma unroll
          for (int i = 0; i < P; ++i) acc[r][i] += ds * kv[i];
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = q0 + r0 + r;
    if (qi >= g.S) continue;
    T* row = dq + q_base + static_cast<int64_t>(qi) * q_stride;
#pragma unroll
    for (int i = 0; i < P; ++i) row[lane + 32 * i] = store<T>(acc[r][i] * g.scale);
  }
}

// dK, dV for one (b, kv head, key tile): sums over the group's query heads and the query
// tiles from the first that sees the tile (the one holding k0 - off) to the end.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_dkv_kernel(const T* q, const T* k, const T* v, const T* dout,
                                                                 const float* lse, const float* dr, T* dk, T* dv,
                                                                 int num_q_tiles, Geometry g) {
  constexpr int P = D / 32;
  extern __shared__ float smem[];
  float* sk = smem;                    // [kTile][D]      by row (broadcast)
  float* sv = sk + kTile * D;          // [kTile][D]      by row
  float* sq = sv + kTile * D;          // [kTile][D + 1]  by column (scores) and by row (dK)
  float* sdo = sq + kTile * (D + 1);   // [kTile][D + 1]  by column (dP) and by row (dV)
  float* slse = sdo + kTile * (D + 1);  // [kTile]
  float* sdr = slse + kTile;            // [kTile]

  const int tile = blockIdx.x;  // the first key tiles see the most queries: start them first
  const int hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kRows;
  const int k0 = tile * kTile;
  const int qt_begin = max(0, k0 - g.off) / kTile;  // k0 - off < S: every key is seen by a query
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * D, kv_stride = static_cast<int64_t>(g.Hkv) * D;
  const int64_t kv_base = (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;

  load_tile<T, D>(sk, D, k + kv_base, kv_stride, k0, g.Sk);
  load_tile<T, D>(sv, D, v + kv_base, kv_stride, k0, g.Sk);
  float acc_k[kRows][P], acc_v[kRows][P];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < P; ++i) acc_k[r][i] = acc_v[r][i] = 0.0f;

  for (int h = hk * g.group; h < (hk + 1) * g.group; ++h) {
    const int64_t q_base = (static_cast<int64_t>(b) * g.S * g.Hq + h) * D;
    const int64_t row_base = (static_cast<int64_t>(b) * g.Hq + h) * g.S;
    for (int qt = qt_begin; qt < num_q_tiles; ++qt) {
      const int q0 = qt * kTile;
      __syncthreads();
      load_tile<T, D>(sq, D + 1, q + q_base, q_stride, q0, g.S);
      load_tile<T, D>(sdo, D + 1, dout + q_base, q_stride, q0, g.S);
      if (threadIdx.x < kTile) {
        const int qi = q0 + threadIdx.x;
        slse[threadIdx.x] = qi < g.S ? lse[row_base + qi] : 0.0f;
        sdr[threadIdx.x] = qi < g.S ? dr[row_base + qi] : 0.0f;
      }
      __syncthreads();

      // s[r][j], dp[r][j]: key row r0 + r against query column lane + 32 j.
      float s[kRows][2], dp[kRows][2];
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = dp[r][0] = dp[r][1] = 0.0f;
#pragma unroll 4
      for (int c = 0; c < D; ++c) {
        const float qa = sq[lane * (D + 1) + c], qb2 = sq[(lane + 32) * (D + 1) + c];
        const float da = sdo[lane * (D + 1) + c], db = sdo[(lane + 32) * (D + 1) + c];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float kv = sk[(r0 + r) * D + c], vv = sv[(r0 + r) * D + c];
          s[r][0] += kv * qa;
          s[r][1] += kv * qb2;
          dp[r][0] += vv * da;
          dp[r][1] += vv * db;
        }
      }
      // s becomes P, dp becomes dS; zero where the key is past the query's last (qi + off) or
      // the query past S.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = lane + 32 * j, qi = q0 + col;
        const float col_lse = slse[col], col_dr = sdr[col];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int ki = k0 + r0 + r;
          const float p = (qi + g.off >= ki && qi < g.S) ? expf(s[r][j] * g.scale - col_lse) : 0.0f;
          s[r][j] = p;
          dp[r][j] = p * (dp[r][j] - col_dr);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll 2
        for (int jj = 0; jj < 32; ++jj) {
          const int j = half * 32 + jj;
          float qv[P], dov[P];
#pragma unroll
          for (int i = 0; i < P; ++i) {
            qv[i] = sq[j * (D + 1) + lane + 32 * i];
            dov[i] = sdo[j * (D + 1) + lane + 32 * i];
          }
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float p = __shfl_sync(kFull, s[r][half], jj);
            const float ds = __shfl_sync(kFull, dp[r][half], jj);
#pragma unroll
            for (int i = 0; i < P; ++i) {
              acc_v[r][i] += p * dov[i];
              acc_k[r][i] += ds * qv[i];
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int ki = k0 + r0 + r;
    if (ki >= g.Sk) continue;
    const int64_t off = kv_base + static_cast<int64_t>(ki) * kv_stride;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      dk[off + lane + 32 * i] = store<T>(acc_k[r][i] * g.scale);
      dv[off + lane + 32 * i] = store<T>(acc_v[r][i]);
    }
  }
}

// Launches `kernel` with `smem` bytes of dynamic shared memory (above 48 KB needs opting in).
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, Args... args) {
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  MC_CUDA_CHECK_LAUNCH();
}

// Calls f(T{}, std::integral_constant<int, D>{}) for the dtypes and head dims of these kernels.
template <typename F>
void dispatch(DType dtype, int64_t head_dim, const char* op, F&& f) {
  auto with_d = [&](auto tag) {
    switch (head_dim) {
      case 32: f(tag, std::integral_constant<int, 32>{}); return;
      case 64: f(tag, std::integral_constant<int, 64>{}); return;
      case 128: f(tag, std::integral_constant<int, 128>{}); return;
      default: MC_FAIL(op, ": no templated tiled kernel for head dim D = ", head_dim, " (32, 64, 128; the others run attention_any_cuda.cu)");
    }
  };
  switch (dtype) {
    case DType::F32: with_d(float{}); return;
    case DType::BF16: with_d(bf16{}); return;
    default: MC_FAIL(op, ": dtype ", dtype_name(dtype), " is not supported on CUDA (f32, bf16)");
  }
}

Geometry geometry(const AttentionDims& d, double scale) {
  MC_CHECK(d.keys() < (int64_t(1) << 30) && d.q_heads <= 65535 && d.batch <= 65535, "attention: sizes ", d.batch,
           " x ", d.seq, " (keys ", d.keys(), ") x ", d.q_heads, " exceed the CUDA kernels' grid limits");
  return {static_cast<int>(d.seq), static_cast<int>(d.q_heads), static_cast<int>(d.kv_heads),
          static_cast<int>(d.group()), static_cast<float>(scale), static_cast<int>(d.keys()),
          static_cast<int>(d.offset())};
}

unsigned num_tiles(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

// D = Dv in {32, 64, 128}: the kernels of this file; every other size runs attention_any_cuda.cu's.
bool templated_head_dim(const AttentionDims& d) {
  return d.value_dim() == d.head_dim && (d.head_dim == 32 || d.head_dim == 64 || d.head_dim == 128);
}

}  // namespace

void attention_forward_tiled(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                             Tensor& lse, const AttentionDims& d) {
  if (!templated_head_dim(d)) {
    attention_forward_tiled_any(q, k, v, scale, out, lse, d);
    return;
  }
  const Geometry g = geometry(d, scale);
  cudaStream_t stream = prepare(q);
  dispatch(q.dtype(), d.head_dim, "attention_forward", [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const size_t smem = sizeof(float) * kTile * (2 * D + (D + 1));
    launch(attention_forward_kernel<T, D>, dim3(num_tiles(d.seq), d.q_heads, d.batch), smem, stream, q.data<T>(),
           k.data<T>(), v.data<T>(), out.data<T>(), lse.data<float>(), g);
  });
}

void attention_backward_tiled(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv,
                              const AttentionDims& d) {
  if (!templated_head_dim(d)) {
    attention_backward_tiled_any(q, k, v, out, lse, dout, scale, dq, dk, dv, d);
    return;
  }
  const Geometry g = geometry(d, scale);
  cudaStream_t stream = prepare(q);
  Tensor dr = Tensor::empty({d.batch, d.q_heads, d.seq}, DType::F32, q.device());
  dispatch(q.dtype(), d.head_dim, "attention_backward", [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const int64_t rows = d.batch * d.seq * d.q_heads;
    const unsigned dr_blocks = static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32));
    launch(attention_dr_kernel<T, D>, dim3(dr_blocks), 0, stream, out.data<T>(), dout.data<T>(), dr.data<float>(),
           rows, g);
    const size_t smem = sizeof(float) * (2 * kTile * D + 2 * kTile * (D + 1));
    launch(attention_dq_kernel<T, D>, dim3(num_tiles(d.seq), d.q_heads, d.batch), smem, stream, q.data<T>(),
           k.data<T>(), v.data<T>(), dout.data<T>(), lse.data<float>(), dr.data<float>(), dq.data<T>(), g);
    launch(attention_dkv_kernel<T, D>, dim3(num_tiles(d.keys()), d.kv_heads, d.batch),
           smem + sizeof(float) * 2 * kTile, stream, q.data<T>(), k.data<T>(), v.data<T>(), dout.data<T>(),
           lse.data<float>(), dr.data<float>(), dk.data<T>(), dv.data<T>(), static_cast<int>(num_tiles(d.seq)), g);
  });
}

AttentionPath attention_path(const AttentionDims& d, DType dtype, double scale) {
  const char* env = env_switch("MOECORE_ATTENTION");
  const std::string choice = env ? env : "";
  if (choice.empty() || choice == "auto") {
    // flash where supported (bf16, head dims (D, Dv) in attention.h's list): it keeps no score
    // matrix and is the fastest path (docs/performance.md); then gemm (Dv = D), then tiled (any
    // D and Dv).
    if (attention_flash_supported(d, dtype, scale)) return AttentionPath::Flash;
    return attention_gemm_supported(d, dtype) ? AttentionPath::Gemm : AttentionPath::Tiled;
  }
  if (choice == "tiled") return AttentionPath::Tiled;
  if (choice == "gemm") {
    MC_CHECK(attention_gemm_supported(d, dtype), "attention: MOECORE_ATTENTION=gemm but the GEMM path does not "
             "support Sq = ", d.seq, ", Sk = ", d.keys(), ", D = ", d.head_dim, ", Dv = ", d.value_dim(), ", dtype ",
             dtype_name(dtype), " (Sk <= ", kAttentionGemmMaxSeq, ", D a multiple of 8, Dv = D, f32 or bf16)");
    return AttentionPath::Gemm;
  }
  if (choice == "flash") {
    MC_CHECK(attention_flash_supported(d, dtype, scale), "attention: MOECORE_ATTENTION=flash but the flash path "
             "does not support dtype ", dtype_name(dtype), ", (D, Dv) = (", d.head_dim, ", ", d.value_dim(),
             "), softmax scale ", scale, " (bf16 with (D, Dv) = (64, 64), (96, 96), (128, 128), (256, 256) or "
             "(192, 128), scale > 0)");
    return AttentionPath::Flash;
  }
  MC_FAIL("attention: MOECORE_ATTENTION must be auto, tiled, gemm or flash; got '", choice, "'");
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                       const AttentionDims& d) {
  switch (attention_path(d, q.dtype(), scale)) {
    case AttentionPath::Flash: attention_forward_flash(q, k, v, scale, out, lse, d); return;
    case AttentionPath::Gemm: attention_forward_gemm(q, k, v, scale, out, lse, d); return;
    case AttentionPath::Tiled: attention_forward_tiled(q, k, v, scale, out, lse, d); return;
  }
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d) {
  switch (attention_path(d, q.dtype(), scale)) {
    case AttentionPath::Flash: attention_backward_flash(q, k, v, out, lse, dout, scale, dq, dk, dv, d); return;
    case AttentionPath::Gemm: attention_backward_gemm(q, k, v, out, lse, dout, scale, dq, dk, dv, d); return;
    case AttentionPath::Tiled: attention_backward_tiled(q, k, v, out, lse, dout, scale, dq, dk, dv, d); return;
  }
}

}  // namespace moecore::ops::cuda
