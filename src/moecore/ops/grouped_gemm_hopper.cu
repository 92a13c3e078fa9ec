// Hopper grouped GEMM over experts: one persistent kernel per GEMM (forward, dgrad, wgrad), bf16
// in, fp32 accumulate, with TMA loads, wgmma on 128x256 / 128x128 tiles and a tile schedule over all
// experts built in the kernel from the experts' row offsets in DEVICE memory (no host copy of
// the counts is needed by the kernel; see grouped_gemm.h for the operations).
//
// Geometry: one CTA = 2 consumer warpgroups + 1 producer warp (288 threads), one CTA per SM:
//   producer warp  one thread issues the TMA loads of a 4-stage ring (an A tile 128 x 64 and a
//                  B tile BN x 64, bf16, 128-byte swizzle);
//   warpgroups 0, 1  consumers: each runs wgmma m64nBNk16 on its 64 rows of the 128 x BN tile and
//                  writes them: bf16 outputs with plain stores; the wgrad into f32 dw through
//                  shared memory and a TMA reduce-add (asynchronous: the next tile's wgmmas
//                  start while it runs), or a TMA store when overwriting (the step's first
//                  gradient: dw is not read); into bf16 dw with loads, adds and stores.
//   Forward and dgrad: BN = 256. Wgrad: BN = 128 (its output is as large as its reduction is
//   short).
//   The tiles of all experts are numbered expert by expert (an expert's tiles: groups of 8
//   m-blocks, each group m fastest then n); CTA b takes tiles b, b + grid, ... (grid = the SM
//   count times the CTAs per SM).
//
// Operands (C[m, n] = sum_k A(m, k) B(n, k)), per expert e with rows [r_e, r_{e+1}):
//   forward  A = x rows (K-major: [rows, K]),  B = w_e (K-major: w [E, N, K], a 3-D TMA map)
//   dgrad    A = dout rows (K-major),          B(n, k) = w_e[k][n] (MN-major, 3-D map over w)
//   wgrad    A(m, k) = dout[r_e + k][m] and B(n, k) = x[r_e + k][n] (both MN-major, 2-D maps);
//            the reduction runs over the expert's rows only: the rows of the last 64-row block
//            that belong to the next expert are zeroed in shared memory before the wgmma.
//   In forward and dgrad an m-block may run past the expert's last row into the next expert's
//   rows (or past the buffer, where TMA reads zeros); those output rows are not stored.
//
// Shared-memory layouts for wgmma (descriptor: start, LBO, SBO in 16-byte units, 128B swizzle):
//   K-major tile [rows][64]: 128-byte rows, 8-row swizzle atoms 1024 bytes apart (SBO); a k16
//     step advances the start by 32 bytes inside the swizzled row.
//   MN-major tile: 64-element (128-byte) chunks of M or N, each [64 k-rows][64]; LBO = 8192
//     bytes between chunks, SBO = 1024 bytes between 8-k-row groups; a k16 step advances the
//     start by 16 rows (2048 bytes).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "moecore/core/cuda_check.h"
#include "moecore/ops/grouped_gemm_hopper.h"

