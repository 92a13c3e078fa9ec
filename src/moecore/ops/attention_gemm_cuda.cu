// CUDA causal GQA attention through cuBLAS tensor-core GEMMs (the "gemm" path).
//
// Layout. q/out/dout [B, Sq, Hq, D] and k/v [B, Sk, Hkv, D] are first copied to head-major
// [B * Hq, Sq, D] and [B * Hq, Sk, D] (k and v expanded: head h gets kv head h / group), so
// that every GEMM is one cublasGemmStridedBatchedEx call over the B * Hq (b, h) pairs (batch
// strides Sq * D or Sk * D, leading dimension D). The copies move ~4 * B * S * Hq * D elements: a few tens of us at
// the benchmark sizes, against launching B times as many GEMMs with batch Hq.
//
// Scores. Per (b, h) a [Sq, ldS] fp32 buffer (ldS = Sk rounded up to 64) holds c Q K^T. The
// scores are written in fp32, not bf16: a bf16 score s carries an absolute error of about
// |s| 2^-9, which exp() turns into a relative error of P of the same size (~2% at |s| ~ 10),
// as large as the whole bf16 output tolerance, and lse would inherit it. The row kernels then
// overwrite each fp32 row in place with P (and dP with dS) stored in T: for bf16 the T matrix
// has leading dimension 2 ldS (its row r occupies the first half of the fp32 row r), for f32
// it is the same matrix. Rows are staged through shared memory so that the in-place write
// cannot clobber values that other threads of the row still have to read.
//
// Causality. With o = Sk - Sq, query s sees keys t <= s + o (attention.h). Queries are cut
// into blocks of Sb rows (Sb a multiple of 64, at most 8 blocks): query block i (rows
// [i Sb, r1_i), r1_i = min(Sq, (i + 1) Sb)) only needs keys [0, kend_i), kend_i = r1_i + o.
// Every GEMM touches only that region (a dense [Sq, o] prefix plus a block-lower-triangular
// [Sq, Sq] part; for o = 0, 1/2 + 1/(2 nblocks) of the dense work: 9/16 at 8 blocks); the
// row kernel writes P = 0 above the shifted diagonal inside the region. The dK/dV GEMMs use
// key blocks that match: key block 0 is [0, o + r1_0) (the prefix and the first diagonal
// block) and key block j > 0 is [o + j Sb, o + r1_j); the queries that see key block j are
// rows [j Sb, Sq), whose computed regions all cover it.
//
//   forward:  per block  S = c Q_i K^T;  row kernel: mask, max, sum, lse, P = exp(S - lse);
//             per block  O_i = P_i V;    O (fp32, head-major) -> out (T, [B, S, Hq, D]).
//   backward: Dr = rowsum(dO * O); per block  S = c Q_i K^T, dP = dO_i V^T;
//             row kernel: P = exp(S - lse) (masked), dS = P (dP - Dr), both stored in T
//             (bf16: as hi + lo pairs, each GEMM below runs on hi, then on lo with beta = 1);
//             per query block  dQ_i = c dS_i K;
//             per key block j  dV_j = P[j.., j]^T dO[j..],  dK_j = c dS[j.., j]^T Q[j..]
//             (query rows from block j down); dQ, dK, dV are fp32 per query head,
//             then dk/dv[g] = sum over the group's heads in a fixed order (no atomics).
// GEMMs: bf16 (or f32) operands, fp32 compute (CUBLAS_COMPUTE_32F: no TF32 for f32),
// fp32 outputs. The forward's P is one bf16 (P >= 0: no cancellation in P V); the backward's
// P and dS are hi/lo bf16 pairs (see grad_rows_kernel), which doubles the three gradient
// GEMMs but keeps the gradients as accurate as the fp32 tiled kernels. cuBLAS is deterministic for a fixed handle, stream and workspace.
//
// Memory: the score buffers (one in the forward, two in the backward) are taken per call
// from the caching allocator; the (b, h) pairs are processed in chunks so that they stay
// under MOECORE_ATTENTION_SCORE_MB (default 2048 MiB).
#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>

