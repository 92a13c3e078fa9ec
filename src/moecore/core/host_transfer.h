// Copies between the host and a GPU that do not make the host wait for the GPU's queue.
//
// PendingRead: a device -> host copy into pinned memory, enqueued on the current stream; the
// values are taken later (get), waiting only if the copy has not arrived by then. The trainer
// starts one for the step's loss before the gradient norm's read, which then covers it.
//
// PinnedUploader: host -> device copies through pinned staging buffers. A copy from pageable
// memory may make the host wait until the stream reaches it (the driver stages it through its own
// buffer); from pinned memory it is enqueued and the host goes on. Each staging buffer is kept
// until its copy has run (an event), since the pinned allocator hands a freed block out again at
// once.
//
// On the CPU both are plain copies.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/tensor.h"

namespace moecore {

class PendingRead {
 public:
  PendingRead() = default;
  ~PendingRead();  // waits for a copy still in flight (its pinned block is reused once freed)
  PendingRead(const PendingRead&) = delete;
  PendingRead& operator=(const PendingRead&) = delete;
  // Starts copying `t` (f64, f32, i64 or i32) to the host; the previous read must have been
  // taken (get) first.
  void start(const Tensor& t);
  bool started() const { return host_.defined(); }
  // The values as doubles; waits for the copy only if it has not finished (counted as a host
  // synchronisation then). The read is consumed: started() is false afterwards.
  std::vector<double> get();

 private:
  Tensor host_;
  std::shared_ptr<Event> arrived_;
};

class PinnedUploader {
 public:
  PinnedUploader() = default;
  ~PinnedUploader();  // waits for the copies still in flight
  PinnedUploader(const PinnedUploader&) = delete;
  PinnedUploader& operator=(const PinnedUploader&) = delete;
  // A copy of the contiguous host tensor `host` on `device`.
  Tensor upload(const Tensor& host, Device device);
  // The same into the contiguous device tensor `dst` of the same shape and dtype (a fixed buffer).
  void upload_into(const Tensor& host, Tensor& dst);

 private:
  struct Staged {
    Tensor buffer;
    std::shared_ptr<Event> copied;
  };
  std::deque<Staged> in_flight_;
};

}  // namespace moecore
