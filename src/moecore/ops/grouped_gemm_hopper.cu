// Hopper grouped GEMM over experts: one persistent kernel per GEMM (forward, dgrad, wgrad), bf16
// in, fp32 accumulate, with TMA loads, wgmma on 128x256 tiles (the forward also on narrower ones,
// for few rows per expert: Config below) and a tile schedule over all
// experts built in the kernel from the experts' row offsets in DEVICE memory (no host copy of
// the counts is needed by the kernel; see grouped_gemm.h for the operations).
//
// Geometry: one CTA = 2 consumer warpgroups + 1 producer warp (288 threads), one CTA per SM:
//   producer warp  one thread issues the TMA loads of a ring of stages (an A tile BM x 64 and a
//                  B tile BN x 64, bf16, 128-byte swizzle);
//   warpgroups 0, 1  consumers: each runs wgmma m64nBNk16 on its 64 rows of the 128 x BN tile
//                  (64-row tiles: m64n(BN/2)k16 on its half of the columns) and
//                  writes them through a shared-memory staging buffer and TMA (asynchronous: the
//                  next tile's wgmmas start while the stores run): bf16 outputs with TMA stores
//                  (plain stores for a 64-row block that crosses the expert's last row); the
//                  wgrad into f32 dw with a TMA reduce-add, or a TMA store when overwriting (the
//                  step's first gradient: dw is not read); into bf16 dw with loads, adds and stores.
//   Dgrad and wgrad on 128 x 256 tiles (BN = 256); the forward on the tile the caller picks.
//   The tiles of all experts are numbered expert by expert (an expert's tiles: groups of 8
//   m-blocks, each group m fastest then n); CTA b takes tiles b, b + grid, ... (grid = the SM
//   count).
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
#include "moecore/ops/hopper_common.cuh"

