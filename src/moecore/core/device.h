// Devices (CPU, CUDA:i), streams and events.
//
// Streams and events are opaque handles here so that code without CUDA headers can hold
// them; on a CPU-only build every stream is the null stream and synchronisation is a no-op.
// Each (thread, device) has a current stream, the default stream unless a StreamGuard set
// another; every CUDA op launches on the current stream of its tensors' device.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moecore {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;  // "cpu", "cuda:0"
};

// "cpu", "cuda", "cuda:N"; the CUDA index is checked against the devices present.
Device parse_device(std::string_view text);

// True when this binary was built with the CUDA backend.
bool cuda_built();
// Number of usable CUDA devices; 0 without the backend, a driver or a GPU (never throws).
int cuda_device_count();
// Why cuda_device_count() is 0, for messages ("built without CUDA", "no CUDA driver", ...).
std::string cuda_unavailable_reason();
// Makes `d` current for this thread's CUDA calls (no-op for the CPU).
void set_current_device(Device d);

class Stream {
 public:
  Stream() = default;
  Stream(Device device, void* handle) : device_(device), handle_(handle) {}
  // Creates a new non-blocking stream on `device` (the caller destroys it with destroy()).
  static Stream create(Device device);
  void destroy();
  Device device() const { return device_; }
  void* handle() const { return handle_; }  // cudaStream_t
  void synchronize() const;
  bool operator==(const Stream& o) const { return device_ == o.device_ && handle_ == o.handle_; }

 private:
  Device device_{};
  void* handle_ = nullptr;
};

Stream current_stream(Device device);
void set_current_stream(Stream stream);

// Restores the previous current stream of the same device on scope exit.
class StreamGuard {
 public:
  explicit StreamGuard(Stream s) : previous_(current_stream(s.device())) { set_current_stream(s); }
  ~StreamGuard() { set_current_stream(previous_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
};

// A CUDA event (timing enabled). On the CPU record/wait/synchronize are no-ops and
// elapsed_ms is measured with the host clock at record time.
class Event {
 public:
  explicit Event(Device device = Device::cpu());
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Device device() const { return device_; }
  void record(Stream stream);
  void record() { record(current_stream(device_)); }
  // Makes `stream` wait for this event without blocking the host.
  void wait(Stream stream) const;
  void synchronize() const;
  // True when the work before the record has finished (cudaEventQuery: no wait, not counted as
  // a host synchronisation).
  bool ready() const;
  // Milliseconds between `start` and this event (both recorded, both on one device).
  float elapsed_ms_since(const Event& start) const;

 private:
  Device device_;
  void* handle_ = nullptr;  // cudaEvent_t
  double host_ms_ = 0;      // CPU events
};

// Blocks until all work on the device is done.
void synchronize(Device device);

// How many times this process's host has waited for a GPU (process-wide, all threads): stream,
// event and device synchronisations, copies from a GPU into pageable host memory, and the
// allocators' cudaFree / cudaFreeHost (a cache release). Not counted: copies from pageable host
// memory to a GPU (the driver stages them and may wait) and waits inside libraries (NCCL,
// cuBLAS). A training step's count shows what keeps the host from running ahead (tests/gpu:
// the MoE layer makes none with device-side expert offsets). CPU builds never count.
uint64_t host_synchronizations();
void count_host_synchronization();  // for code that synchronises through CUDA directly

}  // namespace moecore
