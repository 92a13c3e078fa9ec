// Megatron-LM GPT datasets over indexed datasets (megatron/core/datasets/gpt_dataset.py,
// blended_dataset.py, blended_megatron_dataset_builder.py, helpers.cpp), reimplemented.
//
// Split. "969,30,1" -> weights w normalised to sum 1 (missing entries are 0); bookends
// c = [0, w0, w0+w1, w0+w1+w2]; split k covers documents [round(c_k * N), round(c_{k+1} * N))
// of the N = document_count - 1 documents (round = half to even, as Python's round). A zero
// weight is an unused split. Like Megatron's GPTDataset, document ids are used as sequence ids
// (exact for data preprocessed without sentence splitting: one sequence per document).
//
// Per split, for num_samples samples of seq_length + 1 tokens (Megatron's
// add_extra_token_to_sequence = 1: consecutive samples overlap by one token):
//   tokens_per_epoch = sum of the split's sequence lengths
//   num_epochs = smallest E with E * tokens_per_epoch >= num_samples * seq_length + 1
//   separate_final_epoch (E > 1 only): the last epoch contributes fewer than
//     int(0.8 * samples_per_epoch) samples, samples_per_epoch = (tokens_per_epoch - 1) / seq_length
//   document index int32[E * docs]: the split's document ids tiled E times and shuffled as one
//     array; with separate_final_epoch the first E-1 epochs are shuffled together and the last
//     epoch on its own (so the partly used epoch still visits documents uniformly).
//   sample index int64[n + 1][2], n = (E * tokens_per_epoch - 1) / seq_length: row i =
//     (position in the document index, token offset) where sample i starts; sample i covers
//     [row i, row i+1] inclusive of the end token, i.e. seq_length + 1 tokens, spanning documents.
//   shuffle index int64[n]: a permutation of [0, n); with separate_final_epoch the samples of the
//     first E-1 epochs, [0, (E-1) * tokens_per_epoch - 1) / seq_length), and the rest are
//     shuffled separately.
// size() = n (>= num_samples, as Megatron's len()). sample(i) = tokens of shuffle[i].
//
// Deviation from Megatron: the shuffles use our own deterministic RNG (Fisher-Yates driven by
// Philox4x32-10 keyed by the seed, consumed in Megatron's order: document index, then shuffle
// index), not numpy's RandomState, so the permutations differ from Megatron's for the same
// seed; everything else (split ranges, epoch counts, sample index, sizes) is identical.
//
// Cache. The three indices of a (dataset, split) live in one file
//   <cache_dir or the prefix's directory>/<prefix basename>.<train|valid|test>-<hash>.gptidx
// where hash = 64-bit FNV-1a of everything that determines them (absolute prefix, split
// weights and range, seq_length, seed, num_samples, .idx/.bin size and .idx mtime, format
// version). A file that is damaged (bad magic, size, checksum or out-of-range entries) is
// rebuilt; changed data gives another name. Files are written to a temporary name and renamed.
// If the directory is not writable the indices are used from memory (a note on stderr).
//
// Blending (more than one blend entry): weights normalised; dataset d of split k is built for
// ceil(num_samples[k] * w_d * 1.005) samples; sample j of the blend comes from the dataset with
// the largest error w_d * max(j, 1) - (samples given so far), ties to the lowest d (Megatron's
// build_blending_indices); size() = num_samples[k]. The blend index is computed in memory.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moecore/data/indexed_dataset.h"

