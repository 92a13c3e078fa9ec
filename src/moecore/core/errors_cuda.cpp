#include "moecore/core/cuda_check.h"

#include "moecore/core/nccl_check.h"

namespace moecore::detail {

void raise_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  throw Error(concat("CUDA call failed: ", expr, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"),
              file, line);
}

void raise_cublas(cublasStatus_t s, const char* expr, const char* file, int line) {
  throw Error(concat("cuBLAS call failed: ", expr, ": ", cublasGetStatusName(s), " (",
                     cublasGetStatusString(s), ")"),
              file, line);
}

void raise_nccl(ncclResult_t r, const char* expr, const char* file, int line) {
  throw Error(concat("NCCL call failed: ", expr, ": ", ncclGetErrorString(r), " (code ", static_cast<int>(r),
                     ")"),
              file, line);
}

}  // namespace moecore::detail
