// CUDA causal GQA attention: fused flash-attention kernels on tensor cores (the "flash" path).
// bf16 inputs only; kernels templated on the query/key head dim D and the value head dim DV,
// instantiated for (D, DV) = (64, 64), (96, 96), (128, 128), (256, 256) and MLA's (192, 128);
// semantics as in attention.h. Tiles of Q and K are [rows][D + 8], of V and dO [rows][DV + 8];
// above 48 KiB of dynamic shared memory the launches opt in (cudaFuncSetAttribute).
//
// Every product is an mma.sync.m16n8k16 (bf16 x bf16 -> fp32) with operands fetched from
// shared memory by ldmatrix (.trans where the stored matrix is the transpose of the operand).
// Shared-memory tiles are [rows][D + 8] bf16: the 16-byte pad shifts consecutive rows by 4
// banks, so the 8 row addresses of an ldmatrix hit different banks. Global -> shared copies
// are 16-byte cp.async with zero fill past the last row (queries >= Sq, keys >= Sk).
//
// Fragment layout (m16n8k16, g = lane / 4, t = lane % 4): the fp32 accumulator of a 16x8 block
// holds (row g, cols 2t, 2t+1) and (row g + 8, cols 2t, 2t+1); two neighbouring 8-column
// accumulator blocks, rounded to bf16 pairs, are exactly the A fragment of a 16x16 block, so
// P (and dS) go from the score MMA to the next MMA without leaving registers.
//
// With o = Sk - Sq, query qi sees keys ki <= qi + o (attention.h).
//   forward  grid (query tiles of 128, Hq, B), 8 warps x 16 query rows. Q fragments stay in
//            registers; key tiles of 64 from the diagonal one down to 0 (K of the next tile
//            and V of the current one load while the other is used); online softmax in fp32
//            (running max and sum per row, exp2 with scale * log2 e folded in); P rounded to
//            bf16 for P V. Tiles wholly above the diagonal are never visited; only the tiles
//            that cross the diagonal or the Sk edge are masked.
//   backward 1. Dr = rowsum(dO * O), one warp per row.
//            2. dK, dV: grid (key tiles of 64, Hkv, B), 4 warps x 16 keys; loops over the
//               group's query heads and the query tiles (32 rows where D + DV >= 256, else 64;
//               double-buffered) that see the key tile, computing the transposed products
//               S^T = K Q^T and dP^T = V dO^T so that P^T and dS^T are A fragments for
//               dV += P^T dO and dK += dS^T Q.
//               At D = DV = 256 the dK and dV accumulators of a warp's 16 keys do not fit in
//               registers together: two launches, one for dK and one for dV (each recomputes P).
//            3. dQ: grid (query tiles of 64, Hq, B), 4 warps x 16 queries; loops over key tiles
//               (64, or 32 from D = 192 on; double-buffered): S = Q K^T, dP = dO V^T, dQ += dS K.
//            Each block owns the rows it writes: no atomics, deterministic.
// Precision: scores, softmax statistics and accumulation are fp32; the forward's P enters
// P V as bf16 (one rounding, as on the GEMM path). In the backward, P (for P^T dO) and dS
// (for dS K and dS^T Q) enter as hi + lo bf16 pairs (hi = bf16(x), lo = bf16(x - hi), two
// MMAs into one fp32 accumulator: ~2^-17 relative). A single rounding of P put a few dV
// entries of the first keys (large P, sums near zero) up to ~2x over the bf16 test tolerance
// (dK and dQ with a single-rounded dS passed there);
// MOECORE_ATTENTION_FLASH_SPLIT=0 rounds P and dS once (one MMA instead of two: faster, less
// accurate; docs/performance.md).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "moecore/ops/attention.h"
#include "moecore/core/env_switches.h"
#include "moecore/ops/attention_flash_hopper.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr const char* kFlashHeadDims = "(64, 64), (96, 96), (128, 128), (256, 256) or (192, 128)";

