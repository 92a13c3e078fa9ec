// GPT datasets over indexed datasets (Megatron semantics): split ranges, a hand-written sample
// index, samples against an independent slow reconstruction (concatenate the documents in
// document-index order; sample j is tokens [j*S, j*S + S] of that stream), determinism per
// seed, the separate final epoch, the index cache (created, reused, rebuilt on data change or
// damage) and blending shares.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/data/indexed_dataset.h"

using namespace moecore;
namespace fs = std::filesystem;

namespace {

class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() / ("moecore-data1-gpt-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

using Docs = std::vector<std::vector<int64_t>>;

void write_docs(const std::string& prefix, const Docs& docs) {
  IndexedDatasetWriter w(prefix, TokenDType::I32);
  for (const auto& d : docs) w.add_document(d);
  w.finalize();
}

std::vector<int32_t> lengths_of(const Docs& docs) {
  std::vector<int32_t> r;
  for (const auto& d : docs) r.push_back(static_cast<int32_t>(d.size()));
  return r;
}

// Documents whose tokens name them: document d holds base + 100*d + position.
Docs numbered_docs(int n, int base, int seed) {
  Docs docs;
  for (int d = 0; d < n; ++d) {
    const int len = 1 + (d * 7 + seed * 3) % 13;
    std::vector<int64_t> doc;
    for (int i = 0; i < len; ++i) doc.push_back(base + 100 * d + i);
    docs.push_back(doc);
  }
  return docs;
}

// Independent slow loop: sample j of the (unshuffled) sample order from the document index.
std::vector<int32_t> slow_sample(const Docs& docs, const std::vector<int32_t>& document_index, int64_t seq_length,
                                 int64_t j) {
  std::vector<int32_t> stream;
  for (int32_t d : document_index)
    for (int64_t t : docs[static_cast<size_t>(d)]) stream.push_back(static_cast<int32_t>(t));
  const size_t begin = static_cast<size_t>(j * seq_length);
  EXPECT_LE(begin + static_cast<size_t>(seq_length) + 1, stream.size());
  return {stream.begin() + static_cast<std::ptrdiff_t>(begin),
          stream.begin() + static_cast<std::ptrdiff_t>(begin + static_cast<size_t>(seq_length) + 1)};
}

bool is_permutation_of_range(std::vector<int64_t> v, int64_t lo, int64_t hi) {
  std::sort(v.begin(), v.end());
  if (static_cast<int64_t>(v.size()) != hi - lo) return false;
  for (int64_t i = 0; i < hi - lo; ++i)
    if (v[static_cast<size_t>(i)] != lo + i) return false;
  return true;
}

}  // namespace

TEST(GPTDataset, SplitRanges) {
  using R = std::array<std::pair<int64_t, int64_t>, 3>;
  EXPECT_EQ(split_document_ranges("969,30,1", 1000), (R{{{0, 969}, {969, 999}, {999, 1000}}}));
  // 10 documents: round(9.69) = 10 and round(9.99) = 10 leave valid and test empty.
  EXPECT_EQ(split_document_ranges("969,30,1", 10), (R{{{0, 10}, {10, 10}, {10, 10}}}));
  EXPECT_EQ(split_document_ranges("1,1,1", 10), (R{{{0, 3}, {3, 7}, {7, 10}}}));
  EXPECT_EQ(split_document_ranges("1,1,1", 1000), (R{{{0, 333}, {333, 667}, {667, 1000}}}));
  // Python's round is half to even: 0.5 * 5 = 2.5 -> 2; a missing weight is 0 (unused split).
  EXPECT_EQ(split_document_ranges("1,1", 5), (R{{{0, 2}, {2, 5}, {0, 0}}}));
  EXPECT_EQ(split_document_ranges("98,2,0", 100), (R{{{0, 98}, {98, 100}, {0, 0}}}));
  const auto w = parse_split("969,30,1");
  EXPECT_DOUBLE_EQ(w[0], 0.969);
  EXPECT_DOUBLE_EQ(w[2], 0.001);
  EXPECT_THROW(parse_split("a,b"), Error);
  EXPECT_THROW(parse_split("0,0,0"), Error);
  EXPECT_THROW(parse_split("1,2,3,4"), Error);
}

TEST(GPTDataset, HandWrittenSampleIndex) {
  // Documents A = [10 11 12], B = [20 21], C = [30 31 32 33 34]; order A B C; seq_length 4.
  // Stream 10 11 12 20 21 30 31 32 33 34: each sample takes 5 tokens, consecutive samples share one.
  //   sample 0 = 10 11 12 20 21 : (doc pos 0, offset 0) .. (pos 1, offset 1)
  //   sample 1 = 21 30 31 32 33 : (pos 1, offset 1) .. (pos 2, offset 3)
  // (10 - 1) / 4 = 2 samples; the last token 34 is left over.
  const Docs docs = {{10, 11, 12}, {20, 21}, {30, 31, 32, 33, 34}};
  const std::vector<int64_t> idx = build_sample_index(lengths_of(docs), {0, 1, 2}, 4, 1, 10);
  EXPECT_EQ(idx, (std::vector<int64_t>{0, 0, 1, 1, 2, 3}));
  // Order C A B: 30 31 32 33 34 10 11 12 20 21 -> [30..34] then [34 10 11 12 20].
  EXPECT_EQ(build_sample_index(lengths_of(docs), {2, 0, 1}, 4, 1, 10), (std::vector<int64_t>{0, 0, 0, 4, 2, 0}));

  // Through a dataset file: every sample exactly as the stream says, whatever the shuffle.
  ScratchDir dir;
  write_docs(dir.file("abc"), docs);
  GPTDataConfig c;
  c.blend = {{1.0, dir.file("abc")}};
  c.split = "1,0,0";
  c.seq_length = 4;
  c.num_samples = {2, 0, 0};
  auto sets = build_gpt_datasets(c);
  ASSERT_TRUE(sets[0]);
  EXPECT_FALSE(sets[1]);
  EXPECT_FALSE(sets[2]);
  const auto* g = dynamic_cast<const GPTDataset*>(sets[0].get());
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(g->size(), 2);
  EXPECT_EQ(g->indices().num_epochs, 1);
  const std::vector<int32_t>& order = g->indices().document_index;
  std::vector<int32_t> stream;
  for (int32_t d : order)
    for (int64_t t : docs[static_cast<size_t>(d)]) stream.push_back(static_cast<int32_t>(t));
  for (int64_t i = 0; i < 2; ++i) {
    std::vector<int32_t> got(5, -1);
    g->sample(i, got.data());
    const int64_t j = g->indices().shuffle_index[static_cast<size_t>(i)];
    EXPECT_EQ(got, std::vector<int32_t>(stream.begin() + 4 * j, stream.begin() + 4 * j + 5)) << "sample " << i;
  }
  std::vector<int32_t> out(5);
  EXPECT_THROW(g->sample(2, out.data()), Error);
}

TEST(GPTDataset, SamplesMatchSlowReconstructionOverEpochs) {
  ScratchDir dir;
  const Docs docs = numbered_docs(30, 1000, 1);
  write_docs(dir.file("n"), docs);
  const int64_t S = 8;
  GPTDataConfig c;
  c.blend = {{1.0, dir.file("n")}};
  c.split = "2,1,1";
  c.seq_length = S;
  c.num_samples = {100, 3, 0};  // train needs several epochs
  auto sets = build_gpt_datasets(c);
  ASSERT_TRUE(sets[0] && sets[1]);
  EXPECT_FALSE(sets[2]);
  const auto ranges = split_document_ranges("2,1,1", 30);
  for (int k = 0; k < 2; ++k) {
    const auto* g = dynamic_cast<const GPTDataset*>(sets[k].get());
    ASSERT_NE(g, nullptr);
    EXPECT_GE(g->size(), c.num_samples[k]);
    const GPTIndices& ix = g->indices();
    const int64_t docs_in_split = ranges[k].second - ranges[k].first;
    ASSERT_EQ(static_cast<int64_t>(ix.document_index.size()), ix.num_epochs * docs_in_split);
    for (int32_t d : ix.document_index) {
      EXPECT_GE(d, ranges[k].first);
      EXPECT_LT(d, ranges[k].second);
    }
    if (k == 0) EXPECT_GT(ix.num_epochs, 1);
    for (int64_t i = 0; i < g->size(); ++i) {
      std::vector<int32_t> got(S + 1, -1);
      g->sample(i, got.data());
      EXPECT_EQ(got, slow_sample(docs, ix.document_index, S, ix.shuffle_index[static_cast<size_t>(i)]))
          << "split " << k << " sample " << i;
    }
  }
}

TEST(GPTDataset, SeparateFinalEpoch) {
  // 10 documents of 10 tokens = 100 tokens per epoch, seq_length 4: 24 samples per epoch.
  // 30 samples need 121 tokens: 2 epochs; the second gives 30 - 24 = 6 < int(0.8 * 24) samples.
  std::vector<int32_t> lengths(10, 10);
  const GPTIndices ix = build_gpt_indices(lengths, 0, 10, 4, 30, 7);
  EXPECT_EQ(ix.num_epochs, 2);
  EXPECT_TRUE(ix.separate_final_epoch);
  auto first = std::vector<int64_t>(ix.document_index.begin(), ix.document_index.begin() + 10);
  auto last = std::vector<int64_t>(ix.document_index.begin() + 10, ix.document_index.end());
  EXPECT_TRUE(is_permutation_of_range(first, 0, 10));
  EXPECT_TRUE(is_permutation_of_range(last, 0, 10));
  ASSERT_EQ(ix.num_samples(), (200 - 1) / 4);
  EXPECT_TRUE(is_permutation_of_range({ix.shuffle_index.begin(), ix.shuffle_index.begin() + 24}, 0, 24));
  EXPECT_TRUE(is_permutation_of_range({ix.shuffle_index.begin() + 24, ix.shuffle_index.end()}, 24, 49));
  // 45 samples: the second epoch gives 21 >= 19 samples: one shuffle over both epochs.
  const GPTIndices whole = build_gpt_indices(lengths, 0, 10, 4, 45, 7);
  EXPECT_EQ(whole.num_epochs, 2);
  EXPECT_FALSE(whole.separate_final_epoch);
  EXPECT_TRUE(is_permutation_of_range(whole.shuffle_index, 0, 49));
  // One epoch is enough for 24 samples.
  EXPECT_EQ(build_gpt_indices(lengths, 0, 10, 4, 24, 7).num_epochs, 1);
  EXPECT_EQ(build_gpt_indices(lengths, 0, 10, 4, 25, 7).num_epochs, 2);
}

TEST(GPTDataset, DeterministicPerSeedAndDifferentAcrossSeeds) {
  std::vector<int32_t> lengths(50);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = static_cast<int32_t>(3 + i % 11);
  const GPTIndices a = build_gpt_indices(lengths, 5, 45, 16, 200, 1234);
  const GPTIndices b = build_gpt_indices(lengths, 5, 45, 16, 200, 1234);
  const GPTIndices c = build_gpt_indices(lengths, 5, 45, 16, 200, 1235);
  EXPECT_EQ(a.document_index, b.document_index);
  EXPECT_EQ(a.sample_index, b.sample_index);
  EXPECT_EQ(a.shuffle_index, b.shuffle_index);
  EXPECT_NE(a.document_index, c.document_index);
  EXPECT_NE(a.shuffle_index, c.shuffle_index);
  // Shuffled, not the identity.
  std::vector<int64_t> identity(a.shuffle_index.size());
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(a.shuffle_index, identity);
  EXPECT_THROW(build_gpt_indices(lengths, 5, 5, 16, 10, 1), Error);  // no documents
  EXPECT_THROW(build_gpt_indices(lengths, 0, 10, 0, 10, 1), Error);  // seq_length 0
}

TEST(GPTDataset, CacheCreatedReusedAndRebuilt) {
  ScratchDir dir;
  write_docs(dir.file("c"), numbered_docs(40, 0, 2));
  GPTDataConfig c;
  c.blend = {{1.0, dir.file("c")}};
  c.split = "9,1,0";
  c.seq_length = 8;
  c.num_samples = {50, 5, 0};

  auto first = build_gpt_datasets(c);
  const auto* g1 = dynamic_cast<const GPTDataset*>(first[0].get());
  ASSERT_NE(g1, nullptr);
  EXPECT_FALSE(g1->loaded_from_cache());
  const std::string path = g1->cache_path();
  ASSERT_TRUE(fs::exists(path)) << path;
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(dir.file("")).parent_path()) << "cache beside the data";
  EXPECT_NE(path.find(".train-"), std::string::npos);
  const auto mtime = fs::last_write_time(path);

