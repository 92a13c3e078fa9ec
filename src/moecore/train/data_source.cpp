#include "moecore/train/data_source.h"

#include <vector>

#include "moecore/data/gpt_dataset.h"

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

}  // namespace

DataSources make_data_sources(const TrainArgs& a) {
  DataSources out;
  if (a.mock_data) {
    out.train = std::make_unique<MockSource>(a, "train");
    out.valid = std::make_unique<MockSource>(a, "valid");
    return out;
  }
  GPTDataConfig c;
  c.blend = a.data_blend;
  c.split = a.split;
  c.seq_length = a.model.seq_length;
  c.seed = static_cast<uint64_t>(a.seed);
  c.cache_dir = a.data_cache_path;
  // Megatron's sample counts: every training step, and eval_iters batches per evaluation
  // (validation here reads the same first eval_iters batches at every evaluation).
  c.num_samples[0] = a.train_iters * a.global_batch_size;
  c.num_samples[1] = a.eval_interval > 0 ? a.eval_iters * a.micro_batch_size : 0;
  c.num_samples[2] = 0;
  auto sets = build_gpt_datasets(c);
  MC_CHECK(sets[0] != nullptr, "--data-path: the training split of --split ", a.split, " is empty");
  out.train = std::make_unique<SamplesSource>(std::move(sets[0]), a.model.seq_length, "training");
  if (sets[1]) out.valid = std::make_unique<SamplesSource>(std::move(sets[1]), a.model.seq_length, "validation");
  return out;
}

}  // namespace moecore
