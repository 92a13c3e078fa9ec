// CUDA grouped GEMM over experts: one cublasGemmGroupedBatchedEx call (cuBLAS >= 12.5).
//
// Row-major to column-major as in gemm_cuda.cpp: a row-major C = op(A) op(B) is the
// column-major C^T = op(B)^T op(A)^T, so cuBLAS's first operand is the row-major B. Per
// non-empty expert e with M_e rows starting at row r_e (each expert is one group of size 1):
//   forward  out_e = x_e w_e^T : T,N  m=N n=M_e k=K   A=w_e (ld K)      B=x+r_e*K (ld K)    C=out+r_e*N (ld N)
//   dgrad    dx_e = dout_e w_e : N,N  m=K n=M_e k=N   A=w_e (ld K)      B=dout+r_e*N (ld N) C=dx+r_e*K (ld K)
//   wgrad   dw_e += dout_e^T x_e: N,T m=K n=N  k=M_e  A=x+r_e*K (ld K)  B=dout+r_e*N (ld N) C=dw_e (ld K), beta 1
// Compute type CUBLAS_COMPUTE_32F with float alpha/beta (no TF32 for f32 inputs).
//
// Types: cuBLAS documents bf16 -> bf16 and f32 -> f32 for this API (also f16 and f64), not bf16
// inputs with an f32 output, which the wgrad into fp32 gradients needs. That case is tried once;
// if cuBLAS refuses it (CUBLAS_STATUS_NOT_SUPPORTED / INVALID_VALUE) it is remembered and the
// caller falls back to its per-expert loop (cuBLASLt supports bf16 -> f32); cuBLAS 13.1 refuses
// it. A bf16 temporary plus an add would round
// the fp32 gradients, so it is not used. A zero reduction
// dimension (forward with K = 0, dgrad with N = 0) also falls back (the output must be zeroed).
//
// Pointer arrays: the m/n/k/ld/alpha/beta arrays are host arrays; the A, B and C pointer arrays
// must be in device memory. They are written into a pinned host buffer and copied with
// cudaMemcpyAsync on the current stream just before the GEMM. Each buffer pair (pinned + device)
// belongs to a slot with an event recorded after the GEMM; a slot is reused only once its event
// has completed (cudaEventQuery, never blocking), otherwise a new slot is made, so a copy still
// in flight never sees its source rewritten and no host synchronisation is added.
//
// Speed: this call ran at 35-50% of a dense cuBLAS GEMM of the same FLOPs at the Mixtral and
// Qwen3 expert shapes, slower than the per-expert loop, so it is never the default
// (grouped_gemm.h; measured: docs/performance-log.md, "Grouped GEMM").
#include <algorithm>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "moecore/core/allocator.h"
#include "moecore/core/cuda_check.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/grouped_gemm_hopper.h"

