#include "moecore/core/device.h"

#include <atomic>
#include <chrono>
#include <map>

#include "moecore/core/error.h"

#if MOECORE_WITH_CUDA
#include "moecore/core/cuda_check.h"
#endif

namespace moecore {

std::string Device::str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }

bool cuda_built() { return MOECORE_WITH_CUDA != 0; }

int cuda_device_count() {
#if MOECORE_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

std::string cuda_unavailable_reason() {
#if MOECORE_WITH_CUDA
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (e != cudaSuccess) return std::string("the CUDA runtime reports ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  if (n == 0) return "no CUDA device is present";
  return "";
#else
  return "this moecore was built without the CUDA backend (no nvcc at configure time)";
#endif
}

Device parse_device(std::string_view text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda" || text.rfind("cuda:", 0) == 0) {
    int index = 0;
    if (text.size() > 5) {
      const std::string digits(text.substr(5));
      MC_CHECK(!digits.empty() && digits.size() <= 4 && digits.find_first_not_of("0123456789") == std::string::npos,
               "bad device '", text, "': expected cpu, cuda or cuda:N");
      index = std::stoi(digits);
    }
    const int count = cuda_device_count();
    MC_CHECK(count > 0, "device '", text, "' is not available: ", cuda_unavailable_reason());
    MC_CHECK(index < count, "device '", text, "' does not exist: ", count, " CUDA device(s) present");
    return Device::cuda(index);
  }
  MC_FAIL("bad device '", text, "': expected cpu, cuda or cuda:N");
}

void set_current_device(Device d) {
#if MOECORE_WITH_CUDA
  if (d.is_cuda()) MC_CUDA_CHECK(cudaSetDevice(d.index));
#else
  MC_CHECK(d.is_cpu(), "device ", d.str(), " needs the CUDA backend: ", cuda_unavailable_reason());
#endif
}

// ---- streams ------------------------------------------------------------------
namespace {
std::atomic<uint64_t> g_host_syncs{0};
}  // namespace

uint64_t host_synchronizations() { return g_host_syncs.load(std::memory_order_relaxed); }
void count_host_synchronization() { g_host_syncs.fetch_add(1, std::memory_order_relaxed); }

namespace {
thread_local std::map<int, void*> t_current_stream;  // CUDA device index -> cudaStream_t
}

Stream Stream::create(Device device) {
#if MOECORE_WITH_CUDA
  MC_CHECK(device.is_cuda(), "Stream::create needs a CUDA device, got ", device.str());
  MC_CUDA_CHECK(cudaSetDevice(device.index));
  cudaStream_t s;
  MC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(device, s);
#else
  return Stream(device, nullptr);
#endif
}

void Stream::destroy() {
#if MOECORE_WITH_CUDA
  if (handle_) MC_CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(handle_)));
#endif
  handle_ = nullptr;
}

void Stream::synchronize() const {
#if MOECORE_WITH_CUDA
  if (device_.is_cuda()) {
    count_host_synchronization();
    MC_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
  }
#endif
}

Stream current_stream(Device device) {
  if (device.is_cpu()) return Stream(device, nullptr);
  auto it = t_current_stream.find(device.index);
  return Stream(device, it == t_current_stream.end() ? nullptr : it->second);
}

void set_current_stream(Stream stream) {
  if (stream.device().is_cuda()) t_current_stream[stream.device().index] = stream.handle();
}

void synchronize(Device device) {
#if MOECORE_WITH_CUDA
  if (device.is_cuda()) {
    count_host_synchronization();
    MC_CUDA_CHECK(cudaSetDevice(device.index));
    MC_CUDA_CHECK(cudaDeviceSynchronize());
  }
#else
  (void)device;
#endif
}

// ---- events -------------------------------------------------------------------
static double host_now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

Event::Event(Device device) : device_(device) {
#if MOECORE_WITH_CUDA
  if (device.is_cuda()) {
    MC_CUDA_CHECK(cudaSetDevice(device.index));
    cudaEvent_t e;
    MC_CUDA_CHECK(cudaEventCreate(&e));
    handle_ = e;
  }
#endif
}

Event::~Event() {
#if MOECORE_WITH_CUDA
  if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
#endif
}

void Event::record(Stream stream) {
  MC_CHECK(stream.device() == device_, "Event on ", device_.str(), " recorded on a stream of ", stream.device().str());
#if MOECORE_WITH_CUDA
  if (handle_) {
    MC_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(stream.handle())));
    return;
  }
#endif
  host_ms_ = host_now_ms();
}

void Event::wait(Stream stream) const {
#if MOECORE_WITH_CUDA
  if (handle_)
    MC_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.handle()), static_cast<cudaEvent_t>(handle_), 0));
#else
  (void)stream;
#endif
}

void Event::synchronize() const {
#if MOECORE_WITH_CUDA
  if (handle_) {
    count_host_synchronization();
    MC_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
  }
#endif
}

bool Event::ready() const {
#if MOECORE_WITH_CUDA
  if (handle_) {
    const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
    if (r == cudaErrorNotReady) return false;
    MC_CUDA_CHECK(r);
  }
#endif
  return true;
}

float Event::elapsed_ms_since(const Event& start) const {
  MC_CHECK(start.device_ == device_, "elapsed time between events of different devices");
#if MOECORE_WITH_CUDA
  if (handle_) {
    float ms = 0;
    MC_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.handle_), static_cast<cudaEvent_t>(handle_)));
    return ms;
  }
#endif
  return static_cast<float>(host_ms_ - start.host_ms_);
}

}  // namespace moecore
