#include "moecore/train/data_source.h"

#include <algorithm>
#include <vector>

#include "moecore/data/gpt_dataset.h"
#include "moecore/data/indexed_dataset.h"

namespace moecore {

namespace {

class MockSource : public DataSource {
 public:
  MockSource(const TrainArgs& a, const std::string& split)
      : data_(a.model.vocab_size, a.model.seq_length, static_cast<uint64_t>(a.seed), split) {}
  Batch batch(int64_t first, int64_t count, Device device) const override { return data_.batch(first, count, device); }

 private:
  MockData data_;
};

class SamplesSource : public DataSource {
 public:
  SamplesSource(std::unique_ptr<TokenSamples> samples, int64_t seq, const char* split)
      : samples_(std::move(samples)), seq_(seq), split_(split) {}
  Batch batch(int64_t first, int64_t count, Device device) const override {
    MC_CHECK(first + count <= samples_->size(), "the ", split_, " dataset has ", samples_->size(),
             " samples; sample ", first + count - 1, " was asked for");
    std::vector<int32_t> tokens(static_cast<size_t>(count * seq_)), labels(tokens.size()), buf(static_cast<size_t>(seq_ + 1));
    for (int64_t b = 0; b < count; ++b) {
      samples_->sample(first + b, buf.data());
      std::copy(buf.begin(), buf.end() - 1, tokens.begin() + b * seq_);
      std::copy(buf.begin() + 1, buf.end(), labels.begin() + b * seq_);
    }
    return {Tensor::from_vector(tokens, {count, seq_}, device), Tensor::from_vector(labels, {count, seq_}, device)};
  }

 private:
  std::unique_ptr<TokenSamples> samples_;
  int64_t seq_;
  const char* split_;
};

// --finetune and moecore eval take a checkpoint's model to new data: every token of the data must
// be in the model's vocabulary (data preprocessed with another tokenizer is refused by name before
// any work; a resume reads the data its run has been reading, and is not scanned again).
void check_data_in_vocabulary(const TrainArgs& a) {
  std::vector<int32_t> buf;
  for (const auto& [weight, prefix] : a.data_blend) {
    const IndexedDataset d(prefix);
    int32_t max_id = -1;
    for (int64_t i = 0; i < d.num_sequences(); ++i) {
      buf.resize(static_cast<size_t>(d.sequence_length(i)));
      d.read(i, 0, d.sequence_length(i), buf.data());
      for (int32_t t : buf) max_id = std::max(max_id, t);
    }
    MC_CHECK(max_id < a.model.vocab_size, "--data-path ", prefix, ": token id ", max_id, " is outside the vocabulary of ",
             a.model.vocab_size, " of the model in --load ", a.load, " (--vocab-size); the data was preprocessed with "
             "another tokenizer: preprocess it with the checkpoint's (--tokenizer-type ", a.tokenizer_type,
             a.tokenizer_model.empty() ? "" : " --tokenizer-model " + a.tokenizer_model, ")");
  }
}

// The dataset settings every data source of a run shares (blend, split, sequence length, seed,
// index cache); the caller sets the sample counts.
GPTDataConfig gpt_data_config(const TrainArgs& a) {
  GPTDataConfig c;
  c.blend = a.data_blend;
  c.split = a.split;
  c.seq_length = a.model.seq_length;
  c.seed = static_cast<uint64_t>(a.seed);
  c.cache_dir = a.data_cache_path;
  return c;
}

}  // namespace

DataSources make_data_sources(const TrainArgs& a) {
  DataSources out;
  if (a.mock_data) {
    out.train = std::make_unique<MockSource>(a, "train");
    out.valid = std::make_unique<MockSource>(a, "valid");
    return out;
  }
  if (!a.load.empty() && (a.finetune || a.eval_only)) check_data_in_vocabulary(a);
  GPTDataConfig c = gpt_data_config(a);
  // Megatron's sample counts: every training step, and eval_iters batches per evaluation
  // (validation here reads the same first eval_iters batches at every evaluation).
  c.num_samples[0] = a.eval_only ? 0 : a.train_iters * a.global_batch_size;
  c.num_samples[1] = a.eval_interval > 0 ? a.eval_iters * a.micro_batch_size : 0;
  c.num_samples[2] = 0;
  auto sets = build_gpt_datasets(c);
  MC_CHECK(sets[0] != nullptr || a.eval_only, "--data-path: the training split of --split ", a.split, " is empty");
  if (sets[0]) out.train = std::make_unique<SamplesSource>(std::move(sets[0]), a.model.seq_length, "training");
  if (sets[1]) out.valid = std::make_unique<SamplesSource>(std::move(sets[1]), a.model.seq_length, "validation");
  return out;
}

SplitSamples make_whole_split_source(const TrainArgs& a, Split split) {
  MC_CHECK(!a.mock_data, "--whole-dataset needs --data-path (mock data has no end)");
  MC_CHECK(a.data_blend.size() == 1, "--whole-dataset reads one dataset; --data-path names ", a.data_blend.size(),
           " (a blend): give --eval-iters instead");
  GPTDataConfig c = gpt_data_config(a);
  c.num_samples[static_cast<int>(split)] = 1;  // one epoch: every sample of the split
  auto sets = build_gpt_datasets(c);
  auto& set = sets[static_cast<int>(split)];
  MC_CHECK(set != nullptr, "--data-path ", a.data_blend[0].second, ": the ", kSplitNames[static_cast<int>(split)],
           " split of --split ", a.split, " is empty");
  SplitSamples out;
  out.samples = set->size();
  out.source = std::make_unique<SamplesSource>(std::move(set), a.model.seq_length, "validation");
  return out;
}

}  // namespace moecore
