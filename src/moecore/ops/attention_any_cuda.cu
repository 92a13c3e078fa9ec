// CUDA causal GQA attention for any head dims: the tiled path's kernels where D and Dv are
// runtime values (any D >= 1, any Dv >= 1, Dv may differ from D), f32 or bf16, fp32 FMA on CUDA
// cores. attention_cuda.cu keeps its faster D-templated kernels for D = Dv in {32, 64, 128} and
// sends every other size here; semantics as in attention.h.
//
// The layout follows attention_cuda.cu: tiles of 64 queries x 64 keys, 8 warps, each warp owns 8
// rows of the tile and lane l the columns l and l + 32 of a score tile. What differs is that no
// tile holds a whole head dim:
//   - a score block (Q K^T, dO V^T, or the transposed K Q^T, V dO^T) sums over the contracted
//     dim in chunks of 32 columns, each staged in shared memory (the row operand [64][32] read
//     by broadcast, the column operand [64][33] padded against bank conflicts);
//   - a block writes 128 output columns (4 per lane): the grid's z dimension is B x the number
//     of 128-column chunks of the output (Dv for out, D for dQ, max(D, Dv) for dK and dV), and
//     each block recomputes the scores it needs (identical arithmetic in every chunk, so the
//     softmax statistics agree between chunks).
//   forward  grid (query tiles, Hq, B * ceil(Dv / 128)): online softmax over key tiles
//            0..diagonal, o += P V[:, chunk]; the chunk-0 block writes lse.
//   backward Dr = rowsum(dO * O) (one warp per row), then dQ (grid (query tiles, Hq,
//            B * ceil(D / 128))) and dK/dV (grid (key tiles, Hkv, B * ceil(max(D, Dv) / 128)),
//            over the group's query heads and the query tiles that see the key tile). Each
//            block owns the elements it writes: no atomics, deterministic.
#include <algorithm>

#include "moecore/ops/attention.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

constexpr int kTile = 64;                       // queries or keys per tile
constexpr int kThreads = 256;                   // 8 warps
constexpr int kRows = kTile / (kThreads / 32);  // rows of a tile per warp
constexpr int kChunk = 32;                      // contracted columns staged at a time
constexpr int kOut = 128;                       // output columns per block
constexpr int kP = kOut / 32;                   // output columns per lane
constexpr unsigned kFull = 0xffffffffu;

struct AnyGeometry {
  int S, Hq, Hkv, group;  // S: queries Sq
  float scale;
  int Sk, off;            // keys Sk >= S, off = Sk - S: query qi sees keys ki <= qi + off
  int D, Dv, chunks;      // head dims and the output chunks of the launch (grid z = B * chunks)
};

// dst[kTile][ld] (fp32) = rows [row0, row0 + kTile) x columns [col0, col0 + width) of a matrix
// with row stride `stride`, zero past row `rows` or column `cols`.
template <typename T>
__device__ void load_block(float* dst, int ld, int width, const T* src, int64_t stride, int row0, int rows, int col0,
                           int cols) {
  for (int i = threadIdx.x; i < kTile * width; i += kThreads) {
    const int r = i / width, c = i % width;
    const bool ok = row0 + r < rows && col0 + c < cols;
    dst[r * ld + c] = ok ? load(src[static_cast<int64_t>(row0 + r) * stride + col0 + c]) : 0.0f;
  }
}

// s[r][j] += A[a_row0 + r0 + r] . B[b_row0 + lane + 32 j] over the `cols` columns of both
// (rows of A past a_rows and of B past b_rows count as zero). Every thread of the block calls
// it; it begins with a barrier, so shared buffers read before the call may be rewritten after it.
template <typename T>
__device__ void add_products(float (&s)[kRows][2], float* sa, float* sb, const T* a, int64_t a_stride, int a_row0,
                             int a_rows, const T* b, int64_t b_stride, int b_row0, int b_rows, int cols) {
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRows;
  for (int c0 = 0; c0 < cols; c0 += kChunk) {
    __syncthreads();
    load_block(sa, kChunk, kChunk, a, a_stride, a_row0, a_rows, c0, cols);
    load_block(sb, kChunk + 1, kChunk, b, b_stride, b_row0, b_rows, c0, cols);
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < kChunk; ++c) {
      const float b0 = sb[lane * (kChunk + 1) + c], b1 = sb[(lane + 32) * (kChunk + 1) + c];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float av = sa[(r0 + r) * kChunk + c];
        s[r][0] += av * b0;
        s[r][1] += av * b1;
      }
    }
  }
}

