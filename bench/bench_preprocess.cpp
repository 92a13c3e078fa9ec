// Tokenizer and preprocess throughput (CPU): MB/s of input text per core.
//
//   byte      ByteTokenizer::encode over --byte-mb MB (default 64) of generated English-like text
//   bpe       BpeTokenizer::encode (GPT-2 regex through PCRE2 + merges + per-pre-token cache) over
//             --bpe-mb MB (default 16); the tokenizer is synthetic: 256 byte tokens plus merges that
//             build each word of a 300-word list (with and without its leading space) left to
//             right, and 10% of the words in the text are random letter strings that miss the
//             cache and merge byte by byte.
//   preprocess-byte-wN  the whole `moecore preprocess` pipeline (JSONL reading, JSON parsing,
//             tokenising in N workers, writing .bin/.idx) on a --jsonl-mb MB file (default 64);
//             MB/s of the JSONL file, and per core (divided by min(N, cores)).
// Targets: byte >= 20 MB/s per core, BPE >= 2 MB/s per core. Each measurement is one JSON line;
// a table follows. Flags: --byte-mb, --bpe-mb, --jsonl-mb, --workers (max N, default 2), --dir.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/cli/flags.h"
#include "moecore/data/bpe_tokenizer.h"
#include "moecore/data/preprocess.h"
#include "moecore/data/tokenizer.h"

using namespace moecore;

