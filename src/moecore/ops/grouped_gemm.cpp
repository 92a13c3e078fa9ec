#include "moecore/ops/grouped_gemm.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "moecore/ops/common.h"
#include "moecore/ops/gemm.h"

namespace moecore::ops {

namespace {

// rows_per_group: one entry per expert, none negative, summing to `rows`.
void check_groups(const char* op, const std::vector<int64_t>& groups, int64_t experts, int64_t rows) {
  MC_CHECK(static_cast<int64_t>(groups.size()) == experts, op, ": rows_per_group has ", groups.size(),
           " entries; expected one per expert (", experts, ")");
  int64_t sum = 0;
  for (size_t e = 0; e < groups.size(); ++e) {
    MC_CHECK(groups[e] >= 0, op, ": rows_per_group[", e, "] = ", groups[e], " is negative");
    sum += groups[e];
  }
  MC_CHECK(sum == rows, op, ": rows_per_group sums to ", sum, " but the permuted buffer has ", rows, " rows");
}

void check_2d(const char* op, const char* name, const Tensor& t) {
  check_contiguous(op, name, t);
  MC_CHECK(t.ndim() == 2, op, ": argument '", name, "' has shape ", shape_str(t.shape()), "; expected 2-D");
}

void check_weights(const char* op, const char* name, const Tensor& w) {
  check_contiguous(op, name, w);
  MC_CHECK(w.ndim() == 3, op, ": argument '", name, "' has shape ", shape_str(w.shape()), "; expected [E, N, K]");
}

// b (and the output) must have a's dtype; a weight gradient of bf16 inputs may also be f32.
void check_dtypes(const char* op, const char* na, const Tensor& a, const char* nb, const Tensor& b, const char* nc,
                  const Tensor& c, bool fp32_out_ok) {
  check_dtype(op, na, a, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(b.dtype() == a.dtype(), op, ": '", nb, "' is ", dtype_name(b.dtype()), " but '", na, "' is ",
           dtype_name(a.dtype()));
  const bool ok = c.dtype() == a.dtype() || (fp32_out_ok && a.dtype() == DType::BF16 && c.dtype() == DType::F32);
  MC_CHECK(ok, op, ": '", nc, "' is ", dtype_name(c.dtype()), "; expected ", dtype_name(a.dtype()),
           fp32_out_ok && a.dtype() == DType::BF16 ? " or f32" : "");
}

// The implementation used when neither set_grouped_gemm_impl nor MOECORE_GROUPED_GEMM says.
// Measured on an H200 (docs/performance.md, "Hopper grouped GEMM kernel"): training with Mixed
// against the loop, same call: finegrained-small 1.59x tokens/s, mixtral-small 1.09x; the MoE
// layer at the Qwen3-30B-A3B shape 10.97 vs 12.08 ms, at the Mixtral-8x7B shape 31.6 vs 28.9 ms
// (there cuBLAS's per-expert GEMMs are faster). With the TMA reduce-add wgrad, Hopper beats
// Mixed by 14% on finegrained-small but is 8.6% slower at the Mixtral-8x7B layer shape (an H100,
// one call), and mixtral-small is not measured with it yet: Mixed stays the default. Where the
// kernel cannot run (another GPU, f32, unaligned shapes) Mixed is the loop.
constexpr GroupedGemmImpl kDefaultImpl = GroupedGemmImpl::Mixed;

// -1: not decided yet (read MOECORE_GROUPED_GEMM on first use).
std::atomic<int> g_impl{-1};

#if MOECORE_WITH_CUDA
// True when a CUDA call should go to the grouped backend.
bool use_cuda_grouped(const Tensor& t) { return t.device().is_cuda() && grouped_gemm_impl() == GroupedGemmImpl::Grouped; }
// Forward and dgrad take the Hopper kernel under Hopper and Mixed, the wgrad only under Hopper.
bool use_hopper(const Tensor& t, bool wgrad) {
  const GroupedGemmImpl impl = grouped_gemm_impl();
  return t.device().is_cuda() && (impl == GroupedGemmImpl::Hopper || (!wgrad && impl == GroupedGemmImpl::Mixed));
}
#endif

// Expert e's [N, K] matrix of a [E, N, K] tensor.
Tensor expert_matrix(const Tensor& w, int64_t e) { return w.slice(0, e, e + 1).view({w.size(1), w.size(2)}); }

}  // namespace

const char* grouped_gemm_impl_name(GroupedGemmImpl impl) {
  switch (impl) {
    case GroupedGemmImpl::Loop: return "loop";
    case GroupedGemmImpl::Grouped: return "grouped";
    case GroupedGemmImpl::Hopper: return "hopper";
    case GroupedGemmImpl::Mixed: return "mixed";
  }
  return "?";
}

GroupedGemmImpl grouped_gemm_impl() {
  int v = g_impl.load();
  if (v >= 0) return static_cast<GroupedGemmImpl>(v);
  GroupedGemmImpl impl = kDefaultImpl;
  if (const char* env = std::getenv("MOECORE_GROUPED_GEMM"); env && *env) {
    const std::string s = env;
    MC_CHECK(s == "loop" || s == "grouped" || s == "hopper" || s == "mixed", "MOECORE_GROUPED_GEMM='", s,
             "'; expected 'loop', 'grouped', 'hopper' or 'mixed'");
    impl = s == "loop"      ? GroupedGemmImpl::Loop
           : s == "grouped" ? GroupedGemmImpl::Grouped
           : s == "hopper"  ? GroupedGemmImpl::Hopper
                            : GroupedGemmImpl::Mixed;
  }
  int expected = -1;
  g_impl.compare_exchange_strong(expected, static_cast<int>(impl));
  return static_cast<GroupedGemmImpl>(g_impl.load());
}

void set_grouped_gemm_impl(GroupedGemmImpl impl) { g_impl.store(static_cast<int>(impl)); }

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out) {
  constexpr const char* op = "grouped_gemm_forward";
  check_2d(op, "x", x);
  check_weights(op, "w", w);
  check_2d(op, "out", out);
  check_same_device(op, x, w);
  check_same_device(op, x, out);
  check_groups(op, rows_per_group, w.size(0), x.size(0));
  MC_CHECK(x.size(1) == w.size(2), op, ": 'x' has ", x.size(1), " columns but 'w' is [E, N, K] with K = ", w.size(2));
  check_shape(op, "out", out, {x.size(0), w.size(1)});
  check_dtypes(op, "x", x, "w", w, "out", out, false);
#if MOECORE_WITH_CUDA
  if (use_cuda_grouped(x) && cuda::grouped_gemm_forward(x, w, rows_per_group, out)) return;
  if (use_hopper(x, false) && cuda::hopper_grouped_gemm_forward(x, w, rows_per_group, out)) return;
#endif
  int64_t begin = 0;
  for (size_t e = 0; e < rows_per_group.size(); ++e) {
    const int64_t end = begin + rows_per_group[e];
    if (end > begin) {
      Tensor oe = out.slice(0, begin, end);
      gemm(x.slice(0, begin, end), expert_matrix(w, static_cast<int64_t>(e)), oe, false, true);
    }
    begin = end;
  }
}

void grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& dx) {
  constexpr const char* op = "grouped_gemm_dgrad";
  check_2d(op, "dout", dout);
  check_weights(op, "w", w);
  check_2d(op, "dx", dx);
  check_same_device(op, dout, w);
  check_same_device(op, dout, dx);
  check_groups(op, rows_per_group, w.size(0), dout.size(0));
  MC_CHECK(dout.size(1) == w.size(1), op, ": 'dout' has ", dout.size(1), " columns but 'w' is [E, N, K] with N = ",
           w.size(1));
  check_shape(op, "dx", dx, {dout.size(0), w.size(2)});
  check_dtypes(op, "dout", dout, "w", w, "dx", dx, false);
#if MOECORE_WITH_CUDA
  if (use_cuda_grouped(dout) && cuda::grouped_gemm_dgrad(dout, w, rows_per_group, dx)) return;
  if (use_hopper(dout, false) && cuda::hopper_grouped_gemm_dgrad(dout, w, rows_per_group, dx)) return;
#endif
  int64_t begin = 0;
  for (size_t e = 0; e < rows_per_group.size(); ++e) {
    const int64_t end = begin + rows_per_group[e];
    if (end > begin) {
      Tensor dxe = dx.slice(0, begin, end);
      gemm(dout.slice(0, begin, end), expert_matrix(w, static_cast<int64_t>(e)), dxe, false, false);
    }
    begin = end;
  }
}