struct FlashGeometry {
  int S, Hq, Hkv, group;  // S: queries Sq
  float scale, scale_log2;  // c and c * log2(e)
  int Sk, off;              // keys Sk >= S, off = Sk - S
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a (16x16, row) * b (16x8, col), bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16 pair (round to nearest even): lo in the low half (the smaller column).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// The residual pair x - bf16(x) of a pair packed by pack_bf16, rounded to bf16 (the lo of hi + lo).
__device__ __forceinline__ uint32_t pack_residual(float lo, float hi, uint32_t packed) {
  return pack_bf16(lo - __uint_as_float(packed << 16), hi - __uint_as_float(packed & 0xffff0000u));
}

// acc[2 nb], acc[2 nb + 1] (two 8-column blocks) += A times the 16x16 B block at `addr` (stored
// [k][n], fetched with ldmatrix .trans); with kSplit also + A_lo times it (A = hi + lo bf16 pairs).
template <bool kSplit, int N>
__device__ __forceinline__ void accumulate_pair(float (&acc)[N][4], int nb, const uint32_t (&a)[4],
                                                const uint32_t (&a_lo)[4], uint32_t addr) {
  uint32_t r[4];
  ldsm_x4_t(r, addr);
  mma(acc[2 * nb], a, r[0], r[1]);
  mma(acc[2 * nb + 1], a, r[2], r[3]);
  if constexpr (kSplit) {
    mma(acc[2 * nb], a_lo, r[0], r[1]);
    mma(acc[2 * nb + 1], a_lo, r[2], r[3]);
  }
}

// Copies rows [row0, row0 + R) of a [rows, stride] bf16 matrix (the D columns at src) into
// dst[R][D + 8] with cp.async, zero rows past `rows`. NT threads.
template <int D, int R, int NT>
__device__ __forceinline__ void load_rows(uint16_t* dst, const uint16_t* src, int64_t stride, int row0, int rows) {
  constexpr int C = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int i = threadIdx.x; i < R * C; i += NT) {
    const int r = i / C, c = i % C;
    const bool ok = row0 + r < rows;
    const uint16_t* p = ok ? src + static_cast<int64_t>(row0 + r) * stride + c * 8 : src;
    cp_async16(smem_addr(dst + r * (D + 8) + c * 8), p, ok);
  }
}

// ldmatrix addresses (bytes) for a warp, tiles [rows][LD] bf16.
// A operand 16x16 at (row0, col0) of a row-major tile: x4 gives a0..a3.
template <int LD>
__device__ __forceinline__ uint32_t a_addr(const uint16_t* tile, int row0, int col0, int lane) {
  return smem_addr(tile + (row0 + (lane & 15)) * LD + col0 + (lane >> 4) * 8);
}
// B operand from a tile stored [n][k] (B = tile^T): two 8-column blocks n0..n0+15, k0..k0+15:
// x4 gives (b0, b1) of block n0 and (b0, b1) of block n0 + 8.
template <int LD>
__device__ __forceinline__ uint32_t bt_addr(const uint16_t* tile, int n0, int k0, int lane) {
  return smem_addr(tile + (n0 + (lane & 7) + (lane >> 4) * 8) * LD + k0 + ((lane >> 3) & 1) * 8);
}
// B operand from a tile stored [k][n] (B = tile), with .trans: rows k0..k0+15, columns
// n0..n0+15: x4.trans gives (b0, b1) of block n0 and (b0, b1) of block n0 + 8.
template <int LD>
__device__ __forceinline__ uint32_t bn_addr(const uint16_t* tile, int k0, int n0, int lane) {
  return smem_addr(tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8);
}

// ---------------------------------------------------------------------------------------------
// Forward.
// D: the query/key head dim, DV: the value head dim. Q fragments stay in registers up to D = 192
// (at 256 they and the DV = 256 accumulators would not fit: they are re-read from shared memory).
template <int D, int DV>
struct FwdCfg {
  static constexpr int Br = 128, Bc = 64, NT = 256, LD = D + 8, LDV = DV + 8;
  static constexpr bool kQRegs = D <= 192;
  static constexpr size_t smem = sizeof(uint16_t) * ((Br + Bc) * LD + Bc * LDV);
};

template <int D, int DV>
__global__ void __launch_bounds__(256, 1) flash_forward_kernel(const uint16_t* q, const uint16_t* k,
                                                               const uint16_t* v, uint16_t* out, float* lse,
                                                               FlashGeometry g) {
  using C = FwdCfg<D, DV>;
  constexpr int Br = C::Br, Bc = C::Bc, NT = C::NT, LD = C::LD, LDV = C::LDV;
  extern __shared__ __align__(16) uint16_t smem_fwd[];
  uint16_t* sq = smem_fwd;
  uint16_t* sk = sq + Br * LD;
  uint16_t* sv = sk + Bc * LD;

  const int tile = gridDim.x - 1 - blockIdx.x;  // the longest tiles start first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q0 = tile * Br;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * D, kv_stride = static_cast<int64_t>(g.Hkv) * D;
  const int64_t v_stride = static_cast<int64_t>(g.Hkv) * DV, o_stride = static_cast<int64_t>(g.Hq) * DV;
  const uint16_t* qb = q + (static_cast<int64_t>(b) * g.S * g.Hq + h) * D;
  const uint16_t* kb = k + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;
  const uint16_t* vb = v + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * DV;

  const int kt_end = min(q0 + Br - 1 + g.off, g.Sk - 1) / Bc;
  load_rows<D, Br, NT>(sq, qb, q_stride, q0, g.S);
  load_rows<D, Bc, NT>(sk, kb, kv_stride, kt_end * Bc, g.Sk);
  cp_async_commit();

  const int wrow = warp * 16;                    // the warp's first row in the tile
  const int row_a = q0 + wrow + (lane >> 2);     // accumulator rows of this thread
  const int row_b = row_a + 8;
  const int t2 = 2 * (lane & 3);
  float o[DV / 8][4];
#pragma unroll
  for (int i = 0; i < DV / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[C::kQRegs ? D / 16 : 1][4];

  for (int kt = kt_end; kt >= 0; --kt) {
    const int k0 = kt * Bc;
    __syncthreads();  // the previous P V no longer reads sv
    load_rows<DV, Bc, NT>(sv, vb, v_stride, k0, g.Sk);
    cp_async_commit();
    cp_async_wait<1>();  // Q and this K
    __syncthreads();
    if constexpr (C::kQRegs) {
      if (kt == kt_end) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], a_addr<LD>(sq, wrow, kk * 16, lane));
      }
    }

    float s[Bc / 8][4];
