#include "moecore/core/step_timers.h"

#include <memory>
#include <unordered_map>

#include "moecore/core/error.h"

namespace moecore {
namespace {

// One opening of a region: its two events (pooled: reused after every collection).
struct Record {
  int total = -1;  // index into State::totals
  std::unique_ptr<Event> start, end;
};

struct State {
  int level = 0;
  int depth = 0;
  std::vector<RegionTime> totals;
  std::unordered_map<std::string, int> index;  // name -> totals
  std::vector<Record> records;                 // [0, used): opened since the last collection
  size_t used = 0;
};

State& state() {
  thread_local State s;
  return s;
}

}  // namespace

void set_timing_level(int level) {
  MC_CHECK(level >= 0 && level <= 2, "timing level ", level, " must be 0, 1 or 2");
  state().level = level;
}

int timing_level() { return state().level; }

TimedRegion::TimedRegion(const char* name, int level, Device device) {
  State& s = state();
  if (level > s.level) return;
  auto [it, inserted] = s.index.try_emplace(name, static_cast<int>(s.totals.size()));
  if (inserted) s.totals.push_back(RegionTime{name, s.depth, 0.0, 0});
  if (s.used == s.records.size()) s.records.emplace_back();
  Record& r = s.records[s.used];
  if (!r.start || r.start->device() != device) {  // pooled events of another device
    r.start = std::make_unique<Event>(device);
    r.end = std::make_unique<Event>(device);
  }
  r.total = it->second;
  r.start->record(current_stream(device));
  record_ = static_cast<int>(s.used++);
  s.depth++;
}

TimedRegion::~TimedRegion() {
  if (record_ < 0) return;
  State& s = state();
  Record& r = s.records[static_cast<size_t>(record_)];
  s.depth--;
  try {
    r.end->record();
  } catch (...) {  // a destructor must not throw (e.g. while a CUDA error unwinds the step): drop the sample
    r.total = -1;
  }
}

void collect_region_times() {
  State& s = state();
  MC_CHECK(s.depth == 0, "collect_region_times inside a timed region");  // so every record is closed
  for (size_t i = 0; i < s.used; ++i) {
    Record& r = s.records[i];
    if (r.total < 0) continue;  // dropped
    RegionTime& t = s.totals[static_cast<size_t>(r.total)];
    t.ms += r.end->elapsed_ms_since(*r.start);
    t.calls++;
  }
  s.used = 0;
}

std::vector<RegionTime> take_region_times() {
  collect_region_times();
  State& s = state();
  std::vector<RegionTime> out;
  for (RegionTime& t : s.totals) {
    if (t.calls > 0) out.push_back(t);
    t.ms = 0;
    t.calls = 0;
  }
  return out;
}

}  // namespace moecore