  auto second = build_gpt_datasets(c);
  const auto* g2 = dynamic_cast<const GPTDataset*>(second[0].get());
  ASSERT_NE(g2, nullptr);
  EXPECT_TRUE(g2->loaded_from_cache());
  EXPECT_EQ(g2->cache_path(), path);
  EXPECT_EQ(fs::last_write_time(path), mtime);
  EXPECT_EQ(g2->indices().document_index, g1->indices().document_index);
  EXPECT_EQ(g2->indices().sample_index, g1->indices().sample_index);
  EXPECT_EQ(g2->indices().shuffle_index, g1->indices().shuffle_index);
  EXPECT_TRUE(dynamic_cast<const GPTDataset*>(second[1].get())->loaded_from_cache());

  // Another seed or another seq_length: another file.
  GPTDataConfig other = c;
  other.seed = 99;
  EXPECT_FALSE(dynamic_cast<const GPTDataset*>(build_gpt_datasets(other)[0].get())->loaded_from_cache());

  // A damaged cache file is rebuilt in place.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70);
    f.put('\x7f');
  }
  auto third = build_gpt_datasets(c);
  const auto* g3 = dynamic_cast<const GPTDataset*>(third[0].get());
  EXPECT_FALSE(g3->loaded_from_cache());
  EXPECT_EQ(g3->indices().shuffle_index, g1->indices().shuffle_index);
  EXPECT_TRUE(dynamic_cast<const GPTDataset*>(build_gpt_datasets(c)[0].get())->loaded_from_cache());
  fs::resize_file(path, 30);
  EXPECT_FALSE(dynamic_cast<const GPTDataset*>(build_gpt_datasets(c)[0].get())->loaded_from_cache());

  // New data under the same prefix: different cache name, rebuilt.
  write_docs(dir.file("c"), numbered_docs(40, 0, 3));
  auto fourth = build_gpt_datasets(c);
  const auto* g4 = dynamic_cast<const GPTDataset*>(fourth[0].get());
  EXPECT_FALSE(g4->loaded_from_cache());
  EXPECT_NE(g4->cache_path(), path);

  // cache_dir puts the files there.
  GPTDataConfig elsewhere = c;
  elsewhere.cache_dir = dir.file("cache");
  auto fifth = build_gpt_datasets(elsewhere);
  const auto* g5 = dynamic_cast<const GPTDataset*>(fifth[0].get());
  EXPECT_EQ(fs::path(g5->cache_path()).parent_path(), fs::path(dir.file("cache")));
  EXPECT_TRUE(fs::exists(g5->cache_path()));
}