#include "moecore/core/allocator.h"
#include "moecore/core/env_switches.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

constexpr int kRowThreads = 256;
constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr int64_t kMaxBlocks = 8;  // causal query blocks

cublasHandle_t blas_handle(Device dev, cudaStream_t stream) {
  static std::mutex m;
  static std::map<int, cublasHandle_t> handles;
  static std::map<std::pair<int, cudaStream_t>, void*> spaces;  // kept for the process lifetime
  std::lock_guard<std::mutex> lock(m);
  auto it = handles.find(dev.index);
  if (it == handles.end()) {
    cublasHandle_t h;
    MC_CUBLAS_CHECK(cublasCreate(&h));
    it = handles.emplace(dev.index, h).first;
  }
  auto key = std::make_pair(dev.index, stream);
  auto ws = spaces.find(key);
  if (ws == spaces.end())
    ws = spaces.emplace(key, cuda_allocator(dev.index).allocate(kWorkspaceBytes, stream)).first;
  MC_CUBLAS_CHECK(cublasSetStream(it->second, stream));
  // A workspace of our own per stream keeps cuBLAS's results reproducible across streams.
  MC_CUBLAS_CHECK(cublasSetWorkspace(it->second, ws->second, kWorkspaceBytes));
  return it->second;
}

template <typename T>
constexpr cudaDataType_t cuda_type() {
  return std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
}

// A matrix operand of a strided-batched GEMM: row-major with leading dimension ld, batch
// stride `stride` elements.
struct Mat {
  const void* p;
  cudaDataType_t type;
  int64_t ld, stride;
};

// Row-major, per batch: C[m, n] = alpha op(A) op(B) + beta C, op(A) [m, k], op(B) [k, n].
// Computed column-major as C^T = op(B)^T op(A)^T.
void gemm_rm(cublasHandle_t h, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, Mat a, Mat b,
             void* c, cudaDataType_t c_type, int64_t ldc, int64_t c_stride, int64_t batch, float beta = 0.0f) {
  if (m <= 0 || n <= 0 || k <= 0 || batch <= 0) return;
  MC_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
      static_cast<int>(k), &alpha, b.p, b.type, static_cast<int>(b.ld), b.stride, a.p, a.type, static_cast<int>(a.ld),
      a.stride, &beta, c, c_type, static_cast<int>(ldc), c_stride, static_cast<int>(batch), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
}

// dst[(b * H + h) * S + s, :] = src[b, s, h / rep, :]  (head-major copy; rep > 1 expands kv heads).
template <typename T>
__global__ void to_head_major_kernel(const T* src, T* dst, int64_t total, int S, int H, int Hsrc, int rep, int D) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % D);
    const int64_t row = i / D;
    const int s = static_cast<int>(row % S);
    const int64_t bh = row / S;
    const int h = static_cast<int>(bh % H);
    const int64_t b = bh / H;
    dst[i] = src[((b * S + s) * Hsrc + h / rep) * D + d];
  }
}

// dst[b, s, g, :] = sum_{j < rep} src[b, g * rep + j, s, :]  in this order (src fp32 head-major).
template <typename T>
__global__ void from_head_major_kernel(const float* src, T* dst, int64_t total, int S, int Hdst, int rep, int D) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % D);
    const int64_t r = i / D;
    const int g = static_cast<int>(r % Hdst);
    const int64_t bs = r / Hdst;
    const int s = static_cast<int>(bs % S);
    const int64_t b = bs / S;
    const float* p = src + (((b * Hdst + g) * rep) * S + s) * D + d;
    float acc = 0.0f;
    for (int j = 0; j < rep; ++j) acc += p[static_cast<int64_t>(j) * S * D];
    dst[i] = store<T>(acc);
  }
}