namespace moecore::ops::cuda::hopper {

namespace {

using namespace hopper_ptx;

enum Mode { kForward, kDgrad, kWgrad };

constexpr int kBK = 64;
constexpr int kChunkBytes = 64 * 64 * 2;  // one 64 x 64 bf16 swizzled block
constexpr int kConsumers = 256;             // warpgroups 0 and 1
constexpr int kThreads = kConsumers + 32;   // + the producer warp
constexpr int kMaxExperts = 1024;
constexpr int kRasterGroup = 8;             // m-blocks per raster group (decode_tile)

// Tile shapes. kBM = 128: warpgroup w computes rows [64 w, 64 w + 64) of the 128 x kBN tile;
// kBM = 64: both warpgroups take the tile's 64 rows and warpgroup w its columns
// [w kBN / 2, (w + 1) kBN / 2) (a forward with few rows per expert: the A tile and the wgmmas on
// rows past the expert's last are halved). kStages: the ring depth.
//   Wide      128 x 256, 3 stages of 48 KB and a 64 KB staging buffer for the epilogue: every
//             mode. (Measured: without the staged forward/dgrad epilogue its plain stores took
//             20-55% of the kernel's time at the presets' shapes; the wgrad on 128 x 128 tiles
//             with 4 stages of 32 KB ran at 50-70% of the dense GEMM; docs/performance-log.md.)
//   the others  the forward only (ForwardTile in grouped_gemm_hopper.h): narrower tiles give a
//             GEMM with few rows per expert more tiles than SMs and deeper rings keep more of
//             the weights' bytes in flight, which is what bounds it.
template <int BM, int BN, int STAGES>
struct Config {
  static_assert(BM == 128 || BM == 64, "a tile has 128 rows (a warpgroup per 64) or 64 (a warpgroup per half)");
  static constexpr int kBM = BM, kBN = BN, kStages = STAGES;
  static constexpr int kATileBytes = BM * kBK * 2;
  static constexpr int kStageBytes = kATileBytes + BN * kBK * 2;
  static constexpr int kWgCols = BM == 128 ? BN : BN / 2;  // columns of a warpgroup's 64-row block
  static constexpr int kAcc = kWgCols / 2;                 // fp32 accumulators per thread
  static constexpr int kStagingBytes = 2 * 64 * kWgCols * 2;  // bf16 epilogue: a 64-row block per warpgroup
};
using WideConfig = Config<128, 256, 3>;
using Narrow128Config = Config<128, 128, 5>;
using Rows64Wide = Config<64, 256, 4>;
using Rows64Narrow = Config<64, 128, 8>;
// The wide tile's staging also holds the f32 wgrad epilogue: per warpgroup its 64 x 256 fp32
// result in two column halves, each as four 64 x 32 fp32 boxes with the 128-byte swizzle, added to
// dw in L2 by four TMA reduce-adds (cp.reduce.async.bulk.tensor .add).
static_assert(WideConfig::kStagingBytes == 2 * 2 * 64 * 32 * 4 * 2, "one staging buffer serves both epilogues");
constexpr int kF32BoxCols = 32;  // a 128-byte row of fp32: the widest box the 128-byte swizzle takes
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


// The tile of linear index t: expert e, first row m0 / column n0 of C (forward, dgrad: m0 is a
// row of the permuted buffer), reduction range [k_begin, k_end).
struct Tile {
  int e, m0, n0, k_begin, k_end;
};

template <int kMode, class Cfg>
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
  tile.n0 = nb * Cfg::kBN;
  if (kMode == kWgrad) {
    tile.m0 = mb * Cfg::kBM;
    tile.k_begin = row_off[lo];
    tile.k_end = row_off[lo + 1];
  } else {
    tile.m0 = row_off[lo] + mb * Cfg::kBM;
    tile.k_begin = 0;
    tile.k_end = p.red_len;
  }
  return tile;
}

template <int kMode, class C>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                        const __grid_constant__ CUtensorMap tma_c, const Params p) {  // tma_c: out, or dw
#ifdef MOECORE_HOPPER_DEVICE
  static_assert(kMode == kForward || std::is_same_v<C, WideConfig>, "dgrad and wgrad run on the wide tile");
  constexpr int kBM = C::kBM, kBN = C::kBN, kStages = C::kStages, kStageBytes = C::kStageBytes, kAcc = C::kAcc;
  constexpr int kATileBytes = C::kATileBytes, kStagingBytes = C::kStagingBytes, kWgCols = C::kWgCols;
  constexpr int kBChunks = kBN / 64;  // 64-column chunks of an MN-major B tile
  constexpr int kTransA = kMode == kWgrad ? 1 : 0;
  constexpr int kTransB = kMode == kForward ? 0 : 1;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int kStaging = kStagingBytes;
  float* staging = reinterpret_cast<float*>(smem + kStages * kStageBytes);  // the epilogue's
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
      const Tile tile = decode_tile<kMode, C>(t, tile_start, row_off, experts, n_blocks, p);
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
    const Tile tile = decode_tile<kMode, C>(t, tile_start, row_off, experts, n_blocks, p);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
    int prev_s = -1;
    for (int k0 = tile.k_begin; k0 < tile.k_end; k0 += kBK, ++it) {
      const int s = it % kStages, round = it / kStages;
      mbar_wait(&full[s], round & 1);
      // This warpgroup's 64 rows of A; at kBM = 64 its half of the (K-major, 128-byte rows) B tile.
      uint8_t* sa = smem + s * kStageBytes + (kBM == 128 ? cw * kChunkBytes : 0);
      uint8_t* sb = smem + s * kStageBytes + kATileBytes + (kBM == 64 ? cw * kWgCols * 128 : 0);
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
    const int wg_row0 = kBM == 128 ? cw * 64 : 0, wg_col0 = kBM == 64 ? cw * kWgCols : 0;
    const int r_lo = wg_row0 + warp * 16 + lane / 4;
    const int c_lo = 2 * (lane % 4);
    if (kMode == kWgrad && p.out_f32) {
      // The 64 x 256 fp32 block in two column halves of 32 KB. Each half is staged as four 64 x 32
      // boxes with the 128-byte swizzle (the 16-byte chunk c of row r sits at chunk c ^ (r % 8):
      // a warp's 8-byte stores touch every bank twice, the least 256 bytes can), then added to dw
      // by four TMA reduce-adds (stores when overwriting). The buffer's earlier reduce-adds must
      // have finished reading it first.
      uint8_t* block = reinterpret_cast<uint8_t*>(staging) + cw * (kStagingBytes / 2);
      constexpr int kBoxBytes = 64 * kF32BoxCols * 4;
#pragma unroll
      for (int nh = 0; nh < kBN / 128; ++nh) {
        if (tid == 0) bulk_wait_read_all();
        named_barrier(2 + cw, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
          for (int jj = 0; jj < 16; ++jj) {
            const int j = 16 * nh + jj;
            const int col = 8 * jj + c_lo;  // column inside the half
            const int chunk = (col % kF32BoxCols) / 4;
            uint8_t* dst = block + (col / kF32BoxCols) * kBoxBytes + r * 128 + ((chunk ^ (r % 8)) * 16) + (col % 4) * 4;
            *reinterpret_cast<float2*>(dst) = make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_barrier(2 + cw, 128);
        if (tid == 0) {
#pragma unroll
          for (int box = 0; box < 128 / kF32BoxCols; ++box) {
            const int col0 = tile.n0 + 128 * nh + kF32BoxCols * box;
            if (col0 >= p.out_cols) break;
            if (p.overwrite) tma_store_3d(&tma_c, block + box * kBoxBytes, col0, tile.m0 + cw * 64, tile.e);
            else tma_reduce_add_3d(&tma_c, block + box * kBoxBytes, col0, tile.m0 + cw * 64, tile.e);
          }
        }
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
      const int block_row = tile.m0 + wg_row0;  // this warpgroup's 64 rows
      const int block_col = tile.n0 + wg_col0;  // and its first column
      if (block_row + 64 <= row_end) {
        // All 64 rows are this expert's: stage them as four 64 x 64 bf16 boxes with the 128-byte
        // swizzle (the 16-byte chunk c of row r sits at chunk c ^ (r % 8): the stores of a warp hit
        // 32 different banks), then four TMA stores; columns past out_cols are not written. The
        // previous tile's stores must have finished reading the buffer first.
        uint8_t* block = reinterpret_cast<uint8_t*>(staging) + cw * (kStagingBytes / 2);
        if (tid == 0) bulk_wait_read_all();
        named_barrier(2 + cw, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
          for (int j = 0; j < kWgCols / 8; ++j) {
            uint8_t* dst = block + (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r % 8)) * 16) + c_lo * 2;
            *reinterpret_cast<__nv_bfloat162*>(dst) =
                __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_barrier(2 + cw, 128);
        if (tid == 0) {
#pragma unroll
          for (int box = 0; box < kWgCols / 64; ++box)
            if (block_col + 64 * box < p.out_cols)
              tma_store_2d(&tma_c, block + box * 8192, block_col + 64 * box, block_row);
        }
        continue;
      }
      // A block that crosses the expert's last row: plain stores of its rows only.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = tile.m0 + r_lo + 8 * half;
        if (row >= row_end) continue;
        __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(p.out) + static_cast<size_t>(row) * p.out_cols;
#pragma unroll
        for (int j = 0; j < kWgCols / 8; ++j) {
          const int col = block_col + 8 * j + c_lo;
          if (col >= p.out_cols) continue;
          *reinterpret_cast<__nv_bfloat162*>(out_row + col) =
              __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        }
      }
    }
  }
  if (threadIdx.x % 128 == 0) bulk_wait_all();  // the TMA stores finish before shared memory goes away
#elif defined(__CUDA_ARCH__)
  __trap();  // an image without sm_90a features was loaded: fail loudly rather than write nothing
#endif  // MOECORE_HOPPER_DEVICE
}

template <class C>
constexpr size_t smem_bytes(int experts) {
  return 1024 + static_cast<size_t>(C::kStages) * C::kStageBytes + C::kStagingBytes + 2 * C::kStages * sizeof(uint64_t) +
         2 * (static_cast<size_t>(experts) + 1) * sizeof(int);
}
constexpr size_t kMaxSmem = 227 * 1024;  // per block on sm_90
static_assert(smem_bytes<WideConfig>(kMaxExperts) <= kMaxSmem && smem_bytes<Narrow128Config>(kMaxExperts) <= kMaxSmem &&
                  smem_bytes<Rows64Wide>(kMaxExperts) <= kMaxSmem && smem_bytes<Rows64Narrow>(kMaxExperts) <= kMaxSmem,
              "a tile's ring and staging exceed the shared memory");

template <int kMode, class C>
void launch(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& c, const Params& p, int sms,
            cudaStream_t stream) {
  const size_t smem = smem_bytes<C>(p.experts);
  {  // the shared-memory limit is raised once per device and kernel (the caller has made it current)
    static std::mutex m;
    static bool raised[64] = {};
    int device = 0;
    MC_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(m);
    if (device >= 0 && device < 64 && !raised[device]) {
      MC_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kMode, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes<C>(kMaxExperts))));
      raised[device] = true;
    }
  }
  grouped_gemm_kernel<kMode, C><<<sms, kThreads, smem, stream>>>(a, b, c, p);
  MC_CUDA_CHECK(cudaGetLastError());
}

