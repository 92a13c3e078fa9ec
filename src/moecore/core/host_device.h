#pragma once
// MC_HD marks functions compiled for both the CPU and the GPU, so that both backends run
// the very same arithmetic (dtype conversions, Philox).
#if defined(__CUDACC__)
#define MC_HD __host__ __device__ __forceinline__
#else
#define MC_HD inline
#endif