// Dr[bh, s] = dO . O, one warp per row of the head-major copies.
template <typename T>
__global__ void dr_kernel(const T* o, const T* dout, float* dr, int64_t rows, int D) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  float acc = 0.0f;
  for (int i = lane; i < D; i += 32) acc += load(dout[row * D + i]) * load(o[row * D + i]);
  acc = warp_sum(acc);
  if (lane == 0) dr[row] = acc;
}

struct RowGeom {
  int S, Sb, ldS;  // S: queries Sq; ldS: fp32 leading dimension of the score buffers
  int Sk, off;     // keys and off = Sk - Sq: row s sees columns t <= s + off
};

// The end of the computed region of row s: kend of its query block.
__device__ __forceinline__ int row_end(const RowGeom& g, int s) { return min(g.S, (s / g.Sb + 1) * g.Sb) + g.off; }

// Forward row kernel, one warp per (bh, s) row of the chunk (kRowThreads / 32 rows a block):
// scores (already scaled) -> P in T (in place) and lse. Three passes over the row (max, sum,
// write; the re-reads hit L1/L2). In the write pass, iteration i stores P for columns
// [32 i, 32 i + 32), whose bf16 bytes overlap fp32 columns [16 i, 16 i + 16): read in an
// iteration <= i, and __syncwarp orders this iteration's reads before its writes.
template <typename T>
__global__ void __launch_bounds__(kRowThreads) softmax_rows_kernel(float* scores, float* lse, int64_t rows,
                                                                   RowGeom g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together
  const int s = static_cast<int>(row % g.S);
  const int n = row_end(g, s), last = s + g.off;  // visible keys: t <= last
  float* in = scores + row * g.ldS;
  float m = -INFINITY;
  for (int t = lane; t <= last; t += 32) m = fmaxf(m, in[t]);
  m = warp_max(m);  // key 0 is always visible: finite
  float l = 0.0f;
  for (int t = lane; t <= last; t += 32) l += expf(in[t] - m);
  const float row_lse = m + logf(warp_sum(l));
  T* out = reinterpret_cast<T*>(in);
  for (int t0 = 0; t0 < n; t0 += 32) {
    const int t = t0 + lane;
    const float x = t <= last ? in[t] : -INFINITY;  // t <= last < n
    __syncwarp();
    if (t < n) out[t] = store<T>(expf(x - row_lse));
    __syncwarp();
  }
  if (lane == 0) lse[row] = row_lse;
}

// Backward row kernel, one block per row: P = exp(S - lse) (0 where t > s + off) into the
// score row, dS = P (dP - Dr) into the dP row, in T and in place (the row is staged in shared
// memory first). For bf16 each value x is stored as hi = bf16(x) at column t and lo =
// bf16(x - hi) at column ldS + t of the bf16 row (the second half of the fp32 row), so that
// the backward GEMMs (hi then lo, accumulated in fp32) see x to ~2^-17 relative: rounding P
// and dS to one bf16 (flash-attention's choice) put errors of up to 25% on gradient entries
// that cancel to near zero (dK at S = 2048).
template <typename T>
__global__ void __launch_bounds__(kRowThreads) grad_rows_kernel(float* scores, float* dp, const float* lse,
                                                                const float* dr, RowGeom g) {
  extern __shared__ float smem[];
  const int64_t row = blockIdx.x;
  const int s = static_cast<int>(row % g.S);
  const int n = row_end(g, s), last = s + g.off;
  float* srow = smem;
  float* dprow = smem + n;
  float* in = scores + row * g.ldS;
  float* din = dp + row * g.ldS;
  for (int t = threadIdx.x; t < n; t += kRowThreads) {
    srow[t] = in[t];
    dprow[t] = din[t];
  }
  __syncthreads();
  const float row_lse = lse[row], row_dr = dr[row];
  T* p_out = reinterpret_cast<T*>(in);
  T* ds_out = reinterpret_cast<T*>(din);
  for (int t = threadIdx.x; t < n; t += kRowThreads) {
    const float p = t <= last ? expf(srow[t] - row_lse) : 0.0f;
    const float ds = p * (dprow[t] - row_dr);
    const T p_hi = store<T>(p), ds_hi = store<T>(ds);
    p_out[t] = p_hi;
    ds_out[t] = ds_hi;
    if constexpr (!std::is_same_v<T, float>) {
      p_out[g.ldS + t] = store<T>(p - load(p_hi));
      ds_out[g.ldS + t] = store<T>(ds - load(ds_hi));
    }
  }
}

