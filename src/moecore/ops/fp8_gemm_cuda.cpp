// CUDA FP8 GEMM through cuBLASLt: C [M, N] = A [M, K] . B [N, K]^T (+ beta C), fp32 accumulation.
//
// Row-major to cuBLASLt's column-major as in gemm_cuda.cpp: C^T = B . A^T, so cuBLASLt's first
// operand is B ([N, K] row-major = K x N column-major, op T) and its second A (K x M, op N): the
// "TN" layout FP8 tensor cores require on Hopper (both operands K-major), which is why dgrad and
// wgrad pass transposed copies. Operand types: E4M3 x E4M3, or E5M2 gradients with E4M3 (hybrid).
// Factors (x = code * scale_inv):
//   PerTensor  CUBLASLT_MATMUL_DESC_{A,B}_SCALE_POINTER -> the [1] scale_inv on the device
//   Tile1x128  scale mode VEC128_32F, Block128 scale mode BLK128x128_32F (CUDA 12.9+ headers,
//              Hopper). The factors are repacked into the layout Transformer Engine hands cuBLASLt:
//              1x128 tiles of [R, K] as [ceil(K/128), round_up(R, 4)] (rows contiguous), 128x128
//              blocks as [ceil(R/128), round_up(ceil(K/128), 4)]; tests/gpu/test_gpu_fp8.cpp holds
//              the result to the CPU emulation, which checks that layout on the device.
// FAST_ACCUM stays off (every product promoted in fp32, as the emulation). Descriptors are made per
// call; the heuristic's algorithm is kept per shape bucket, types, scale modes and pointer alignments
// (the real alignments are declared: an output may be one expert's row slice) in a bounded LRU cache.
// K not a multiple of 16, and M not one with block scaling, run on zero-padded operands (every
// caller: the contract is the CPU's, any M and K). The block factors are repacked on the device.
// A tuned path is later work.
#include <algorithm>
#include <list>
#include <map>
#include <mutex>
#include <tuple>

#include "moecore/core/allocator.h"
#include "moecore/core/cuda_check.h"
#include "moecore/ops/fp8_quant.h"

