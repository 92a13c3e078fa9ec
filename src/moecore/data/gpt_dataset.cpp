#include "moecore/data/gpt_dataset.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "moecore/core/error.h"
#include "moecore/core/philox.h"

namespace moecore {

const char* const kSplitNames[3] = {"train", "valid", "test"};

namespace {

// A sequential stream of 64-bit words from Philox (seed, fixed key, counter) and Fisher-Yates
// shuffles over it: the same seed gives the same permutations on every machine.
class ShuffleRng {
 public:
  explicit ShuffleRng(uint64_t seed) : seed_(seed), key_(rng_key("moecore/gpt-dataset/shuffle")) {}
  uint64_t next() {
    const PhiloxWords w = philox_words(seed_, key_, counter_++);
    return static_cast<uint64_t>(w.w[0]) | (static_cast<uint64_t>(w.w[1]) << 32);
  }
  // Uniform in [0, n), n >= 1, by rejection (no modulo bias).
  uint64_t below(uint64_t n) {
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
    uint64_t r;
    do r = next();
    while (r >= limit);
    return r % n;
  }
  template <typename T>
  void shuffle(T* a, int64_t n) {
    for (int64_t i = n - 1; i > 0; --i) std::swap(a[i], a[below(static_cast<uint64_t>(i) + 1)]);
  }