namespace moecore::ops::cuda {

namespace {

enum class Kind { Forward, Dgrad, Wgrad };

cudaDataType_t cuda_type(DType t) { return t == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

cublasHandle_t blas_handle(int device) {
  static std::mutex m;
  static std::map<int, cublasHandle_t> handles;  // kept for the process lifetime
  std::lock_guard<std::mutex> lock(m);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasHandle_t h;
  MC_CUBLAS_CHECK(cublasCreate(&h));
  handles[device] = h;
  return h;
}

// A pinned host array of pointers, its device copy and the event after the GEMM that read it.
struct Slot {
  void** host = nullptr;
  void** dev = nullptr;
  size_t capacity = 0;  // pointers
  cudaEvent_t done = nullptr;
  bool busy = false;    // between acquire() and release()
};

class SlotPool {
 public:
  explicit SlotPool(int device) : device_(device) {}
  Slot& acquire(size_t pointers, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot* slot = nullptr;
    for (auto& s : slots_) {
      if (s->busy) continue;
      const cudaError_t q = cudaEventQuery(s->done);  // never-recorded events count as complete
      if (q == cudaErrorNotReady) continue;
      MC_CUDA_CHECK(q);
      slot = s.get();
      break;
    }
    if (!slot) {
      slots_.push_back(std::make_unique<Slot>());
      slot = slots_.back().get();
      MC_CUDA_CHECK(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming));
    }
    if (slot->capacity < pointers) {  // the slot is idle: its old buffers can go
      if (slot->host) pinned_allocator().deallocate(slot->host);
      if (slot->dev) cuda_allocator(device_).deallocate(slot->dev);
      const size_t cap = std::max<size_t>(pointers, 3 * 256);
      slot->host = static_cast<void**>(pinned_allocator().allocate(cap * sizeof(void*)));
      slot->dev = static_cast<void**>(cuda_allocator(device_).allocate(cap * sizeof(void*), stream));
      slot->capacity = cap;
    }
    slot->busy = true;
    return *slot;
  }
  void release(Slot& slot, cudaStream_t stream) {
    // Recording fails only on a broken context; the slot then stays busy (never reused).
    MC_CUDA_CHECK(cudaEventRecord(slot.done, stream));
    std::lock_guard<std::mutex> lock(mutex_);
    slot.busy = false;
  }

 private:
  int device_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<Slot>> slots_;  // kept for the process lifetime
};

SlotPool& slot_pool(int device) {
  static std::mutex m;
  static std::map<int, std::unique_ptr<SlotPool>> pools;
  std::lock_guard<std::mutex> lock(m);
  auto& p = pools[device];
  if (!p) p = std::make_unique<SlotPool>(device);
  return *p;
}

// Set once cuBLAS has refused bf16 inputs with an f32 output.
std::mutex g_refused_mutex;
bool g_bf16_f32_refused = false;

int checked_int(int64_t v, const char* what) {
  MC_CHECK(v <= INT_MAX, "grouped_gemm (CUDA): ", what, " = ", v, " exceeds the int range of cuBLAS's grouped GEMM");
  return static_cast<int>(v);
}

// a: x (forward) or dout (dgrad, wgrad); b: w (forward, dgrad) or x (wgrad); c: the output.
bool run(Kind kind, const Tensor& a, const Tensor& b, const std::vector<int64_t>& rows, Tensor& c) {
  const DType in = a.dtype(), out = c.dtype();
  const bool types_ok = (in == DType::F32 && out == DType::F32) || (in == DType::BF16 && out == DType::BF16) ||
                        (in == DType::BF16 && out == DType::F32);
  if (!types_ok) return false;  // f64: the loop raises ops::gemm's "CPU-only" error
  const bool mixed = in == DType::BF16 && out == DType::F32;
  if (mixed) {
    std::lock_guard<std::mutex> lock(g_refused_mutex);
    if (g_bf16_f32_refused) return false;
  }

  // Row-major sizes: N = output columns of the forward, K = its reduction dimension.
  int64_t n_dim = 0, k_dim = 0;
  switch (kind) {
    case Kind::Forward: n_dim = b.size(1), k_dim = b.size(2); break;  // x [M,K], w [E,N,K]
    case Kind::Dgrad: n_dim = b.size(1), k_dim = b.size(2); break;    // dout [M,N], w [E,N,K]
    case Kind::Wgrad: n_dim = c.size(1), k_dim = c.size(2); break;    // dout [M,N], x [M,K], dw [E,N,K]
  }
  if (n_dim == 0 || k_dim == 0) {
    // Forward with K = 0 / dgrad with N = 0 must zero a non-empty output: the loop does that.
    // Otherwise there is nothing to compute.
    if (kind == Kind::Forward && k_dim == 0 && n_dim > 0) return false;
    if (kind == Kind::Dgrad && n_dim == 0 && k_dim > 0) return false;
    return true;
  }

  const size_t in_size = dtype_size(in), out_size = dtype_size(out);
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pb = static_cast<const char*>(b.data_ptr());
  char* pc = static_cast<char*>(c.data_ptr());

  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> ms, ns, ks, lda, ldb, ldc, sizes;
  std::vector<float> alphas, betas;
  std::vector<const void*> aptr, bptr;
  std::vector<void*> cptr;
  const int N = checked_int(n_dim, "N"), K = checked_int(k_dim, "K");
  int64_t begin = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    const int64_t me = rows[e];
    const int64_t r = begin;
    begin += me;
    if (me == 0) continue;  // zero-row experts: nothing to write (wgrad slice unchanged)
    const int M = checked_int(me, "rows of an expert");
    const int64_t expert_off = static_cast<int64_t>(e) * n_dim * k_dim;  // into w or dw
    switch (kind) {
      case Kind::Forward:
        ta.push_back(CUBLAS_OP_T), tb.push_back(CUBLAS_OP_N);
        ms.push_back(N), ns.push_back(M), ks.push_back(K);
        aptr.push_back(pb + expert_off * in_size), lda.push_back(K);
        bptr.push_back(pa + r * k_dim * in_size), ldb.push_back(K);
        cptr.push_back(pc + r * n_dim * out_size), ldc.push_back(N);
        break;
      case Kind::Dgrad:
        ta.push_back(CUBLAS_OP_N), tb.push_back(CUBLAS_OP_N);
        ms.push_back(K), ns.push_back(M), ks.push_back(N);
        aptr.push_back(pb + expert_off * in_size), lda.push_back(K);
        bptr.push_back(pa + r * n_dim * in_size), ldb.push_back(N);
        cptr.push_back(pc + r * k_dim * out_size), ldc.push_back(K);
        break;
      case Kind::Wgrad:
        ta.push_back(CUBLAS_OP_N), tb.push_back(CUBLAS_OP_T);
        ms.push_back(K), ns.push_back(N), ks.push_back(M);
        aptr.push_back(pb + r * k_dim * in_size), lda.push_back(K);
        bptr.push_back(pa + r * n_dim * in_size), ldb.push_back(N);
        cptr.push_back(pc + expert_off * out_size), ldc.push_back(K);
        break;
    }
    alphas.push_back(1.0f);
    betas.push_back(kind == Kind::Wgrad ? 1.0f : 0.0f);
    sizes.push_back(1);
  }
  const int groups = static_cast<int>(sizes.size());
  if (groups == 0) return true;  // every expert empty