TEST(GPTDataset, BlendingSharesFollowWeights) {
  ScratchDir dir;
  // Dataset d's tokens lie in [d * 100000, d * 100000 + 99999].
  for (int d = 0; d < 3; ++d) write_docs(dir.file("b" + std::to_string(d)), numbered_docs(60, d * 100000, d));
  GPTDataConfig c;
  c.blend = {{5.0, dir.file("b0")}, {3.0, dir.file("b1")}, {2.0, dir.file("b2")}};
  c.split = "9,1,0";
  c.seq_length = 16;
  c.num_samples = {10000, 20, 0};
  auto sets = build_gpt_datasets(c);
  const auto* blend = dynamic_cast<const BlendedSamples*>(sets[0].get());
  ASSERT_NE(blend, nullptr);
  ASSERT_EQ(blend->size(), 10000);
  ASSERT_TRUE(sets[1]);
  EXPECT_EQ(sets[1]->size(), 20);
  EXPECT_FALSE(sets[2]);
  const double w[3] = {0.5, 0.3, 0.2};
  const std::vector<int64_t> sizes = blend_sizes({0.5, 0.3, 0.2}, 10000);
  EXPECT_EQ(sizes, (std::vector<int64_t>{5025, 3015, 2010}));
  int64_t count[3] = {0, 0, 0};
  for (int32_t d : blend->dataset_index()) ++count[d];
  for (int d = 0; d < 3; ++d) {
    EXPECT_NEAR(static_cast<double>(count[d]) / 10000.0, w[d], 0.01) << "dataset " << d;
    EXPECT_GE(blend->datasets()[static_cast<size_t>(d)]->size(), sizes[static_cast<size_t>(d)]);
  }
  // Each sample comes from the dataset the blend index names, in order within that dataset.
  std::vector<int32_t> out(17), direct(17);
  for (int64_t i = 0; i < 10000; i += 37) {
    blend->sample(i, out.data());
    const int32_t d = blend->dataset_index()[static_cast<size_t>(i)];
    for (int32_t t : out) EXPECT_EQ(t / 100000, d) << "sample " << i;
    blend->datasets()[static_cast<size_t>(d)]->sample(blend->dataset_sample_index()[static_cast<size_t>(i)], direct.data());
    EXPECT_EQ(out, direct);
  }
  // Megatron's greedy rule on a small case: weights 0.5/0.3/0.2, first 10 picks.
  std::vector<int32_t> di;
  std::vector<int64_t> dsi;
  build_blending_indices({0.5, 0.3, 0.2}, 10, &di, &dsi);
  // (worked by hand: j=4 -> errors 0, 0.2, -0.2 picks 1; j=5 -> 0.5, -0.5, 0 picks 0; ...)
  EXPECT_EQ(di, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 2, 0, 1, 0}));
  EXPECT_EQ(dsi, (std::vector<int64_t>{0, 0, 0, 1, 1, 2, 1, 3, 2, 4}));
}