namespace moecore::ops::cuda::hopper {

namespace {

enum Mode { kForward, kDgrad, kWgrad };

constexpr int kBM = 128, kBK = 64;
constexpr int kChunkBytes = 64 * 64 * 2;  // one 64 x 64 bf16 swizzled block
constexpr int kATileBytes = kBM * kBK * 2;  // the A tile of a stage (16 KB)
constexpr int kConsumers = 256;             // warpgroups 0 and 1
constexpr int kThreads = kConsumers + 32;   // + the producer warp
constexpr int kMaxExperts = 1024;
constexpr int kRasterGroup = 8;             // m-blocks per raster group (decode_tile)

// Tile width, ring depth and CTAs per SM. Forward and dgrad: 128 x 256 tiles (wgmma m64n256k16,
// 128 accumulators a thread), 4 stages of 48 KB. Wgrad: 128 x 128 tiles (its output is as large
// as its reduction is short), 4 stages of 32 KB and a 64 KB staging buffer. (Measured before the
// reduce-add: two wgrad CTAs per SM with 3 stages beat one with 5; docs/performance.md.)
template <int BN, int STAGES, int CTAS>
struct Config {
  static constexpr int kBN = BN, kStages = STAGES, kCtasPerSm = CTAS;
  static constexpr int kStageBytes = kATileBytes + BN * kBK * 2;
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per thread (m64nBN over 128 threads)
};
using WideConfig = Config<256, 4, 1>;
using NarrowConfig = Config<128, 4, 1>;
// Wgrad into f32 dw: each consumer warpgroup stages its 64 x 128 fp32 result in shared memory
// and one TMA reduce-add (cp.reduce.async.bulk.tensor .add) adds it to dw in L2, asynchronously,
// while the warpgroup goes on to the next tile.
constexpr int kStagingBytes = 2 * 64 * 128 * 4;
template <int kMode>
using ConfigOf = std::conditional_t<kMode == kWgrad, NarrowConfig, WideConfig>;

// MN-major descriptor strides (bytes): LBO = between 64-element chunks, SBO = between 8-row groups.
constexpr uint32_t kMnLbo = kChunkBytes, kMnSbo = 1024;

struct Params {
  const int* offsets;  // [experts + 1] row offsets of each expert's rows (device)
  int experts;
  int out_cols;        // forward/dgrad: output columns; wgrad: dw columns (x's K)
  int red_len;         // forward/dgrad: reduction length; wgrad: unused (rows of the expert)
  int dw_rows;         // wgrad: dw rows (dout's N); forward/dgrad: unused
  void* out;           // bf16 [rows, out_cols]; wgrad: dw [E, dw_rows, out_cols], f32 or bf16
  int out_f32;         // wgrad: dw is f32
  int overwrite;       // wgrad: dw = (not +=); experts without rows get tiles of zeros
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOECORE_HOPPER_DEVICE 1
#endif

#ifdef MOECORE_HOPPER_DEVICE
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// dw[e][row0.., col0..] = the 64 x 128 fp32 block at src (TMA store; out-of-range parts of the
// box are not written).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// dw[e][row0.., col0..] += the 64 x 128 fp32 block at src (TMA reduce-add; out-of-range parts
// of the box are not written).
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 128] (+)= A[64 x 16] B[128 x 16]^T; kTransA / kTransB: the operand is MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// D[64 x 256] (+)= A[64 x 16] B[256 x 16]^T; kTransA / kTransB: the operand is MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

template <int kTransA, int kTransB, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (N == 64) wgmma_m64n128k16<kTransA, kTransB>(d, desc_a, desc_b, 1);
  else wgmma_m64n256k16<kTransA, kTransB>(d, desc_a, desc_b, 1);
}
#endif  // MOECORE_HOPPER_DEVICE

// The tile of linear index t: expert e, first row m0 / column n0 of C (forward, dgrad: m0 is a
// row of the permuted buffer), reduction range [k_begin, k_end).
struct Tile {
  int e, m0, n0, k_begin, k_end;
};

template <int kMode>
__device__ __forceinline__ Tile decode_tile(int t, const int* tile_start, const int* row_off, int experts,
                                            int n_blocks, const Params& p) {
  int lo = 0, hi = experts - 1;  // the last expert whose first tile is <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  Tile tile;
  tile.e = lo;
  const int local = t - tile_start[lo];
  // Grouped raster: kRasterGroup m-blocks at a time, m fastest inside the group, so the tiles
  // in flight at once share a few A row blocks and a few B column blocks (both stay in L2).
  const int m_blocks = (tile_start[lo + 1] - tile_start[lo]) / n_blocks;
  const int first_m = local / (kRasterGroup * n_blocks) * kRasterGroup;
  const int group_m = min(m_blocks - first_m, kRasterGroup);
  const int in_group = local - first_m * n_blocks;
  const int mb = first_m + in_group % group_m, nb = in_group / group_m;
  tile.n0 = nb * ConfigOf<kMode>::kBN;
  if (kMode == kWgrad) {
    tile.m0 = mb * kBM;
    tile.k_begin = row_off[lo];
    tile.k_end = row_off[lo + 1];
  } else {
    tile.m0 = row_off[lo] + mb * kBM;
    tile.k_begin = 0;
    tile.k_end = p.red_len;
  }
  return tile;
}

template <int kMode>
__global__ void __launch_bounds__(kThreads, ConfigOf<kMode>::kCtasPerSm)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                        const __grid_constant__ CUtensorMap tma_dw, const Params p) {
#ifdef MOECORE_HOPPER_DEVICE
  using C = ConfigOf<kMode>;
  constexpr int kBN = C::kBN, kStages = C::kStages, kStageBytes = C::kStageBytes, kAcc = C::kAcc;
  constexpr int kBChunks = kBN / 64;  // 64-column chunks of an MN-major B tile
  constexpr int kTransA = kMode == kWgrad ? 1 : 0;
  constexpr int kTransB = kMode == kForward ? 0 : 1;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int kStaging = kMode == kWgrad ? kStagingBytes : 0;
  float* staging = reinterpret_cast<float*>(smem + kStages * kStageBytes);  // wgrad, f32 dw
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes + kStaging);
  uint64_t* empty = full + kStages;
  int* row_off = reinterpret_cast<int*>(empty + kStages);  // [experts + 1]
  int* tile_start = row_off + p.experts + 1;               // [experts + 1]

  const int experts = p.experts;
  for (int i = threadIdx.x; i <= experts; i += blockDim.x) row_off[i] = p.offsets[i];
  __syncthreads();
  const int n_blocks = (p.out_cols + kBN - 1) / kBN;
  if (threadIdx.x == 0) {
    const int wgrad_m_blocks = (p.dw_rows + kBM - 1) / kBM;
    int acc = 0;
    for (int e = 0; e < experts; ++e) {
      tile_start[e] = acc;
      const int rows = row_off[e + 1] - row_off[e];
      // An expert without rows has no wgrad tiles, except when overwriting (its tiles store zeros).
      const int m_blocks = kMode == kWgrad ? (rows > 0 || p.overwrite ? wgrad_m_blocks : 0) : (rows + kBM - 1) / kBM;
      acc += m_blocks * n_blocks;
    }
    tile_start[experts] = acc;
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int total = tile_start[experts];

  if (threadIdx.x >= kConsumers) {  // producer warp: one thread issues the loads
    if (threadIdx.x != kConsumers) return;
    int it = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = decode_tile<kMode>(t, tile_start, row_off, experts, n_blocks, p);
      for (int k0 = tile.k_begin; k0 < tile.k_end; k0 += kBK, ++it) {
        const int s = it % kStages, round = it / kStages;
        if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
        uint8_t* sa = smem + s * kStageBytes;
        uint8_t* sb = sa + kATileBytes;
        mbar_expect_tx(&full[s], kStageBytes);
        if (kMode == kForward) {
          tma_load_2d(sa, &tma_a, &full[s], k0, tile.m0);
          tma_load_3d(sb, &tma_b, &full[s], k0, tile.n0, tile.e);
        } else if (kMode == kDgrad) {
          tma_load_2d(sa, &tma_a, &full[s], k0, tile.m0);
#pragma unroll
          for (int c = 0; c < kBChunks; ++c) tma_load_3d(sb + c * kChunkBytes, &tma_b, &full[s], tile.n0 + 64 * c, k0, tile.e);
        } else {
          tma_load_2d(sa, &tma_a, &full[s], tile.m0, k0);
          tma_load_2d(sa + kChunkBytes, &tma_a, &full[s], tile.m0 + 64, k0);
#pragma unroll
          for (int c = 0; c < kBChunks; ++c) tma_load_2d(sb + c * kChunkBytes, &tma_b, &full[s], tile.n0 + 64 * c, k0);
        }
      }
    }
    return;
  }

  // consumers
  const int cw = threadIdx.x / 128;  // which 64 rows of the tile
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  float acc[kAcc];
  int it = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = decode_tile<kMode>(t, tile_start, row_off, experts, n_blocks, p);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
    int prev_s = -1;
    for (int k0 = tile.k_begin; k0 < tile.k_end; k0 += kBK, ++it) {
      const int s = it % kStages, round = it / kStages;
      mbar_wait(&full[s], round & 1);
      uint8_t* sa = smem + s * kStageBytes + cw * kChunkBytes;  // this warpgroup's 64 rows of A
      uint8_t* sb = smem + s * kStageBytes + kATileBytes;
      if (kMode == kWgrad) {
        const int valid = tile.k_end - k0;  // reduction rows of this expert in the block
        if (valid < kBK) {
          // Zero rows [valid, 64) of this warpgroup's A chunk and of its share of the B chunks
          // (MN-major: one 128-byte row per reduction index, whatever the swizzle).
          const int words = (kBK - valid) * 8;  // 16-byte words per chunk
          uint4* a_rows = reinterpret_cast<uint4*>(sa + valid * 128);
          for (int i = tid; i < words; i += 128) a_rows[i] = make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int c = cw * kBChunks / 2; c < (cw + 1) * kBChunks / 2; ++c) {
            uint4* b_rows = reinterpret_cast<uint4*>(sb + c * kChunkBytes + valid * 128);
            for (int i = tid; i < words; i += 128) b_rows[i] = make_uint4(0, 0, 0, 0);
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          asm volatile("bar.sync 1, 256;\n" ::: "memory");
        }
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        uint64_t da, db;
        if (kTransA) da = smem_desc(smem_u32(sa) + kk * 2048, kMnLbo, kMnSbo);
        else da = smem_desc(smem_u32(sa) + kk * 32, 16, 1024);
        if (kTransB) db = smem_desc(smem_u32(sb) + kk * 2048, kMnLbo, kMnSbo);
        else db = smem_desc(smem_u32(sb) + kk * 32, 16, 1024);
        wgmma_m64k16<kTransA, kTransB>(acc, da, db);
      }
      wgmma_commit();
      if (prev_s >= 0) {  // the previous stage's wgmmas are done: give its buffers back
        wgmma_wait<1>();
        if (tid == 0) mbar_arrive(&empty[prev_s]);
      }
      prev_s = s;
    }
    wgmma_wait<0>();
    fence_acc(acc);
    if (prev_s >= 0 && tid == 0) mbar_arrive(&empty[prev_s]);

    // Epilogue. Accumulator fragment of m64nNk16: thread (warp, lane) holds rows
    // 16 warp + lane/4 (+8) and columns 8 j + 2 (lane % 4) (+1), j = 0..N/8-1.
    const int r_lo = cw * 64 + warp * 16 + lane / 4;
    const int c_lo = 2 * (lane % 4);
    if (kMode == kWgrad && p.out_f32) {
      // Stage the 64 x 128 block (row-major, 512-byte rows), then one TMA reduce-add. The
      // previous tile's reduce must have finished reading the buffer first.
      float* block = staging + cw * 64 * 128;
      if (tid == 0) bulk_wait_read_all();
      named_barrier(2 + cw, 128);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j)
          *reinterpret_cast<float2*>(block + r * 128 + 8 * j + c_lo) =
              make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_barrier(2 + cw, 128);
      if (tid == 0) {
        if (p.overwrite) tma_store_3d(&tma_dw, block, tile.n0, tile.m0 + cw * 64, tile.e);
        else tma_reduce_add_3d(&tma_dw, block, tile.n0, tile.m0 + cw * 64, tile.e);
      }
    } else if (kMode == kWgrad) {  // bf16 dw: read-modify-write (a plain write when overwriting)
      const size_t base = static_cast<size_t>(tile.e) * p.dw_rows * p.out_cols;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = tile.m0 + r_lo + 8 * half;
        if (row >= p.dw_rows) continue;
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
          const int col = tile.n0 + 8 * j + c_lo;
          if (col >= p.out_cols) continue;
          const size_t idx = base + static_cast<size_t>(row) * p.out_cols + col;
          const float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
          __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + idx);
          const float2 cur = p.overwrite ? make_float2(0.f, 0.f) : __bfloat1622float2(*o);
          *o = __floats2bfloat162_rn(cur.x + v0, cur.y + v1);
        }
      }
    } else {
      const int row_end = row_off[tile.e + 1];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = tile.m0 + r_lo + 8 * half;
        if (row >= row_end) continue;
        __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(p.out) + static_cast<size_t>(row) * p.out_cols;
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j) {
          const int col = tile.n0 + 8 * j + c_lo;
          if (col >= p.out_cols) continue;
          *reinterpret_cast<__nv_bfloat162*>(out_row + col) =
              __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        }
      }
    }
  }
  if (kMode == kWgrad && p.out_f32 && threadIdx.x % 128 == 0) bulk_wait_all();  // before smem goes away
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without sm_90a features was loaded: fail loudly rather than write nothing
#endif  // MOECORE_HOPPER_DEVICE
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    MC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    MC_CHECK(q == cudaDriverEntryPointSuccess && f, "grouped GEMM (Hopper): the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A tensor map, out-of-bounds elements read as zero (and not written). dims/box innermost first;
// strides in bytes of dims 1.. . Operands: bf16 with the 128-byte swizzle; the f32 dw of the
// wgrad's reduce-add: no swizzle.
CUtensorMap make_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                     CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                     CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  CUtensorMap map;
  cuuint64_t gdim[3], gstride[2];
  cuuint32_t bdim[3], estride[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) gdim[i] = dims[i], bdim[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) gstride[i] = strides[i];
  const CUresult r = encode_fn()(&map, type, rank, const_cast<void*>(base), gdim, gstride,
                                 bdim, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MC_CHECK(r == CUDA_SUCCESS, "grouped GEMM (Hopper): cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
  return map;
}

struct DeviceInfo {
  bool hopper = false;
  int sms = 0;
};

DeviceInfo device_info(int device) {
  static std::mutex m;
  static DeviceInfo info[64];
  static bool known[64] = {};
  std::lock_guard<std::mutex> lock(m);
  if (device < 0 || device >= 64) return {};
  if (!known[device]) {
    cudaDeviceProp prop;
    MC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    info[device].hopper = prop.major == 9 && prop.minor == 0;
    info[device].sms = prop.multiProcessorCount;
    known[device] = true;
  }
  return info[device];
}

template <int kMode>
size_t smem_bytes(int experts) {
  using C = ConfigOf<kMode>;
  return 1024 + static_cast<size_t>(C::kStages) * C::kStageBytes + (kMode == kWgrad ? kStagingBytes : 0) +
         2 * C::kStages * sizeof(uint64_t) +
         2 * (static_cast<size_t>(experts) + 1) * sizeof(int);
}

template <int kMode>
void launch(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& dw, const Params& p, int sms,
            cudaStream_t stream) {
  const size_t smem = smem_bytes<kMode>(p.experts);
  {  // the shared-memory limit is raised once per device (the caller has made it current)
    static std::mutex m;
    static bool raised[64] = {};
    int device = 0;
    MC_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(m);
    if (device >= 0 && device < 64 && !raised[device]) {
      MC_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes<kMode>(kMaxExperts))));
      raised[device] = true;
    }
  }
  grouped_gemm_kernel<kMode><<<sms * ConfigOf<kMode>::kCtasPerSm, kThreads, smem, stream>>>(a, b, dw, p);
  MC_CUDA_CHECK(cudaGetLastError());
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool available(const Tensor& a, const Tensor& b, const Tensor& c, int64_t experts) {
#ifndef MOECORE_HAVE_SM90A
  return false;
#else
  if (!a.device().is_cuda() || a.dtype() != DType::BF16 || b.dtype() != DType::BF16) return false;
  if (experts < 1 || experts > kMaxExperts) return false;
  if (!device_info(a.device().index).hopper) return false;
  if (a.ndim() != 2 || b.ndim() < 2 || b.ndim() > 3 || c.ndim() < 2 || c.ndim() > 3) return false;
  for (const Tensor* t : {&a, &b, &c}) {
    if (!t->is_contiguous() || !aligned16(t->data_ptr())) return false;
    for (int64_t d : t->shape()) if (d == 0 || d > INT32_MAX / 2) return false;
    if (t->size(t->ndim() - 1) % 8 != 0) return false;  // TMA: 16-byte row strides
  }
  return true;
#endif
}

