// kernel_trace: a CUDA injection library that records every kernel's device time through CUPTI's
// activity API and prints, when the process exits, a table of kernels grouped by name and launch
// shape (grid x block), sorted by total time. It is the per-kernel profile the device machine
// cannot take with nsys:
//
//   CUDA_INJECTION64_PATH=build/tools/kernel_trace/libmoecore_kernel_trace.so \
//   KERNEL_TRACE_OUT=trace.txt build/bench/bench_generate --no-cuda-graph
//
// The CUDA driver loads the library named by CUDA_INJECTION64_PATH at the first CUDA call and runs
// its InitializeInjection(). KERNEL_TRACE_OUT names the output file (stderr when unset);
// KERNEL_TRACE_TOP limits the rows (40 by default). Kernels inside CUDA graphs are recorded too.
// Durations are the device's start/end stamps, so host launch gaps between kernels do not count.
#include <cupti.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <cxxabi.h>

namespace {

struct KernelTotals {
  uint64_t count = 0;
  uint64_t total_ns = 0;
  uint64_t min_ns = UINT64_MAX;
  uint64_t max_ns = 0;
};

// Key: demangled name, grid and block as "gx,gy,gz/bx,by,bz".
using KernelKey = std::pair<std::string, std::string>;

std::mutex g_mutex;
std::map<KernelKey, KernelTotals>* g_totals = nullptr;
uint64_t g_first_start = UINT64_MAX, g_last_end = 0;
constexpr size_t kBufferBytes = 8u << 20;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "unknown CUPTI error");
}

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* out = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && out ? out : name;
  std::free(out);
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    char shape[96];
    std::snprintf(shape, sizeof shape, "%d,%d,%d/%d,%d,%d", k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY,
                  k->blockZ);
    KernelTotals& t = (*g_totals)[{demangle(k->name), shape}];
    const uint64_t ns = k->end - k->start;
    t.count++;
    t.total_ns += ns;
    t.min_ns = std::min(t.min_ns, ns);
    t.max_ns = std::max(t.max_ns, ns);
    g_first_start = std::min<uint64_t>(g_first_start, k->start);
    g_last_end = std::max<uint64_t>(g_last_end, k->end);
  }
  std::free(buffer);
}

void print_table() {
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(g_mutex);
  const char* path = std::getenv("KERNEL_TRACE_OUT");
  FILE* out = path && *path ? std::fopen(path, "w") : stderr;
  if (!out) out = stderr;
  const char* top_env = std::getenv("KERNEL_TRACE_TOP");
  const size_t top = top_env ? std::strtoul(top_env, nullptr, 10) : 40;
  std::vector<std::pair<KernelKey, KernelTotals>> rows(g_totals->begin(), g_totals->end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.total_ns > b.second.total_ns; });
  uint64_t all_ns = 0, all_count = 0;
  for (const auto& r : rows) all_ns += r.second.total_ns, all_count += r.second.count;
  std::fprintf(out, "kernel_trace: %llu kernels, %.3f ms of kernel time over a %.3f ms span\n",
               static_cast<unsigned long long>(all_count), all_ns * 1e-6,
               all_count ? (g_last_end - g_first_start) * 1e-6 : 0.0);
  std::fprintf(out, "%7s %9s %10s %10s %10s  %-22s %s\n", "share", "count", "total ms", "mean us", "max us",
               "grid/block", "kernel");
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& [key, t] = rows[i];
    std::string name = key.first.size() > 140 ? key.first.substr(0, 140) + "..." : key.first;
    std::fprintf(out, "%6.1f%% %9llu %10.3f %10.2f %10.2f  %-22s %s\n", all_ns ? 100.0 * t.total_ns / all_ns : 0.0,
                 static_cast<unsigned long long>(t.count), t.total_ns * 1e-6, t.total_ns * 1e-3 / t.count,
                 t.max_ns * 1e-3, key.second.c_str(), name.c_str());
  }
  if (out != stderr) std::fclose(out);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  g_totals = new std::map<KernelKey, KernelTotals>();
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
  std::atexit(print_table);
  return 1;
}
