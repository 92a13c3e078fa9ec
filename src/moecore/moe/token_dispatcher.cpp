// The dispatcher interface's one-call forms, the factory, the communication timers and the
// helpers both dispatchers use.
#include "moecore/moe/token_dispatcher.h"

#include <cstdlib>
#include <cstring>
#include <numeric>

#include "moecore/core/env_switches.h"
#include "moecore/moe/allgather_dispatcher.h"
#include "moecore/moe/alltoall_dispatcher.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/fp8_quant.h"

namespace moecore {

const char* dispatcher_name(DispatcherType t) { return t == DispatcherType::AllGather ? "allgather" : "alltoall"; }

namespace {
double g_comm_seconds = 0, g_wait_seconds = 0;
DispatchVolume g_volume;
}  // namespace

DispatchVolume take_dispatch_volume() {
  const DispatchVolume v = g_volume;
  g_volume = DispatchVolume{};
  return v;
}

bool dispatch_timers_enabled() {
  static const bool on = [] {
    const char* v = env_switch("MOECORE_COMM_TIMERS");
    return v && std::strcmp(v, "0") != 0 && *v;
  }();
  return on;
}

DispatchCommTime take_dispatch_comm_time() {
  const DispatchCommTime t{g_comm_seconds + g_wait_seconds, g_wait_seconds};
  g_comm_seconds = g_wait_seconds = 0;
  return t;
}

namespace dispatch_detail {

CommTimer::CommTimer(comm::Communicator& group, bool ep_collective)
    : dev_(group.device()), on_(dispatch_timers_enabled()) {
  if (on_) {
    synchronize(dev_);
    const auto arrived = std::chrono::steady_clock::now();
    group.barrier();
    t0_ = std::chrono::steady_clock::now();
    g_wait_seconds += std::chrono::duration<double>(t0_ - arrived).count();
  }
  clock_.emplace(dev_, ep_collective);
}

CommTimer::~CommTimer() {
  clock_.reset();
  if (!on_) return;
  synchronize(dev_);
  g_comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

Shape with_rows(const Tensor& t, int64_t rows) {
  Shape s = t.shape();
  s[0] = rows;
  return s;
}

void count_dispatch(int64_t rows, int64_t bytes) {
  g_volume.rows += rows;
  g_volume.bytes += bytes;
}

Fp8Rows quantize_dispatch_rows(const Tensor& rows, Fp8Dispatch mode) {
  MC_CHECK(mode != Fp8Dispatch::Off && rows.ndim() == 2 && (rows.dtype() == DType::F32 || rows.dtype() == DType::BF16),
           "FP8 dispatch: rows ", rows.describe(), ": expected [rows, hidden] f32 or bf16");
  const int64_t n = rows.size(0), hidden = rows.size(1);
  const int64_t tiles = (hidden + ops::kFp8BlockSize - 1) / ops::kFp8BlockSize;
  const Device dev = rows.device();
  if (mode == Fp8Dispatch::Tiles) {
    if (n == 0) return {Tensor::empty({0, hidden}, DType::FP8E4M3, dev), Tensor::empty({0, tiles}, DType::F32, dev)};
    ops::Fp8Tensor q = ops::quantize_tiles(rows, ops::Fp8Format::E4M3);
    return {q.data, q.scale_inv};
  }
  // The scale from the rows' amax on their device (no rows: amax 0, scale 1).
  ops::Fp8Tensor q = ops::quantize_per_tensor(rows, ops::amax_tensor(rows), ops::Fp8ScaleFrom::Amax, ops::Fp8Format::E4M3);
  return {q.data, q.scale_inv.view({1})};
}

Tensor dequantize_dispatch_rows(const Tensor& codes, const Tensor& scale_inv, Fp8Dispatch mode,
                                const std::vector<int64_t>& chunk_rows, DType dtype) {
  const int64_t m = codes.size(0), hidden = codes.size(1);
  Tensor out32 = Tensor::empty({m, hidden}, DType::F32, codes.device());
  if (mode == Fp8Dispatch::Tiles) {
    if (m > 0) out32 = ops::dequantize({codes, scale_inv, ops::Fp8Scaling::Tile1x128});
  } else {
    MC_CHECK(scale_inv.numel() == static_cast<int64_t>(chunk_rows.size()) && total(chunk_rows) == m,
             "FP8 dispatch: ", scale_inv.numel(), " factors for ", chunk_rows.size(), " chunks of ", total(chunk_rows),
             " rows, ", m, " received");
    int64_t at = 0;
    for (size_t c = 0; c < chunk_rows.size(); ++c) {
      const int64_t rows = chunk_rows[c];
      if (rows == 0) continue;
      const int64_t i = static_cast<int64_t>(c);
      out32.slice(0, at, at + rows)
          .copy_from(ops::dequantize({codes.slice(0, at, at + rows), scale_inv.slice(0, i, i + 1),
                                      ops::Fp8Scaling::PerTensor}));
      at += rows;
    }
  }
  return dtype == DType::F32 ? out32 : ops::cast_to(out32, dtype);
}

int64_t total(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

void unpermute(const Tensor& rows, const Tensor& probs, const ops::MoeRouting& r, Tensor& out) {
  if (probs.defined()) {
    ops::moe_unpermute_forward(rows, probs, r, out);
  } else {
    ops::moe_permute_backward(rows, r, out);
  }
}

}  // namespace dispatch_detail

TokenDispatcher::TokenDispatcher(comm::Communicator* ep, int64_t num_experts) : ep_(ep), num_experts_(num_experts) {
  ep_size_ = ep ? ep->size() : 1;
  ep_rank_ = ep ? ep->rank() : 0;
  MC_CHECK(num_experts % ep_size_ == 0, "--num-experts ", num_experts, " is not divisible by ",
           "--expert-model-parallel-size ", ep_size_);
  local_experts_ = num_experts / ep_size_;
  first_expert_ = ep_rank_ * local_experts_;
}

TokenRows TokenDispatcher::dispatch(const DispatchInput& in, Ctx& ctx) const {
  return dispatch_postprocess(token_dispatch(dispatch_preprocess(in, ctx), ctx), ctx);
}

Tensor TokenDispatcher::combine(const Tensor& expert_out, Ctx& ctx) const {
  return combine_postprocess(token_combine(combine_preprocess(expert_out, ctx), ctx), ctx);
}

Tensor TokenDispatcher::combine_backward(const Tensor& dout, Ctx& ctx) const {
  return combine_preprocess_backward(token_combine_backward(combine_postprocess_backward(dout, ctx), ctx), ctx);
}

TokenRows TokenDispatcher::dispatch_backward(const TokenRows& d_expert_in, Ctx& ctx) const {
  return dispatch_preprocess_backward(token_dispatch_backward(dispatch_postprocess_backward(d_expert_in, ctx), ctx),
                                      ctx);
}

std::shared_ptr<const TokenDispatcher> make_token_dispatcher(DispatcherType type, int64_t num_experts,
                                                             comm::Communicator* ep, comm::Communicator* etp,
                                                             comm::Communicator* tp_ep) {
  const int64_t ep_size = ep ? ep->size() : 1;
  MC_CHECK(!etp || (tp_ep && tp_ep->size() == etp->size() * ep_size), "TokenDispatcher: the ETP x EP group must have ",
           "|ETP| x |EP| ranks");
  comm::Communicator* gather = etp ? tp_ep : ep;
  if (type == DispatcherType::AllGather && gather != nullptr)
    return std::make_shared<AllGatherDispatcher>(ep, num_experts, gather);
  return std::make_shared<AllToAllDispatcher>(ep, num_experts, etp);
}

}  // namespace moecore