void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw) {
  constexpr const char* op = "grouped_gemm_wgrad";
  check_2d(op, "dout", dout);
  check_2d(op, "x", x);
  check_weights(op, "dw", dw);
  check_same_device(op, dout, x);
  check_same_device(op, dout, dw);
  check_groups(op, rows_per_group, dw.size(0), dout.size(0));
  MC_CHECK(x.size(0) == dout.size(0), op, ": 'x' has ", x.size(0), " rows but 'dout' has ", dout.size(0));
  check_shape(op, "dw", dw, {dw.size(0), dout.size(1), x.size(1)});
  check_dtypes(op, "dout", dout, "x", x, "dw", dw, true);
#if MOECORE_WITH_CUDA
  if (use_cuda_grouped(dout) && cuda::grouped_gemm_wgrad(dout, x, rows_per_group, dw)) return;
  if (use_hopper(dout, true) && cuda::hopper_grouped_gemm_wgrad(dout, x, rows_per_group, dw)) return;
#endif
  int64_t begin = 0;
  for (size_t e = 0; e < rows_per_group.size(); ++e) {
    const int64_t end = begin + rows_per_group[e];
    if (end > begin) {
      Tensor dwe = expert_matrix(dw, static_cast<int64_t>(e));
      gemm(dout.slice(0, begin, end), x.slice(0, begin, end), dwe, true, false, 1.0f, 1.0f);
    }
    begin = end;
  }
}

}  // namespace moecore::ops