template <typename Kernel, typename... Args>
void launch_rows(Kernel kernel, int64_t rows, size_t smem, cudaStream_t stream, Args... args) {
  if (smem > 48 * 1024)
    MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(rows), kRowThreads, smem, stream>>>(args...);
  MC_CUDA_CHECK_LAUNCH();
}

// S: the sequence length of src (Sq for q-like tensors, Sk for k and v).
template <typename T>
void to_head_major(const Tensor& src, Tensor& dst, const AttentionDims& d, int64_t S, int rep, cudaStream_t stream) {
  const int64_t total = dst.numel();
  to_head_major_kernel<T><<<grid_for(total), 256, 0, stream>>>(
      src.data<T>(), dst.data<T>(), total, static_cast<int>(S), static_cast<int>(d.q_heads),
      static_cast<int>(d.q_heads / rep), rep, static_cast<int>(d.head_dim));
  MC_CUDA_CHECK_LAUNCH();
}

template <typename T>
void from_head_major(const Tensor& src, Tensor& dst, const AttentionDims& d, int64_t S, int rep,
                     cudaStream_t stream) {
  const int64_t total = dst.numel();
  from_head_major_kernel<T><<<grid_for(total), 256, 0, stream>>>(
      src.data<float>(), dst.data<T>(), total, static_cast<int>(S), static_cast<int>(d.q_heads / rep), rep,
      static_cast<int>(d.head_dim));
  MC_CUDA_CHECK_LAUNCH();
}

// Sizes shared by the forward and the backward. Query block i: rows [r0(i), r1(i)), keys
// [0, kend(i)). Key block j (backward): keys [c0(j), c1(j)), seen by query rows [r0(j), S).
struct Plan {
  int64_t S, Sk, off, D, BH, Sb, nblocks, ldS, chunk;  // S = Sq; chunk: (b, h) pairs per pass
  RowGeom rows() const {
    return {static_cast<int>(S), static_cast<int>(Sb), static_cast<int>(ldS), static_cast<int>(Sk),
            static_cast<int>(off)};
  }
  int64_t r0(int64_t i) const { return i * Sb; }
  int64_t r1(int64_t i) const { return std::min(S, (i + 1) * Sb); }
  int64_t kend(int64_t i) const { return r1(i) + off; }
  int64_t c0(int64_t j) const { return j == 0 ? 0 : off + r0(j); }  // block 0 takes the prefix [0, off)
  int64_t c1(int64_t j) const { return off + r1(j); }
};

int64_t score_budget_bytes() {
  int64_t mb = 2048;
  if (const char* e = env_switch("MOECORE_ATTENTION_SCORE_MB")) {
    const long long v = std::atoll(e);
    if (v > 0) mb = v;
  }
  return mb << 20;
}

Plan make_plan(const AttentionDims& d, int buffers) {
  Plan p{};
  p.S = d.seq;
  p.Sk = d.keys();
  p.off = d.offset();
  p.D = d.head_dim;
  p.BH = d.batch * d.q_heads;
  p.ldS = (p.Sk + 63) / 64 * 64;
  p.nblocks = std::min<int64_t>(kMaxBlocks, std::max<int64_t>(1, (d.seq + 255) / 256));
  p.Sb = ((d.seq + p.nblocks - 1) / p.nblocks + 63) / 64 * 64;
  p.nblocks = (d.seq + p.Sb - 1) / p.Sb;
  const int64_t per_bh = p.S * p.ldS * static_cast<int64_t>(sizeof(float)) * buffers;
  p.chunk = std::max<int64_t>(1, std::min<int64_t>(p.BH, score_budget_bytes() / per_bh));
  return p;
}

