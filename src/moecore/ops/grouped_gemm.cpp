#include "moecore/ops/grouped_gemm.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "moecore/core/env_switches.h"
#include "moecore/ops/common.h"
#include "moecore/ops/elementwise.h"
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
// Mixed (the kernel for forward and input gradient, the loop for weight gradients) was the
// default first; where the kernel cannot run (another GPU, f32, unaligned shapes) Mixed is the
// loop. Auto is the default since the measurements in docs/performance-log.md ("Hopper grouped GEMM
// kernel", "The MoE layer without host synchronisation, ..."): at the Mixtral-8x7B expert shape
// (one expert's matrix 4096 x 14336 = 58.7M elements) cuBLAS's per-expert GEMMs beat the kernel
// on all six GEMMs and the host's wait for the counts hides behind them; at mixtral-small's
// (2048 x 11264 = 23M and 2048 x 5632) the loop wins the GEMMs alone but loses in training (the
// host waits for each layer's counts, then enqueues per-expert calls while the GPU idles):
// all-kernel with device offsets there, and below (Qwen3, finegrained-small) the kernel wins
// outright.
constexpr int64_t kAutoLoopFromElements = 40'000'000;
constexpr GroupedGemmImpl kDefaultImpl = GroupedGemmImpl::Auto;

// -1: not decided yet (read MOECORE_GROUPED_GEMM on first use).
std::atomic<int> g_impl{-1};

#if MOECORE_WITH_CUDA
// True when a CUDA call should go to the grouped backend.
bool use_cuda_grouped(const Tensor& t) { return t.device().is_cuda() && grouped_gemm_impl() == GroupedGemmImpl::Grouped; }
// Whether a GEMM with the expert weight (or weight gradient) w [E, N, K] takes the Hopper
// kernel: forward and dgrad under Hopper and Mixed, the wgrad only under Hopper; under Auto all
// three when one expert's matrix has fewer than kAutoLoopFromElements elements, none otherwise.
bool use_hopper(const Tensor& w, bool wgrad) {
  if (!w.device().is_cuda()) return false;
  switch (grouped_gemm_impl()) {
    case GroupedGemmImpl::Hopper: return true;
    case GroupedGemmImpl::Mixed: return !wgrad;
    case GroupedGemmImpl::Auto: return w.ndim() == 3 && w.size(1) * w.size(2) < kAutoLoopFromElements;
    default: return false;
  }
}
#endif

}  // namespace

Tensor expert_matrix(const Tensor& w, int64_t e) { return w.slice(0, e, e + 1).view({w.size(1), w.size(2)}); }

const char* grouped_gemm_impl_name(GroupedGemmImpl impl) {
  switch (impl) {
    case GroupedGemmImpl::Loop: return "loop";
    case GroupedGemmImpl::Grouped: return "grouped";
    case GroupedGemmImpl::Hopper: return "hopper";
    case GroupedGemmImpl::Mixed: return "mixed";
    case GroupedGemmImpl::Auto: return "auto";
  }
  return "?";
}