#pragma unroll
    for (int i = 0; i < Bc / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if constexpr (!C::kQRegs) ldsm_x4(qf[0], a_addr<LD>(sq, wrow, kk * 16, lane));
      const uint32_t(&qa)[4] = qf[C::kQRegs ? kk : 0];
#pragma unroll
      for (int nb = 0; nb < Bc / 16; ++nb) {
        uint32_t r[4];
        ldsm_x4(r, bt_addr<LD>(sk, nb * 16, kk * 16, lane));
        mma(s[2 * nb], qa, r[0], r[1]);
        mma(s[2 * nb + 1], qa, r[2], r[3]);
      }
    }
    if (k0 + Bc - 1 > q0 + wrow + g.off || k0 + Bc > g.Sk) {
#pragma unroll
      for (int nb = 0; nb < Bc / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ki = k0 + nb * 8 + t2 + (e & 1), qi = e < 2 ? row_a : row_b;
          if (ki > qi + g.off || ki >= g.Sk) s[nb][e] = -INFINITY;
        }
    }
    // Online softmax over the two rows of this thread (a quad of lanes shares a row).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = m[i];
#pragma unroll
      for (int nb = 0; nb < Bc / 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * i], s[nb][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = mx == -INFINITY ? 0.0f : mx * g.scale_log2;  // a row with no key yet
      const float corr = exp2f(m[i] * g.scale_log2 - shift);
      float sum = 0.0f;
#pragma unroll
      for (int nb = 0; nb < Bc / 8; ++nb) {
        s[nb][2 * i] = exp2f(fmaf(s[nb][2 * i], g.scale_log2, -shift));
        s[nb][2 * i + 1] = exp2f(fmaf(s[nb][2 * i + 1], g.scale_log2, -shift));
        sum += s[nb][2 * i] + s[nb][2 * i + 1];
      }
      l[i] = l[i] * corr + sum;  // this thread's part; the quad is summed at the end
      m[i] = mx;
#pragma unroll
      for (int nb = 0; nb < DV / 8; ++nb) {
        o[nb][2 * i] *= corr;
        o[nb][2 * i + 1] *= corr;
      }
    }
    cp_async_wait<0>();  // V
    __syncthreads();     // every warp is done with sk
    if (kt > 0) {
      load_rows<D, Bc, NT>(sk, kb, kv_stride, (kt - 1) * Bc, g.Sk);
      cp_async_commit();
    }
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nb = 0; nb < DV / 16; ++nb) {
        uint32_t r[4];
        ldsm_x4_t(r, bn_addr<LDV>(sv, kk * 16, nb * 16, lane));
        mma(o[2 * nb], a, r[0], r[1]);
        mma(o[2 * nb + 1], a, r[2], r[3]);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const int64_t out_base = (static_cast<int64_t>(b) * g.S * g.Hq + h) * DV;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int qi = i == 0 ? row_a : row_b;
    if (qi >= g.S) continue;
    const float inv = 1.0f / l[i];
    uint16_t* orow = out + out_base + static_cast<int64_t>(qi) * o_stride;
#pragma unroll
    for (int nb = 0; nb < DV / 8; ++nb)
      *reinterpret_cast<uint32_t*>(orow + nb * 8 + t2) = pack_bf16(o[nb][2 * i] * inv, o[nb][2 * i + 1] * inv);
    if ((lane & 3) == 0) lse[(static_cast<int64_t>(b) * g.Hq + h) * g.S + qi] = m[i] * g.scale + logf(l[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Dr[b, h, s] = dO . O, one warp per row of the [B, S, Hq] row order of out (D: the value head dim).
template <int D>
__global__ void __launch_bounds__(256) flash_dr_kernel(const uint16_t* out, const uint16_t* dout, float* dr,
                                                       int64_t rows, FlashGeometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;
  float acc = 0.0f;
#pragma unroll
  for (int c = 2 * lane; c < D; c += 64) {
    const int64_t at = row * D + c;
    const uint32_t o2 = *reinterpret_cast<const uint32_t*>(out + at);
    const uint32_t d2 = *reinterpret_cast<const uint32_t*>(dout + at);
    acc += __uint_as_float(o2 << 16) * __uint_as_float(d2 << 16) +
           __uint_as_float(o2 & 0xffff0000u) * __uint_as_float(d2 & 0xffff0000u);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = row % g.Hq, bs = row / g.Hq, s = bs % g.S, b = bs / g.S;
    dr[(b * g.Hq + h) * g.S + s] = acc;
  }
}

// Which of dK and dV a dK/dV launch computes: both, or (where the two accumulators of a warp's 16
// keys would not fit in registers, D = DV = 256) one of them per launch, each recomputing P.
enum DkvPart { kBoth = 0, kOnlyK = 1, kOnlyV = 2 };

template <int D, int DV>
struct DkvCfg {
  static constexpr int Bn = 64, Bm = D + DV >= 256 ? 32 : 64, NT = 128, LD = D + 8, LDV = DV + 8;
  static constexpr bool kSplitParts = D + DV > 320;  // two launches (kOnlyK, kOnlyV) instead of one
  static constexpr size_t smem = sizeof(uint16_t) * (Bn + 2 * Bm) * (LD + LDV) + sizeof(float) * 4 * Bm;
};

template <int D, int DV, bool kSplit, int kPart>
__global__ void __launch_bounds__(128) flash_dkv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                        const uint16_t* dout, const float* lse, const float* dr,
                                                        uint16_t* dk, uint16_t* dv, FlashGeometry g) {
  using C = DkvCfg<D, DV>;
  constexpr int Bn = C::Bn, Bm = C::Bm, NT = C::NT, LD = C::LD, LDV = C::LDV;
  constexpr bool kK = kPart != kOnlyV, kV = kPart != kOnlyK;  // dS is needed only for dK
  extern __shared__ __align__(16) uint16_t smem_dkv[];
  uint16_t* sk = smem_dkv;
  uint16_t* sv = sk + Bn * LD;
  uint16_t* sq = sv + Bn * LDV;       // [2][Bm][LD]
  uint16_t* sdo = sq + 2 * Bm * LD;   // [2][Bm][LDV]
  float* slse = reinterpret_cast<float*>(sdo + 2 * Bm * LDV);  // [2][Bm], lse * log2(e)
  float* sdr = slse + 2 * Bm;                                  // [2][Bm]

  const int tile = blockIdx.x;  // the first key tiles see the most queries: start them first
  const int hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int k0 = tile * Bn;
  const int qt_begin = max(0, k0 - g.off) / Bm;  // k0 - off < S
  const int q_tiles = (g.S + Bm - 1) / Bm - qt_begin;
  const int n_it = q_tiles * g.group;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * D, kv_stride = static_cast<int64_t>(g.Hkv) * D;
  const int64_t o_stride = static_cast<int64_t>(g.Hq) * DV, v_stride = static_cast<int64_t>(g.Hkv) * DV;
  const int64_t kv_row = static_cast<int64_t>(b) * g.Sk * g.Hkv + hk;
  const int64_t kv_base = kv_row * D, v_base = kv_row * DV;

  // Queues the loads of iteration `it` (query head, query tile) into buffer `buf`.
  auto issue = [&](int it, int buf) {
    const int h = hk * g.group + it / q_tiles, q0 = (qt_begin + it % q_tiles) * Bm;
    const int64_t q_row = static_cast<int64_t>(b) * g.S * g.Hq + h;
    load_rows<D, Bm, NT>(sq + buf * Bm * LD, q + q_row * D, q_stride, q0, g.S);
    load_rows<DV, Bm, NT>(sdo + buf * Bm * LDV, dout + q_row * DV, o_stride, q0, g.S);
    const int64_t row_base = (static_cast<int64_t>(b) * g.Hq + h) * g.S;
    for (int i = threadIdx.x; i < Bm; i += NT) {
      const int qi = q0 + i;
      slse[buf * Bm + i] = qi < g.S ? lse[row_base + qi] * kLog2e : INFINITY;  // P = 0 past S
      sdr[buf * Bm + i] = qi < g.S ? dr[row_base + qi] : 0.0f;
    }
  };

  load_rows<D, Bn, NT>(sk, k + kv_base, kv_stride, k0, g.Sk);
  load_rows<DV, Bn, NT>(sv, v + v_base, v_stride, k0, g.Sk);
  issue(0, 0);
  cp_async_commit();

  const int wrow = warp * 16;
  const int key_a = k0 + wrow + (lane >> 2);  // accumulator rows (keys) of this thread
  const int t2 = 2 * (lane & 3);
  float acc_k[kK ? D / 8 : 1][4], acc_v[kV ? DV / 8 : 1][4];
#pragma unroll
  for (int i = 0; i < (kK ? D / 8 : 1); ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[i][e] = 0.0f;
#pragma unroll
  for (int i = 0; i < (kV ? DV / 8 : 1); ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_v[i][e] = 0.0f;

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    const int q0 = (qt_begin + it % q_tiles) * Bm;
    __syncthreads();  // iteration it - 1 no longer reads buffer buf ^ 1
    if (it + 1 < n_it) issue(it + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint16_t* tq = sq + buf * Bm * LD;
    const uint16_t* tdo = sdo + buf * Bm * LDV;
    const float* tl = slse + buf * Bm;
    const float* td = sdr + buf * Bm;

    // S^T = K Q^T and dP^T = V dO^T: rows keys (16 per warp), columns the Bm queries.
    float s[Bm / 8][4], dp[Bm / 8][4];
#pragma unroll
    for (int i = 0; i < Bm / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
    if constexpr (D == DV && kPart == kBoth) {  // one loop: the operand loads interleave
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ka[4], va[4];
        ldsm_x4(ka, a_addr<LD>(sk, wrow, kk * 16, lane));
        ldsm_x4(va, a_addr<LDV>(sv, wrow, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < Bm / 16; ++nb) {
          uint32_t r[4];
          ldsm_x4(r, bt_addr<LD>(tq, nb * 16, kk * 16, lane));
          mma(s[2 * nb], ka, r[0], r[1]);
          mma(s[2 * nb + 1], ka, r[2], r[3]);
          ldsm_x4(r, bt_addr<LDV>(tdo, nb * 16, kk * 16, lane));
          mma(dp[2 * nb], va, r[0], r[1]);
          mma(dp[2 * nb + 1], va, r[2], r[3]);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ka[4];
        ldsm_x4(ka, a_addr<LD>(sk, wrow, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < Bm / 16; ++nb) {
          uint32_t r[4];
          ldsm_x4(r, bt_addr<LD>(tq, nb * 16, kk * 16, lane));
          mma(s[2 * nb], ka, r[0], r[1]);
          mma(s[2 * nb + 1], ka, r[2], r[3]);
        }
      }
      if constexpr (kK) {
#pragma unroll
        for (int kk = 0; kk < DV / 16; ++kk) {
          uint32_t va[4];
          ldsm_x4(va, a_addr<LDV>(sv, wrow, kk * 16, lane));
#pragma unroll
          for (int nb = 0; nb < Bm / 16; ++nb) {
            uint32_t r[4];
            ldsm_x4(r, bt_addr<LDV>(tdo, nb * 16, kk * 16, lane));
            mma(dp[2 * nb], va, r[0], r[1]);
            mma(dp[2 * nb + 1], va, r[2], r[3]);
          }
        }
      }
    }
    // s becomes P^T, dp becomes dS^T. Past S: lse = inf gives P = 0.
    const bool masked = q0 + g.off < k0 + wrow + 15;
#pragma unroll
    for (int nb = 0; nb < Bm / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nb * 8 + t2 + (e & 1), ki = key_a + (e < 2 ? 0 : 8);
        float p = exp2f(fmaf(s[nb][e], g.scale_log2, -tl[col]));
        if (masked && ki > q0 + col + g.off) p = 0.0f;
        s[nb][e] = p;
        dp[nb][e] = p * (dp[nb][e] - td[col]);
      }
    // dV += P^T dO, dK += dS^T Q (columns d).
#pragma unroll
    for (int kk = 0; kk < Bm / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const uint32_t da[4] = {pack_bf16(dp[2 * kk][0], dp[2 * kk][1]), pack_bf16(dp[2 * kk][2], dp[2 * kk][3]),
                              pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                              pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
      uint32_t pl[4], dl[4];
      if constexpr (kSplit) {
        pl[0] = pack_residual(s[2 * kk][0], s[2 * kk][1], pa[0]);
        pl[1] = pack_residual(s[2 * kk][2], s[2 * kk][3], pa[1]);
        pl[2] = pack_residual(s[2 * kk + 1][0], s[2 * kk + 1][1], pa[2]);
        pl[3] = pack_residual(s[2 * kk + 1][2], s[2 * kk + 1][3], pa[3]);
        dl[0] = pack_residual(dp[2 * kk][0], dp[2 * kk][1], da[0]);
        dl[1] = pack_residual(dp[2 * kk][2], dp[2 * kk][3], da[1]);
        dl[2] = pack_residual(dp[2 * kk + 1][0], dp[2 * kk + 1][1], da[2]);
        dl[3] = pack_residual(dp[2 * kk + 1][2], dp[2 * kk + 1][3], da[3]);
      }
      if constexpr (D == DV && kPart == kBoth) {  // one loop, as the scores above
#pragma unroll
        for (int nb = 0; nb < D / 16; ++nb) {
          accumulate_pair<kSplit>(acc_v, nb, pa, pl, bn_addr<LDV>(tdo, kk * 16, nb * 16, lane));
          accumulate_pair<kSplit>(acc_k, nb, da, dl, bn_addr<LD>(tq, kk * 16, nb * 16, lane));
        }
      } else {
        if constexpr (kV) {
#pragma unroll
          for (int nb = 0; nb < DV / 16; ++nb) accumulate_pair<kSplit>(acc_v, nb, pa, pl, bn_addr<LDV>(tdo, kk * 16, nb * 16, lane));
        }
        if constexpr (kK) {
#pragma unroll
          for (int nb = 0; nb < D / 16; ++nb) accumulate_pair<kSplit>(acc_k, nb, da, dl, bn_addr<LD>(tq, kk * 16, nb * 16, lane));
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ki = key_a + 8 * i;
    if (ki >= g.Sk) continue;
    if constexpr (kK) {
      const int64_t at = kv_base + static_cast<int64_t>(ki) * kv_stride;
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb)
        *reinterpret_cast<uint32_t*>(dk + at + nb * 8 + t2) =
            pack_bf16(acc_k[nb][2 * i] * g.scale, acc_k[nb][2 * i + 1] * g.scale);
    }
    if constexpr (kV) {
      const int64_t at = v_base + static_cast<int64_t>(ki) * v_stride;
#pragma unroll
      for (int nb = 0; nb < DV / 8; ++nb)
        *reinterpret_cast<uint32_t*>(dv + at + nb * 8 + t2) = pack_bf16(acc_v[nb][2 * i], acc_v[nb][2 * i + 1]);
    }
  }
}

// Key tiles of 32 from D = 192 on (the dQ accumulators take most of the registers).
template <int D, int DV>
struct DqCfg {
  static constexpr int Bm = 64, Bn = D >= 192 ? 32 : 64, NT = 128, LD = D + 8, LDV = DV + 8;
  static constexpr size_t smem = sizeof(uint16_t) * (Bm + 2 * Bn) * (LD + LDV);
};

template <int D, int DV, bool kSplit>
__global__ void __launch_bounds__(128) flash_dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                       const uint16_t* dout, const float* lse, const float* dr,
                                                       uint16_t* dq, FlashGeometry g) {
  using C = DqCfg<D, DV>;
  constexpr int Bm = C::Bm, Bn = C::Bn, NT = C::NT, LD = C::LD, LDV = C::LDV;
  extern __shared__ __align__(16) uint16_t smem_dq[];
  uint16_t* sq = smem_dq;
  uint16_t* sdo = sq + Bm * LD;
  uint16_t* sk = sdo + Bm * LDV;     // [2][Bn][LD]
  uint16_t* sv = sk + 2 * Bn * LD;   // [2][Bn][LDV]

  const int tile = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q0 = tile * Bm;
  const int64_t q_stride = static_cast<int64_t>(g.Hq) * D, kv_stride = static_cast<int64_t>(g.Hkv) * D;
  const int64_t o_stride = static_cast<int64_t>(g.Hq) * DV, v_stride = static_cast<int64_t>(g.Hkv) * DV;
  const int64_t q_row = static_cast<int64_t>(b) * g.S * g.Hq + h, q_base = q_row * D;
  const uint16_t* kb = k + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * D;
  const uint16_t* vb = v + (static_cast<int64_t>(b) * g.Sk * g.Hkv + hk) * DV;
  const int kt_end = min(q0 + Bm - 1 + g.off, g.Sk - 1) / Bn;

  load_rows<D, Bm, NT>(sq, q + q_base, q_stride, q0, g.S);
  load_rows<DV, Bm, NT>(sdo, dout + q_row * DV, o_stride, q0, g.S);
  load_rows<D, Bn, NT>(sk, kb, kv_stride, 0, g.Sk);
  load_rows<DV, Bn, NT>(sv, vb, v_stride, 0, g.Sk);
  cp_async_commit();

  const int wrow = warp * 16;
  const int row_a = q0 + wrow + (lane >> 2);
  const int t2 = 2 * (lane & 3);
  const int64_t row_base = (static_cast<int64_t>(b) * g.Hq + h) * g.S;
  float rl[2], rd[2];  // lse * log2(e) and Dr of rows row_a, row_a + 8
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int qi = row_a + 8 * i;
    rl[i] = qi < g.S ? lse[row_base + qi] * kLog2e : INFINITY;
    rd[i] = qi < g.S ? dr[row_base + qi] : 0.0f;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  for (int kt = 0; kt <= kt_end; ++kt) {
    const int buf = kt & 1, k0 = kt * Bn;
    __syncthreads();  // iteration kt - 1 no longer reads buffer buf ^ 1
    if (kt < kt_end) {
      load_rows<D, Bn, NT>(sk + (buf ^ 1) * Bn * LD, kb, kv_stride, k0 + Bn, g.Sk);
      load_rows<DV, Bn, NT>(sv + (buf ^ 1) * Bn * LDV, vb, v_stride, k0 + Bn, g.Sk);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint16_t* tk = sk + buf * Bn * LD;
    const uint16_t* tv = sv + buf * Bn * LDV;

    float s[Bn / 8][4], dp[Bn / 8][4];
#pragma unroll
    for (int i = 0; i < Bn / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
    if constexpr (D == DV) {  // one loop: the operand loads interleave
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[4], da[4];
        ldsm_x4(qa, a_addr<LD>(sq, wrow, kk * 16, lane));
        ldsm_x4(da, a_addr<LDV>(sdo, wrow, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < Bn / 16; ++nb) {
          uint32_t r[4];
          ldsm_x4(r, bt_addr<LD>(tk, nb * 16, kk * 16, lane));
          mma(s[2 * nb], qa, r[0], r[1]);
          mma(s[2 * nb + 1], qa, r[2], r[3]);
          ldsm_x4(r, bt_addr<LDV>(tv, nb * 16, kk * 16, lane));
          mma(dp[2 * nb], da, r[0], r[1]);
          mma(dp[2 * nb + 1], da, r[2], r[3]);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[4];
        ldsm_x4(qa, a_addr<LD>(sq, wrow, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < Bn / 16; ++nb) {
          uint32_t r[4];
          ldsm_x4(r, bt_addr<LD>(tk, nb * 16, kk * 16, lane));
          mma(s[2 * nb], qa, r[0], r[1]);
          mma(s[2 * nb + 1], qa, r[2], r[3]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk) {
        uint32_t da[4];
        ldsm_x4(da, a_addr<LDV>(sdo, wrow, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < Bn / 16; ++nb) {
          uint32_t r[4];
          ldsm_x4(r, bt_addr<LDV>(tv, nb * 16, kk * 16, lane));
          mma(dp[2 * nb], da, r[0], r[1]);
          mma(dp[2 * nb + 1], da, r[2], r[3]);
        }
      }
    }
    const bool masked = k0 + Bn - 1 > q0 + wrow + g.off || k0 + Bn > g.Sk;
#pragma unroll
    for (int nb = 0; nb < Bn / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ki = k0 + nb * 8 + t2 + (e & 1), i = e >> 1, qi = row_a + 8 * i;
        float p = exp2f(fmaf(s[nb][e], g.scale_log2, -rl[i]));
        if (masked && (ki > qi + g.off || ki >= g.Sk)) p = 0.0f;
        dp[nb][e] = p * (dp[nb][e] - rd[i]);
      }
    // dQ += dS K: B = K as stored [key][d].
#pragma unroll
    for (int kk = 0; kk < Bn / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16(dp[2 * kk][0], dp[2 * kk][1]), pack_bf16(dp[2 * kk][2], dp[2 * kk][3]),
                             pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                             pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
      uint32_t al[4];
      if constexpr (kSplit) {
        al[0] = pack_residual(dp[2 * kk][0], dp[2 * kk][1], a[0]);
        al[1] = pack_residual(dp[2 * kk][2], dp[2 * kk][3], a[1]);
        al[2] = pack_residual(dp[2 * kk + 1][0], dp[2 * kk + 1][1], a[2]);
        al[3] = pack_residual(dp[2 * kk + 1][2], dp[2 * kk + 1][3], a[3]);
      }
#pragma unroll
      for (int nb = 0; nb < D / 16; ++nb) accumulate_pair<kSplit>(acc, nb, a, al, bn_addr<LD>(tk, kk * 16, nb * 16, lane));
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int qi = row_a + 8 * i;
    if (qi >= g.S) continue;
    uint16_t* row = dq + q_base + static_cast<int64_t>(qi) * q_stride;
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb)
      *reinterpret_cast<uint32_t*>(row + nb * 8 + t2) =
          pack_bf16(acc[nb][2 * i] * g.scale, acc[nb][2 * i + 1] * g.scale);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

template <typename Kernel, typename... Args>
void launch_flash(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, Args... args) {
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, threads, smem, stream>>>(args...);
  MC_CUDA_CHECK_LAUNCH();
}

// Calls f(integral_constant D, integral_constant DV) for the head dims the flash kernels take.
template <typename F>
void with_head_dims(int64_t head_dim, int64_t value_dim, const char* op, F&& f) {
  using std::integral_constant;
  if (value_dim == head_dim) {
    switch (head_dim) {
      case 64: f(integral_constant<int, 64>{}, integral_constant<int, 64>{}); return;
      case 96: f(integral_constant<int, 96>{}, integral_constant<int, 96>{}); return;
      case 128: f(integral_constant<int, 128>{}, integral_constant<int, 128>{}); return;
      case 256: f(integral_constant<int, 256>{}, integral_constant<int, 256>{}); return;
      default: break;
    }
  } else if (head_dim == 192 && value_dim == 128) {
    f(integral_constant<int, 192>{}, integral_constant<int, 128>{});
    return;
  }
  MC_FAIL(op, ": the flash path supports head dims (D, Dv) = ", kFlashHeadDims, ", got (", head_dim, ", ", value_dim,
          ")");
}

FlashGeometry flash_geometry(const AttentionDims& d, DType dtype, double scale, const char* op) {
  MC_CHECK(attention_flash_supported(d, dtype, scale), op, ": the flash path needs bf16 inputs, head dims (D, Dv) = ",
           kFlashHeadDims, " and a softmax scale > 0; got ", dtype_name(dtype), ", (", d.head_dim, ", ",
           d.value_dim(), "), scale ", scale);
  MC_CHECK(d.keys() < (int64_t(1) << 30) && d.q_heads <= 65535 && d.batch <= 65535, op, ": sizes ", d.batch, " x ",
           d.seq, " (keys ", d.keys(), ") x ", d.q_heads, " exceed the flash kernels' grid limits");
  const float c = static_cast<float>(scale);
  return {static_cast<int>(d.seq), static_cast<int>(d.q_heads), static_cast<int>(d.kv_heads),
          static_cast<int>(d.group()), c, c * kLog2e, static_cast<int>(d.keys()), static_cast<int>(d.offset())};
}

const uint16_t* bits(const Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data<bf16>()); }
uint16_t* bits(Tensor& t) { return reinterpret_cast<uint16_t*>(t.data<bf16>()); }

unsigned tiles(int64_t n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

}  // namespace

bool attention_flash_supported(const AttentionDims& d, DType dtype, double scale) {
  const int64_t D = d.head_dim, Dv = d.value_dim();
  const bool dims = (D == Dv && (D == 64 || D == 96 || D == 128 || D == 256)) || (D == 192 && Dv == 128);
  return dtype == DType::BF16 && dims && scale > 0;
}

bool attention_flash_split_ds() {
  const char* env = env_switch("MOECORE_ATTENTION_FLASH_SPLIT");
  return !(env && std::string(env) == "0");
}

void attention_forward_flash(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out,
                             Tensor& lse, const AttentionDims& d) {
  const FlashGeometry g = flash_geometry(d, q.dtype(), scale, "attention_forward");
  cudaStream_t stream = prepare(q);
  if (flash_hopper::available(d, q, k, v)) {
    flash_hopper::forward(q, k, v, g.scale, out, lse, d, stream);
    return;
  }
  with_head_dims(d.head_dim, d.value_dim(), "attention_forward", [&](auto dim, auto vdim) {
    constexpr int D = decltype(dim)::value, DV = decltype(vdim)::value;
    using C = FwdCfg<D, DV>;
    launch_flash(flash_forward_kernel<D, DV>, dim3(tiles(d.seq, C::Br), d.q_heads, d.batch), C::NT, C::smem, stream,
                 bits(q), bits(k), bits(v), bits(out), lse.data<float>(), g);
  });
}

void attention_backward_flash(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv,
                              const AttentionDims& d) {
  const FlashGeometry g = flash_geometry(d, q.dtype(), scale, "attention_backward");
  cudaStream_t stream = prepare(q);
  Tensor dr = Tensor::empty({d.batch, d.q_heads, d.seq}, DType::F32, q.device());
  const bool split = attention_flash_split_ds();
  with_head_dims(d.head_dim, d.value_dim(), "attention_backward", [&](auto dim, auto vdim) {
    constexpr int D = decltype(dim)::value, DV = decltype(vdim)::value;
    const int64_t rows = d.batch * d.seq * d.q_heads;
    launch_flash(flash_dr_kernel<DV>, dim3(static_cast<unsigned>((rows + 7) / 8)), 256, 0, stream, bits(out),
                 bits(dout), dr.data<float>(), rows, g);
    if (flash_hopper::available(d, q, k, v, &dout)) {
      flash_hopper::backward(q, k, v, lse, dr, dout, g.scale, split, dq, dk, dv, d, stream);
      return;
    }
    auto run = [&](auto split_tag) {
      constexpr bool S = decltype(split_tag)::value;
      using KV = DkvCfg<D, DV>;
      const dim3 kv_grid(tiles(d.keys(), KV::Bn), d.kv_heads, d.batch);
      auto dkv = [&](auto part) {
        launch_flash(flash_dkv_kernel<D, DV, S, decltype(part)::value>, kv_grid, KV::NT, KV::smem, stream, bits(q),
                     bits(k), bits(v), bits(dout), lse.data<float>(), dr.data<float>(), bits(dk), bits(dv), g);
      };
      if constexpr (KV::kSplitParts) {
        dkv(std::integral_constant<int, kOnlyK>{});
        dkv(std::integral_constant<int, kOnlyV>{});
      } else {
        dkv(std::integral_constant<int, kBoth>{});
      }
      using Q = DqCfg<D, DV>;
      launch_flash(flash_dq_kernel<D, DV, S>, dim3(tiles(d.seq, Q::Bm), d.q_heads, d.batch), Q::NT, Q::smem, stream,
                   bits(q), bits(k), bits(v), bits(dout), lse.data<float>(), dr.data<float>(), bits(dq), g);
    };
    if (split)
      run(std::true_type{});
    else
      run(std::false_type{});
  });
}

}  // namespace moecore::ops::cuda