 private:
  uint64_t seed_, key_, counter_ = 0;
};

// ---- cache file ---------------------------------------------------------------------
// magic "MCGPTIX1" | u64 key hash | i64 num_epochs | i64 separate_final_epoch |
// i64 n_document_index | i64 n_sample_index (rows) | i64 n_shuffle |
// int32[n_document_index] | int64[2 * rows] | int64[n_shuffle] | u64 checksum of all before
constexpr char kCacheMagic[8] = {'M', 'C', 'G', 'P', 'T', 'I', 'X', '1'};
constexpr size_t kCacheHeader = 8 + 6 * 8;

uint64_t checksum(const unsigned char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

template <typename T>
void put(std::vector<unsigned char>& b, const T& v) {
  const auto* p = reinterpret_cast<const unsigned char*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}
template <typename T>
void put_array(std::vector<unsigned char>& b, const std::vector<T>& v) {
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  b.insert(b.end(), p, p + v.size() * sizeof(T));
}

// Writes the cache file (temporary name, then rename); false with a reason on failure.
bool write_cache(const std::string& path, uint64_t key, const GPTIndices& ix, std::string* why) {
  std::vector<unsigned char> b;
  b.reserve(kCacheHeader + 4 * ix.document_index.size() + 8 * ix.sample_index.size() + 8 * ix.shuffle_index.size() + 8);
  for (char c : kCacheMagic) b.push_back(static_cast<unsigned char>(c));
  put(b, key);
  put<int64_t>(b, ix.num_epochs);
  put<int64_t>(b, ix.separate_final_epoch ? 1 : 0);
  put<int64_t>(b, static_cast<int64_t>(ix.document_index.size()));
  put<int64_t>(b, static_cast<int64_t>(ix.sample_index.size() / 2));
  put<int64_t>(b, static_cast<int64_t>(ix.shuffle_index.size()));
  put_array(b, ix.document_index);
  put_array(b, ix.sample_index);
  put_array(b, ix.shuffle_index);
  put(b, checksum(b.data(), b.size()));
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) {
    *why = "cannot create " + tmp + ": " + std::strerror(errno);
    return false;
  }
  const bool ok = std::fwrite(b.data(), 1, b.size(), f) == b.size();
  if (std::fclose(f) != 0 || !ok) {
    *why = "cannot write " + tmp + ": " + std::strerror(errno);
    std::remove(tmp.c_str());
    return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    *why = "cannot rename " + tmp + " to " + path + ": " + std::strerror(errno);
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

// Reads and validates a cache file; false (with the reason) when absent or unusable.
bool read_cache(const std::string& path, uint64_t key, const std::vector<int32_t>& lengths, int64_t doc_begin,
                int64_t doc_end, GPTIndices* ix, std::string* why) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *why = "absent";
    return false;
  }
  std::vector<unsigned char> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto fail = [&](const std::string& m) {
    *why = m;
    return false;
  };
  if (b.size() < kCacheHeader + 8 || std::memcmp(b.data(), kCacheMagic, 8) != 0) return fail("bad header");
  int64_t h[6];
  std::memcpy(h, b.data() + 8, sizeof(h));
  uint64_t stored_key;
  std::memcpy(&stored_key, b.data() + 8, 8);
  const int64_t epochs = h[1], separate = h[2], nd = h[3], rows = h[4], ns = h[5];
  if (stored_key != key) return fail("key mismatch");
  const int64_t docs = doc_end - doc_begin;
  if (epochs < 1 || epochs > std::numeric_limits<int32_t>::max() || nd < 0 || rows < 1 ||
      static_cast<uint64_t>(nd) > b.size() || static_cast<uint64_t>(rows) > b.size())
    return fail("inconsistent counts");
  if ((separate != 0 && separate != 1) || nd != epochs * docs || rows < 1 || ns != rows - 1)
    return fail("inconsistent counts");
  const size_t expected = kCacheHeader + 4 * static_cast<size_t>(nd) + 16 * static_cast<size_t>(rows) +
                          8 * static_cast<size_t>(ns) + 8;
  if (b.size() != expected) return fail("wrong size");
  uint64_t sum;
  std::memcpy(&sum, b.data() + b.size() - 8, 8);
  if (sum != checksum(b.data(), b.size() - 8)) return fail("checksum mismatch");
  GPTIndices r;
  r.num_epochs = epochs;
  r.separate_final_epoch = separate == 1;
  r.document_index.resize(static_cast<size_t>(nd));
  r.sample_index.resize(2 * static_cast<size_t>(rows));
  r.shuffle_index.resize(static_cast<size_t>(ns));
  const unsigned char* p = b.data() + kCacheHeader;
  std::memcpy(r.document_index.data(), p, 4 * r.document_index.size());
  p += 4 * r.document_index.size();
  std::memcpy(r.sample_index.data(), p, 8 * r.sample_index.size());
  p += 8 * r.sample_index.size();
  std::memcpy(r.shuffle_index.data(), p, 8 * r.shuffle_index.size());
  // Entries in range, so that sample() can trust them.
  for (int32_t d : r.document_index)
    if (d < doc_begin || d >= doc_end) return fail("document index out of range");
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t pos = r.sample_index[2 * i], off = r.sample_index[2 * i + 1];
    if (pos < 0 || pos >= nd || off < 0 || off > lengths[static_cast<size_t>(r.document_index[pos])])
      return fail("sample index out of range");
    if (i > 0 && pos < r.sample_index[2 * i - 2]) return fail("sample index decreasing");
  }
  for (int64_t s : r.shuffle_index)
    if (s < 0 || s >= ns) return fail("shuffle index out of range");
  *ix = std::move(r);
  return true;
}

std::string hex64(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof(s), "%016llx", static_cast<unsigned long long>(v));
  return s;
}

struct FileStamp {
  int64_t size = -1, mtime_ns = -1;
};
FileStamp stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + static_cast<int64_t>(st.st_mtim.tv_nsec)};
}

}  // namespace

// ---- split ------------------------------------------------------------------------------

std::array<double, 3> parse_split(const std::string& split) {
  std::vector<double> w;
  size_t i = 0;
  while (i < split.size()) {
    if (!(std::isdigit(static_cast<unsigned char>(split[i])) || split[i] == '.')) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < split.size() && (std::isdigit(static_cast<unsigned char>(split[j])) || split[j] == '.')) ++j;
    const std::string number = split.substr(i, j - i);
    char* end = nullptr;
    const double v = std::strtod(number.c_str(), &end);
    MC_CHECK(end && *end == '\0' && number != ".", "split '", split, "': '", number, "' is not a number");
    w.push_back(v);
    i = j;
  }
  MC_CHECK(!w.empty() && w.size() <= 3, "split '", split, "': expected 1 to 3 weights (train,valid,test), got ",
           w.size());
  w.resize(3, 0.0);
  const double sum = w[0] + w[1] + w[2];
  MC_CHECK(sum > 0 && std::isfinite(sum), "split '", split, "': the weights sum to ", sum, ", expected > 0");
  return {w[0] / sum, w[1] / sum, w[2] / sum};
}