  const Device dev = a.device();
  MC_CUDA_CHECK(cudaSetDevice(dev.index));
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream(dev).handle());
  SlotPool& pool = slot_pool(dev.index);
  Slot& slot = pool.acquire(3 * static_cast<size_t>(groups), stream);
  // Layout of the pointer buffer: [A pointers | B pointers | C pointers].
  for (int g = 0; g < groups; ++g) {
    slot.host[g] = const_cast<void*>(aptr[g]);
    slot.host[groups + g] = const_cast<void*>(bptr[g]);
    slot.host[2 * groups + g] = cptr[g];
  }
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  try {
    MC_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, 3 * static_cast<size_t>(groups) * sizeof(void*),
                                  cudaMemcpyHostToDevice, stream));
    cublasHandle_t h = blas_handle(dev.index);
    static std::mutex handle_mutex;  // one handle per device, its stream set per call
    std::lock_guard<std::mutex> lock(handle_mutex);
    MC_CUBLAS_CHECK(cublasSetStream(h, stream));
    void** d = slot.dev;
    st = cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(), alphas.data(),
                                    const_cast<const void* const*>(d), cuda_type(in), lda.data(),
                                    const_cast<const void* const*>(d + groups), cuda_type(in), ldb.data(),
                                    betas.data(), d + 2 * groups, cuda_type(out), ldc.data(), groups, sizes.data(),
                                    CUBLAS_COMPUTE_32F);
  } catch (...) {
    pool.release(slot, stream);  // the event covers whatever was enqueued
    throw;
  }
  pool.release(slot, stream);
  if (mixed && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
    std::lock_guard<std::mutex> lock(g_refused_mutex);
    g_bf16_f32_refused = true;
    return false;
  }
  MC_CUBLAS_CHECK(st);
  return true;
}

// Host row counts as device offsets for a kernel: written into a pinned slot and copied up on
// the current stream (the same no-synchronisation reuse rule as the pointer arrays above); then
// launch(offsets on the device, stream).
template <typename Launch>
void with_device_offsets(const Device& dev, const std::vector<int64_t>& rows, Launch&& launch) {
  const int64_t experts = static_cast<int64_t>(rows.size());
  MC_CUDA_CHECK(cudaSetDevice(dev.index));
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream(dev).handle());
  SlotPool& pool = slot_pool(dev.index);
  const size_t ints = static_cast<size_t>(experts) + 1;
  Slot& slot = pool.acquire((ints * sizeof(int) + sizeof(void*) - 1) / sizeof(void*), stream);
  try {
    int* host = reinterpret_cast<int*>(slot.host);
    int64_t begin = 0;
    for (int64_t e = 0; e < experts; ++e) host[e] = static_cast<int>(begin), begin += rows[e];
    host[experts] = static_cast<int>(begin);
    MC_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, ints * sizeof(int), cudaMemcpyHostToDevice, stream));
    launch(reinterpret_cast<const int*>(slot.dev), stream);
  } catch (...) {
    pool.release(slot, stream);
    throw;
  }
  pool.release(slot, stream);
}