namespace moecore {

struct GPTDataConfig {
  std::vector<std::pair<double, std::string>> blend;  // (weight, prefix); one entry = no blending
  std::string split = "969,30,1";                      // train,valid,test weights over documents
  int64_t seq_length = 0;
  uint64_t seed = 1234;
  std::array<int64_t, 3> num_samples{};                // samples needed per split (0: split unused)
  std::string cache_dir;                               // "" = beside each dataset's files
};

class TokenSamples {  // a dataset of fixed-length samples
 public:
  virtual ~TokenSamples() = default;
  virtual int64_t size() const = 0;
  // writes seq_length + 1 tokens of sample i (tokens = out[0:S], labels = out[1:S+1])
  virtual void sample(int64_t i, int32_t* out) const = 0;
};

// Builds (train, valid, test); an unused split (num_samples 0 or an empty document range) is nullptr.
std::array<std::unique_ptr<TokenSamples>, 3> build_gpt_datasets(const GPTDataConfig& config);

// ---- the pieces (exposed for tests and tools) ----------------------------------------

extern const char* const kSplitNames[3];  // "train", "valid", "test"

// "969,30,1" -> normalised weights (numbers separated by anything else; missing ones are 0).
std::array<double, 3> parse_split(const std::string& split);
// Document ranges [begin, end) per split for num_documents documents (empty for weight 0).
std::array<std::pair<int64_t, int64_t>, 3> split_document_ranges(const std::string& split, int64_t num_documents);

struct GPTIndices {
  int64_t num_epochs = 0;
  bool separate_final_epoch = false;
  std::vector<int32_t> document_index;  // [num_epochs * docs] sequence ids
  std::vector<int64_t> sample_index;    // [(n + 1) * 2] (position in document_index, offset)
  std::vector<int64_t> shuffle_index;   // [n]
  int64_t num_samples() const { return static_cast<int64_t>(shuffle_index.size()); }
};

// The indices for documents [doc_begin, doc_end) (sequence ids) with the given lengths.
GPTIndices build_gpt_indices(const std::vector<int32_t>& sequence_lengths, int64_t doc_begin, int64_t doc_end,
                             int64_t seq_length, int64_t num_samples, uint64_t seed);

// The sample index alone (Megatron's build_sample_idx, dropping the last partial sample) for a
// given document index over num_epochs epochs of tokens_per_epoch tokens: [(n + 1) * 2].
std::vector<int64_t> build_sample_index(const std::vector<int32_t>& sequence_lengths,
                                        const std::vector<int32_t>& document_index, int64_t seq_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch);

// Megatron's blending: (dataset of each sample, sample within that dataset), for normalised weights.
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int32_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index);
// Per-dataset sample counts of a blend: ceil(num_samples * w * 1.005) for normalised w.
std::vector<int64_t> blend_sizes(const std::vector<double>& weights, int64_t num_samples);

class GPTDataset : public TokenSamples {
 public:
  // Loads the indices from the cache or builds (and caches) them.
  GPTDataset(std::shared_ptr<const IndexedDataset> data, int split, std::pair<int64_t, int64_t> documents,
             const GPTDataConfig& config, int64_t num_samples);
  int64_t size() const override { return indices_.num_samples(); }
  void sample(int64_t i, int32_t* out) const override;

  const GPTIndices& indices() const { return indices_; }
  const std::string& cache_path() const { return cache_path_; }
  bool loaded_from_cache() const { return loaded_from_cache_; }

 private:
  std::shared_ptr<const IndexedDataset> data_;
  int64_t seq_length_;
  GPTIndices indices_;
  std::string cache_path_;
  bool loaded_from_cache_ = false;
};

class BlendedSamples : public TokenSamples {
 public:
  BlendedSamples(std::vector<std::unique_ptr<TokenSamples>> datasets, const std::vector<double>& weights, int64_t size);
  int64_t size() const override { return static_cast<int64_t>(dataset_index_.size()); }
  void sample(int64_t i, int32_t* out) const override;

  const std::vector<std::unique_ptr<TokenSamples>>& datasets() const { return datasets_; }
  const std::vector<int32_t>& dataset_index() const { return dataset_index_; }
  const std::vector<int64_t>& dataset_sample_index() const { return dataset_sample_index_; }

 private:
  std::vector<std::unique_ptr<TokenSamples>> datasets_;
  std::vector<int32_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace moecore
