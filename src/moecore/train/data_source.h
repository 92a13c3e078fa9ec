// Where training batches come from: --mock-data (synthetic progressions) or --data-path
// (Megatron .bin/.idx datasets through the GPT sample index, split and blended as Megatron
// does). Samples are addressed by position, so a resumed run continues exactly where the
// checkpoint left off.
#pragma once

#include <memory>

#include "moecore/data/mock_data.h"
#include "moecore/train/arguments.h"

namespace moecore {

class DataSource {
 public:
  virtual ~DataSource() = default;
  // Samples [first, first + count) as tokens/labels [count, seq] on `device`.
  virtual Batch batch(int64_t first, int64_t count, Device device) const = 0;
};

enum class Split { Train = 0, Valid = 1, Test = 2 };

// The train and validation sources for `args` (validation may be nullptr: no validation data).
struct DataSources {
  std::unique_ptr<DataSource> train, valid;
};
// With args.eval_only (moecore eval) there is no training source.
DataSources make_data_sources(const TrainArgs& args);

// One whole split of --data-path (one dataset; a blend is refused): every sample of one epoch
// of the split (in the order a training run's validation reads it when that fits in one epoch).
struct SplitSamples {
  std::unique_ptr<DataSource> source;
  int64_t samples = 0;
};
SplitSamples make_whole_split_source(const TrainArgs& args, Split split);

}  // namespace moecore