template <typename T>
void forward_impl(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                  const AttentionDims& d) {
  cudaStream_t stream = prepare(q);
  const Device dev = q.device();
  const Plan p = make_plan(d, 1);
  const int rep = static_cast<int>(d.group());
  const DType t = q.dtype();
  Tensor qh = Tensor::empty({p.BH, p.S, p.D}, t, dev), kh = Tensor::empty({p.BH, p.Sk, p.D}, t, dev),
         vh = Tensor::empty({p.BH, p.Sk, p.D}, t, dev), oh = Tensor::empty({p.BH, p.S, p.D}, DType::F32, dev);
  to_head_major<T>(q, qh, d, p.S, 1, stream);
  to_head_major<T>(k, kh, d, p.Sk, rep, stream);
  to_head_major<T>(v, vh, d, p.Sk, rep, stream);
  Tensor scores = Tensor::empty({p.chunk, p.S, p.ldS}, DType::F32, dev);
  cublasHandle_t h = blas_handle(dev, stream);
  const cudaDataType_t ct = cuda_type<T>();
  const int64_t sd = p.S * p.D, kd = p.Sk * p.D, ss = p.S * p.ldS;  // batch strides: q-like, k/v, scores
  const int64_t ldP = p.ldS * static_cast<int64_t>(sizeof(float) / sizeof(T));
  const int64_t pstride = p.S * ldP;
  for (int64_t bh0 = 0; bh0 < p.BH; bh0 += p.chunk) {
    const int64_t nb = std::min(p.chunk, p.BH - bh0);
    const T* Q = qh.data<T>() + bh0 * sd;
    const T* K = kh.data<T>() + bh0 * kd;
    const T* V = vh.data<T>() + bh0 * kd;
    float* O = oh.data<float>() + bh0 * sd;
    float* Sc = scores.data<float>();
    for (int64_t i = 0; i < p.nblocks; ++i) {
      const int64_t r0 = p.r0(i), rows = p.r1(i) - r0, kend = p.kend(i);
      gemm_rm(h, false, true, rows, kend, p.D, static_cast<float>(scale), {Q + r0 * p.D, ct, p.D, sd},
              {K, ct, p.D, kd}, Sc + r0 * p.ldS, CUDA_R_32F, p.ldS, ss, nb);
    }
    const int64_t rows = nb * p.S, warps = kRowThreads / 32;
    softmax_rows_kernel<T><<<static_cast<unsigned>((rows + warps - 1) / warps), kRowThreads, 0, stream>>>(
        Sc, lse.data<float>() + bh0 * p.S, rows, p.rows());
    MC_CUDA_CHECK_LAUNCH();
    const T* P = reinterpret_cast<const T*>(Sc);
    for (int64_t i = 0; i < p.nblocks; ++i) {
      const int64_t r0 = p.r0(i), rows = p.r1(i) - r0, kend = p.kend(i);
      gemm_rm(h, false, false, rows, p.D, kend, 1.0f, {P + r0 * ldP, ct, ldP, pstride}, {V, ct, p.D, kd},
              O + r0 * p.D, CUDA_R_32F, p.D, sd, nb);
    }
  }
  from_head_major<T>(oh, out, d, p.S, 1, stream);
}

