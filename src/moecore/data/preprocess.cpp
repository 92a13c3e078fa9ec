#include "moecore/data/preprocess.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "moecore/core/error.h"
#include "moecore/core/progress.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/jsonl.h"
#include "moecore/data/tokenizer.h"

namespace moecore {

namespace {

constexpr size_t kBatchBytes = size_t(1) << 20;
constexpr size_t kBatchLines = 2048;
constexpr int kBadLinesShown = 5;

// Lines read by the main thread, tokenised by a worker, written by the main thread in order.
struct Batch {
  std::vector<std::pair<int64_t, std::string>> lines;  // (line number, text)
  std::vector<std::vector<std::vector<int64_t>>> docs;  // [key][line in batch]; empty vector: no document
  std::vector<char> ok;                                  // per line: parsed
  std::vector<std::pair<int64_t, std::string>> bad;      // (line number, what was wrong)
  std::exception_ptr error;
  int64_t error_line = 0;
  bool done = false;
};

class WorkerPool {
 public:
  WorkerPool(int64_t n, const PreprocessOptions& opt, const Tokenizer& tok) : opt_(opt), tok_(tok) {
    eod_ = opt.append_eod ? tok.eod() : -1;
    for (int64_t i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(Batch* b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(b);
    }
    work_cv_.notify_one();
  }
  void wait(Batch* b) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return b->done; });
  }

 private:
  void loop() {
    for (;;) {
      Batch* b = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        b = queue_.front();
        queue_.pop_front();
      }
      process(*b);
      {
        std::lock_guard<std::mutex> lock(mu_);
        b->done = true;
      }
      done_cv_.notify_all();
    }
  }
  void process(Batch& b) const {
    const size_t nkeys = opt_.json_keys.size();
    b.docs.assign(nkeys, std::vector<std::vector<int64_t>>(b.lines.size()));
    b.ok.assign(b.lines.size(), 0);
    std::vector<std::string> values;
    for (size_t i = 0; i < b.lines.size(); ++i) {
      const std::string problem = parse_jsonl_fields(b.lines[i].second, opt_.json_keys, values);
      if (!problem.empty()) {
        b.bad.emplace_back(b.lines[i].first, problem);
        if (!opt_.skip_bad_lines) return;  // the writer stops at this line
        continue;
      }
      b.ok[i] = 1;
      try {
        for (size_t k = 0; k < nkeys; ++k) {
          std::vector<int64_t> ids = tok_.encode(values[k]);
          if (!ids.empty() && eod_ >= 0) ids.push_back(eod_);
          b.docs[k][i] = std::move(ids);
        }
      } catch (...) {
        b.error = std::current_exception();
        b.error_line = b.lines[i].first;
        return;
      }
    }
  }

  const PreprocessOptions& opt_;
  const Tokenizer& tok_;
  int64_t eod_ = -1;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Batch*> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

std::string fmt_rate(double x, const char* unit) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f %s", x, unit);
  return buf;
}

}  // namespace