namespace {

const char* const kWords[] = {
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "I", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you",
    "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will",
    "would", "who", "so", "no", "time", "people", "year", "way", "day", "man", "thing", "woman", "life", "child",
    "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place",
    "case", "week", "company", "system", "program", "question", "work", "government", "number", "night",
    "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right",
    "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service",
    "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community",
    "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face",
    "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result",
    "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education",
    "good", "new", "first", "last", "long", "great", "little", "own", "other", "old", "big", "high", "different",
    "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "say",
    "make", "go", "know", "take", "see", "come", "think", "look", "want", "give", "use", "find", "tell", "ask",
    "seem", "feel", "try", "leave", "call", "model", "training", "expert", "router", "token", "layer",
    "attention", "gradient", "parallel", "memory", "throughput", "dataset", "language", "network", "learning",
    "however", "therefore", "because", "although", "during", "between", "through", "against", "without",
    "within", "about", "after", "before", "under", "around", "among", "2023", "1984", "42", "100", "3.14",
    "don't", "it's", "we'll", "they're", "I'm", "you've", "she'd"};

std::string english_like(size_t bytes, uint32_t seed, double random_word_fraction) {
  std::mt19937 rng(seed);
  const size_t nwords = sizeof(kWords) / sizeof(kWords[0]);
  std::string s;
  s.reserve(bytes + 64);
  int in_sentence = 0;
  while (s.size() < bytes) {
    std::string w;
    if (std::uniform_real_distribution<double>(0, 1)(rng) < random_word_fraction) {
      const int n = 3 + static_cast<int>(rng() % 8);
      for (int i = 0; i < n; ++i) w.push_back(static_cast<char>('a' + rng() % 26));
    } else {
      w = kWords[rng() % nwords];
    }
    if (in_sentence == 0 && !w.empty() && w[0] >= 'a' && w[0] <= 'z') w[0] = static_cast<char>(w[0] - 32);
    if (in_sentence > 0) s.push_back(' ');
    s += w;
    ++in_sentence;
    const uint32_t r = rng() % 100;
    if (r < 6) s.push_back(',');
    if (in_sentence > 8 && r < 15) {
      s += (r % 7 == 0) ? "!" : ".";
      s += (rng() % 6 == 0) ? "\n\n" : " ";
      in_sentence = 0;
    }
  }
  s.resize(bytes);
  return s;
}

// A synthetic byte-level BPE tokenizer.json whose merges build the benchmark's words.
std::string synthetic_tokenizer_json() {
  nlohmann::json vocab = nlohmann::json::object(), merges = nlohmann::json::array();
  // GPT-2 bytes_to_unicode, written out here so the benchmark does not depend on internals.
  std::vector<std::string> byte_char(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const int cp = printable ? b : next++;
    std::string u;
    if (cp < 0x80) u.push_back(static_cast<char>(cp));
    else {
      u.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      u.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    byte_char[b] = u;
  }
  int64_t id = 0;
  for (int b = 0; b < 256; ++b) vocab[byte_char[b]] = id++;
  for (const char* word : kWords) {
    for (const std::string& text : {std::string(word), " " + std::string(word)}) {
      std::string acc = byte_char[static_cast<unsigned char>(text[0])];
      for (size_t i = 1; i < text.size(); ++i) {
        const std::string& c = byte_char[static_cast<unsigned char>(text[i])];
        if (!vocab.contains(acc + c)) {
          merges.push_back(acc + " " + c);
          vocab[acc + c] = id++;
        }
        acc += c;
      }
    }
  }
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", {{{"id", id}, {"content", "<|endoftext|>"}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  return j.dump();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Row {
  std::string name;
  double mb, seconds, mb_per_s, per_core, target;
  int64_t tokens;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t byte_mb = 64, bpe_mb = 16, jsonl_mb = 64, max_workers = 2;
    std::string dir = (std::filesystem::temp_directory_path() / "moecore_bench_preprocess").string();
    cli::FlagSet flags("bench_preprocess", "tokenizer and preprocess throughput");
    flags.add_int("byte-mb", &byte_mb, "MB of text for the byte tokenizer");
    flags.add_int("bpe-mb", &bpe_mb, "MB of text for the BPE tokenizer");
    flags.add_int("jsonl-mb", &jsonl_mb, "MB of JSONL for the preprocess pipeline (0: skip)");
    flags.add_int("workers", &max_workers, "largest --workers to measure");
    flags.add_string("dir", &dir, "scratch directory");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    std::vector<Row> rows;
    const auto report = [&](Row r) {
      nlohmann::json j = {{"bench", "preprocess"}, {"case", r.name},          {"mb", r.mb},
                          {"seconds", r.seconds},  {"mb_per_s", r.mb_per_s},  {"mb_per_s_per_core", r.per_core},
                          {"tokens", r.tokens},    {"target_mb_per_s_per_core", r.target}, {"cores", cores}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
      rows.push_back(r);
    };

    {  // byte tokenizer
      const std::string text = english_like(static_cast<size_t>(byte_mb) << 20, 1, 0.1);
      ByteTokenizer t;
      int64_t tokens = 0;
      const size_t chunk = 4096;  // document-sized calls
      const auto t0 = std::chrono::steady_clock::now();
      for (size_t off = 0; off < text.size(); off += chunk)
        tokens += static_cast<int64_t>(t.encode(std::string_view(text).substr(off, chunk)).size());
      const double s = seconds_since(t0), mb = text.size() / 1e6;
      report({"byte", mb, s, mb / s, mb / s, 20, tokens});
    }
    if (tokenizer_has_pcre2()) {  // BPE
      const auto tok = BpeTokenizer::from_json_text(synthetic_tokenizer_json(), "synthetic");
      const std::string text = english_like(static_cast<size_t>(bpe_mb) << 20, 2, 0.1);
      int64_t tokens = 0;
      const size_t chunk = 4096;
      (void)tok->encode(std::string_view(text).substr(0, 1 << 20));  // fills the cache with the common words
      const auto t0 = std::chrono::steady_clock::now();
      for (size_t off = 0; off < text.size(); off += chunk)
        tokens += static_cast<int64_t>(tok->encode(std::string_view(text).substr(off, chunk)).size());
      const double s = seconds_since(t0), mb = text.size() / 1e6;
      report({"bpe (" + std::to_string(tok->vocab_size()) + " tokens, " + std::to_string(mb / tokens * 1e6).substr(0, 4) +
                  " B/token)",
              mb, s, mb / s, mb / s, 2, tokens});
    } else {
      std::fprintf(stderr, "bench_preprocess: built without PCRE2: no BPE measurement\n");
    }
    if (jsonl_mb > 0) {  // the whole pipeline
      std::filesystem::create_directories(dir);
      const std::string input = dir + "/bench.jsonl";
      {
        std::ofstream f(input, std::ios::binary);
        std::mt19937 rng(5);
        size_t written = 0;
        uint32_t seed = 10;
        while (written < static_cast<size_t>(jsonl_mb) << 20) {
          const std::string line = nlohmann::json({{"text", english_like(500 + rng() % 4000, seed++, 0.1)}}).dump() + "\n";
          f << line;
          written += line.size();
        }
      }
      const double mb = std::filesystem::file_size(input) / 1e6;
      for (int64_t w = 1; w <= max_workers; w *= 2) {
        PreprocessOptions o;
        o.input = input;
        o.output_prefix = dir + "/out";
        o.tokenizer_type = "ByteTokenizer";
        o.append_eod = true;
        o.workers = w;
        o.progress_interval_s = 0;
        const auto t0 = std::chrono::steady_clock::now();
        const PreprocessResult r = preprocess(o, nullptr);
        const double s = seconds_since(t0);
        const double used = static_cast<double>(std::min<int64_t>(w, cores));
        report({"preprocess-byte-w" + std::to_string(w), mb, s, mb / s, mb / s / used, 20, r.tokens[0]});
      }
      std::filesystem::remove_all(dir);
    }
    std::printf("\nTokenizer throughput (%u hardware threads; MB = 1e6 bytes of input)\n", cores);
    std::printf("%-34s %9s %9s %10s %14s %8s\n", "case", "MB", "s", "MB/s", "MB/s per core", "target");
    for (const Row& r : rows)
      std::printf("%-34s %9.1f %9.2f %10.1f %14.1f %8.0f\n", r.name.c_str(), r.mb, r.seconds, r.mb_per_s, r.per_core,
                  r.target);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_preprocess: error: %s\n", e.what());
    return 1;
  }
}