__device__ __forceinline__ void zero(float (&s)[kRows][2]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = 0.0f;
}

// acc[r][i] += sum_j w[r][j] * tile[j][lane + 32 i] over the tile's kTile rows; w[r][half]
// holds column lane + 32 half of row r (spread over the warp, fetched by shuffles).
__device__ __forceinline__ void add_weighted_rows(float (&acc)[kRows][kP], const float (&w)[kRows][2],
                                                  const float* tile) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll 4
    for (int jj = 0; jj < 32; ++jj) {
      const int j = half * 32 + jj;
      float x[kP];
#pragma unroll
      for (int i = 0; i < kP; ++i) x[i] = tile[j * kOut + lane + 32 * i];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float p = __shfl_sync(kFull, w[r][half], jj);
#pragma unroll
        for (int i = 0; i < kP; ++i) acc[r][i] += p * x[i];
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) any_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                                                               AnyGeometry g) {
  extern __shared__ float smem[];
  float* sa = smem;                       // [kTile][kChunk]
  float* sb = sa + kTile * kChunk;        // [kTile][kChunk + 1]
  float* sv = sb + kTile * (kChunk + 1);  // [kTile][kOut]

  const int tile = gridDim.x - 1 - blockIdx.x;  // the longest (last) tiles start first
  const int h = blockIdx.y, b = blockIdx.z / g.chunks, v0 = (blockIdx.z % g.chunks) * kOut, hk = h / g.group;
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRows, q0 = tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * g.D, k_stride = static_cast<int64_t>(g.Hkv) * g.D;
  const int64_t v_stride = static_cast<int64_t>(g.Hkv) * g.Dv, o_stride = static_cast<int64_t>(g.Hq) * g.Dv;
  const T* qb = q + (static_cast<int64_t>(b) * g.S * g.Hq + h) * g.D;
  const T* kb = k + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * g.D;
  const T* vb = v + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * g.Dv;

  float o[kRows][kP], m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kP; ++i) o[r][i] = 0.0f;
  }
  const int kt_end = min(q0 + kTile - 1 + g.off, g.Sk - 1) / kTile;
  for (int kt = 0; kt <= kt_end; ++kt) {
    const int k0 = kt * kTile;
    float s[kRows][2];
    zero(s);
    add_products(s, sa, sb, qb, q_stride, q0, g.S, kb, k_stride, k0, g.Sk, g.D);
    // Online softmax: key 0 is visible to every row, so m is finite after the first tile.
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
      for (int i = 0; i < kP; ++i) o[r][i] *= corr;
    }
    load_block(sv, kOut, kOut, vb, v_stride, k0, g.Sk, v0, g.Dv);  // sv's last readers passed add_products' barrier
    __syncthreads();
    add_weighted_rows(o, s, sv);
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = q0 + r0 + r;
    if (qi >= g.S) continue;
    const float inv = 1.0f / l[r];
    T* orow = out + (static_cast<int64_t>(b) * g.S * g.Hq + h) * g.Dv + static_cast<int64_t>(qi) * o_stride;
#pragma unroll
    for (int i = 0; i < kP; ++i) {
      const int c = v0 + lane + 32 * i;
      if (c < g.Dv) orow[c] = store<T>(o[r][i] * inv);
    }
    if (lane == 0 && v0 == 0) lse[(static_cast<int64_t>(b) * g.Hq + h) * g.S + qi] = m[r] + logf(l[r]);
  }
}