template <typename T>
void backward_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                   const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d) {
  cudaStream_t stream = prepare(q);
  const Device dev = q.device();
  const Plan p = make_plan(d, 2);
  const int rep = static_cast<int>(d.group());
  const DType t = q.dtype();
  const Shape hq{p.BH, p.S, p.D}, hk{p.BH, p.Sk, p.D};
  Tensor qh = Tensor::empty(hq, t, dev), kh = Tensor::empty(hk, t, dev), vh = Tensor::empty(hk, t, dev),
         doh = Tensor::empty(hq, t, dev);
  to_head_major<T>(q, qh, d, p.S, 1, stream);
  to_head_major<T>(k, kh, d, p.Sk, rep, stream);
  to_head_major<T>(v, vh, d, p.Sk, rep, stream);
  to_head_major<T>(dout, doh, d, p.S, 1, stream);
  Tensor dr = Tensor::empty({p.BH, p.S}, DType::F32, dev);
  {
    Tensor oh = Tensor::empty(hq, t, dev);
    to_head_major<T>(out, oh, d, p.S, 1, stream);
    const int64_t rows = p.BH * p.S;
    dr_kernel<T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(oh.data<T>(), doh.data<T>(),
                                                                            dr.data<float>(), rows,
                                                                            static_cast<int>(p.D));
    MC_CUDA_CHECK_LAUNCH();
  }  // oh goes back to the allocator (stream-ordered)
  Tensor dqh = Tensor::empty(hq, DType::F32, dev), dkh = Tensor::empty(hk, DType::F32, dev),
         dvh = Tensor::empty(hk, DType::F32, dev);
  Tensor scores = Tensor::empty({p.chunk, p.S, p.ldS}, DType::F32, dev);
  Tensor dps = Tensor::empty({p.chunk, p.S, p.ldS}, DType::F32, dev);
  cublasHandle_t h = blas_handle(dev, stream);
  const cudaDataType_t ct = cuda_type<T>();
  const int64_t sd = p.S * p.D, kd = p.Sk * p.D, ss = p.S * p.ldS;  // batch strides: q-like, k/v, scores
  const int64_t ldP = p.ldS * static_cast<int64_t>(sizeof(float) / sizeof(T));
  const int64_t pstride = p.S * ldP;
  const float c = static_cast<float>(scale);
  // The longest computed row is the last block's: kend = Sk.
  const size_t smem = 2 * sizeof(float) * static_cast<size_t>(p.kend(p.nblocks - 1));
  for (int64_t bh0 = 0; bh0 < p.BH; bh0 += p.chunk) {
    const int64_t nb = std::min(p.chunk, p.BH - bh0);
    const T* Q = qh.data<T>() + bh0 * sd;
    const T* K = kh.data<T>() + bh0 * kd;
    const T* V = vh.data<T>() + bh0 * kd;
    const T* dO = doh.data<T>() + bh0 * sd;
    float* dQ = dqh.data<float>() + bh0 * sd;
    float* dK = dkh.data<float>() + bh0 * kd;
    float* dV = dvh.data<float>() + bh0 * kd;
    float* Sc = scores.data<float>();
    float* dP = dps.data<float>();
    for (int64_t i = 0; i < p.nblocks; ++i) {
      const int64_t r0 = p.r0(i), rows = p.r1(i) - r0, kend = p.kend(i);
      gemm_rm(h, false, true, rows, kend, p.D, c, {Q + r0 * p.D, ct, p.D, sd}, {K, ct, p.D, kd}, Sc + r0 * p.ldS,
              CUDA_R_32F, p.ldS, ss, nb);
      gemm_rm(h, false, true, rows, kend, p.D, 1.0f, {dO + r0 * p.D, ct, p.D, sd}, {V, ct, p.D, kd},
              dP + r0 * p.ldS, CUDA_R_32F, p.ldS, ss, nb);
    }
    launch_rows(grad_rows_kernel<T>, nb * p.S, smem, stream, Sc, dP, lse.data<float>() + bh0 * p.S,
                dr.data<float>() + bh0 * p.S, p.rows());
    const T* P = reinterpret_cast<const T*>(Sc);
    const T* dS = reinterpret_cast<const T*>(dP);
    // bf16: the hi part (offset 0) then the lo part (offset ldS) accumulated onto it in fp32.
    const int parts = std::is_same_v<T, float> ? 1 : 2;
    for (int part = 0; part < parts; ++part) {
      const int64_t off = part * p.ldS;
      const float beta = part == 0 ? 0.0f : 1.0f;
      for (int64_t i = 0; i < p.nblocks; ++i) {
        const int64_t r0 = p.r0(i), rows = p.r1(i) - r0, kend = p.kend(i);
        gemm_rm(h, false, false, rows, p.D, kend, c, {dS + off + r0 * ldP, ct, ldP, pstride}, {K, ct, p.D, kd},
                dQ + r0 * p.D, CUDA_R_32F, p.D, sd, nb, beta);
      }
      for (int64_t j = 0; j < p.nblocks; ++j) {
        // Keys [c0, c1) against query rows [r0, S): every such row's computed region covers them.
        const int64_t c0 = p.c0(j), cols = p.c1(j) - c0, r0 = p.r0(j), kr = p.S - r0;
        gemm_rm(h, true, false, cols, p.D, kr, 1.0f, {P + off + r0 * ldP + c0, ct, ldP, pstride},
                {dO + r0 * p.D, ct, p.D, sd}, dV + c0 * p.D, CUDA_R_32F, p.D, kd, nb, beta);
        gemm_rm(h, true, false, cols, p.D, kr, c, {dS + off + r0 * ldP + c0, ct, ldP, pstride},
                {Q + r0 * p.D, ct, p.D, sd}, dK + c0 * p.D, CUDA_R_32F, p.D, kd, nb, beta);
      }
    }
  }
  from_head_major<T>(dqh, dq, d, p.S, 1, stream);
  from_head_major<T>(dkh, dk, d, p.Sk, rep, stream);
  from_head_major<T>(dvh, dv, d, p.Sk, rep, stream);
}

