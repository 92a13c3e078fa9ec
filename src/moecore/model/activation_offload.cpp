// The offloading mechanism: host copies per (micro-batch, layer), the side stream and its events,
// the prefetch order and the host memory counters.
#include "moecore/model/activation_offload.h"

#include <cstring>
#include <map>
#include <mutex>

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

// A layer's offloaded slots: entry k restores slot `slot`, from its own copy (source == k) or as
// a view of entry `source`'s tensor (the same bytes).
struct LayerGroup {
  struct Entry {
    int slot = 0, source = 0;
    Shape shape;
  };
  std::vector<Entry> entries;
  std::vector<HostCopy> copies;         // per entry (empty for a view)
  std::vector<Tensor> device;           // per entry, once prefetched
  std::shared_ptr<Event> copied;        // the copies to the host (GPU)
  std::shared_ptr<Event> reloaded;      // the copies back (GPU)
  size_t num_slots = 0;
  bool prefetched = false;
};

class ActivationStash {
 public:
  ~ActivationStash() {
    // A forward without its backward: the host copies must not be freed under a running copy.
    try {
      for (auto& [layer, g] : layers)
        for (const std::shared_ptr<Event>& e : {g.copied, g.reloaded})
          if (e && !e->ready()) e->synchronize();
    } catch (...) {  // a failed device reports on its next call; a destructor must not throw
    }
  }
  std::map<int64_t, LayerGroup> layers;
};

struct ActivationOffloader::InFlight {
  std::vector<HostCopy> copies;
  std::shared_ptr<Event> reloaded;
};

ActivationOffloader::ActivationOffloader(Device device) : device_(device) {}

ActivationOffloader::~ActivationOffloader() {
  try {
    if (releasing_copied_) releasing_copied_->synchronize();
    releasing_.clear();
    poll_host_buffers(true);
    if (side_created_) side_.destroy();
  } catch (...) {  // a failed device reports on its next call; a destructor must not throw
  }
}

Stream ActivationOffloader::side_stream() {
  if (!side_created_) {
    side_ = Stream::create(device_);
    side_created_ = true;
  }
  return side_;
}

void ActivationOffloader::release_forward_copies() {
  if (releasing_copied_) releasing_copied_->wait(current_stream(device_));  // later reuse comes after the copy
  releasing_copied_.reset();
  releasing_.clear();
}

void ActivationOffloader::poll_host_buffers(bool wait) {
  while (!host_in_flight_.empty()) {
    const std::shared_ptr<Event>& e = host_in_flight_.front()->reloaded;
    if (e && !e->ready()) {
      if (!wait) return;
      e->synchronize();
    }
    host_in_flight_.pop_front();
  }
}

void ActivationOffloader::offload(std::shared_ptr<ActivationStash>& stash, int64_t layer,
                                  const std::vector<OffloadSlot>& slots) {
  release_forward_copies();
  poll_host_buffers(false);
  if (!stash) {
    stash = std::make_shared<ActivationStash>();
    order_.push_back(stash);
  }
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
    const Stream compute = current_stream(device_), side = side_stream();
    Event produced(device_);
    produced.record(compute);
    produced.wait(side);
    {
      const StreamGuard on_side(side);
      for (size_t k = 0; k < g.entries.size(); ++k) {
        HostCopy& c = g.copies[k];
        if (c.nbytes == 0) continue;
        c.pinned = Tensor::empty_pinned(c.shape, c.dtype);
        c.pinned.copy_from(sources[k]);  // asynchronous: the destination is pinned
      }
    }
    g.copied = std::make_shared<Event>(device_);
    g.copied->record(side);
    releasing_copied_ = g.copied;
    releasing_ = sources;  // handed back once the compute stream has waited for the copies
  }
  for (const LayerGroup::Entry& e : g.entries) *slots[static_cast<size_t>(e.slot)].tensor = Tensor();
  // A second offload of a layer before its reload would drop the first group's copies unwaited.
  MC_CHECK(stash->layers.find(layer) == stash->layers.end(), "activation offloading: layer ", layer,
           " is offloaded twice before its backward");
  stash->layers[layer] = std::move(g);
}