namespace moecore::ops::cuda {

namespace {
constexpr size_t kWorkspaceBytes = 32u << 20;

cublasLtHandle_t fp8_lt_handle(int device) {
  static std::mutex m;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(m);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h;
  MC_CUBLAS_CHECK(cublasLtCreate(&h));
  return handles[device] = h;
}

struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (second) cublasLtMatrixLayoutDestroy(second);
    if (first) cublasLtMatrixLayoutDestroy(first);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

cudaDataType_t code_type(const Fp8Tensor& t) { return t.format() == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = a & (~a + 1);
  return static_cast<uint32_t>(a == 0 || low > 256 ? 256 : low);
}

struct AlgoKey {
  int device;
  uint64_t m, n, k;
  cudaDataType_t first, second, out;
  int32_t mode_first, mode_second;
  uint32_t align_first, align_second, align_out;
  auto tie() const {
    return std::tie(device, m, n, k, first, second, out, mode_first, mode_second, align_first, align_second, align_out);
  }
  bool operator<(const AlgoKey& o) const { return tie() < o.tie(); }
};

// The heuristic's algorithms per key, with M and K in buckets. The routed experts' row counts (M of
// forward and dgrad, K of wgrad) change every step; a heuristic query per new count cost more host
// time than the GEMMs took on the device with many experts. A key's M and K are rounded up to a
// bucket (a power of two from 16 to 1024, then a multiple of 1024); the bucket's algorithm is the
// heuristic's answer for the bucket's own shape, used for every shape in it once
// cublasLtMatmulAlgoCheck accepts it for the real one (else that shape is asked for, uncached). The
// cache is bounded: the least recently used entry goes when it is full.
constexpr size_t kAlgoCacheEntries = 1024;
uint64_t bucket(uint64_t v) {
  if (v > 1024) return (v + 1023) / 1024 * 1024;
  uint64_t b = 16;
  while (b < v) b *= 2;
  return b;
}
struct AlgoCache {
  std::mutex m;
  std::list<std::pair<AlgoKey, cublasLtMatmulAlgo_t>> order;  // most recently used first
  std::map<AlgoKey, std::list<std::pair<AlgoKey, cublasLtMatmulAlgo_t>>::iterator> where;
};
AlgoCache& algo_cache() {
  static AlgoCache cache;
  return cache;
}
bool cached_algo(const AlgoKey& key, cublasLtMatmulAlgo_t& algo) {
  AlgoCache& c = algo_cache();
  std::lock_guard<std::mutex> lock(c.m);
  const auto it = c.where.find(key);
  if (it == c.where.end()) return false;
  c.order.splice(c.order.begin(), c.order, it->second);
  algo = it->second->second;
  return true;
}
void cache_algo(const AlgoKey& key, const cublasLtMatmulAlgo_t& algo) {
  AlgoCache& c = algo_cache();
  std::lock_guard<std::mutex> lock(c.m);
  const auto it = c.where.find(key);
  if (it != c.where.end()) {
    it->second->second = algo;
    c.order.splice(c.order.begin(), c.order, it->second);
    return;
  }
  c.order.emplace_front(key, algo);
  c.where[key] = c.order.begin();
  if (c.order.size() > kAlgoCacheEntries) {
    c.where.erase(c.order.back().first);
    c.order.pop_back();
  }
}

// t [R, C] as [rows, cols] (rows >= R, cols >= C) with zero codes appended: a code 0 is the value
// +0 in both formats. The factors keep their grid (a multiple of 16 never crosses a multiple of
// 128, so ceil(cols / 128) and, for 128x128 blocks, ceil(rows / 128) are unchanged); 1x128 tiles
// get zero factors for the new rows.
Fp8Tensor zero_padded(const Fp8Tensor& t, int64_t rows, int64_t cols, cudaStream_t stream) {
  const Device dev = t.data.device();
  Fp8Tensor p{Tensor::zeros({rows, cols}, t.data.dtype(), dev), t.scale_inv, t.scaling};
  if (t.rows() > 0 && t.cols() > 0)
    MC_CUDA_CHECK(cudaMemcpy2DAsync(p.data.data_ptr(), static_cast<size_t>(cols), t.data.data_ptr(),
                                    static_cast<size_t>(t.cols()), static_cast<size_t>(t.cols()),
                                    static_cast<size_t>(t.rows()), cudaMemcpyDeviceToDevice, stream));
  if (t.scaling == Fp8Scaling::Tile1x128 && rows > t.rows()) {
    p.scale_inv = Tensor::zeros({rows, t.scale_inv.size(1)}, DType::F32, dev);
    p.scale_inv.slice(0, 0, t.rows()).copy_from(t.scale_inv);
  }
  return p;
}

// The operand's factors in cuBLASLt's layout (above) and its scale mode.
Tensor cublas_factors(const Fp8Tensor& t, int32_t& mode) {
  if (t.scaling == Fp8Scaling::PerTensor) {
    mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    return t.scale_inv;
  }
  const int64_t sr = t.scale_inv.size(0), sc = t.scale_inv.size(1);
  Tensor packed;
  if (t.scaling == Fp8Scaling::Tile1x128) {  // [R, KB] -> [KB, round_up(R, 4)]
    mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    packed = Tensor::zeros({sc, round_up(sr, 4)}, DType::F32, t.data.device());
  } else {  // [RB, KB] -> [RB, round_up(KB, 4)]
    mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    packed = Tensor::zeros({sr, round_up(sc, 4)}, DType::F32, t.data.device());
  }
  pack_cublas_factors(t, packed);  // on the device: no host round trip
  return packed;
}
// The heuristic's first algorithm for C^T [N, m] = B [N, k] . A^T (the descriptor op's types and
// scale modes), with the given pointer alignments (first, second, out) and our workspace;
// CUBLAS_STATUS_NOT_SUPPORTED when it has none.
cublasStatus_t heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cudaDataType_t first_type,
                         cudaDataType_t second_type, cudaDataType_t out_type, uint64_t m, uint64_t n, uint64_t k,
                         const uint32_t aligns[3], cublasLtMatmulAlgo_t& algo) {
  Descriptors d;
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.first, first_type, k, n, static_cast<int64_t>(k)));
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.second, second_type, k, m, static_cast<int64_t>(k)));
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.out, out_type, n, m, static_cast<int64_t>(n)));
  MC_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
  const size_t ws = kWorkspaceBytes;
  MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, align_attr[i], &aligns[std::min(i, 2)], sizeof(uint32_t)));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, op, d.first, d.second, d.out, d.out, d.pref, 1, &result, &count);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (count == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  algo = result.algo;
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace

void fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c, float beta) {
  const Device dev = c.device();
  MC_CUDA_CHECK(cudaSetDevice(dev.index));
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream(dev).handle());
  const uint64_t M = static_cast<uint64_t>(a.rows()), N = static_cast<uint64_t>(b.rows()),
                 K = static_cast<uint64_t>(a.cols());
  if (M == 0 || N == 0) return;
  MC_CHECK(K > 0 && N % 16 == 0, "fp8_gemm: cuBLASLt FP8 needs K > 0 and N a multiple of 16; got M=", M, " N=", N,
           " K=", K);
  // cuBLASLt's FP8 GEMMs want K a multiple of 16 (a wgrad's K is the rows: an expert's share of the
  // tokens), and its block-scaled modes have no algorithm for a row count of A that is not one (an
  // expert's ragged rows). Every caller gets the padding here: the product runs on operands with
  // zero codes appended (zero_padded above: the same factors), into a padded output whose first M
  // rows go to C. Zero codes add nothing to the real sums.
  const bool pad_m = a.scaling != Fp8Scaling::PerTensor && M % 16 != 0;
  if (K % 16 != 0 || pad_m) {
    const int64_t m = static_cast<int64_t>(M), mp = pad_m ? round_up(m, 16) : m, kp = round_up(static_cast<int64_t>(K), 16);
    const Fp8Tensor pa = zero_padded(a, mp, kp, stream), pb = zero_padded(b, static_cast<int64_t>(N), kp, stream);
    if (mp == m) {
      cuda::fp8_gemm(pa, pb, c, beta);
      return;
    }
    Tensor out = Tensor::zeros({mp, static_cast<int64_t>(N)}, c.dtype(), dev);
    if (beta != 0.0f) out.slice(0, 0, m).copy_from(c);
    cuda::fp8_gemm(pa, pb, out, beta);
    c.copy_from(out.slice(0, 0, m));
    return;
  }
  int32_t mode_first = 0, mode_second = 0;
  const Tensor factors_first = cublas_factors(b, mode_first), factors_second = cublas_factors(a, mode_second);
  Descriptors d;  // pref unused here (heuristic() makes its own)
  MC_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  const void* p_first = factors_first.data_ptr();
  const void* p_second = factors_second.data_ptr();
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p_first, sizeof p_first));
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p_second, sizeof p_second));
  if (mode_first != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F || mode_second != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
    MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_first, sizeof mode_first));
    MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_second, sizeof mode_second));
  }
  const cudaDataType_t out_type = c.dtype() == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.first, code_type(b), K, N, static_cast<int64_t>(K)));
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.second, code_type(a), K, M, static_cast<int64_t>(K)));
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.out, out_type, N, M, static_cast<int64_t>(N)));
  cublasLtHandle_t handle = fp8_lt_handle(dev.index);
  // The heuristic's choice per shape bucket, types, scale modes and pointer alignments (C may be a
  // row slice of a larger output, e.g. one expert's rows: its real alignment is declared). The
  // bucket's algorithm is the heuristic's answer for the bucket's own shape, so the choice depends
  // on the shape only, not on which shapes came first (a resumed run computes as the original).
  const uint32_t aligns[3] = {alignment(b.data.data_ptr()), alignment(a.data.data_ptr()), alignment(c.data_ptr())};
  const AlgoKey key{dev.index, bucket(M), N, bucket(K), code_type(b), code_type(a), out_type, mode_first, mode_second,
                    aligns[0], aligns[1], aligns[2]};
  cublasLtMatmulAlgo_t algo{};
  if (!cached_algo(key, algo)) {
    const cublasStatus_t st = heuristic(handle, d.op, code_type(b), code_type(a), out_type, key.m, N, key.k, aligns, algo);
    if (st == CUBLAS_STATUS_SUCCESS) cache_algo(key, algo);
  }
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(handle, d.op, d.first, d.second, d.out, d.out, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
      check.workspaceSize > kWorkspaceBytes) {  // not for this shape (or none for the bucket): ask for it
    const cublasStatus_t st = heuristic(handle, d.op, code_type(b), code_type(a), out_type, M, N, K, aligns, algo);
    MC_CHECK(st == CUBLAS_STATUS_SUCCESS, "fp8_gemm: cuBLASLt has no FP8 algorithm for M=", M, " N=", N, " K=", K, " (",
             fp8_format_name(b.format()), " x ", fp8_format_name(a.format()), ", scale modes ", mode_first, "/",
             mode_second, ", alignments ", aligns[0], "/", aligns[1], "/", aligns[2], "): ", cublasGetStatusName(st));
  }
  Tensor workspace = Tensor::empty({static_cast<int64_t>(kWorkspaceBytes)}, DType::U8, dev);
  const float alpha = 1.0f;
  MC_CUBLAS_CHECK(cublasLtMatmul(handle, d.op, &alpha, b.data.data_ptr(), d.first, a.data.data_ptr(), d.second, &beta,
                                 c.data_ptr(), d.out, c.data_ptr(), d.out, &algo, workspace.data_ptr(),
                                 kWorkspaceBytes, stream));
}

}  // namespace moecore::ops::cuda