std::array<std::pair<int64_t, int64_t>, 3> split_document_ranges(const std::string& split, int64_t num_documents) {
  const std::array<double, 3> w = parse_split(split);
  // Bookends as Megatron's convert_split_vector_to_split_matrix (a running sum from 0).
  const double c[4] = {0.0, w[0], w[0] + w[1], w[0] + w[1] + w[2]};
  std::array<std::pair<int64_t, int64_t>, 3> r{};
  const double n = static_cast<double>(num_documents);
  for (int k = 0; k < 3; ++k) {
    if (c[k + 1] <= c[k]) continue;  // zero weight: unused split
    // Python's round(): half to even, which nearbyint does in the default rounding mode.
    const int64_t b = static_cast<int64_t>(std::nearbyint(c[k] * n));
    const int64_t e = static_cast<int64_t>(std::nearbyint(c[k + 1] * n));
    r[k] = {b, std::max(b, e)};
  }
  return r;
}

// ---- indices --------------------------------------------------------------------------

GPTIndices build_gpt_indices(const std::vector<int32_t>& sequence_lengths, int64_t doc_begin, int64_t doc_end,
                             int64_t seq_length, int64_t num_samples, uint64_t seed) {
  MC_CHECK(seq_length >= 1, "GPT dataset: seq_length must be >= 1, got ", seq_length);
  MC_CHECK(num_samples >= 1, "GPT dataset: num_samples must be >= 1, got ", num_samples);
  MC_CHECK(0 <= doc_begin && doc_begin < doc_end && doc_end <= static_cast<int64_t>(sequence_lengths.size()) &&
               doc_end <= std::numeric_limits<int32_t>::max(),
           "GPT dataset: document range [", doc_begin, ", ", doc_end, ") is empty or beyond the ",
           sequence_lengths.size(), " sequences");
  const int64_t docs = doc_end - doc_begin;
  int64_t tokens_per_epoch = 0;
  for (int64_t d = doc_begin; d < doc_end; ++d) tokens_per_epoch += sequence_lengths[static_cast<size_t>(d)];
  MC_CHECK(tokens_per_epoch >= 2, "GPT dataset: documents [", doc_begin, ", ", doc_end, ") hold ", tokens_per_epoch,
           " tokens; a sample needs at least 2");

  GPTIndices ix;
  // Epochs: enough tokens for num_samples samples of seq_length plus the one extra token.
  const int64_t tokens_needed = num_samples * seq_length + 1;
  ix.num_epochs = (tokens_needed + tokens_per_epoch - 1) / tokens_per_epoch;
  int64_t samples_sans_final_epoch = 0;
  if (ix.num_epochs > 1) {
    samples_sans_final_epoch = ((ix.num_epochs - 1) * tokens_per_epoch - 1) / seq_length;
    const int64_t from_final_epoch = num_samples - samples_sans_final_epoch;
    const int64_t per_epoch = (tokens_per_epoch - 1) / seq_length;
    MC_CHECK(from_final_epoch >= 0 && from_final_epoch <= per_epoch + 1, "GPT dataset: internal epoch count error");
    ix.separate_final_epoch = from_final_epoch < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }

  ShuffleRng rng(seed);
  // Document index: tiled ids, shuffled as one array, or (separate final epoch) the first
  // E-1 epochs and the last one separately.
  ix.document_index.resize(static_cast<size_t>(ix.num_epochs * docs));
  for (int64_t e = 0; e < ix.num_epochs; ++e)
    for (int64_t d = 0; d < docs; ++d) ix.document_index[static_cast<size_t>(e * docs + d)] = static_cast<int32_t>(doc_begin + d);
  if (ix.separate_final_epoch) {
    const int64_t first = (ix.num_epochs - 1) * docs;
    rng.shuffle(ix.document_index.data(), first);
    rng.shuffle(ix.document_index.data() + first, docs);
  } else {
    rng.shuffle(ix.document_index.data(), static_cast<int64_t>(ix.document_index.size()));
  }

  ix.sample_index = build_sample_index(sequence_lengths, ix.document_index, seq_length, ix.num_epochs, tokens_per_epoch);
  const int64_t n = static_cast<int64_t>(ix.sample_index.size() / 2) - 1;

  // Shuffle index: the full epochs' samples and the final partial epoch's samples separately.
  ix.shuffle_index.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ix.shuffle_index[static_cast<size_t>(i)] = i;
  const int64_t first = ix.separate_final_epoch ? samples_sans_final_epoch : n;
  rng.shuffle(ix.shuffle_index.data(), first);
  rng.shuffle(ix.shuffle_index.data() + first, n - first);
  return ix;
}