// The forward on tile C: a = x [rows, K], b = w [E, N, K], c = out [rows, N].
template <class C>
void forward(const Tensor& a, const Tensor& b, const CUtensorMap& mc, Params& p, int sms, cudaStream_t stream) {
  const uint64_t K = b.size(2), N = b.size(1), E = b.size(0), rows = a.size(0);
  const uint64_t da[2] = {K, rows}, sa[1] = {K * 2};
  const uint32_t ba[2] = {64, C::kBM};
  const uint64_t db[3] = {K, N, E}, sb[2] = {K * 2, N * K * 2};
  const uint32_t bb[3] = {64, C::kBN, 1};
  const CUtensorMap ma = make_map(a.data_ptr(), 2, da, sa, ba), mb = make_map(b.data_ptr(), 3, db, sb, bb);
  p.out_cols = static_cast<int>(N), p.red_len = static_cast<int>(K);
  launch<kForward, C>(ma, mb, mc, p, sms, stream);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The bf16 output [rows, cols] of the forward and the dgrad for the epilogue's TMA stores: 64 x 64
// boxes with the 128-byte swizzle (the staging layout).
CUtensorMap out_map(const Tensor& c, uint64_t cols) {
  const uint64_t dims[2] = {cols, static_cast<uint64_t>(c.size(0))}, strides[1] = {cols * 2};
  const uint32_t box[2] = {64, 64};
  return make_map(c.data_ptr(), 2, dims, strides, box);
}

}  // namespace