PreprocessResult preprocess(const PreprocessOptions& opt, std::ostream* log) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  MC_CHECK(!opt.input.empty(), "preprocess needs --input (a JSON Lines file)");
  MC_CHECK(!opt.output_prefix.empty(), "preprocess needs --output-prefix");
  MC_CHECK(!opt.tokenizer_type.empty(), "preprocess needs --tokenizer-type (", kTokenizerTypes, ")");
  MC_CHECK(!opt.json_keys.empty(), "preprocess needs at least one --json-keys key");
  MC_CHECK(opt.workers >= 1 && opt.workers <= 1024, "--workers must be in [1, 1024], got ", opt.workers);
  for (size_t i = 0; i < opt.json_keys.size(); ++i)
    for (size_t k = 0; k < i; ++k)
      MC_CHECK(opt.json_keys[i] != opt.json_keys[k], "--json-keys names '", opt.json_keys[i], "' twice");

  const std::unique_ptr<Tokenizer> tok = make_tokenizer(opt.tokenizer_type, opt.tokenizer_model);
  if (opt.append_eod) (void)tok->eod();  // fails now, not after reading half the input
  const TokenDType dtype = token_dtype_for_vocab(tok->vocab_size());
  JsonlLineReader reader(opt.input);

  PreprocessResult res;
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  for (const std::string& key : opt.json_keys) {
    res.output_prefixes.push_back(opt.output_prefix + "_" + key + "_document");
    writers.push_back(std::make_unique<IndexedDatasetWriter>(res.output_prefixes.back(), dtype));
  }
  res.tokens.assign(opt.json_keys.size(), 0);
  std::vector<std::pair<int64_t, std::string>> bad_shown;

  auto last_log = t0;
  const auto progress = [&](bool final) {
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    const double mb = static_cast<double>(reader.bytes_read()) / 1e6;
    std::ostringstream os;
    os << "preprocess: " << (final ? "done: " : "") << res.documents << " documents ("
       << fmt_rate(res.documents / std::max(s, 1e-9), "docs/s") << "), " << fmt_rate(mb, "MB") << " ("
       << fmt_rate(mb / std::max(s, 1e-9), "MB/s") << ")";
    if (!final && reader.total_bytes() > 0) {
      // The time left at the rate so far (core/progress.h's estimate).
      const double done = static_cast<double>(reader.bytes_read()), total = static_cast<double>(reader.total_bytes());
      os << ", " << fmt_rate(100.0 * done / total, "%") << ", ETA "
         << (done > 0 ? format_duration(s * (total - done) / done) : std::string("?"));
    }
    if (final) os << " in " << fmt_rate(s, "s");
    *log << os.str() << std::endl;
  };

  {
    WorkerPool pool(opt.workers, opt, *tok);
    std::deque<std::unique_ptr<Batch>> inflight;
    const size_t max_inflight = static_cast<size_t>(opt.workers) * 3;
    bool input_done = false;
    std::string line;
    int64_t line_no = 0;
    for (;;) {
      while (!input_done && inflight.size() < max_inflight) {
        auto b = std::make_unique<Batch>();
        size_t bytes = 0;
        while (b->lines.size() < kBatchLines && bytes < kBatchBytes) {
          if (!reader.next(line, line_no)) {
            input_done = true;
            break;
          }
          bytes += line.size();
          b->lines.emplace_back(line_no, std::move(line));
        }
        if (b->lines.empty()) break;
        pool.submit(b.get());
        inflight.push_back(std::move(b));
      }
      if (inflight.empty()) break;
      Batch& b = *inflight.front();
      pool.wait(&b);
      if (!b.bad.empty() && !opt.skip_bad_lines) {
        MC_FAIL(opt.input, ":", b.bad.front().first, ": ", b.bad.front().second,
                " (--skip-bad-lines skips such lines; nothing was written)");
      }
      if (b.error) {
        try {
          std::rethrow_exception(b.error);
        } catch (const std::exception& e) {
          MC_FAIL(opt.input, ":", b.error_line, ": ", e.what(), " (nothing was written)");
        }
      }
      for (const auto& bl : b.bad) {
        if (bad_shown.size() < kBadLinesShown) bad_shown.push_back(bl);
        ++res.bad_lines;
      }
      for (size_t i = 0; i < b.lines.size(); ++i) {
        if (!b.ok[i]) continue;
        bool empty = true;
        for (size_t k = 0; k < writers.size(); ++k) {
          if (b.docs[k][i].empty()) continue;  // an empty text: no sequence, as Megatron
          empty = false;
          writers[k]->add_document(b.docs[k][i]);
          res.tokens[k] += static_cast<int64_t>(b.docs[k][i].size());
        }
        if (empty) ++res.empty_documents;
        else ++res.documents;
      }
      inflight.pop_front();
      if (log && opt.progress_interval_s > 0 &&
          std::chrono::duration<double>(clock::now() - last_log).count() >= opt.progress_interval_s) {
        last_log = clock::now();
        progress(false);
      }
    }
  }
  for (auto& w : writers) w->finalize();
  res.input_bytes = reader.bytes_read();
  res.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  if (log) {
    progress(true);
    for (size_t k = 0; k < writers.size(); ++k)
      *log << "preprocess: wrote " << res.output_prefixes[k] << ".{bin,idx}: " << writers[k]->num_documents()
           << " documents, " << res.tokens[k] << " tokens (" << token_dtype_name(dtype) << ", "
           << tok->name() << ", vocab " << tok->vocab_size() << ")" << std::endl;
    if (res.empty_documents > 0)
      *log << "preprocess: " << res.empty_documents << " lines with empty text gave no document" << std::endl;
    if (res.bad_lines > 0) {
      *log << "preprocess: skipped " << res.bad_lines << " bad line" << (res.bad_lines == 1 ? "" : "s") << ":";
      for (const auto& [n, why] : bad_shown) *log << "\n  line " << n << ": " << why;
      if (res.bad_lines > static_cast<int64_t>(bad_shown.size())) *log << "\n  ...";
      *log << std::endl;
    }
  }
  return res;
}

}  // namespace moecore
