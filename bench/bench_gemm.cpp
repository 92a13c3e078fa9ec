// GEMM benchmark: TFLOP/s of ops::gemm for the square 8192^3 bf16 ceiling and MoE-like shapes
// (expert FC1/FC2 forward and the backward GEMMs at the Mixtral-8x7B, Qwen3-30B-A3B and
// mixtral-small expert sizes).
//
// On a GPU: bf16 in, fp32 accumulate, bf16 out, through cuBLASLt; inputs are random (never
// zeros), and each shape rotates over enough input sets to exceed the L2 cache. Timing: CUDA
// events around `iters` back-to-back calls after warm-up; the median of `repeats` such runs.
// On the CPU: f32 through OpenBLAS at smaller sizes.
//
// Flags: --device cpu|cuda (default: cuda when present), --repeats N, --quick (fewer shapes).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/cli/flags.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/core/tensor.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/random.h"

#if MOECORE_WITH_CUDA
#include <cublas_v2.h>

#include "moecore/core/cuda_check.h"
#endif

using namespace moecore;

namespace {

struct Case {
  std::string name;
  int64_t m, n, k;
  bool ta, tb;
};

struct Result {
  Case c;
  double ms;
  double tflops;
  double ref_tflops;  // cuBLAS (cublasGemmEx, default algorithm) on the same inputs; 0 on the CPU
};

#if MOECORE_WITH_CUDA
// The ceiling we hold ops::gemm to: plain cuBLAS on the same row-major problem (computed as
// C^T = op(B)^T op(A)^T in column-major, like ops::gemm).
void cublas_reference(cublasHandle_t h, const Case& c, const Tensor& a, const Tensor& b, Tensor& out) {
  const float alpha = 1.0f, beta = 0.0f;
  MC_CUBLAS_CHECK(cublasGemmEx(h, c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, c.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                               static_cast<int>(c.n), static_cast<int>(c.m), static_cast<int>(c.k), &alpha,
                               b.data_ptr(), CUDA_R_16BF, static_cast<int>(c.tb ? c.k : c.n), a.data_ptr(),
                               CUDA_R_16BF, static_cast<int>(c.ta ? c.m : c.k), &beta, out.data_ptr(), CUDA_R_16BF,
                               static_cast<int>(c.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
#endif

// Median milliseconds per call of fn(i) over `repeats` runs of `iters` back-to-back calls.
template <typename F>
double time_ms(Device dev, int iters, int repeats, F&& fn) {
  for (int w = 0; w < 3; ++w) fn(w);
  synchronize(dev);
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    Event start(dev), stop(dev);
    start.record();
    for (int i = 0; i < iters; ++i) fn(i);
    stop.record();
    stop.synchronize();
    times.push_back(stop.elapsed_ms_since(start) / iters);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

Result run_case(const Case& c, Device dev, DType dtype, int repeats) {
  const int64_t a_rows = c.ta ? c.k : c.m, a_cols = c.ta ? c.m : c.k;
  const int64_t b_rows = c.tb ? c.n : c.k, b_cols = c.tb ? c.k : c.n;
  const double bytes = static_cast<double>(a_rows * a_cols + b_rows * b_cols + c.m * c.n) * dtype_size(dtype);
  const int sets = dev.is_cuda() ? std::max(2, static_cast<int>(std::ceil(200e6 / bytes))) : 1;  // > L2 (50-60 MB)
  std::vector<Tensor> as, bs, cs;
  for (int s = 0; s < sets; ++s) {
    as.push_back(Tensor::empty({a_rows, a_cols}, dtype, dev));
    bs.push_back(Tensor::empty({b_rows, b_cols}, dtype, dev));
    cs.push_back(Tensor::empty({c.m, c.n}, dtype, dev));
    ops::fill_normal(as.back(), 1234 + s, rng_key("bench-a"), 0.0, 1.0);
    ops::fill_normal(bs.back(), 1234 + s, rng_key("bench-b"), 0.0, 1.0);
  }
  const double flops = 2.0 * static_cast<double>(c.m) * c.n * c.k;
  const int iters = std::max(3, std::min(200, static_cast<int>((dev.is_cuda() ? 2e13 : 2e10) / flops)));
  const double ms =
      time_ms(dev, iters, repeats, [&](int i) { ops::gemm(as[i % sets], bs[i % sets], cs[i % sets], c.ta, c.tb); });
  double ref_tflops = 0;
#if MOECORE_WITH_CUDA
  if (dev.is_cuda()) {
    static cublasHandle_t handle = [] {
      cublasHandle_t h;
      MC_CUBLAS_CHECK(cublasCreate(&h));
      return h;
    }();
    MC_CUBLAS_CHECK(cublasSetStream(handle, static_cast<cudaStream_t>(current_stream(dev).handle())));
    const double ref_ms =
        time_ms(dev, iters, repeats, [&](int i) { cublas_reference(handle, c, as[i % sets], bs[i % sets], cs[i % sets]); });
    ref_tflops = flops / (ref_ms * 1e-3) / 1e12;
  }
#endif
  return {c, ms, flops / (ms * 1e-3) / 1e12, ref_tflops};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string device_name = cuda_device_count() > 0 ? "cuda" : "cpu";
    int64_t repeats = 5;
    bool quick = false;
    cli::FlagSet flags("bench_gemm", "GEMM throughput: square ceiling and MoE expert shapes.");
    flags.add_string("device", &device_name, "cpu or cuda");
    flags.add_int("repeats", &repeats, "timed repetitions (median reported)");
    flags.add_bool("quick", &quick, "only a few shapes");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    const Device dev = parse_device(device_name);
    const DType dtype = dev.is_cuda() ? DType::BF16 : DType::F32;
    std::vector<Case> cases;
    if (dev.is_cuda()) {
      cases = {
          {"square 8192^3", 8192, 8192, 8192, false, false},
          // Mixtral-8x7B experts (h4096 f14336), 8192 tokens x top-2 / 8 experts = 2048 tokens per expert
          {"mixtral fc1 fwd (2048x28672x4096)", 2048, 28672, 4096, false, true},
          {"mixtral fc2 fwd (2048x4096x14336)", 2048, 4096, 14336, false, true},
          {"mixtral fc1 dgrad (2048x4096x28672)", 2048, 4096, 28672, false, false},
          {"mixtral fc1 wgrad (28672x4096x2048)", 28672, 4096, 2048, true, false},
          // Qwen3-30B-A3B experts (h2048 f768), 16384 tokens x top-8 / 128 experts = 1024 tokens per expert
          {"qwen3 fc1 fwd (1024x1536x2048)", 1024, 1536, 2048, false, true},
          {"qwen3 fc2 fwd (1024x2048x768)", 1024, 2048, 768, false, true},
          {"qwen3 fc1 wgrad (1536x2048x1024)", 1536, 2048, 1024, true, false},
          // mixtral-small preset (h2048 f5632 E8 k2, 8192 tokens): 2048 tokens per expert
          {"mixtral-small fc1 fwd (2048x11264x2048)", 2048, 11264, 2048, false, true},
          {"mixtral-small fc2 fwd (2048x2048x5632)", 2048, 2048, 5632, false, true},
      };
      if (quick) cases.resize(3);
    } else {
      cases = {{"square 1024^3", 1024, 1024, 1024, false, false},
               {"expert fc1 fwd (512x1024x256)", 512, 1024, 256, false, true},
               {"expert fc1 wgrad (1024x256x512)", 1024, 256, 512, true, false}};
      if (quick) cases.resize(1);
    }
    const nlohmann::json info = system_info();
    const std::string card = dev.is_cuda() ? info["cuda_devices"][dev.index]["name"].get<std::string>() : "cpu";
    std::vector<Result> results;
    for (const Case& c : cases) {
      Result r = run_case(c, dev, dtype, static_cast<int>(repeats));
      results.push_back(r);
      nlohmann::json j = {{"bench", "gemm"}, {"case", c.name}, {"device", card},   {"dtype", dtype_name(dtype)},
                          {"m", c.m},        {"n", c.n},       {"k", c.k},         {"trans_a", c.ta},
                          {"trans_b", c.tb}, {"ms", r.ms},     {"tflops", r.tflops}, {"cublas_tflops", r.ref_tflops}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
    const double ceiling = results[0].tflops;
    std::printf("\nGEMM on %s (%s, fp32 accumulate)\n", card.c_str(), dtype_name(dtype));
    std::printf("%-42s %9s %9s %10s %11s %11s\n", "case", "ms", "TFLOP/s", "of square", "cuBLAS", "vs cuBLAS");
    for (const Result& r : results)
      std::printf("%-42s %9.3f %9.1f %9.1f%% %11.1f %10.1f%%\n", r.c.name.c_str(), r.ms, r.tflops,
                  100.0 * r.tflops / ceiling, r.ref_tflops, r.ref_tflops > 0 ? 100.0 * r.tflops / r.ref_tflops : 0.0);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: error: %s\n", e.what());
    return 1;
  }
}
