// The side stream of moe/side_stream.h.
#include "moecore/moe/side_stream.h"

#include <map>
#include <utility>

namespace moecore {

namespace {

Stream side_stream_of(Device device, SideLane lane) {
  static std::map<std::pair<int, SideLane>, Stream> streams;  // the training loop's thread; kept for the process
  Stream& s = streams[{device.index, lane}];
  if (!s.handle()) s = Stream::create(device);
  return s;
}

}  // namespace

void SideStream::fork(Device device, bool on, SideLane lane) {
  if (!on || !device.is_cuda()) return;
  device_ = device;
  const Stream side = side_stream_of(device, lane);
  Event ready(device);
  ready.record();  // on the compute stream: after the inputs
  ready.wait(side);
  guard_.emplace(side);
}

void SideStream::leave() {
  if (!guard_) return;
  done_ = std::make_unique<Event>(device_);
  done_->record();  // on the side stream, after its work
  guard_.reset();
}

void SideStream::join() {
  leave();
  if (!done_) return;
  done_->wait(current_stream(device_));
  done_.reset();
}

}  // namespace moecore