const char* forward_tile_name(ForwardTile t) {
  switch (t) {
    case ForwardTile::Auto: return "auto";
    case ForwardTile::Wide128: return "128x256";
    case ForwardTile::Narrow128: return "128x128";
    case ForwardTile::Rows64Wide: return "64x256";
    case ForwardTile::Rows64Narrow: return "64x128";
  }
  return "?";
}

ForwardTile auto_forward_tile(int64_t rows, int64_t experts, int64_t n, int sms) {
  // At most 64 rows per expert on average (decoding, tiny batches): 64-row tiles; narrow ones
  // (twice the tiles, a deeper ring) at up to 8 rows per expert or while the wide ones would
  // leave SMs idle (bench_decode_gemm measures each tile at decoding's shapes).
  if (rows > 64 * experts) return ForwardTile::Wide128;
  const int64_t wide_tiles = experts * ((n + 255) / 256);
  return rows <= 8 * experts || wide_tiles < 2 * sms ? ForwardTile::Rows64Narrow : ForwardTile::Rows64Wide;
}

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
                  cudaStream_t stream, bool accumulate, ForwardTile tile) {
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
      const CUtensorMap mc = out_map(c, b.size(1));
      switch (tile == ForwardTile::Auto ? auto_forward_tile(a.size(0), b.size(0), b.size(1), info.sms) : tile) {
        case ForwardTile::Narrow128: forward<Narrow128Config>(a, b, mc, p, info.sms, stream); break;
        case ForwardTile::Rows64Wide: forward<Rows64Wide>(a, b, mc, p, info.sms, stream); break;
        case ForwardTile::Rows64Narrow: forward<Rows64Narrow>(a, b, mc, p, info.sms, stream); break;
        default: forward<WideConfig>(a, b, mc, p, info.sms, stream); break;
      }
      break;
    }
    case GroupedMode::Dgrad: {  // a = dout [rows, N], b = w [E, N, K], c = dx [rows, K]
      const uint64_t K = b.size(2), N = b.size(1), E = b.size(0);
      const uint64_t da[2] = {N, rows}, sa[1] = {N * 2};
      const uint32_t ba[2] = {64, WideConfig::kBM};
      const uint64_t db[3] = {K, N, E}, sb[2] = {K * 2, N * K * 2};
      const uint32_t bb[3] = {64, 64, 1};
      ma = make_map(a.data_ptr(), 2, da, sa, ba);
      mb = make_map(b.data_ptr(), 3, db, sb, bb);
      p.out_cols = static_cast<int>(K), p.red_len = static_cast<int>(N);
      launch<kDgrad, WideConfig>(ma, mb, out_map(c, K), p, info.sms, stream);
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
        const uint32_t bc[3] = {kF32BoxCols, 64, 1};  // the staging's 64 x 32 swizzled boxes
        mc = make_map(c.data_ptr(), 3, dc, sc, bc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
      }
      launch<kWgrad, WideConfig>(ma, mb, mc, p, info.sms, stream);
      break;
    }
  }
}

}  // namespace moecore::ops::cuda::hopper