GroupedGemmImpl grouped_gemm_impl() {
  int v = g_impl.load();
  if (v >= 0) return static_cast<GroupedGemmImpl>(v);
  GroupedGemmImpl impl = kDefaultImpl;
  if (const char* env = env_switch("MOECORE_GROUPED_GEMM"); env && *env) {
    const std::string s = env;
    MC_CHECK(s == "loop" || s == "grouped" || s == "hopper" || s == "mixed" || s == "auto", "MOECORE_GROUPED_GEMM='",
             s, "'; expected 'auto', 'loop', 'grouped', 'hopper' or 'mixed'");
    impl = s == "loop"      ? GroupedGemmImpl::Loop
           : s == "grouped" ? GroupedGemmImpl::Grouped
           : s == "hopper"  ? GroupedGemmImpl::Hopper
           : s == "mixed"   ? GroupedGemmImpl::Mixed
                            : GroupedGemmImpl::Auto;
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
  if (x.device().is_cuda() && grouped_gemm_impl() == GroupedGemmImpl::Auto && x.size(0) <= kGroupedGemvMaxRows &&
      cuda::grouped_gemv_forward(x, w, rows_per_group, out))
    return;
  if (use_cuda_grouped(x) && cuda::grouped_gemm_forward(x, w, rows_per_group, out)) return;
  if (use_hopper(w, false) && cuda::hopper_grouped_gemm_forward(x, w, rows_per_group, out)) return;
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
  if (use_hopper(w, false) && cuda::hopper_grouped_gemm_dgrad(dout, w, rows_per_group, dx)) return;
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

void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw,
                        bool accumulate) {
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
  if (use_cuda_grouped(dout)) {  // cuBLAS's grouped call accumulates: zero first to overwrite
    if (!accumulate) fill(dw, 0.0);
    if (cuda::grouped_gemm_wgrad(dout, x, rows_per_group, dw)) return;
    accumulate = true;
  }
  if (use_hopper(dw, true) && cuda::hopper_grouped_gemm_wgrad(dout, x, rows_per_group, dw, accumulate)) return;
#endif
  int64_t begin = 0;
  for (size_t e = 0; e < rows_per_group.size(); ++e) {
    const int64_t end = begin + rows_per_group[e];
    Tensor dwe = expert_matrix(dw, static_cast<int64_t>(e));
    if (end > begin) {
      gemm(dout.slice(0, begin, end), x.slice(0, begin, end), dwe, true, false, 1.0f, accumulate ? 1.0f : 0.0f);
    } else if (!accumulate) {
      fill(dwe, 0.0);
    }
    begin = end;
  }
}

const std::vector<int64_t>& ExpertRows::counts() const {
  if (!host.empty() || !offsets.defined()) return host;
  if (copied_.empty()) {
    const std::vector<int32_t> off = offsets.to_vector<int32_t>();
    copied_.resize(off.size() - 1);
    for (size_t e = 0; e + 1 < off.size(); ++e) copied_[e] = static_cast<int64_t>(off[e + 1]) - off[e];
  }
  return copied_;
}

namespace {

// Offsets [E + 1] i32 on `t`'s device for E experts: shape, dtype and device. Their values are
// checked (check_groups) only where the counts come to the host (CPU, or a GPU fallback); the
// kernel trusts them (ExpertRows' preconditions).
void check_offsets(const char* op, const ExpertRows& rows, int64_t experts, const Tensor& t) {
  MC_CHECK(!rows.host.empty() || rows.offsets.defined(), op, ": the expert rows have neither host counts nor device offsets");
  if (!rows.offsets.defined()) return;
  check_contiguous(op, "rows.offsets", rows.offsets);
  check_dtype(op, "rows.offsets", rows.offsets, {DType::I32});
  check_shape(op, "rows.offsets", rows.offsets, {experts + 1});
  check_same_device(op, t, rows.offsets);
}

#if MOECORE_WITH_CUDA
// True when the GEMM ran on the device offsets alone (kernel(): checks the shapes and launches).
template <typename Kernel>
bool device_rows_ran(bool wgrad, const ExpertRows& rows, const Tensor& w, Kernel&& kernel) {
  return rows.host.empty() && rows.offsets.defined() && use_hopper(w, wgrad) && kernel();
}
#endif

}  // namespace

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows, Tensor& out) {
  check_weights("grouped_gemm_forward", "w", w);
  check_offsets("grouped_gemm_forward", rows, w.size(0), x);
#if MOECORE_WITH_CUDA
  if (rows.host.empty() && rows.offsets.defined() && grouped_gemm_impl() == GroupedGemmImpl::Auto &&
      x.ndim() == 2 && out.ndim() == 2 && x.size(1) == w.size(2) && out.size(0) == x.size(0) &&
      out.size(1) == w.size(1) && x.size(0) <= kGroupedGemvMaxRows && cuda::grouped_gemv_forward(x, w, rows.offsets, out))
    return;
  if (device_rows_ran(false, rows, w, [&] {
        return x.ndim() == 2 && out.ndim() == 2 && x.size(1) == w.size(2) && out.size(0) == x.size(0) &&
               out.size(1) == w.size(1) && out.dtype() == x.dtype() && w.dtype() == x.dtype() &&
               cuda::hopper_grouped_gemm_forward(x, w, rows.offsets, out);
      }))
    return;
#endif
  grouped_gemm_forward(x, w, rows.counts(), out);
}

void grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const ExpertRows& rows, Tensor& dx) {
  check_weights("grouped_gemm_dgrad", "w", w);
  check_offsets("grouped_gemm_dgrad", rows, w.size(0), dout);
#if MOECORE_WITH_CUDA
  if (device_rows_ran(false, rows, w, [&] {
        return dout.ndim() == 2 && dx.ndim() == 2 && dout.size(1) == w.size(1) && dx.size(0) == dout.size(0) &&
               dx.size(1) == w.size(2) && dx.dtype() == dout.dtype() && w.dtype() == dout.dtype() &&
               cuda::hopper_grouped_gemm_dgrad(dout, w, rows.offsets, dx);
      }))
    return;
#endif
  grouped_gemm_dgrad(dout, w, rows.counts(), dx);
}

void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const ExpertRows& rows, Tensor& dw, bool accumulate) {
  check_weights("grouped_gemm_wgrad", "dw", dw);
  check_offsets("grouped_gemm_wgrad", rows, dw.size(0), dout);
#if MOECORE_WITH_CUDA
  if (device_rows_ran(true, rows, dw, [&] {
        return dout.ndim() == 2 && x.ndim() == 2 && x.size(0) == dout.size(0) && dw.size(1) == dout.size(1) &&
               dw.size(2) == x.size(1) && x.dtype() == dout.dtype() &&
               (dw.dtype() == dout.dtype() || (dout.dtype() == DType::BF16 && dw.dtype() == DType::F32)) &&
               cuda::hopper_grouped_gemm_wgrad(dout, x, rows.offsets, dw, accumulate);
      }))
    return;
#endif
  grouped_gemm_wgrad(dout, x, rows.counts(), dw, accumulate);
}

bool grouped_gemm_device_rows(const Tensor& w) {
#if MOECORE_WITH_CUDA
  return use_hopper(w, false) && use_hopper(w, true) && cuda::hopper_grouped_gemm_takes(w);
#else
  (void)w;
  return false;
#endif
}

}  // namespace moecore::ops