TEST(GPTDataset, BuilderErrors) {
  ScratchDir dir;
  GPTDataConfig c;
  c.blend = {{1.0, dir.file("nothing")}};
  c.seq_length = 4;
  c.num_samples = {1, 0, 0};
  try {
    build_gpt_datasets(c);
    ADD_FAILURE() << "a missing dataset was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("nothing.idx")), std::string::npos) << e.what();
  }
  write_docs(dir.file("one"), {{1, 2, 3}});
  c.blend = {{1.0, dir.file("one")}};
  c.seq_length = 0;
  EXPECT_THROW(build_gpt_datasets(c), Error);
  c.seq_length = 4;
  c.split = "969,30,1";
  c.num_samples = {5, 5, 5};  // one document: only train has documents
  auto sets = build_gpt_datasets(c);
  EXPECT_TRUE(sets[0]);
  EXPECT_FALSE(sets[1]);
  EXPECT_FALSE(sets[2]);
  // A blend whose member has no documents in a used split names it.
  write_docs(dir.file("two"), numbered_docs(100, 0, 1));
  c.blend = {{1.0, dir.file("one")}, {1.0, dir.file("two")}};
  try {
    build_gpt_datasets(c);
    ADD_FAILURE() << "an empty split of a blend member was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no documents in the valid split"), std::string::npos) << e.what();
  }
}
