#include "moecore/core/host_transfer.h"

#include <cstring>

#include "moecore/core/error.h"

namespace moecore {

PendingRead::~PendingRead() {
  try {
    if (arrived_ && !arrived_->ready()) arrived_->synchronize();
  } catch (...) {  // a failed device reports on its next call; a destructor must not throw
  }
}

void PendingRead::start(const Tensor& t) {
  MC_CHECK(t.defined(), "PendingRead::start: undefined tensor");
  // Replacing a read in flight would free its pinned block while the copy still writes into it.
  MC_CHECK(!started(), "PendingRead::start: the previous read was not taken (get) yet");
  const DType d = t.dtype();
  MC_CHECK(d == DType::F64 || d == DType::F32 || d == DType::I64 || d == DType::I32, "PendingRead::start: dtype ",
           dtype_name(d), " is not supported (expected f64, f32, i64 or i32)");
  if (t.device().is_cpu()) {
    host_ = t.clone();
    arrived_.reset();
    return;
  }
  host_ = Tensor::empty_pinned(t.shape(), t.dtype());
  host_.copy_from(t.contiguous());  // asynchronous: the destination is pinned
  arrived_ = std::make_shared<Event>(t.device());
  arrived_->record();
}

std::vector<double> PendingRead::get() {
  MC_CHECK(started(), "PendingRead::get before start");
  if (arrived_) {
    if (!arrived_->ready()) arrived_->synchronize();
    arrived_.reset();
  }
  std::vector<double> out;
  switch (host_.dtype()) {
    case DType::F64: out = host_.to_vector<double>(); break;
    case DType::F32:
      for (float v : host_.to_vector<float>()) out.push_back(static_cast<double>(v));
      break;
    case DType::I64:
      for (int64_t v : host_.to_vector<int64_t>()) out.push_back(static_cast<double>(v));
      break;
    case DType::I32:
      for (int32_t v : host_.to_vector<int32_t>()) out.push_back(static_cast<double>(v));
      break;
    default: MC_FAIL("PendingRead::get: dtype ", dtype_name(host_.dtype()), " is not supported");  // start() refuses it
  }
  host_ = Tensor();
  return out;
}

PinnedUploader::~PinnedUploader() {
  try {
    for (const Staged& s : in_flight_)
      if (!s.copied->ready()) s.copied->synchronize();
  } catch (...) {  // a failed device reports on its next call; a destructor must not throw
  }
}

Tensor PinnedUploader::upload(const Tensor& host, Device device) {
  MC_CHECK(host.defined() && host.device().is_cpu() && host.is_contiguous(),
           "PinnedUploader::upload needs a contiguous host tensor, got ", host.defined() ? host.describe() : "nothing");
  if (device.is_cpu()) return host.clone();
  Tensor out = Tensor::empty(host.shape(), host.dtype(), device);
  upload_into(host, out);
  return out;
}

void PinnedUploader::upload_into(const Tensor& host, Tensor& dst) {
  MC_CHECK(host.defined() && host.device().is_cpu() && host.is_contiguous(),
           "PinnedUploader::upload needs a contiguous host tensor, got ", host.defined() ? host.describe() : "nothing");
  MC_CHECK(dst.defined() && dst.is_contiguous() && dst.shape() == host.shape() && dst.dtype() == host.dtype(),
           "PinnedUploader::upload_into: ", host.describe(), " into ", dst.defined() ? dst.describe() : "nothing");
  if (dst.device().is_cpu()) {
    dst.copy_from(host);
    return;
  }
  while (!in_flight_.empty() && in_flight_.front().copied->ready()) in_flight_.pop_front();
  Staged s;
  s.buffer = Tensor::empty_pinned(host.shape(), host.dtype());
  if (host.nbytes() > 0) std::memcpy(s.buffer.data_ptr(), host.data_ptr(), host.nbytes());
  dst.copy_from(s.buffer);  // asynchronous from pinned memory
  s.copied = std::make_shared<Event>(dst.device());
  s.copied->record();
  in_flight_.push_back(std::move(s));
}

}  // namespace moecore