void grouped_gemm(GroupedMode mode, const Tensor& a, const Tensor& b, Tensor& c, const int* offsets, int experts,
                  cudaStream_t stream, bool accumulate) {
  const DeviceInfo info = device_info(a.device().index);
  Params p{};
  p.overwrite = mode == GroupedMode::Wgrad && !accumulate;
  p.offsets = offsets;
  p.experts = experts;
  p.out = c.data_ptr();
  const uint64_t rows = static_cast<uint64_t>(a.size(0));
  CUtensorMap ma, mb;
  switch (mode) {
    case GroupedMode::Forward: {  // a = x [rows, K], b = w [E, N, K], c = out [rows, N]
      const uint64_t K = b.size(2), N = b.size(1), E = b.size(0);
      const uint64_t da[2] = {K, rows}, sa[1] = {K * 2};
      const uint32_t ba[2] = {64, kBM};
      const uint64_t db[3] = {K, N, E}, sb[2] = {K * 2, N * K * 2};
      const uint32_t bb[3] = {64, WideConfig::kBN, 1};
      ma = make_map(a.data_ptr(), 2, da, sa, ba);
      mb = make_map(b.data_ptr(), 3, db, sb, bb);
      p.out_cols = static_cast<int>(N), p.red_len = static_cast<int>(K);
      launch<kForward>(ma, mb, mb, p, info.sms, stream);  // no dw map: b's is passed, unused
      break;
    }
    case GroupedMode::Dgrad: {  // a = dout [rows, N], b = w [E, N, K], c = dx [rows, K]
      const uint64_t K = b.size(2), N = b.size(1), E = b.size(0);
      const uint64_t da[2] = {N, rows}, sa[1] = {N * 2};
      const uint32_t ba[2] = {64, kBM};
      const uint64_t db[3] = {K, N, E}, sb[2] = {K * 2, N * K * 2};
      const uint32_t bb[3] = {64, 64, 1};
      ma = make_map(a.data_ptr(), 2, da, sa, ba);
      mb = make_map(b.data_ptr(), 3, db, sb, bb);
      p.out_cols = static_cast<int>(K), p.red_len = static_cast<int>(N);
      launch<kDgrad>(ma, mb, mb, p, info.sms, stream);
      break;
    }
    case GroupedMode::Wgrad: {  // a = dout [rows, N], b = x [rows, K], c = dw [E, N, K]
      const uint64_t N = a.size(1), K = b.size(1);
      const uint64_t da[2] = {N, rows}, sa[1] = {N * 2};
      const uint64_t db[2] = {K, rows}, sb[1] = {K * 2};
      const uint32_t box[2] = {64, 64};
      ma = make_map(a.data_ptr(), 2, da, sa, box);
      mb = make_map(b.data_ptr(), 2, db, sb, box);
      p.out_cols = static_cast<int>(K), p.dw_rows = static_cast<int>(N);
      p.out_f32 = c.dtype() == DType::F32;
      CUtensorMap mc = mb;  // bf16 dw: the epilogue adds with plain loads and stores
      if (p.out_f32) {
        const uint64_t dc[3] = {K, N, static_cast<uint64_t>(c.size(0))}, sc[2] = {K * 4, N * K * 4};
        const uint32_t bc[3] = {128, 64, 1};
        mc = make_map(c.data_ptr(), 3, dc, sc, bc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE);
      }
      launch<kWgrad>(ma, mb, mc, p, info.sms, stream);
      break;
    }
  }
}

}  // namespace moecore::ops::cuda::hopper
