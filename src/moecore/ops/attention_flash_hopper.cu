// Hopper (sm_90a) flash attention for D = 128 and MLA's D = 192 with Dv = 128 (KD below: the
// query/key head dim; the value head dim is 128), bf16 in, fp32 accumulate: the flash path's
// kernels on compute capability 9.0 (semantics in attention.h, interface in
// attention_flash_hopper.h).
//
// Every kernel: one CTA = 2 consumer warpgroups + 1 producer warpgroup (384 threads; setmaxnreg
// moves registers to the consumers), one CTA per SM.
// The producer issues TMA loads (128-byte swizzle; q/k/v/dout seen as 4-D tensors {D, H, S, B}, so
// a box {64, 1, rows, 1} is a [rows][64] block of one head; a KD-wide row tile is KD / 64 such
// chunks) of the CTA's fixed tiles once and of the streamed tiles into a ring of stages
// (full/empty mbarriers). Each consumer warpgroup owns
// 64 rows of the CTA's tile and runs wgmma: products of two shared-memory tiles give score-like
// blocks in fp32 registers; those blocks, rounded to bf16 pairs, are the register A operand of
// the next wgmma (the m64n*k16 accumulator layout is the A fragment layout), so P and dS never
// touch shared memory.
//
//   forward  grid (query tiles of 128, Hq, B), longest first. Q (128 x KD) once;
//            K (KD wide) and V (128 wide) tiles of 128 keys, from the last one the tile sees down
//            to 0, 2 stages. S = Q K^T, masked only
//            in tiles that cross the shifted diagonal or the key end; online softmax in fp32
//            (exp2 with c log2 e folded in), O = O corr + P V with P rounded to bf16 (as the
//            mma.sync kernels).
//   dK, dV   grid (key tiles of 128, Hkv, B). K (KD wide) and V (128 keys) once; for every query
//            head of the group and every query tile (64 queries at KD = 128, 32 at KD = 192: the
//            registers) that sees the key tile: Q, dO, lse and Dr of its rows, in 4 (KD = 128) or 7
//            stages. S^T = K Q^T, dP^T = V dO^T (m64n64 / m64n32), P^T = exp(c S^T - lse),
//            dS^T = P^T (dP^T - Dr); dV += P^T dO, dK += dS^T Q (register A, dO and Q MN-major;
//            dK is m64n192 at KD = 192).
//   dQ       grid (query tiles of 128, Hq, B), longest first. Q, dO (128 rows) once; K (KD wide)
//            and V tiles of 64 keys, 4 stages (3 at KD = 192). S = Q K^T, dP = dO V^T (m64n64),
//            dS as above, dQ += dS K (K read MN-major from the same tile).
// Each CTA owns the rows it writes: no atomics, deterministic. split: P (for dV) and dS enter
// their products as hi + lo bf16 pairs (two wgmmas into one accumulator), as in
// attention_flash_cuda.cu.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "moecore/core/cuda_check.h"
#include "moecore/core/env_switches.h"
#include "moecore/ops/attention_flash_hopper.h"
#include "moecore/ops/hopper_common.cuh"