std::vector<int64_t> build_sample_index(const std::vector<int32_t>& sequence_lengths,
                                        const std::vector<int32_t>& document_index, int64_t seq_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch) {
  // Megatron's build_sample_idx with drop_last_partial_sequence and one extra token per sample.
  MC_CHECK(seq_length >= 1 && num_epochs >= 1 && tokens_per_epoch >= 1 && !document_index.empty(),
           "build_sample_index: bad arguments");
  const int64_t n = (num_epochs * tokens_per_epoch - 1) / seq_length;
  std::vector<int64_t> r(2 * static_cast<size_t>(n + 1));
  const int64_t last_position = static_cast<int64_t>(document_index.size()) - 1;
  int64_t position = 0, offset = 0;
  for (int64_t s = 1; s <= n; ++s) {
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      const int64_t doc_length =
          sequence_lengths[static_cast<size_t>(document_index[static_cast<size_t>(position)])] - offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The sample ends inside this document; the next one starts on its last token.
        offset += remaining + doc_length - 1;
        remaining = 0;
      } else {
        MC_CHECK(position < last_position, "build_sample_index: sample ", s,
                 " runs past the document index (tokens_per_epoch does not match the documents)");
        ++position;
        offset = 0;
      }
    }
    r[2 * static_cast<size_t>(s)] = position;
    r[2 * static_cast<size_t>(s) + 1] = offset;
  }
  return r;
}

// ---- blending ---------------------------------------------------------------------------