// Dr[b, h, s] = dO . O, one warp per row of the [B, S, Hq] row order of out (Dv columns).
template <typename T>
__global__ void __launch_bounds__(kThreads) any_dr_kernel(const T* out, const T* dout, float* dr, int64_t rows,
                                                          AnyGeometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  float acc = 0.0f;
  for (int c = lane; c < g.Dv; c += 32) acc += load(dout[row * g.Dv + c]) * load(out[row * g.Dv + c]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = row % g.Hq, bs = row / g.Hq, s = bs % g.S, b = bs / g.S;
    dr[(b * g.Hq + h) * g.S + s] = acc;
  }
}

// dQ[:, chunk] for one (b, h, query tile): scale sum_t dS[s, t] K_t over the key tiles it sees.
template <typename T>
__global__ void __launch_bounds__(kThreads) any_dq_kernel(const T* q, const T* k, const T* v, const T* dout,
                                                          const float* lse, const float* dr, T* dq, AnyGeometry g) {
  extern __shared__ float smem[];
  float* sa = smem;                        // [kTile][kChunk]
  float* sb = sa + kTile * kChunk;         // [kTile][kChunk + 1]
  float* sk = sb + kTile * (kChunk + 1);   // [kTile][kOut]: K[:, chunk]

  const int tile = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z / g.chunks, c0 = (blockIdx.z % g.chunks) * kOut, hk = h / g.group;
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRows, q0 = tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * g.D, k_stride = static_cast<int64_t>(g.Hkv) * g.D;
  const int64_t v_stride = static_cast<int64_t>(g.Hkv) * g.Dv, o_stride = static_cast<int64_t>(g.Hq) * g.Dv;
  const int64_t bh = static_cast<int64_t>(b) * g.S * g.Hq + h;
  const T* qb = q + bh * g.D;
  const T* dob = dout + bh * g.Dv;
  const T* kb = k + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * g.D;
  const T* vb = v + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * g.Dv;
  const int64_t row_base = (static_cast<int64_t>(b) * g.Hq + h) * g.S;

  float acc[kRows][kP], row_lse[kRows], row_dr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = q0 + r0 + r;
    row_lse[r] = qi < g.S ? lse[row_base + qi] : 0.0f;
    row_dr[r] = qi < g.S ? dr[row_base + qi] : 0.0f;
#pragma unroll
    for (int i = 0; i < kP; ++i) acc[r][i] = 0.0f;
  }
  const int kt_end = min(q0 + kTile - 1 + g.off, g.Sk - 1) / kTile;
  for (int kt = 0; kt <= kt_end; ++kt) {
    const int k0 = kt * kTile;
    float s[kRows][2], dp[kRows][2];
    zero(s);
    zero(dp);
    add_products(s, sa, sb, qb, q_stride, q0, g.S, kb, k_stride, k0, g.Sk, g.D);
    add_products(dp, sa, sb, dob, o_stride, q0, g.S, vb, v_stride, k0, g.Sk, g.Dv);
    // s becomes dS = P (dP - Dr), P = 0 above the (shifted) diagonal and past Sk.
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
    load_block(sk, kOut, kOut, kb, k_stride, k0, g.Sk, c0, g.D);
    __syncthreads();
    add_weighted_rows(acc, s, sk);
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = q0 + r0 + r;
    if (qi >= g.S) continue;
    T* row = dq + bh * g.D + static_cast<int64_t>(qi) * q_stride;
#pragma unroll
    for (int i = 0; i < kP; ++i) {
      const int c = c0 + lane + 32 * i;
      if (c < g.D) row[c] = store<T>(acc[r][i] * g.scale);
    }
  }
}