// The Hopper kernel with host row counts.
bool run_hopper(hopper::GroupedMode mode, const Tensor& a, const Tensor& b, const std::vector<int64_t>& rows,
                Tensor& c, bool accumulate = true) {
  const int64_t experts = static_cast<int64_t>(rows.size());
  if (!hopper::available(a, b, c, experts)) return false;
  with_device_offsets(a.device(), rows, [&](const int* offsets, cudaStream_t stream) {
    hopper::grouped_gemm(mode, a, b, c, offsets, static_cast<int>(experts), stream, accumulate);
  });
  return true;
}

}  // namespace

bool grouped_gemv_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows, Tensor& out) {
  if (!grouped_gemv_takes(x, w, out)) return false;
  with_device_offsets(x.device(), rows, [&](const int* offsets, cudaStream_t stream) {
    grouped_gemv_launch(x, w, offsets, out, stream);
  });
  return true;
}

bool hopper_grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows, Tensor& out) {
  return run_hopper(hopper::GroupedMode::Forward, x, w, rows, out);
}

bool hopper_grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows, Tensor& dx) {
  return run_hopper(hopper::GroupedMode::Dgrad, dout, w, rows, dx);
}

bool hopper_grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows, Tensor& dw,
                               bool accumulate) {
  return run_hopper(hopper::GroupedMode::Wgrad, dout, x, rows, dw, accumulate);
}

namespace {
bool run_hopper_offsets(hopper::GroupedMode mode, const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& c,
                        bool accumulate = true) {
  const int64_t experts = offsets.numel() - 1;
  if (!hopper::available(a, b, c, experts)) return false;
  MC_CUDA_CHECK(cudaSetDevice(a.device().index));
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream(a.device()).handle());
  hopper::grouped_gemm(mode, a, b, c, offsets.data<int32_t>(), static_cast<int>(experts), stream, accumulate);
  return true;
}
}  // namespace

bool hopper_grouped_gemm_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out) {
  return run_hopper_offsets(hopper::GroupedMode::Forward, x, w, offsets, out);
}

bool hopper_grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const Tensor& offsets, Tensor& dx) {
  return run_hopper_offsets(hopper::GroupedMode::Dgrad, dout, w, offsets, dx);
}

bool hopper_grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const Tensor& offsets, Tensor& dw, bool accumulate) {
  return run_hopper_offsets(hopper::GroupedMode::Wgrad, dout, x, offsets, dw, accumulate);
}

bool hopper_grouped_gemm_takes(const Tensor& w) {
  // available() on stand-ins shaped from w: a [N, K] and c [K, N] (w's first expert viewed),
  // so both N and K meet the multiple-of-8 rule. The activations the caller passes later are
  // fresh contiguous allocations of w's dtype; rows = 0 is declined then (the counts path runs).
  if (w.ndim() != 3 || !w.device().is_cuda() || w.size(0) == 0) return false;
  const Tensor first = w.slice(0, 0, 1);
  return hopper::available(first.view({w.size(1), w.size(2)}), w, first.view({w.size(2), w.size(1)}), w.size(0));
}

bool grouped_gemm_bf16_f32_refused() {
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  return g_bf16_f32_refused;
}

bool grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows, Tensor& out) {
  return run(Kind::Forward, x, w, rows, out);
}

bool grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows, Tensor& dx) {
  return run(Kind::Dgrad, dout, w, rows, dx);
}

bool grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows, Tensor& dw) {
  return run(Kind::Wgrad, dout, x, rows, dw);
}

}  // namespace moecore::ops::cuda
