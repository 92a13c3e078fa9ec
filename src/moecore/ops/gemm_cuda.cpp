// CUDA GEMM through cuBLASLt.
//
// cuBLASLt is column-major. A row-major [r, c] matrix is a column-major [c, r] one with the
// same leading dimension, so C = op(A) op(B) (row-major) is computed as
// C^T = op(B)^T op(A)^T (column-major): B is cuBLASLt's first operand and A its second, with
// m = N, n = M. Stored layouts (rows, cols, ld) in column-major terms:
//   first  operand (B): trans_b ? (K, N, K) : (N, K, N), op = trans_b ? T : N
//   second operand (A): trans_a ? (M, K, M) : (K, M, K), op = trans_a ? T : N
//   C and D:            (N, M, N)
// Compute type is fp32 (CUBLAS_COMPUTE_32F: no TF32 for f32 inputs), scale type fp32.
// Heuristic results are cached per (shape, dtypes, transposes, pointer alignment); each
// (device, stream) has its own 32 MiB workspace from the caching allocator.
#include <map>
#include <mutex>
#include <tuple>

#include "moecore/core/allocator.h"
#include "moecore/core/cuda_check.h"
#include "moecore/ops/gemm.h"

namespace moecore::ops::cuda {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

cudaDataType_t to_cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    default: MC_FAIL("gemm: dtype ", dtype_name(t), " not supported by the CUDA GEMM");
  }
}

uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a /= 2;
  return a;
}

cublasLtHandle_t lt_handle(int device) {
  static std::mutex m;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(m);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h;
  MC_CUBLAS_CHECK(cublasLtCreate(&h));
  handles[device] = h;
  return h;
}

void* workspace(Device device, cudaStream_t stream) {
  static std::mutex m;
  static std::map<std::pair<int, cudaStream_t>, void*> spaces;  // kept for the process lifetime
  std::lock_guard<std::mutex> lock(m);
  auto key = std::make_pair(device.index, stream);
  auto it = spaces.find(key);
  if (it != spaces.end()) return it->second;
  void* p = cuda_allocator(device.index).allocate(kWorkspaceBytes, stream);
  spaces[key] = p;
  return p;
}

using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int, int, uint32_t, uint32_t, uint32_t, bool>;

struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  ~Descriptors() {
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (second) cublasLtMatrixLayoutDestroy(second);
    if (first) cublasLtMatrixLayoutDestroy(first);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

size_t cublaslt_version() { return cublasLtGetVersion(); }

void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool ta, bool tb, float alpha, float beta) {
  const GemmShape s = gemm_shape(a, b, c, ta, tb);
  const Device dev = a.device();
  MC_CUDA_CHECK(cudaSetDevice(dev.index));
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream(dev).handle());
  if (s.m == 0 || s.n == 0) return;
  if (s.k == 0) {  // cuBLASLt rejects k = 0; by definition C = beta * C
    MC_CHECK(beta == 0.0f, "gemm: k = 0 with beta != 0 is not supported on CUDA");
    MC_CUDA_CHECK(cudaMemsetAsync(c.data_ptr(), 0, c.nbytes(), stream));
    return;
  }

  const cudaDataType_t ab_type = to_cuda_type(a.dtype());
  const cudaDataType_t c_type = to_cuda_type(c.dtype());
  Descriptors d;
  MC_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first));
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second));
  const uint64_t M = static_cast<uint64_t>(s.m), N = static_cast<uint64_t>(s.n), K = static_cast<uint64_t>(s.k);
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.first, ab_type, tb ? K : N, tb ? N : K, static_cast<int64_t>(tb ? K : N)));
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.second, ab_type, ta ? M : K, ta ? K : M, static_cast<int64_t>(ta ? M : K)));
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.out, c_type, N, M, static_cast<int64_t>(N)));

  cublasLtHandle_t handle = lt_handle(dev.index);
  const uint32_t align_b = alignment_of(b.data_ptr()), align_a = alignment_of(a.data_ptr()),
                 align_c = alignment_of(c.data_ptr());
  const AlgoKey key{dev.index, s.m, s.n, s.k, ta, tb, static_cast<int>(ab_type), static_cast<int>(c_type),
                    align_a, align_b, align_c, beta != 0.0f};
  static std::mutex cache_mutex;
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> cache;
  cublasLtMatmulAlgo_t algo;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      algo = it->second;
      found = true;
    }
  }
  if (!found) {
    cublasLtMatmulPreference_t pref;
    MC_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspaceBytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b, sizeof align_b);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a, sizeof align_a);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.first, d.second, d.out, d.out, pref, 1, &result, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    MC_CHECK(st == CUBLAS_STATUS_SUCCESS && count > 0, "gemm: cuBLASLt has no algorithm for M=", s.m, " N=", s.n,
             " K=", s.k, " ", dtype_name(a.dtype()), "->", dtype_name(c.dtype()), " (", cublasGetStatusName(st), ")");
    algo = result.algo;
    std::lock_guard<std::mutex> lock(cache_mutex);
    cache[key] = algo;
  }
  MC_CUBLAS_CHECK(cublasLtMatmul(handle, d.op, &alpha, b.data_ptr(), d.first, a.data_ptr(), d.second, &beta,
                                 c.data_ptr(), d.out, c.data_ptr(), d.out, &algo, workspace(dev, stream),
                                 kWorkspaceBytes, stream));
}

}  // namespace moecore::ops::cuda