// dK[:, chunk] and dV[:, chunk] for one (b, kv head, key tile): sums over the group's query heads
// and the query tiles from the first that sees the key tile (the one holding k0 - off) on.
template <typename T>
__global__ void __launch_bounds__(kThreads) any_dkv_kernel(const T* q, const T* k, const T* v, const T* dout,
                                                           const float* lse, const float* dr, T* dk, T* dv,
                                                           int num_q_tiles, AnyGeometry g) {
  extern __shared__ float smem[];
  float* sa = smem;                        // [kTile][kChunk]
  float* sb = sa + kTile * kChunk;         // [kTile][kChunk + 1]
  float* sq = sb + kTile * (kChunk + 1);   // [kTile][kOut]: Q[:, chunk]
  float* sdo = sq + kTile * kOut;          // [kTile][kOut]: dO[:, chunk]

  const int tile = blockIdx.x;  // the first key tiles see the most queries: start them first
  const int hk = blockIdx.y, b = blockIdx.z / g.chunks, c0 = (blockIdx.z % g.chunks) * kOut;
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRows, k0 = tile * kTile;
  const int qt_begin = max(0, k0 - g.off) / kTile;  // k0 - off < S: every key is seen by a query
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * g.D, k_stride = static_cast<int64_t>(g.Hkv) * g.D;
  const int64_t v_stride = static_cast<int64_t>(g.Hkv) * g.Dv, o_stride = static_cast<int64_t>(g.Hq) * g.Dv;
  const int64_t bk = static_cast<int64_t>(b) * g.Sk * g.Hkv + hk;
  const T* kb = k + bk * g.D;
  const T* vb = v + bk * g.Dv;

  float acc_k[kRows][kP], acc_v[kRows][kP];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < kP; ++i) acc_k[r][i] = acc_v[r][i] = 0.0f;

  for (int h = hk * g.group; h < (hk + 1) * g.group; ++h) {
    const int64_t bh = static_cast<int64_t>(b) * g.S * g.Hq + h;
    const int64_t row_base = (static_cast<int64_t>(b) * g.Hq + h) * g.S;
    for (int qt = qt_begin; qt < num_q_tiles; ++qt) {
      const int q0 = qt * kTile;
      // s[r][j], dp[r][j]: key row r0 + r against query column lane + 32 j.
      float s[kRows][2], dp[kRows][2];
      zero(s);
      zero(dp);
      add_products(s, sa, sb, kb, k_stride, k0, g.Sk, q + bh * g.D, q_stride, q0, g.S, g.D);
      add_products(dp, sa, sb, vb, v_stride, k0, g.Sk, dout + bh * g.Dv, o_stride, q0, g.S, g.Dv);
      // s becomes P, dp becomes dS; zero where the key is past the query's last or the query past S.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int qi = q0 + lane + 32 * j;
        const float col_lse = qi < g.S ? lse[row_base + qi] : 0.0f, col_dr = qi < g.S ? dr[row_base + qi] : 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int ki = k0 + r0 + r;
          const float p = (qi + g.off >= ki && qi < g.S) ? expf(s[r][j] * g.scale - col_lse) : 0.0f;
          s[r][j] = p;
          dp[r][j] = p * (dp[r][j] - col_dr);
        }
      }
      load_block(sq, kOut, kOut, q + bh * g.D, q_stride, q0, g.S, c0, g.D);
      load_block(sdo, kOut, kOut, dout + bh * g.Dv, o_stride, q0, g.S, c0, g.Dv);
      __syncthreads();
      add_weighted_rows(acc_v, s, sdo);
      add_weighted_rows(acc_k, dp, sq);
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int ki = k0 + r0 + r;
    if (ki >= g.Sk) continue;
#pragma unroll
    for (int i = 0; i < kP; ++i) {
      const int c = c0 + lane + 32 * i;
      if (c < g.D) dk[bk * g.D + static_cast<int64_t>(ki) * k_stride + c] = store<T>(acc_k[r][i] * g.scale);
      if (c < g.Dv) dv[bk * g.Dv + static_cast<int64_t>(ki) * v_stride + c] = store<T>(acc_v[r][i]);
    }
  }
}