template <typename F>
void dispatch_gemm(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(bf16{}); return;
    default: MC_FAIL(op, ": dtype ", dtype_name(t), " is not supported by the CUDA GEMM attention path (f32, bf16)");
  }
}

}  // namespace

bool attention_gemm_supported(const AttentionDims& d, DType dtype) {
  // One head dim for q, k and v (Dv = D; other Dv take the flash or tiled path). Row kernels
  // stage up to two fp32 score rows (Sk long) in shared memory (2 * 4 * 16384 = 128 KiB).
  return (dtype == DType::F32 || dtype == DType::BF16) && d.keys() <= kAttentionGemmMaxSeq &&
         d.head_dim % 8 == 0 && d.value_dim() == d.head_dim && d.batch * d.q_heads <= (int64_t(1) << 30);
}

void attention_forward_gemm(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                            Tensor& lse, const AttentionDims& d) {
  MC_CHECK(attention_gemm_supported(d, q.dtype()), "attention_forward: the GEMM path does not support Sq = ", d.seq,
           ", Sk = ", d.keys(), ", D = ", d.head_dim, ", dtype ", dtype_name(q.dtype()));
  dispatch_gemm(q.dtype(), "attention_forward", [&](auto tag) {
    forward_impl<decltype(tag)>(q, k, v, scale, out, lse, d);
  });
}

void attention_backward_gemm(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv,
                             const AttentionDims& d) {
  MC_CHECK(attention_gemm_supported(d, q.dtype()), "attention_backward: the GEMM path does not support Sq = ",
           d.seq, ", Sk = ", d.keys(), ", D = ", d.head_dim, ", dtype ", dtype_name(q.dtype()));
  dispatch_gemm(q.dtype(), "attention_backward", [&](auto tag) {
    backward_impl<decltype(tag)>(q, k, v, out, lse, dout, scale, dq, dk, dv, d);
  });
}

}  // namespace moecore::ops::cuda
