#include "moecore/comm/in_flight_queue.h"

namespace moecore::comm {

void* InFlightQueue::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pool_.empty()) return nullptr;
  void* marker = pool_.back();
  pool_.pop_back();
  return marker;
}

void InFlightQueue::give_back(void* marker) {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_.push_back(marker);
}

void InFlightQueue::push(void* marker, const char* collective, Clock::time_point at) {
  std::lock_guard<std::mutex> lock(mutex_);
  issued_.push_back({marker, collective, at});
}

std::optional<InFlightQueue::Oldest> InFlightQueue::oldest(Clock::time_point now,
                                                           const std::function<bool(void*)>& finished) {
  std::lock_guard<std::mutex> lock(mutex_);
  while (!issued_.empty()) {
    const Issued& first = issued_.front();
    if (!finished(first.marker)) return Oldest{first.collective, std::chrono::duration<double>(now - first.at).count()};
    pool_.push_back(first.marker);
    issued_.pop_front();
  }
  return std::nullopt;
}

std::vector<void*> InFlightQueue::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<void*> all = std::move(pool_);
  pool_.clear();
  for (const Issued& i : issued_) all.push_back(i.marker);
  issued_.clear();
  return all;
}

size_t InFlightQueue::pooled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pool_.size();
}

size_t InFlightQueue::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_.size();
}

}  // namespace moecore::comm