void ActivationOffloader::finish_forward() { release_forward_copies(); }

namespace {

// Device tensors for a group's copies; on a GPU the copies run on `side` after the compute
// stream's work so far (the blocks may have served it) and `reloaded` marks their end.
void start_reload(LayerGroup& g, Device device, std::optional<Stream> side) {
  g.device.assign(g.entries.size(), Tensor());
  for (size_t k = 0; k < g.entries.size(); ++k) {
    const HostCopy& c = g.copies[k];
    if (g.entries[k].source != static_cast<int>(k)) continue;
    const MemoryCategoryScope module(c.made_by);
    g.device[k] = Tensor::empty(c.shape, c.dtype, device);
  }
  if (!side) {
    for (size_t k = 0; k < g.entries.size(); ++k)
      if (g.copies[k].bytes) std::memcpy(g.device[k].data_ptr(), g.copies[k].bytes.get(), static_cast<size_t>(g.copies[k].nbytes));
  } else {
    Event free_to_write(device);
    free_to_write.record(current_stream(device));
    free_to_write.wait(*side);
    const StreamGuard on_side(*side);
    for (size_t k = 0; k < g.entries.size(); ++k)
      if (g.copies[k].pinned.defined()) g.device[k].copy_from(g.copies[k].pinned);  // asynchronous from pinned
    g.reloaded = std::make_shared<Event>(device);
    g.reloaded->record(*side);
  }
  g.prefetched = true;
}

}  // namespace

void ActivationOffloader::prefetch_highest(ActivationStash& stash) {
  if (stash.layers.empty()) return;
  LayerGroup& g = std::prev(stash.layers.end())->second;
  if (g.prefetched) return;
  start_reload(g, device_, device_.is_cpu() ? std::nullopt : std::optional<Stream>(side_stream()));
}

void ActivationOffloader::begin_backward(const std::shared_ptr<ActivationStash>& stash) {
  release_forward_copies();
  if (stash) prefetch_highest(*stash);
}

void ActivationOffloader::reload(const std::shared_ptr<ActivationStash>& stash, int64_t layer,
                                 const std::vector<OffloadSlot>& slots) {
  release_forward_copies();
  poll_host_buffers(false);
  if (!stash) return;
  auto it = stash->layers.find(layer);
  if (it == stash->layers.end()) return;
  LayerGroup& g = it->second;
  MC_CHECK(g.num_slots == slots.size(), "activation offloading: layer ", layer, " offloaded ", g.num_slots,
           " slots and reloads ", slots.size());
  if (!g.prefetched) start_reload(g, device_, device_.is_cpu() ? std::nullopt : std::optional<Stream>(side_stream()));
  if (g.reloaded) g.reloaded->wait(current_stream(device_));
  for (size_t k = 0; k < g.entries.size(); ++k) {
    const LayerGroup::Entry& e = g.entries[k];
    const Tensor& src = g.device[static_cast<size_t>(e.source)];
    *slots[static_cast<size_t>(e.slot)].tensor = src.shape() == e.shape ? src : src.view(e.shape);
  }
  if (g.reloaded) {  // the host buffers go once their copies have run
    auto f = std::make_unique<InFlight>();
    f->copies = std::move(g.copies);
    f->reloaded = g.reloaded;
    host_in_flight_.push_back(std::move(f));
  }
  stash->layers.erase(it);
  // The next layer in backward order: this micro-batch's next lower one, else the oldest other
  // micro-batch's highest.
  if (!stash->layers.empty()) {
    prefetch_highest(*stash);
    return;
  }
  std::deque<std::weak_ptr<ActivationStash>> keep;
  for (const std::weak_ptr<ActivationStash>& w : order_) {
    const std::shared_ptr<ActivationStash> s = w.lock();
    if (s && s != stash && !s->layers.empty()) keep.push_back(w);
  }
  order_ = std::move(keep);
  if (!order_.empty()) prefetch_highest(*order_.front().lock());
}

OffloadForwardEnd::~OffloadForwardEnd() {
  try {
    if (offloader_) offloader_->finish_forward();
  } catch (...) {  // a failed device reports on its next call; a destructor must not throw
  }
}

}  // namespace moecore