void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int32_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index) {
  MC_CHECK(!weights.empty(), "blending: no datasets");
  std::vector<int64_t> given(weights.size(), 0);
  dataset_index->resize(static_cast<size_t>(size));
  dataset_sample_index->resize(static_cast<size_t>(size));
  for (int64_t j = 0; j < size; ++j) {
    // The dataset furthest below its share so far (first one on ties).
    const double at = std::max(static_cast<double>(j), 1.0);
    size_t best = 0;
    double best_error = weights[0] * at - static_cast<double>(given[0]);
    for (size_t d = 1; d < weights.size(); ++d) {
      const double error = weights[d] * at - static_cast<double>(given[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    (*dataset_index)[static_cast<size_t>(j)] = static_cast<int32_t>(best);
    (*dataset_sample_index)[static_cast<size_t>(j)] = given[best]++;
  }
}

std::vector<int64_t> blend_sizes(const std::vector<double>& weights, int64_t num_samples) {
  std::vector<int64_t> r;
  // The 0.5% margin makes sure each dataset can serve every sample the blend asks of it.
  for (double w : weights) r.push_back(static_cast<int64_t>(std::ceil(static_cast<double>(num_samples) * w * 1.005)));
  return r;
}

// ---- datasets ---------------------------------------------------------------------------

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, int split, std::pair<int64_t, int64_t> documents,
                       const GPTDataConfig& config, int64_t num_samples)
    : data_(std::move(data)), seq_length_(config.seq_length) {
  MC_CHECK(split >= 0 && split < 3, "GPTDataset: split ", split, " is not 0 (train), 1 (valid) or 2 (test)");
  const IndexedDataset& d = *data_;
  // Megatron uses document ids as sequence ids; they coincide without sentence splitting.
  MC_CHECK(d.num_documents() <= d.num_sequences(), d.idx_path(), ": ", d.num_documents(), " documents but ",
           d.num_sequences(), " sequences; GPT datasets use document ids as sequence ids");
  std::vector<int32_t> lengths(static_cast<size_t>(d.num_documents()));
  for (int64_t i = 0; i < d.num_documents(); ++i) lengths[static_cast<size_t>(i)] = static_cast<int32_t>(d.sequence_length(i));

  // Cache key: everything that determines the indices.
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::weakly_canonical(std::filesystem::absolute(d.prefix(), ec), ec);
  if (abs.empty()) abs = d.prefix();
  const FileStamp idx = stamp(d.idx_path()), bin = stamp(d.bin_path());
  const std::array<double, 3> w = parse_split(config.split);
  std::ostringstream key;
  key.precision(17);
  key << "moecore-gpt-indices v1|prefix=" << abs.string() << "|split=" << w[0] << "," << w[1] << "," << w[2]
      << "|which=" << split << "|documents=" << documents.first << "," << documents.second
      << "|seq_length=" << config.seq_length << "|seed=" << config.seed << "|num_samples=" << num_samples
      << "|idx=" << idx.size << "@" << idx.mtime_ns << "|bin=" << bin.size;
  const uint64_t hash = rng_key(key.str());
  const std::filesystem::path dir = config.cache_dir.empty() ? abs.parent_path() : std::filesystem::path(config.cache_dir);
  cache_path_ = (dir / (abs.filename().string() + "." + kSplitNames[split] + "-" + hex64(hash) + ".gptidx")).string();

  std::string why;
  if (read_cache(cache_path_, hash, lengths, documents.first, documents.second, &indices_, &why)) {
    loaded_from_cache_ = true;
    return;
  }
  if (why != "absent") std::cerr << "moecore: note: rebuilding " << cache_path_ << " (" << why << ")\n";
  indices_ = build_gpt_indices(lengths, documents.first, documents.second, config.seq_length, num_samples, config.seed);
  if (!write_cache(cache_path_, hash, indices_, &why))
    std::cerr << "moecore: note: GPT dataset indices not cached (" << why << "); using them from memory\n";
}

void GPTDataset::sample(int64_t i, int32_t* out) const {
  MC_CHECK(i >= 0 && i < size(), data_->prefix(), ": sample ", i, " out of range [0, ", size(), ")");
  const int64_t j = indices_.shuffle_index[static_cast<size_t>(i)];
  const int64_t b = indices_.sample_index[2 * j], b_off = indices_.sample_index[2 * j + 1];
  const int64_t e = indices_.sample_index[2 * j + 2], e_off = indices_.sample_index[2 * j + 3];
  const int64_t want = seq_length_ + 1;
  int64_t written = 0;
  for (int64_t k = b; k <= e; ++k) {
    const int64_t seq = indices_.document_index[static_cast<size_t>(k)];
    const int64_t off = k == b ? b_off : 0;
    // The last document contributes up to and including its end offset (the extra token).
    const int64_t len = k == e ? e_off + 1 - off : data_->sequence_length(seq) - off;
    MC_CHECK(len >= 0 && written + len <= want, data_->prefix(), ": damaged GPT indices at sample ", i);
    data_->read(seq, off, len, out + written);
    written += len;
  }
  MC_CHECK(written == want, data_->prefix(), ": damaged GPT indices: sample ", i, " has ", written, " tokens, expected ",
           want);
}

BlendedSamples::BlendedSamples(std::vector<std::unique_ptr<TokenSamples>> datasets, const std::vector<double>& weights,
                               int64_t size)
    : datasets_(std::move(datasets)) {
  MC_CHECK(datasets_.size() == weights.size(), "blending: ", datasets_.size(), " datasets but ", weights.size(),
           " weights");
  build_blending_indices(weights, size, &dataset_index_, &dataset_sample_index_);
  std::vector<int64_t> used(datasets_.size(), 0);
  for (int64_t j = 0; j < size; ++j) {
    const size_t d = static_cast<size_t>(dataset_index_[static_cast<size_t>(j)]);
    used[d] = std::max(used[d], dataset_sample_index_[static_cast<size_t>(j)] + 1);
  }
  for (size_t d = 0; d < datasets_.size(); ++d)
    MC_CHECK(used[d] <= datasets_[d]->size(), "blending: dataset ", d, " has ", datasets_[d]->size(),
             " samples, the blend needs ", used[d]);
}

void BlendedSamples::sample(int64_t i, int32_t* out) const {
  MC_CHECK(i >= 0 && i < size(), "blended dataset: sample ", i, " out of range [0, ", size(), ")");
  datasets_[static_cast<size_t>(dataset_index_[static_cast<size_t>(i)])]->sample(
      dataset_sample_index_[static_cast<size_t>(i)], out);
}

// ---- builder ----------------------------------------------------------------------------

std::array<std::unique_ptr<TokenSamples>, 3> build_gpt_datasets(const GPTDataConfig& config) {
  MC_CHECK(!config.blend.empty(), "GPT datasets: no data prefix given");
  MC_CHECK(config.seq_length >= 1, "GPT datasets: seq_length must be >= 1, got ", config.seq_length);
  double total = 0;
  for (const auto& [w, prefix] : config.blend) {
    MC_CHECK(w >= 0 && std::isfinite(w), "GPT datasets: blend weight ", w, " of '", prefix, "' must be >= 0");
    total += w;
  }
  MC_CHECK(config.blend.size() == 1 || total > 0, "GPT datasets: the blend weights sum to 0");
  // Entries of weight 0 take no part (the greedy blend could otherwise pick one on a tie).
  std::vector<std::string> prefixes;
  std::vector<double> weights;
  for (const auto& [w, prefix] : config.blend)
    if (config.blend.size() == 1 || w > 0) {
      prefixes.push_back(prefix);
      weights.push_back(config.blend.size() == 1 ? 1.0 : w / total);
    }
  for (int k = 0; k < 3; ++k)
    MC_CHECK(config.num_samples[k] >= 0, "GPT datasets: num_samples[", kSplitNames[k], "] = ", config.num_samples[k],
             " is negative");

  std::vector<std::shared_ptr<const IndexedDataset>> data;
  std::vector<std::array<std::pair<int64_t, int64_t>, 3>> ranges;
  for (const auto& prefix : prefixes) {
    data.push_back(std::make_shared<const IndexedDataset>(prefix));
    ranges.push_back(split_document_ranges(config.split, data.back()->num_documents()));
  }

  std::array<std::unique_ptr<TokenSamples>, 3> out;
  for (int k = 0; k < 3; ++k) {
    const int64_t n = config.num_samples[k];
    if (n == 0) continue;
    if (data.size() == 1) {
      if (ranges[0][k].second > ranges[0][k].first)
        out[k] = std::make_unique<GPTDataset>(data[0], k, ranges[0][k], config, n);
      continue;
    }
    int empty = 0;
    for (const auto& r : ranges) empty += r[k].second <= r[k].first;
    if (empty == static_cast<int>(ranges.size())) continue;
    const std::vector<int64_t> sizes = blend_sizes(weights, n);
    std::vector<std::unique_ptr<TokenSamples>> parts;
    for (size_t d = 0; d < data.size(); ++d) {
      MC_CHECK(ranges[d][k].second > ranges[d][k].first, data[d]->prefix(), ": no documents in the ", kSplitNames[k],
               " split (", data[d]->num_documents(), " documents, split '", config.split, "'), but the blend needs ",
               sizes[d], " samples from it");
      parts.push_back(std::make_unique<GPTDataset>(data[d], k, ranges[d][k], config, sizes[d]));
    }
    out[k] = std::make_unique<BlendedSamples>(std::move(parts), weights, n);
  }
  return out;
}

}  // namespace moecore
