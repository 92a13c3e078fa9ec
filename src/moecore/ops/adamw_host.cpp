#include "moecore/ops/adamw_host.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "moecore/core/error.h"

namespace moecore::ops {

namespace {
constexpr int64_t kChunk = int64_t{1} << 16;  // elements a thread updates at a time

struct Chunk {
  size_t piece;
  int64_t lo, hi;
};

// Runs update(piece, param, grad, m, v, weight or null) on every chunk, on `threads` threads.
void run_chunks(std::vector<HostAdamWPiece>& pieces, int threads,
                const std::function<void(HostAdamWPiece&, Tensor&, const Tensor&, Tensor&, Tensor&, Tensor*)>& update) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const HostAdamWPiece& p = pieces[i];
    MC_CHECK(p.param.device().is_cpu(), "adamw_step_host: piece ", i, " is on ", p.param.device().str(),
             "; expected host memory");
    const int64_t n = p.param.numel();
    for (int64_t lo = 0; lo < n; lo += kChunk) chunks.push_back({i, lo, std::min(n, lo + kChunk)});
  }
  if (chunks.empty()) return;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), chunks.size()));
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&] {
    try {
      for (size_t c = next++; c < chunks.size(); c = next++) {
        HostAdamWPiece& p = pieces[chunks[c].piece];
        const int64_t lo = chunks[c].lo, hi = chunks[c].hi;
        auto part = [&](const Tensor& t) { return t.view({t.numel()}).slice(0, lo, hi); };
        Tensor param = part(p.param), m = part(p.exp_avg), v = part(p.exp_avg_sq);
        Tensor weight = p.compute_weight.defined() ? part(p.compute_weight) : Tensor();
        update(p, param, part(p.grad), m, v, weight.defined() ? &weight : nullptr);
      }
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next = chunks.size();  // the others stop at their next chunk
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();  // the calling thread takes chunks too
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}
}  // namespace

void adamw_step_host(std::vector<HostAdamWPiece>& pieces, float grad_scale, int threads) {
  run_chunks(pieces, threads, [&](HostAdamWPiece& p, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, Tensor* w) {
    adamw_step(param, grad, m, v, p.config, grad_scale, w, /*parallel=*/false);
  });
}

void adamw_step_host(std::vector<HostAdamWPiece>& pieces, const Tensor& step, int threads) {
  MC_CHECK(step.device().is_cpu(), "adamw_step_host: the step's scalars are on ", step.device().str(),
           "; expected a host copy");
  run_chunks(pieces, threads, [&](HostAdamWPiece& p, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, Tensor* w) {
    adamw_step(param, grad, m, v, step, p.config.weight_decay > 0, w, /*parallel=*/false);
  });
}

}  // namespace moecore::ops