// Launches `kernel` with `smem` bytes of dynamic shared memory (above 48 KiB needs opting in).
template <typename Kernel, typename... Args>
void launch_any(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, Args... args) {
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  MC_CUDA_CHECK_LAUNCH();
}

template <typename F>
void with_dtype(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(bf16{}); return;
    default: MC_FAIL(op, ": dtype ", dtype_name(dtype), " is not supported on CUDA (f32, bf16)");
  }
}

int chunks_of(int64_t cols) { return static_cast<int>((cols + kOut - 1) / kOut); }

// The geometry of a launch whose grid z is B x `chunks`.
AnyGeometry any_geometry(const AttentionDims& d, double scale, int chunks) {
  MC_CHECK(d.keys() < (int64_t(1) << 30) && d.q_heads <= 65535 && d.batch * chunks <= 65535 &&
               d.head_dim < (int64_t(1) << 24) && d.value_dim() < (int64_t(1) << 24),
           "attention: sizes ", d.batch, " x ", d.seq, " (keys ", d.keys(), ") x ", d.q_heads, ", head dims ",
           d.head_dim, " / ", d.value_dim(), " exceed the CUDA kernels' grid limits");
  return {static_cast<int>(d.seq),   static_cast<int>(d.q_heads),  static_cast<int>(d.kv_heads),
          static_cast<int>(d.group()), static_cast<float>(scale),  static_cast<int>(d.keys()),
          static_cast<int>(d.offset()), static_cast<int>(d.head_dim), static_cast<int>(d.value_dim()), chunks};
}

unsigned num_tiles(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

constexpr size_t kScoreSmem = sizeof(float) * kTile * (2 * kChunk + 1);  // sa + sb
constexpr size_t kBlockSmem = sizeof(float) * kTile * kOut;              // one [kTile][kOut] tile

}  // namespace

void attention_forward_tiled_any(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                                 Tensor& lse, const AttentionDims& d) {
  const AnyGeometry g = any_geometry(d, scale, chunks_of(d.value_dim()));
  cudaStream_t stream = prepare(q);
  with_dtype(q.dtype(), "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    launch_any(any_forward_kernel<T>, dim3(num_tiles(d.seq), d.q_heads, d.batch * g.chunks),
               kScoreSmem + kBlockSmem, stream, q.data<T>(), k.data<T>(), v.data<T>(), out.data<T>(),
               lse.data<float>(), g);
  });
}

void attention_backward_tiled_any(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Tensor& dout, double scale, Tensor& dq, Tensor& dk,
                                  Tensor& dv, const AttentionDims& d) {
  const AnyGeometry gq = any_geometry(d, scale, chunks_of(d.head_dim));
  const AnyGeometry gkv = any_geometry(d, scale, chunks_of(std::max(d.head_dim, d.value_dim())));
  cudaStream_t stream = prepare(q);
  Tensor dr = Tensor::empty({d.batch, d.q_heads, d.seq}, DType::F32, q.device());
  with_dtype(q.dtype(), "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = d.batch * d.seq * d.q_heads;
    launch_any(any_dr_kernel<T>, dim3(static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32))), 0,
               stream, out.data<T>(), dout.data<T>(), dr.data<float>(), rows, gq);
    launch_any(any_dq_kernel<T>, dim3(num_tiles(d.seq), d.q_heads, d.batch * gq.chunks), kScoreSmem + kBlockSmem,
               stream, q.data<T>(), k.data<T>(), v.data<T>(), dout.data<T>(), lse.data<float>(), dr.data<float>(),
               dq.data<T>(), gq);
    launch_any(any_dkv_kernel<T>, dim3(num_tiles(d.keys()), d.kv_heads, d.batch * gkv.chunks),
               kScoreSmem + 2 * kBlockSmem, stream, q.data<T>(), k.data<T>(), v.data<T>(), dout.data<T>(),
               lse.data<float>(), dr.data<float>(), dk.data<T>(), dv.data<T>(), static_cast<int>(num_tiles(d.seq)),
               gkv);
  });
}

}  // namespace moecore::ops::cuda