namespace moecore::ops::cuda::flash_hopper {

namespace {

using namespace hopper_ptx;

constexpr int kD = 128;
constexpr int kConsumers = 256;             // warpgroups 0 and 1
constexpr int kThreads = kConsumers + 128;  // + the producer warpgroup (one warp of it works)
// Registers per thread after setmaxnreg. A CTA of 384 threads starts with kStartRegs per thread
// (65536 / 384, rounded down to a multiple of 8: 168), and setmaxnreg.inc only moves registers the
// producer's setmaxnreg.dec gave back: the consumers' gain must not exceed the producer's loss,
// or the consumers wait forever. 240 / 24 balance exactly (256 x 72 = 128 x 144); with 32 for the
// producer the consumers would ask for more than it frees (the assert below refuses that build,
// whose kernels hung).
constexpr int kConsumerRegs = 240, kProducerRegs = 24;
constexpr int kStartRegs = (65536 / kThreads) & ~7;
static_assert(kConsumers * (kConsumerRegs - kStartRegs) <= (kThreads - kConsumers) * (kStartRegs - kProducerRegs),
              "setmaxnreg: the consumers would take more registers than the producer frees");
constexpr float kLog2e = 1.4426950408889634f;
// Bytes of one [rows][64] bf16 block: the two halves of a row tile of D = 128 lie this far apart.
constexpr int chunk_bytes(int rows) { return rows * 64 * 2; }

// The most dynamic shared memory a CTA may have (227 KiB on compute capability 9.0).
constexpr size_t kMaxSmem = 227 * 1024;

struct Geometry {
  int Sq, Sk, off;       // off = Sk - Sq: query s sees keys t <= s + off
  int Hq, Hkv, group;
  float scale, scale_log2;  // c and c log2(e)
};

// The forward takes a query/key head dim KD of 128 or 192 (MLA; the value head dim stays 128):
// Q and K are KD / 64 chunks of [rows][64]. At KD = 192 the shared memory is 1 KiB + 48 KiB (Q)
// + 2 stages x (48 + 32) KiB.
namespace fwd {
constexpr int kBr = 128, kBc = 128, kStages = 2;
template <int KD>
struct Sizes {
  static_assert(KD == 128 || KD == 192, "the Hopper forward takes KD = 128 or 192");
  static constexpr int kQBytes = kBr * KD * 2;    // Q: KD / 64 chunks [128][64]
  static constexpr int kKBytes = kBc * KD * 2;    // K: KD / 64 chunks [128 keys][64 d] (K-major B of S = Q K^T)
  static constexpr int kVBytes = kBc * kD * 2;    // V: [2 key blocks][2 d chunks][64][64] (MN-major B of P V)
  static constexpr int kStageBytes = kKBytes + kVBytes;
  static constexpr size_t kSmem = 1024 + kQBytes + kStages * kStageBytes + (1 + 3 * kStages) * sizeof(uint64_t);
  static_assert(kSmem <= kMaxSmem, "forward: shared memory over 227 KiB");
};
}  // namespace fwd

// dK, dV: 128 keys (64 per warpgroup) against kBm-query tiles; K is KD / 64 chunks [128 keys][64],
// V 2 chunks. KD = 128: 64-query tiles, 4 stages (faster than 32-query tiles with 6 stages at
// mixtral-small's shape). KD = 192: the dK accumulator is 64 x 192 (96 registers a thread), so
// 64-query tiles (S^T and dP^T of 32 registers each) would not fit the consumers' 240 registers:
// 32-query tiles (m64n32: 16 each), 7 stages of Q (3 chunks [32][64]) and dO (2 chunks).
namespace dkv {
constexpr int kBn = 128;
template <int KD>
struct Sizes {
  static_assert(KD == 128 || KD == 192, "the Hopper backward takes KD = 128 or 192");
  static constexpr int kBm = KD == 128 ? 64 : 32, kStages = KD == 128 ? 4 : 7;
  static constexpr int kKBytes = kBn * KD * 2;    // K: KD / 64 chunks [128 keys][64 d]
  static constexpr int kVBytes = kBn * kD * 2;    // V: 2 chunks [128 keys][64 d]
  static constexpr int kQBytes = kBm * KD * 2;    // Q of a stage: KD / 64 chunks [kBm][64]
  static constexpr int kDoBytes = kBm * kD * 2;   // dO of a stage: 2 chunks [kBm][64]
  static constexpr int kStageBytes = kQBytes + kDoBytes;  // what the TMA loads of a stage bring
  static constexpr size_t kSmem = 1024 + kKBytes + kVBytes + kStages * kStageBytes +
                                  2 * kStages * kBm * sizeof(float) + (1 + 2 * kStages) * sizeof(uint64_t);
  static_assert(kSmem <= kMaxSmem, "dK/dV: shared memory over 227 KiB");
  static_assert(kStageBytes % 1024 == 0 && chunk_bytes(kBm) % 1024 == 0, "128-byte swizzle: 1 KiB aligned tiles");
};
}  // namespace dkv

// dQ: 128 queries (64 per warpgroup) against 64-key tiles; Q is KD / 64 chunks [128][64], dO 2
// chunks; a stage holds K (KD / 64 chunks [64 keys][64]) and V (2 chunks). 4 stages at KD = 128,
// 3 at KD = 192 (the dQ accumulator, 64 x KD, fits the registers either way).
namespace dq {
constexpr int kBm = 128, kBn = 64;
template <int KD>
struct Sizes {
  static_assert(KD == 128 || KD == 192, "the Hopper backward takes KD = 128 or 192");
  static constexpr int kStages = KD == 128 ? 4 : 3;
  static constexpr int kQBytes = kBm * KD * 2;   // Q: KD / 64 chunks [128][64]
  static constexpr int kDoBytes = kBm * kD * 2;  // dO: 2 chunks [128][64]
  static constexpr int kKBytes = kBn * KD * 2;   // K of a stage: KD / 64 chunks [64 keys][64 d]
  static constexpr int kVBytes = kBn * kD * 2;   // V of a stage: 2 chunks [64 keys][64 d]
  static constexpr int kStageBytes = kKBytes + kVBytes;  // what the TMA loads of a stage bring
  static constexpr size_t kSmem =
      1024 + kQBytes + kDoBytes + kStages * kStageBytes + (1 + 2 * kStages) * sizeof(uint64_t);
  static_assert(kSmem <= kMaxSmem, "dQ: shared memory over 227 KiB");
  static_assert(kStageBytes % 1024 == 0 && kKBytes % 1024 == 0, "128-byte swizzle: 1 KiB aligned tiles");
};
}  // namespace dq

#ifdef MOECORE_HOPPER_DEVICE
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}
// bf16 pair (round to nearest even), lo in the low half (the smaller column).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// The pair (lo, hi) - bf16 values of `packed`, rounded to bf16: the lo part of a hi + lo split.
__device__ __forceinline__ uint32_t pack_residual(float lo, float hi, uint32_t packed) {
  const float2 r = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  return pack_bf16(lo - r.x, hi - r.y);
}
// The register A fragment of k16 step kk (columns 16 kk .. 16 kk + 15) of a 64 x N fp32
// accumulator: the pairs of 8-column blocks 2 kk (rows g, g + 8) and 2 kk + 1.
template <int N>
__device__ __forceinline__ void a_fragment(const float (&s)[N], int kk, uint32_t (&a)[4], uint32_t (&lo)[4],
                                           bool split) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    a[r] = pack_bf16(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    if (split) lo[r] = pack_residual(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1], a[r]);
  }
}
template <int kRegs>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (kRegs > 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t addr) { return smem_desc(addr, 16, 1024); }
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t addr, uint32_t chunk_stride) {
  return smem_desc(addr, chunk_stride, 1024);
}
// D[64 x N] (+)= A[64 x 16] B[N x 16]^T, both K-major in shared memory, N = 32 or 64.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 32 || N == 64);
  if constexpr (N == 32) wgmma_m64n32k16<0, 0>(d, desc_a, desc_b, scale_d);
  else wgmma_m64n64k16<0, 0>(d, desc_a, desc_b, scale_d);
}
// D[64 x N] += A[64 x 16] B[N x 16]^T, A in registers, B MN-major in shared memory (N / 64
// chunks LBO apart), N = 128 or 192.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 128 || N == 192);
  if constexpr (N == 128) wgmma_m64n128k16_rs<1>(d, a, desc_b);
  else wgmma_m64n192k16_rs<1>(d, a, desc_b);
}
__device__ __forceinline__ void init_barriers(uint64_t* bars, int n, int count_first, int count_full, int stages) {
  // bars: [0] the fixed tiles, [1, 1 + n * stages) full barriers, then the empty ones.
  mbar_init(&bars[0], count_first);
  for (int s = 0; s < n * stages; ++s) mbar_init(&bars[1 + s], count_full);
  for (int s = 0; s < stages; ++s) mbar_init(&bars[1 + n * stages + s], 2);  // one arrival per warpgroup
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
#endif

// ---------------------------------------------------------------------------------------------
// Forward (KD: the query/key head dim, 128 or 192; the value head dim is kD = 128).
template <int KD>
__global__ void __launch_bounds__(kThreads, 1)
    flash_forward_hopper(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                         const __grid_constant__ CUtensorMap tv, __nv_bfloat16* out, float* lse, const Geometry g) {
#ifdef MOECORE_HOPPER_DEVICE
  using namespace fwd;
  using Z = Sizes<KD>;
  constexpr int kQBytes = Z::kQBytes, kKBytes = Z::kKBytes, kVBytes = Z::kVBytes, kStageBytes = Z::kStageBytes;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = aligned_smem(smem_raw);
  uint8_t* stages = sq + kQBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;
  uint64_t* v_full = k_full + kStages;
  uint64_t* empty = v_full + kStages;

  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / g.group;
  const int q0 = qt * kBr;
  const int key_end = min(g.Sk, q0 + kBr + g.off);  // keys [0, key_end) are seen by some row
  const int n_tiles = (key_end + kBc - 1) / kBc;
  if (threadIdx.x == 0) init_barriers(bars, 2, 1, 1, kStages);
  __syncthreads();

  if (threadIdx.x >= kConsumers) {  // producer: one thread issues the loads
    set_max_registers<kProducerRegs>();
    if (threadIdx.x != kConsumers) return;
    mbar_expect_tx(q_full, kQBytes);
    for (int c = 0; c < KD / 64; ++c) tma_load_4d(sq + c * chunk_bytes(kBr), &tq, q_full, 64 * c, h, q0, b);
    for (int it = 0; it < n_tiles; ++it) {
      const int s = it % kStages, round = it / kStages;
      const int k0 = (n_tiles - 1 - it) * kBc;
      if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
      uint8_t* sk = stages + s * kStageBytes;
      uint8_t* sv = sk + kKBytes;
      mbar_expect_tx(&k_full[s], kKBytes);
      for (int c = 0; c < KD / 64; ++c) tma_load_4d(sk + c * chunk_bytes(kBc), &tk, &k_full[s], 64 * c, kvh, k0, b);
      mbar_expect_tx(&v_full[s], kVBytes);
      for (int kb = 0; kb < 2; ++kb)
        for (int c = 0; c < 2; ++c)
          tma_load_4d(sv + (2 * kb + c) * chunk_bytes(64), &tv, &v_full[s], 64 * c, kvh, k0 + 64 * kb, b);
    }
    return;
  }

  set_max_registers<kConsumerRegs>();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, t = lane % 4;
  const int row0 = q0 + wg * 64 + warp * 16 + lane / 4;  // this thread's rows: row0, row0 + 8
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const uint32_t q_base = smem_u32(sq) + wg * chunk_bytes(64);  // this warpgroup's 64 rows
  mbar_wait(q_full, 0);
  for (int it = 0; it < n_tiles; ++it) {
    const int s = it % kStages;
    const uint32_t parity = (it / kStages) & 1;
    const int k0 = (n_tiles - 1 - it) * kBc;
    const uint32_t k_base = smem_u32(stages + s * kStageBytes), v_base = k_base + kKBytes;
    float sc[64];
    mbar_wait(&k_full[s], parity);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk) {  // S = Q K^T over d
      const uint32_t k16 = (kk & 3) * 32;
      wgmma_m64n128k16<0, 0>(sc, kmajor_desc(q_base + (kk >> 2) * chunk_bytes(kBr) + k16),
                             kmajor_desc(k_base + (kk >> 2) * chunk_bytes(kBc) + k16), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(sc);
    // Accumulator (j, e): row row0 + 8 (e / 2), key k0 + 8 j + 2 t + e % 2.
    if (k0 + kBc - 1 > q0 + g.off || k0 + kBc > g.Sk) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * j + 2 * t + (e & 1), row = row0 + 8 * (e >> 1);
          if (key > row + g.off || key >= g.Sk) sc[4 * j + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // online softmax of row row0 + 8 i (a quad of lanes shares it)
      float mx = m[i];
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * i], sc[4 * j + 2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = mx == -INFINITY ? 0.0f : mx * g.scale_log2;  // a row with no key yet
      const float corr = exp2f(m[i] * g.scale_log2 - shift);
      m[i] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(fmaf(sc[4 * j + 2 * i + e], g.scale_log2, -shift));
          sc[4 * j + 2 * i + e] = p;
          sum += p;
        }
      l[i] = l[i] * corr + sum;  // this thread's part; the quad is summed at the end
#pragma unroll
      for (int j = 0; j < 16; ++j) o[4 * j + 2 * i] *= corr, o[4 * j + 2 * i + 1] *= corr;
    }
    uint32_t pa[8][4], unused[4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) a_fragment(sc, kk, pa[kk], unused, false);
    mbar_wait(&v_full[s], parity);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk)  // O += P V: keys 16 kk.. of 64-key block kk / 4
      wgmma_m64n128k16_rs<1>(o, pa[kk],
                             mnmajor_desc(v_base + (kk >> 2) * 2 * chunk_bytes(64) + (kk & 3) * 2048, chunk_bytes(64)));
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(o);
    if (tid == 0) mbar_arrive(&empty[s]);
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + 8 * i;
    if (row >= g.Sq) continue;
    const float inv = 1.0f / l[i];
    __nv_bfloat16* dst = out + ((static_cast<int64_t>(b) * g.Sq + row) * g.Hq + h) * kD + 2 * t;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
          __floats2bfloat162_rn(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
    if (t == 0) lse[(static_cast<int64_t>(b) * g.Hq + h) * g.Sq + row] = m[i] * g.scale + logf(l[i]);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without sm_90a features was loaded: fail loudly rather than write nothing
#endif
}

// ---------------------------------------------------------------------------------------------
// dK, dV per key tile (KD: the query/key head dim, 128 or 192; the value head dim is kD = 128).
template <int KD, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    flash_dkv_hopper(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                     const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const float* lse,
                     const float* dr, __nv_bfloat16* dk, __nv_bfloat16* dv, const Geometry g) {
#ifdef MOECORE_HOPPER_DEVICE
  using namespace dkv;
  using Z = Sizes<KD>;
  constexpr int kBm = Z::kBm, kStages = Z::kStages, kKBytes = Z::kKBytes, kVBytes = Z::kVBytes;
  constexpr int kQBytes = Z::kQBytes, kStageBytes = Z::kStageBytes;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sk = aligned_smem(smem_raw);
  uint8_t* sv = sk + kKBytes;
  uint8_t* stages = sv + kVBytes;  // [stage]: Q [KD / 64][kBm][64], dO [2][kBm][64]
  float* s_lse = reinterpret_cast<float*>(stages + kStages * kStageBytes);  // [stage][kBm], lse log2(e)
  float* s_dr = s_lse + kStages * kBm;                                      // [stage][kBm]
  uint64_t* bars = reinterpret_cast<uint64_t*>(s_dr + kStages * kBm);
  uint64_t* kv_full = bars;
  uint64_t* full = bars + 1;
  uint64_t* empty = full + kStages;

  const int k0 = blockIdx.x * kBn, kvh = blockIdx.y, b = blockIdx.z;  // the first key tiles have most work
  const int qt_begin = max(0, k0 - g.off) / kBm;  // the first query tile that sees a key of the tile
  const int per_head = (g.Sq + kBm - 1) / kBm - qt_begin;
  const int total = g.group * per_head;
  if (threadIdx.x == 0) init_barriers(bars, 1, 1, 32, kStages);  // full: every producer lane arrives
  __syncthreads();

  if (threadIdx.x >= kConsumers) {  // producer: lse and Dr by every lane of one warp, TMA by lane 0
    set_max_registers<kProducerRegs>();
    if (threadIdx.x >= kConsumers + 32) return;
    const int lane = threadIdx.x - kConsumers;
    if (lane == 0) {
      mbar_expect_tx(kv_full, kKBytes + kVBytes);  // KD / 64 + 2 boxes of [128][64]
      for (int c = 0; c < KD / 64; ++c) {
        tma_load_4d(sk + c * chunk_bytes(kBn), &tk, kv_full, 64 * c, kvh, k0, b);
        if (c < 2) tma_load_4d(sv + c * chunk_bytes(kBn), &tv, kv_full, 64 * c, kvh, k0, b);
      }
    }
    for (int it = 0; it < total; ++it) {
      const int s = it % kStages, round = it / kStages;
      const int hq = kvh * g.group + it / per_head, qs = (qt_begin + it % per_head) * kBm;
      if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
      for (int r = lane; r < kBm; r += 32) {
        const int row = qs + r;
        const int64_t at = (static_cast<int64_t>(b) * g.Hq + hq) * g.Sq + row;
        s_lse[s * kBm + r] = row < g.Sq ? lse[at] * kLog2e : INFINITY;  // rows past Sq: P = 0
        s_dr[s * kBm + r] = row < g.Sq ? dr[at] : 0.f;
      }
      if (lane == 0) {
        uint8_t* q_dst = stages + s * kStageBytes;
        mbar_expect_tx(&full[s], kStageBytes);  // KD / 64 + 2 boxes of [kBm][64]
        for (int c = 0; c < KD / 64; ++c) {
          tma_load_4d(q_dst + c * chunk_bytes(kBm), &tq, &full[s], 64 * c, hq, qs, b);
          if (c < 2) tma_load_4d(q_dst + kQBytes + c * chunk_bytes(kBm), &tdo, &full[s], 64 * c, hq, qs, b);
        }
      } else {
        mbar_arrive(&full[s]);
      }
    }
    return;
  }

  set_max_registers<kConsumerRegs>();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, t = lane % 4;
  const int key0 = k0 + wg * 64 + warp * 16 + lane / 4;  // this thread's keys: key0, key0 + 8
  float acc_k[KD / 2], acc_v[64];
#pragma unroll
  for (int i = 0; i < KD / 2; ++i) acc_k[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) acc_v[i] = 0.f;
  const uint32_t k_base = smem_u32(sk) + wg * chunk_bytes(64), v_base = smem_u32(sv) + wg * chunk_bytes(64);
  mbar_wait(kv_full, 0);
  for (int it = 0; it < total; ++it) {
    const int s = it % kStages;
    const int qs = (qt_begin + it % per_head) * kBm;
    const uint32_t q_base = smem_u32(stages + s * kStageBytes), do_base = q_base + kQBytes;
    float st[kBm / 2], dpt[kBm / 2];
    mbar_wait(&full[s], (it / kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk) {  // S^T = K Q^T over KD, dP^T = V dO^T over kD
      const uint32_t off_a = (kk >> 2) * chunk_bytes(kBn) + (kk & 3) * 32;
      const uint32_t off_b = (kk >> 2) * chunk_bytes(kBm) + (kk & 3) * 32;
      wgmma_ss<kBm>(st, kmajor_desc(k_base + off_a), kmajor_desc(q_base + off_b), kk > 0);
      if (kk < kD / 16) wgmma_ss<kBm>(dpt, kmajor_desc(v_base + off_a), kmajor_desc(do_base + off_b), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(st);
    fence_acc(dpt);
    // Accumulator (j, e): key key0 + 8 (e / 2), query qs + 8 j + 2 t + e % 2.
    const bool masked = k0 + kBn - 1 - qs > g.off;
    const float* lse2 = s_lse + s * kBm;
    const float* drs = s_dr + s * kBm;
#pragma unroll
    for (int j = 0; j < kBm / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * t + (e & 1);
        float p = exp2f(fmaf(st[4 * j + e], g.scale_log2, -lse2[col]));
        if (masked && key0 + 8 * (e >> 1) > qs + col + g.off) p = 0.f;
        st[4 * j + e] = p;
        dpt[4 * j + e] = p * (dpt[4 * j + e] - drs[col]);
      }
    uint32_t pa[kBm / 16][4], pl[kBm / 16][4], sa[kBm / 16][4], sl[kBm / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBm / 16; ++kk) {
      a_fragment(st, kk, pa[kk], pl[kk], kSplit);
      a_fragment(dpt, kk, sa[kk], sl[kk], kSplit);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBm / 16; ++kk) {  // dV += P^T dO, dK += dS^T Q over the kBm queries
      // MN-major B: query rows 16 kk.. (2 KiB per 16 rows), d chunks chunk_bytes(kBm) apart.
      const uint64_t ddo = mnmajor_desc(do_base + kk * 2048, chunk_bytes(kBm));
      const uint64_t dq_ = mnmajor_desc(q_base + kk * 2048, chunk_bytes(kBm));
      wgmma_rs<kD>(acc_v, pa[kk], ddo);
      if (kSplit) wgmma_rs<kD>(acc_v, pl[kk], ddo);
      wgmma_rs<KD>(acc_k, sa[kk], dq_);
      if (kSplit) wgmma_rs<KD>(acc_k, sl[kk], dq_);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc_v);
    fence_acc(acc_k);
    if (tid == 0) mbar_arrive(&empty[s]);
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = key0 + 8 * i;
    if (key >= g.Sk) continue;
    const int64_t row = (static_cast<int64_t>(b) * g.Sk + key) * g.Hkv + kvh;
    __nv_bfloat16* dk_row = dk + row * KD + 2 * t;
    __nv_bfloat16* dv_row = dv + row * kD + 2 * t;
#pragma unroll
    for (int j = 0; j < KD / 8; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(dk_row + 8 * j) =
          __floats2bfloat162_rn(acc_k[4 * j + 2 * i] * g.scale, acc_k[4 * j + 2 * i + 1] * g.scale);
      if (j < kD / 8)
        *reinterpret_cast<__nv_bfloat162*>(dv_row + 8 * j) =
            __floats2bfloat162_rn(acc_v[4 * j + 2 * i], acc_v[4 * j + 2 * i + 1]);
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// dQ per query tile (KD as above).
template <int KD, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    flash_dq_hopper(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                    const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const float* lse,
                    const float* dr, __nv_bfloat16* dq, const Geometry g) {
#ifdef MOECORE_HOPPER_DEVICE
  using namespace dq;
  using Z = Sizes<KD>;
  constexpr int kStages = Z::kStages, kQBytes = Z::kQBytes, kDoBytes = Z::kDoBytes, kKBytes = Z::kKBytes;
  constexpr int kStageBytes = Z::kStageBytes;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = aligned_smem(smem_raw);
  uint8_t* sdo = sq + kQBytes;
  uint8_t* stages = sdo + kDoBytes;  // [stage]: K [KD / 64][64][64], V [2][64][64]
  uint64_t* bars = reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes);
  uint64_t* qd_full = bars;
  uint64_t* full = bars + 1;
  uint64_t* empty = full + kStages;

  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / g.group;
  const int q0 = qt * kBm;
  const int key_end = min(g.Sk, q0 + kBm + g.off);
  const int n_tiles = (key_end + kBn - 1) / kBn;
  if (threadIdx.x == 0) init_barriers(bars, 1, 1, 1, kStages);
  __syncthreads();

  if (threadIdx.x >= kConsumers) {
    set_max_registers<kProducerRegs>();
    if (threadIdx.x != kConsumers) return;
    mbar_expect_tx(qd_full, kQBytes + kDoBytes);  // KD / 64 + 2 boxes of [128][64]
    for (int c = 0; c < KD / 64; ++c) {
      tma_load_4d(sq + c * chunk_bytes(kBm), &tq, qd_full, 64 * c, h, q0, b);
      if (c < 2) tma_load_4d(sdo + c * chunk_bytes(kBm), &tdo, qd_full, 64 * c, h, q0, b);
    }
    for (int it = 0; it < n_tiles; ++it) {
      const int s = it % kStages, round = it / kStages;
      const int k0 = (n_tiles - 1 - it) * kBn;
      if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
      uint8_t* dst = stages + s * kStageBytes;
      mbar_expect_tx(&full[s], kStageBytes);  // KD / 64 + 2 boxes of [64][64]
      for (int c = 0; c < KD / 64; ++c) {
        tma_load_4d(dst + c * chunk_bytes(kBn), &tk, &full[s], 64 * c, kvh, k0, b);
        if (c < 2) tma_load_4d(dst + kKBytes + c * chunk_bytes(kBn), &tv, &full[s], 64 * c, kvh, k0, b);
      }
    }
    return;
  }

  set_max_registers<kConsumerRegs>();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, t = lane % 4;
  const int row0 = q0 + wg * 64 + warp * 16 + lane / 4;
  float lse2[2], drr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + 8 * i;
    const int64_t at = (static_cast<int64_t>(b) * g.Hq + h) * g.Sq + row;
    lse2[i] = row < g.Sq ? lse[at] * kLog2e : INFINITY;
    drr[i] = row < g.Sq ? dr[at] : 0.f;
  }
  float acc[KD / 2];
#pragma unroll
  for (int i = 0; i < KD / 2; ++i) acc[i] = 0.f;
  const uint32_t q_base = smem_u32(sq) + wg * chunk_bytes(64), do_base = smem_u32(sdo) + wg * chunk_bytes(64);
  mbar_wait(qd_full, 0);
  for (int it = 0; it < n_tiles; ++it) {
    const int s = it % kStages;
    const int k0 = (n_tiles - 1 - it) * kBn;
    const uint32_t k_base = smem_u32(stages + s * kStageBytes), v_base = k_base + kKBytes;
    float sc[32], dp[32];
    mbar_wait(&full[s], (it / kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk) {  // S = Q K^T over KD, dP = dO V^T over kD
      const uint32_t off_a = (kk >> 2) * chunk_bytes(kBm) + (kk & 3) * 32;
      const uint32_t off_b = (kk >> 2) * chunk_bytes(kBn) + (kk & 3) * 32;
      wgmma_ss<kBn>(sc, kmajor_desc(q_base + off_a), kmajor_desc(k_base + off_b), kk > 0);
      if (kk < kD / 16) wgmma_ss<kBn>(dp, kmajor_desc(do_base + off_a), kmajor_desc(v_base + off_b), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(sc);
    fence_acc(dp);
    const bool masked = k0 + kBn - 1 > q0 + g.off || k0 + kBn > g.Sk;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1, key = k0 + 8 * j + 2 * t + (e & 1);
        float p = exp2f(fmaf(sc[4 * j + e], g.scale_log2, -lse2[i]));
        if (masked && (key > row0 + 8 * i + g.off || key >= g.Sk)) p = 0.f;
        sc[4 * j + e] = p * (dp[4 * j + e] - drr[i]);  // dS
      }
    uint32_t sa[4][4], sl[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) a_fragment(sc, kk, sa[kk], sl[kk], kSplit);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {  // dQ += dS K: K read MN-major (KD / 64 d chunks 8 KiB apart)
      const uint64_t dk_ = mnmajor_desc(k_base + kk * 2048, chunk_bytes(kBn));
      wgmma_rs<KD>(acc, sa[kk], dk_);
      if (kSplit) wgmma_rs<KD>(acc, sl[kk], dk_);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc);
    if (tid == 0) mbar_arrive(&empty[s]);
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + 8 * i;
    if (row >= g.Sq) continue;
    __nv_bfloat16* dst = dq + ((static_cast<int64_t>(b) * g.Sq + row) * g.Hq + h) * KD + 2 * t;
#pragma unroll
    for (int j = 0; j < KD / 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) =
          __floats2bfloat162_rn(acc[4 * j + 2 * i] * g.scale, acc[4 * j + 2 * i + 1] * g.scale);
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

Geometry geometry(const AttentionDims& d, float scale) {
  return {static_cast<int>(d.seq),     static_cast<int>(d.keys()),    static_cast<int>(d.offset()),
          static_cast<int>(d.q_heads), static_cast<int>(d.kv_heads),  static_cast<int>(d.group()),
          scale,                       scale * kLog2e};
}

// A [B, S, H, W] bf16 tensor (W: its head dim, t's last size: 128, or 192 for MLA's q and k) as
// the 4-D TMA tensor {W, H, S, B}; box {64, 1, rows, 1}.
CUtensorMap head_map(const Tensor& t, int64_t seq, int64_t heads, uint32_t rows) {
  const uint64_t batch = static_cast<uint64_t>(t.size(0)), w = static_cast<uint64_t>(t.size(3));
  const uint64_t dims[4] = {w, static_cast<uint64_t>(heads), static_cast<uint64_t>(seq), batch};
  const uint64_t strides[3] = {w * 2, static_cast<uint64_t>(heads) * w * 2, static_cast<uint64_t>(seq) * heads * w * 2};
  const uint32_t box[4] = {64, 1, rows, 1};
  return make_map(t.data_ptr(), 4, dims, strides, box);
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, Args... args) {
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  MC_CUDA_CHECK(cudaGetLastError());
}

unsigned tiles(int64_t n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__nv_bfloat16* bf16_ptr(Tensor& t) { return reinterpret_cast<__nv_bfloat16*>(t.data_ptr()); }

// The two backward launches at query/key head dim KD (the maps' boxes: the tiles' rows by 64
// columns; q, k are KD wide, v, dout 128).
template <int KD>
void backward_kd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& dr,
                 const Tensor& dout, float scale, bool split, Tensor& dq, Tensor& dk, Tensor& dv,
                 const AttentionDims& d, cudaStream_t stream) {
  const Geometry g = geometry(d, scale);
  const float* l = lse.data<float>();
  const float* r = dr.data<float>();
  {
    using Z = dkv::Sizes<KD>;
    const CUtensorMap tq = head_map(q, d.seq, d.q_heads, Z::kBm), tdo = head_map(dout, d.seq, d.q_heads, Z::kBm);
    const CUtensorMap tk = head_map(k, d.keys(), d.kv_heads, dkv::kBn), tv = head_map(v, d.keys(), d.kv_heads, dkv::kBn);
    const dim3 grid(tiles(d.keys(), dkv::kBn), d.kv_heads, d.batch);
    if (split)
      launch(flash_dkv_hopper<KD, true>, grid, Z::kSmem, stream, tq, tdo, tk, tv, l, r, bf16_ptr(dk), bf16_ptr(dv), g);
    else
      launch(flash_dkv_hopper<KD, false>, grid, Z::kSmem, stream, tq, tdo, tk, tv, l, r, bf16_ptr(dk), bf16_ptr(dv), g);
  }
  {
    using Z = dq::Sizes<KD>;
    const CUtensorMap tq = head_map(q, d.seq, d.q_heads, dq::kBm), tdo = head_map(dout, d.seq, d.q_heads, dq::kBm);
    const CUtensorMap tk = head_map(k, d.keys(), d.kv_heads, dq::kBn), tv = head_map(v, d.keys(), d.kv_heads, dq::kBn);
    const dim3 grid(tiles(d.seq, dq::kBm), d.q_heads, d.batch);
    if (split)
      launch(flash_dq_hopper<KD, true>, grid, Z::kSmem, stream, tq, tdo, tk, tv, l, r, bf16_ptr(dq), g);
    else
      launch(flash_dq_hopper<KD, false>, grid, Z::kSmem, stream, tq, tdo, tk, tv, l, r, bf16_ptr(dq), g);
  }
}

}  // namespace

bool available(const AttentionDims& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* dout) {
#ifndef MOECORE_HAVE_SM90A
  return false;
#else
  const char* env = env_switch("MOECORE_ATTENTION_FLASH_HOPPER");
  if (env && std::string(env) == "0") return false;
  // Both directions take D = Dv = 128 and MLA's D = 192 / Dv = 128.
  const bool dims = d.value_dim() == kD && (d.head_dim == kD || d.head_dim == 192);
  if (!dims || q.dtype() != DType::BF16 || !q.device().is_cuda()) return false;
  if (!device_info(q.device().index).hopper) return false;
  for (const Tensor* x : {&q, &k, &v, dout})
    if (x && (!x->is_contiguous() || !aligned16(x->data_ptr()))) return false;
  return d.keys() < (int64_t(1) << 30) && d.q_heads <= 65535 && d.kv_heads <= 65535 && d.batch <= 65535;
#endif
}

void forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale, Tensor& out, Tensor& lse,
             const AttentionDims& d, cudaStream_t stream) {
  const Geometry g = geometry(d, scale);
  const CUtensorMap tq = head_map(q, d.seq, d.q_heads, fwd::kBr), tk = head_map(k, d.keys(), d.kv_heads, fwd::kBc),
                    tv = head_map(v, d.keys(), d.kv_heads, 64);
  const dim3 grid(tiles(d.seq, fwd::kBr), d.q_heads, d.batch);
  MC_CHECK(d.value_dim() == kD && (d.head_dim == 128 || d.head_dim == 192), "flash_hopper::forward: head dims ",
           d.head_dim, " / ", d.value_dim(), " (the Hopper forward takes 128 / 128 or 192 / 128)");
  if (d.head_dim == 192)
    launch(flash_forward_hopper<192>, grid, fwd::Sizes<192>::kSmem, stream, tq, tk, tv, bf16_ptr(out),
           lse.data<float>(), g);
  else
    launch(flash_forward_hopper<128>, grid, fwd::Sizes<128>::kSmem, stream, tq, tk, tv, bf16_ptr(out),
           lse.data<float>(), g);
}

void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& dr,
              const Tensor& dout, float scale, bool split, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d,
              cudaStream_t stream) {
  MC_CHECK(d.value_dim() == kD && (d.head_dim == 128 || d.head_dim == 192), "flash_hopper::backward: head dims ",
           d.head_dim, " / ", d.value_dim(), " (the Hopper backward takes 128 / 128 or 192 / 128)");
  if (d.head_dim == 192)
    backward_kd<192>(q, k, v, lse, dr, dout, scale, split, dq, dk, dv, d, stream);
  else
    backward_kd<128>(q, k, v, lse, dr, dout, scale, split, dq, dk, dv, d, stream);
}

}  // namespace moecore::ops::cuda::flash_hopper
