// The offloading mechanism: host copies per (micro-batch, offload group), the copy streams and
// their events, the in-flight window, the prefetch order and the host memory counters.
#include "moecore/model/activation_offload.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "moecore/core/env_switches.h"
#include "moecore/core/error.h"

namespace moecore {

namespace {

constexpr std::array<const char*, kNumOffloadModules> kNames = {"attn_norm", "core_attn", "attn_proj",
                                                                "mlp_norm",  "expert_fc1", "moe_act"};

// Host bytes of offloaded activations, per module, over every offloader of the process.
struct HostCounters {
  std::mutex mutex;
  std::array<int64_t, kNumOffloadModules> now{};
  OffloadHostUsage usage;
  void add(OffloadModule m, int64_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex);
    now[static_cast<size_t>(m)] += bytes;
    usage.now += bytes;
    if (usage.now > usage.peak) {
      usage.peak = usage.now;
      usage.at_peak = now;
    }
  }
};
HostCounters& host_counters() {
  static HostCounters c;
  return c;
}

}  // namespace

const char* offload_module_name(OffloadModule m) { return kNames[static_cast<size_t>(m)]; }

std::string offload_module_names() {
  std::string s;
  for (const char* n : kNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

std::optional<OffloadModule> parse_offload_module(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (name == kNames[i]) return static_cast<OffloadModule>(i);
  return std::nullopt;
}

bool OffloadModules::any() const {
  for (bool b : on)
    if (b) return true;
  return false;
}

OffloadModules parse_offload_modules(const std::vector<std::string>& names) {
  OffloadModules m;
  for (const std::string& n : names) {
    const std::optional<OffloadModule> mod = parse_offload_module(n);
    MC_CHECK(mod.has_value(), "--offload-modules '", n, "': expected one of ", offload_module_names());
    m.on[static_cast<size_t>(*mod)] = true;
  }
  return m;
}

OffloadHostUsage offload_host_usage() {
  HostCounters& c = host_counters();
  const std::lock_guard<std::mutex> lock(c.mutex);
  return c.usage;
}

// One offloaded tensor's bytes on the host: pinned memory for a GPU, a plain buffer for the CPU
// (not from the CPU allocator: the memory report counts that one as the device).
struct HostCopy {
  Shape shape;
  DType dtype = DType::F32;
  OffloadModule module = OffloadModule::kAttnNorm;
  ActivationModule made_by = ActivationModule::kOther;
  Tensor pinned;
  std::unique_ptr<std::byte[]> bytes;
  int64_t nbytes = 0;
  HostCopy() = default;
  HostCopy(HostCopy&& o) noexcept
      : shape(std::move(o.shape)), dtype(o.dtype), module(o.module), made_by(o.made_by), pinned(std::move(o.pinned)),
        bytes(std::move(o.bytes)), nbytes(o.nbytes) {
    o.nbytes = 0;  // the counters follow the bytes
  }
  HostCopy& operator=(HostCopy&&) = delete;
  ~HostCopy() {
    if (nbytes > 0) host_counters().add(module, -nbytes);
  }
};

// An offload group's slots (a part of a layer): entry k restores slot `slot`, from its own copy
// (source == k) or as a view of entry `source`'s tensor (the same bytes).
struct LayerGroup {
  struct Entry {
    int slot = 0, source = 0;
    Shape shape;
  };
  std::vector<Entry> entries;
  std::vector<HostCopy> copies;         // per entry (empty for a view)
  std::vector<Tensor> device;           // per entry, once prefetched
  // GPU: per entry, the device tensors while their copy to the host may run (shared with the
  // offloader's forward_copies_; emptied when handed back or taken back for the backward).
  std::shared_ptr<std::vector<Tensor>> sources;
  std::shared_ptr<Event> copied;        // the copies to the host (GPU)
  std::shared_ptr<Event> reloaded;      // the copies back (GPU; none when taken back without a copy)
  size_t num_slots = 0;
  bool prefetched = false;
};

class ActivationStash {
 public:
  ~ActivationStash() {
    // A forward without its backward: the host copies must not be freed under a running copy.
    try {
      for (auto& [group, g] : layers)
        for (const std::shared_ptr<Event>& e : {g.copied, g.reloaded})
          if (e && !e->ready()) e->synchronize();
    } catch (...) {  // a failed device reports on its next call; a destructor must not throw
    }
  }
  std::map<int64_t, LayerGroup> layers;  // by group
};

// Host buffers (and device tensors) kept until `done` has fired.
struct ActivationOffloader::InFlight {
  std::vector<HostCopy> copies;
  std::vector<Tensor> device;
  std::shared_ptr<Event> done;
};

// An offload group whose device tensors wait for their copy to the host.
struct ActivationOffloader::ForwardCopy {
  std::shared_ptr<std::vector<Tensor>> sources;
  std::shared_ptr<Event> copied;
};

int64_t offload_window() {
  const char* v = env_switch("MOECORE_OFFLOAD_WINDOW");
  if (!v) return kDefaultOffloadWindow;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  MC_CHECK(*v != '\0' && end && *end == '\0' && n >= 1 && n <= 1000000, "MOECORE_OFFLOAD_WINDOW='", v,
           "': expected an integer >= 1 (offload groups in flight; unset: ", kDefaultOffloadWindow, ")");
  return static_cast<int64_t>(n);
}

int64_t offload_backward_groups(int64_t window) { return std::max<int64_t>(window, 2); }

ActivationOffloader::ActivationOffloader(Device device) : device_(device), window_(offload_window()) {}

ActivationOffloader::~ActivationOffloader() {
  try {
    for (const ForwardCopy& f : forward_copies_)
      if (!f.copied->ready()) f.copied->synchronize();
    forward_copies_.clear();
    poll_host_buffers(true);
    if (streams_created_) {
      d2h_.destroy();
      h2d_.destroy();
    }
  } catch (...) {  // a failed device reports on its next call; a destructor must not throw
  }
}

void ActivationOffloader::create_streams() {
  if (streams_created_) return;
  d2h_ = Stream::create(device_);
  h2d_ = Stream::create(device_);
  streams_created_ = true;
}

void ActivationOffloader::release_copied_forward() {
  // The copies run in order on one stream: the oldest first.
  while (!forward_copies_.empty() && (forward_copies_.front().sources->empty() || forward_copies_.front().copied->ready())) {
    forward_copies_.front().sources->clear();
    forward_copies_.pop_front();
  }
  std::erase_if(forward_copies_, [](const ForwardCopy& f) { return f.sources->empty(); });  // taken back
}

void ActivationOffloader::bound_forward_copies() {
  while (static_cast<int64_t>(forward_copies_.size()) > window_) {
    ForwardCopy& f = forward_copies_.front();
    // Later work of the compute stream (which may reuse the blocks) comes after the copy.
    if (!f.copied->ready()) f.copied->wait(current_stream(device_));
    f.sources->clear();
    forward_copies_.pop_front();
  }
}

void ActivationOffloader::poll_host_buffers(bool wait) {
  std::erase_if(host_in_flight_, [wait](const std::unique_ptr<InFlight>& f) {
    if (!f->done || f->done->ready()) return true;
    if (wait) f->done->synchronize();
    return wait;
  });
}

void ActivationOffloader::offload(std::shared_ptr<ActivationStash>& stash, int64_t group,
                                  const std::vector<OffloadSlot>& slots) {
  release_copied_forward();
  poll_host_buffers(false);
  if (!stash) {
    stash = std::make_shared<ActivationStash>();
    order_.push_back(stash);
  }
  // A second offload of a group before its reload would drop the first one's copies unwaited.
  MC_CHECK(stash->layers.find(group) == stash->layers.end(), "activation offloading: group ", group,
           " is offloaded twice before its backward");
  LayerGroup g;
  g.num_slots = slots.size();
  std::vector<Tensor> sources;
  for (size_t s = 0; s < slots.size(); ++s) {
    const Tensor& t = *slots[s].tensor;
    if (!t.defined() || !t.is_contiguous() || t.numel() == 0) continue;  // stays where it is
    LayerGroup::Entry e{static_cast<int>(s), static_cast<int>(g.entries.size()), t.shape()};
    for (size_t k = 0; k < g.entries.size(); ++k) {
      const Tensor& o = sources[k];
      if (o.data_ptr() == t.data_ptr() && o.nbytes() == t.nbytes() && o.dtype() == t.dtype()) {
        e.source = g.entries[k].source;  // the same bytes: restored as a view
        break;
      }
    }
    g.entries.push_back(e);
    sources.push_back(t);
    g.copies.emplace_back();
    if (e.source != static_cast<int>(g.entries.size()) - 1) continue;
    HostCopy& c = g.copies.back();
    c.shape = t.shape();
    c.dtype = t.dtype();
    c.module = slots[s].module;
    c.made_by = slots[s].made_by;
    c.nbytes = static_cast<int64_t>(t.nbytes());
    host_counters().add(c.module, c.nbytes);
  }
  if (g.entries.empty()) return;
  if (device_.is_cpu()) {
    for (size_t k = 0; k < g.entries.size(); ++k) {
      HostCopy& c = g.copies[k];
      if (c.nbytes == 0) continue;
      c.bytes = std::make_unique<std::byte[]>(static_cast<size_t>(c.nbytes));
      std::memcpy(c.bytes.get(), sources[k].data_ptr(), static_cast<size_t>(c.nbytes));
    }
  } else {
    create_streams();
    Event produced(device_);
    produced.record(current_stream(device_));
    produced.wait(d2h_);
    {
      const StreamGuard on_d2h(d2h_);
      for (size_t k = 0; k < g.entries.size(); ++k) {
        HostCopy& c = g.copies[k];
        if (c.nbytes == 0) continue;
        c.pinned = Tensor::empty_pinned(c.shape, c.dtype);  // the pinned allocator's cache after the first step
        c.pinned.copy_from(sources[k]);                      // asynchronous: the destination is pinned
      }
    }
    g.copied = std::make_shared<Event>(device_);
    g.copied->record(d2h_);
    g.sources = std::make_shared<std::vector<Tensor>>(std::move(sources));
    forward_copies_.push_back({g.sources, g.copied});
  }
  for (const LayerGroup::Entry& e : g.entries) *slots[static_cast<size_t>(e.slot)].tensor = Tensor();
  stash->layers[group] = std::move(g);
  bound_forward_copies();
}

void ActivationOffloader::finish_forward() {
  release_copied_forward();
  poll_host_buffers(false);
}

// Device tensors for a group's copies. On a GPU: the device tensors still kept for a running copy
// to the host are taken back as they are (the host buffers go once that copy has run); otherwise
// the copies run on the host-to-device stream after the copy to the host and after the compute
// stream's work so far (the new blocks may have served it), and `reloaded` marks their end.
void ActivationOffloader::start_reload(LayerGroup& g) {
  g.prefetched = true;
  g.device.assign(g.entries.size(), Tensor());
  if (g.sources && !g.sources->empty()) {
    for (size_t k = 0; k < g.entries.size(); ++k)
      if (g.entries[k].source == static_cast<int>(k)) g.device[k] = (*g.sources)[k];
    auto f = std::make_unique<InFlight>();
    f->copies = std::move(g.copies);
    f->device = std::move(*g.sources);  // not reused under the running copy
    f->done = g.copied;
    g.sources->clear();
    host_in_flight_.push_back(std::move(f));
    return;
  }
  for (size_t k = 0; k < g.entries.size(); ++k) {
    const HostCopy& c = g.copies[k];
    if (g.entries[k].source != static_cast<int>(k)) continue;
    const MemoryCategoryScope module(c.made_by);
    g.device[k] = Tensor::empty(c.shape, c.dtype, device_);
  }
  if (device_.is_cpu()) {
    for (size_t k = 0; k < g.entries.size(); ++k)
      if (g.copies[k].bytes) std::memcpy(g.device[k].data_ptr(), g.copies[k].bytes.get(), static_cast<size_t>(g.copies[k].nbytes));
    return;
  }
  create_streams();
  Event free_to_write(device_);
  free_to_write.record(current_stream(device_));
  free_to_write.wait(h2d_);
  if (g.copied) g.copied->wait(h2d_);
  const StreamGuard on_h2d(h2d_);
  for (size_t k = 0; k < g.entries.size(); ++k)
    if (g.copies[k].pinned.defined()) g.device[k].copy_from(g.copies[k].pinned);  // asynchronous from pinned
  g.reloaded = std::make_shared<Event>(device_);
  g.reloaded->record(h2d_);
}

// The next `budget` groups in backward order are on their way back: `stash`'s from its highest
// down, then the other micro-batches' in the order of their forwards.
void ActivationOffloader::prefetch_ahead(const std::shared_ptr<ActivationStash>& stash, int64_t budget) {
  std::erase_if(order_, [](const std::weak_ptr<ActivationStash>& w) {
    const std::shared_ptr<ActivationStash> s = w.lock();
    return !s || s->layers.empty();
  });
  auto visit = [&](ActivationStash& s) {
    for (auto it = s.layers.rbegin(); it != s.layers.rend() && budget > 0; ++it, --budget)
      if (!it->second.prefetched) start_reload(it->second);
  };
  if (stash) visit(*stash);
  for (const std::weak_ptr<ActivationStash>& w : order_) {
    if (budget <= 0) break;
    const std::shared_ptr<ActivationStash> s = w.lock();
    if (s && s != stash) visit(*s);
  }
}

void ActivationOffloader::begin_backward(const std::shared_ptr<ActivationStash>& stash) {
  release_copied_forward();
  poll_host_buffers(false);
  if (stash) prefetch_ahead(stash, offload_backward_groups(window_));
}

void ActivationOffloader::reload(const std::shared_ptr<ActivationStash>& stash, int64_t group,
                                 const std::vector<OffloadSlot>& slots) {
  release_copied_forward();
  poll_host_buffers(false);
  if (!stash) return;
  auto it = stash->layers.find(group);
  if (it == stash->layers.end()) return;
  LayerGroup& g = it->second;
  MC_CHECK(g.num_slots == slots.size(), "activation offloading: group ", group, " offloaded ", g.num_slots,
           " slots and reloads ", slots.size());
  if (!g.prefetched) start_reload(g);
  if (g.reloaded) g.reloaded->wait(current_stream(device_));  // the compute stream waits, not the host
  for (size_t k = 0; k < g.entries.size(); ++k) {
    const LayerGroup::Entry& e = g.entries[k];
    const Tensor& src = g.device[static_cast<size_t>(e.source)];
    *slots[static_cast<size_t>(e.slot)].tensor = src.shape() == e.shape ? src : src.view(e.shape);
  }
  if (g.reloaded) {  // the host buffers go once their copies have run
    auto f = std::make_unique<InFlight>();
    f->copies = std::move(g.copies);
    f->done = g.reloaded;
    host_in_flight_.push_back(std::move(f));
  }
  stash->layers.erase(it);
  prefetch_ahead(stash, offload_backward_groups(window_) - 1);  // this group is still on the device
}

OffloadForwardEnd::~OffloadForwardEnd() {
  try {
    if (offloader_) offloader_->finish_forward();
  } catch (...) {  // a failed device reports on its next call; a destructor must not throw
  }
}

}  // namespace moecore
