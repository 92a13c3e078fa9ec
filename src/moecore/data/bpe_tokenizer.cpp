#include "moecore/data/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

#if MOECORE_WITH_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

namespace moecore {

const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

bool tokenizer_has_pcre2() { return MOECORE_WITH_PCRE2 != 0; }

namespace {

using json = nlohmann::json;

// ---- UTF-8 helpers ---------------------------------------------------------------------
void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes one code point at s[i]; returns its length in bytes, or 0 for an invalid sequence.
size_t decode_utf8(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return *cp = c, 1;
  size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
  if (n == 0 || c > 0xF4 || i + n > s.size()) return 0;
  uint32_t v = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(i + k) & 0x3F);
  }
  static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > 0x10FFFF || (v >= 0xD800 && v < 0xE000)) return 0;
  return *cp = v, n;
}

// ---- NFC check -------------------------------------------------------------------------
// Code points that NFC may change or that may change their neighbours: not NFC_QC=Yes, or
// canonical combining class != 0, or the second element of a canonical composition (Hangul
// V/T jamo included). Generated with Python's unicodedata (Unicode 14.0); everything else is
// NFC-inert, so text made only of it is already in NFC.
constexpr uint32_t kNfcUnsafe[][2] = {
    {0x300, 0x34E}, {0x350, 0x36F}, {0x374, 0x374}, {0x37E, 0x37E}, {0x387, 0x387}, {0x483, 0x487},
    {0x591, 0x5BD}, {0x5BF, 0x5BF}, {0x5C1, 0x5C2}, {0x5C4, 0x5C5}, {0x5C7, 0x5C7}, {0x610, 0x61A},
    {0x64B, 0x65F}, {0x670, 0x670}, {0x6D6, 0x6DC}, {0x6DF, 0x6E4}, {0x6E7, 0x6E8}, {0x6EA, 0x6ED},
    {0x711, 0x711}, {0x730, 0x74A}, {0x7EB, 0x7F3}, {0x7FD, 0x7FD}, {0x816, 0x819}, {0x81B, 0x823},
    {0x825, 0x827}, {0x829, 0x82D}, {0x859, 0x85B}, {0x898, 0x89F}, {0x8CA, 0x8E1}, {0x8E3, 0x8FF},
    {0x93C, 0x93C}, {0x94D, 0x94D}, {0x951, 0x954}, {0x958, 0x95F}, {0x9BC, 0x9BC}, {0x9BE, 0x9BE},
    {0x9CD, 0x9CD}, {0x9D7, 0x9D7}, {0x9DC, 0x9DD}, {0x9DF, 0x9DF}, {0x9FE, 0x9FE}, {0xA33, 0xA33},
    {0xA36, 0xA36}, {0xA3C, 0xA3C}, {0xA4D, 0xA4D}, {0xA59, 0xA5B}, {0xA5E, 0xA5E}, {0xABC, 0xABC},
    {0xACD, 0xACD}, {0xB3C, 0xB3C}, {0xB3E, 0xB3E}, {0xB4D, 0xB4D}, {0xB56, 0xB57}, {0xB5C, 0xB5D},
    {0xBBE, 0xBBE}, {0xBCD, 0xBCD}, {0xBD7, 0xBD7}, {0xC3C, 0xC3C}, {0xC4D, 0xC4D}, {0xC55, 0xC56},
    {0xCBC, 0xCBC}, {0xCC2, 0xCC2}, {0xCCD, 0xCCD}, {0xCD5, 0xCD6}, {0xD3B, 0xD3C}, {0xD3E, 0xD3E},
    {0xD4D, 0xD4D}, {0xD57, 0xD57}, {0xDCA, 0xDCA}, {0xDCF, 0xDCF}, {0xDDF, 0xDDF}, {0xE38, 0xE3A},
    {0xE48, 0xE4B}, {0xEB8, 0xEBA}, {0xEC8, 0xECB}, {0xF18, 0xF19}, {0xF35, 0xF35}, {0xF37, 0xF37},
    {0xF39, 0xF39}, {0xF43, 0xF43}, {0xF4D, 0xF4D}, {0xF52, 0xF52}, {0xF57, 0xF57}, {0xF5C, 0xF5C},
    {0xF69, 0xF69}, {0xF71, 0xF76}, {0xF78, 0xF78}, {0xF7A, 0xF7D}, {0xF80, 0xF84}, {0xF86, 0xF87},
    {0xF93, 0xF93}, {0xF9D, 0xF9D}, {0xFA2, 0xFA2}, {0xFA7, 0xFA7}, {0xFAC, 0xFAC}, {0xFB5, 0xFB5},
    {0xFB7, 0xFB7}, {0xFB9, 0xFB9}, {0xFC6, 0xFC6}, {0x102E, 0x102E}, {0x1037, 0x1037}, {0x1039, 0x103A},
    {0x108D, 0x108D}, {0x1161, 0x1175}, {0x11A8, 0x11C2}, {0x135D, 0x135F}, {0x1714, 0x1715}, {0x1734, 0x1734},
    {0x17D2, 0x17D2}, {0x17DD, 0x17DD}, {0x18A9, 0x18A9}, {0x1939, 0x193B}, {0x1A17, 0x1A18}, {0x1A60, 0x1A60},
    {0x1A75, 0x1A7C}, {0x1A7F, 0x1A7F}, {0x1AB0, 0x1ABD}, {0x1ABF, 0x1ACE}, {0x1B34, 0x1B35}, {0x1B44, 0x1B44},
    {0x1B6B, 0x1B73}, {0x1BAA, 0x1BAB}, {0x1BE6, 0x1BE6}, {0x1BF2, 0x1BF3}, {0x1C37, 0x1C37}, {0x1CD0, 0x1CD2},
    {0x1CD4, 0x1CE0}, {0x1CE2, 0x1CE8}, {0x1CED, 0x1CED}, {0x1CF4, 0x1CF4}, {0x1CF8, 0x1CF9}, {0x1DC0, 0x1DFF},
    {0x1F71, 0x1F71}, {0x1F73, 0x1F73}, {0x1F75, 0x1F75}, {0x1F77, 0x1F77}, {0x1F79, 0x1F79}, {0x1F7B, 0x1F7B},
    {0x1F7D, 0x1F7D}, {0x1FBB, 0x1FBB}, {0x1FBE, 0x1FBE}, {0x1FC9, 0x1FC9}, {0x1FCB, 0x1FCB}, {0x1FD3, 0x1FD3},
    {0x1FDB, 0x1FDB}, {0x1FE3, 0x1FE3}, {0x1FEB, 0x1FEB}, {0x1FEE, 0x1FEF}, {0x1FF9, 0x1FF9}, {0x1FFB, 0x1FFB},
    {0x1FFD, 0x1FFD}, {0x2000, 0x2001}, {0x20D0, 0x20DC}, {0x20E1, 0x20E1}, {0x20E5, 0x20F0}, {0x2126, 0x2126},
    {0x212A, 0x212B}, {0x2329, 0x232A}, {0x2ADC, 0x2ADC}, {0x2CEF, 0x2CF1}, {0x2D7F, 0x2D7F}, {0x2DE0, 0x2DFF},
    {0x302A, 0x302F}, {0x3099, 0x309A}, {0xA66F, 0xA66F}, {0xA674, 0xA67D}, {0xA69E, 0xA69F}, {0xA6F0, 0xA6F1},
    {0xA806, 0xA806}, {0xA82C, 0xA82C}, {0xA8C4, 0xA8C4}, {0xA8E0, 0xA8F1}, {0xA92B, 0xA92D}, {0xA953, 0xA953},
    {0xA9B3, 0xA9B3}, {0xA9C0, 0xA9C0}, {0xAAB0, 0xAAB0}, {0xAAB2, 0xAAB4}, {0xAAB7, 0xAAB8}, {0xAABE, 0xAABF},
    {0xAAC1, 0xAAC1}, {0xAAF6, 0xAAF6}, {0xABED, 0xABED}, {0xF900, 0xFA0D}, {0xFA10, 0xFA10}, {0xFA12, 0xFA12},
    {0xFA15, 0xFA1E}, {0xFA20, 0xFA20}, {0xFA22, 0xFA22}, {0xFA25, 0xFA26}, {0xFA2A, 0xFA6D}, {0xFA70, 0xFAD9},
    {0xFB1D, 0xFB1F}, {0xFB2A, 0xFB36}, {0xFB38, 0xFB3C}, {0xFB3E, 0xFB3E}, {0xFB40, 0xFB41}, {0xFB43, 0xFB44},
    {0xFB46, 0xFB4E}, {0xFE20, 0xFE2F}, {0x101FD, 0x101FD}, {0x102E0, 0x102E0}, {0x10376, 0x1037A}, {0x10A0D, 0x10A0D},
    {0x10A0F, 0x10A0F}, {0x10A38, 0x10A3A}, {0x10A3F, 0x10A3F}, {0x10AE5, 0x10AE6}, {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC},
    {0x10F46, 0x10F50}, {0x10F82, 0x10F85}, {0x11046, 0x11046}, {0x11070, 0x11070}, {0x1107F, 0x1107F}, {0x110B9, 0x110BA},
    {0x11100, 0x11102}, {0x11127, 0x11127}, {0x11133, 0x11134}, {0x11173, 0x11173}, {0x111C0, 0x111C0}, {0x111CA, 0x111CA},
    {0x11235, 0x11236}, {0x112E9, 0x112EA}, {0x1133B, 0x1133C}, {0x1133E, 0x1133E}, {0x1134D, 0x1134D}, {0x11357, 0x11357},
    {0x11366, 0x1136C}, {0x11370, 0x11374}, {0x11442, 0x11442}, {0x11446, 0x11446}, {0x1145E, 0x1145E}, {0x114B0, 0x114B0},
    {0x114BA, 0x114BA}, {0x114BD, 0x114BD}, {0x114C2, 0x114C3}, {0x115AF, 0x115AF}, {0x115BF, 0x115C0}, {0x1163F, 0x1163F},
    {0x116B6, 0x116B7}, {0x1172B, 0x1172B}, {0x11839, 0x1183A}, {0x11930, 0x11930}, {0x1193D, 0x1193E}, {0x11943, 0x11943},
    {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99}, {0x11C3F, 0x11C3F}, {0x11D42, 0x11D42},
    {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x16AF0, 0x16AF4}, {0x16B30, 0x16B36}, {0x16FF0, 0x16FF1}, {0x1BC9E, 0x1BC9E},
    {0x1D15E, 0x1D169}, {0x1D16D, 0x1D172}, {0x1D17B, 0x1D182}, {0x1D185, 0x1D18B}, {0x1D1AA, 0x1D1AD}, {0x1D1BB, 0x1D1C0},
    {0x1D242, 0x1D244}, {0x1E000, 0x1E006}, {0x1E008, 0x1E018}, {0x1E01B, 0x1E021}, {0x1E023, 0x1E024}, {0x1E026, 0x1E02A},
    {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E8D0, 0x1E8D6}, {0x1E944, 0x1E94A}, {0x2F800, 0x2FA1D},
};

bool nfc_inert(uint32_t cp) {
  if (cp < 0x300) return true;
  const auto* end = std::end(kNfcUnsafe);
  const auto* it = std::upper_bound(std::begin(kNfcUnsafe), end, cp,
                                    [](uint32_t v, const uint32_t(&r)[2]) { return v < r[0]; });
  if (it == std::begin(kNfcUnsafe)) return true;
  --it;
  return cp > (*it)[1];
}

void check_nfc_inert(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t n = decode_utf8(text, i, &cp);
    if (n == 0) {  // invalid UTF-8: NFC is undefined; HF (Rust strings) never sees it either
      MC_FAIL("HuggingFaceTokenizer: the text has invalid UTF-8 at byte ", i,
              " and the tokenizer's normalizer is NFC, which needs valid UTF-8");
    }
    if (!nfc_inert(cp)) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "U+%04X", cp);
      MC_FAIL("HuggingFaceTokenizer: the tokenizer's normalizer is NFC and the text contains ", hex,
              " (byte ", i, "), which NFC may change; moecore checks NFC but does not implement it "
              "for combining or decomposable characters yet, so it refuses rather than mis-encode");
    }
    i += n;
  }
}

// ---- GPT-2 bytes_to_unicode ------------------------------------------------------------
std::array<uint32_t, 256> bytes_to_unicode() {
  std::array<uint32_t, 256> map{};
  std::array<bool, 256> printable{};
  for (int b = 33; b <= 126; ++b) printable[b] = true;
  for (int b = 161; b <= 172; ++b) printable[b] = true;
  for (int b = 174; b <= 255; ++b) printable[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = printable[b] ? static_cast<uint32_t>(b) : next++;
  return map;
}

// ---- regex -------------------------------------------------------------------------------
class Regex {
 public:
  explicit Regex(const std::string& pattern) : pattern_(pattern) {
#if MOECORE_WITH_PCRE2
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      MC_FAIL("pre-tokenizer regex does not compile at offset ", offset, ": ", reinterpret_cast<char*>(msg),
              " (pattern: ", pattern, ")");
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
#else
    MC_FAIL("HuggingFaceTokenizer needs PCRE2 for its pre-tokenizer regex, and moecore was built without it; "
            "install libpcre2-dev (and pkg-config; scripts/install-deps.sh) and re-run cmake (pattern: ",
            pattern, ")");
#endif
  }
  ~Regex() {
#if MOECORE_WITH_PCRE2
    if (code_) pcre2_code_free(code_);
#endif
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends to `out` the pieces of `text`: matches and (unless drop_matches... ) gaps.
  // removed_matches: HF's "Removed" behaviour (only the gaps are kept).
  void split(std::string_view text, std::vector<std::string_view>& out, bool removed_matches) const {
#if MOECORE_WITH_PCRE2
    struct ThreadState {
      pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
      pcre2_match_context* mc = pcre2_match_context_create(nullptr);
      pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
      ThreadState() { pcre2_jit_stack_assign(mc, nullptr, stack); }
      ~ThreadState() {
        pcre2_match_data_free(md);
        pcre2_match_context_free(mc);
        pcre2_jit_stack_free(stack);
      }
    };
    thread_local ThreadState st;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t pos = 0, gap_start = 0;
    while (pos <= text.size()) {
      const int rc = pcre2_match(code_, subject, text.size(), pos, 0, st.md, st.mc);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        MC_FAIL("pre-tokenizer regex failed on a text of ", text.size(), " bytes: ", reinterpret_cast<char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: keep it out and move on by one byte
        pos = b + 1;
        continue;
      }
      if (b > gap_start) out.push_back(text.substr(gap_start, b - gap_start));
      if (!removed_matches) out.push_back(text.substr(b, e - b));
      gap_start = pos = e;
    }
    if (gap_start < text.size()) out.push_back(text.substr(gap_start));
#else
    (void)text, (void)out, (void)removed_matches;
#endif
  }

 private:
  std::string pattern_;
#if MOECORE_WITH_PCRE2
  pcre2_code* code_ = nullptr;
#endif
};

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}-/").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// One step of the pre-tokenizer.
struct PreStep {
  std::unique_ptr<Regex> regex;  // null: no splitting
  bool removed = false;          // behaviour Removed (else Isolated)
  bool add_prefix_space = false;
};

struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool lstrip = false, rstrip = false, single_word = false;
};

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_word_byte(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u >= 0x80 || std::isalnum(u) || c == '_';
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MC_CHECK(f.good(), "HuggingFaceTokenizer: cannot open '", path, "'");
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

}  // namespace

// ---- the tokenizer ----------------------------------------------------------------------
struct BpeTokenizer::Impl {
  std::string origin;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> id_to_token;  // "" where no token
  std::vector<char> is_added;
  std::vector<AddedToken> added;
  std::array<std::vector<int>, 256> added_by_first_byte;  // indices into added, longest first
  std::array<std::string, 256> byte_char;                 // byte -> its byte-level character (UTF-8)
  std::array<int64_t, 256> byte_id{};                     // byte -> id of that character (-1: none)
  std::unordered_map<uint32_t, unsigned char> char_byte;  // byte-level character -> byte
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged)
  bool ignore_merges = false;
  int64_t unk_id = -1;
  bool nfc = false;
  std::vector<PreStep> steps;
  std::vector<int64_t> prefix_ids, suffix_ids;  // post_processor template
  int64_t eod_id = -1;
  int64_t vocab_size = 0;

  // Per-pre-token cache, sharded to keep threads apart.
  static constexpr int kShards = 64;
  static constexpr size_t kShardCapacity = 16384;
  static constexpr size_t kMaxCachedBytes = 64;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>> map;
  };
  mutable std::array<Shard, kShards> cache;

  void load(const json& j);
  void load_normalizer(const json& n);
  void load_pre_tokenizer(const json& p);
  void load_post_processor(const json& p);
  void split_added(std::string_view text, const std::function<void(std::string_view)>& on_text,
                   const std::function<void(int64_t, std::string_view)>& on_added) const;
  void pre_tokenize(std::string_view segment, const std::function<void(std::string_view)>& on_piece) const;
  void bpe(std::string_view piece, std::vector<int64_t>& out) const;
  void bpe_uncached(std::string_view piece, std::vector<int32_t>& out) const;
};

void BpeTokenizer::Impl::load_normalizer(const json& n) {
  if (n.is_null()) return;
  const std::string type = n.value("type", "");
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    for (const auto& sub : n.at("normalizers")) load_normalizer(sub);
  } else {
    MC_FAIL(origin, ": normalizer '", type, "' is not supported (moecore supports none, NFC, or a Sequence of them)");
  }
}

void BpeTokenizer::Impl::load_pre_tokenizer(const json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const auto& sub : p.at("pretokenizers")) load_pre_tokenizer(sub);
  } else if (type == "ByteLevel") {
    PreStep step;
    step.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) step.regex = std::make_unique<Regex>(kGpt2Pattern);
    if (step.regex || step.add_prefix_space) steps.push_back(std::move(step));
  } else if (type == "Split") {
    const json& pat = p.at("pattern");
    std::string regex;
    if (pat.contains("Regex")) regex = pat.at("Regex").get<std::string>();
    else if (pat.contains("String")) regex = regex_escape(pat.at("String").get<std::string>());
    else MC_FAIL(origin, ": Split pre-tokenizer pattern must be {\"Regex\": ...} or {\"String\": ...}");
    const std::string behavior = p.value("behavior", "Isolated");
    MC_CHECK(behavior == "Isolated" || behavior == "Removed", origin, ": Split behavior '", behavior,
             "' is not supported (moecore supports Isolated and Removed)");
    MC_CHECK(!p.value("invert", false), origin, ": Split with invert=true is not supported");
    PreStep step;
    step.regex = std::make_unique<Regex>(regex);
    step.removed = behavior == "Removed";
    steps.push_back(std::move(step));
  } else if (type == "Digits") {
    PreStep step;
    step.regex = std::make_unique<Regex>(p.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+");
    steps.push_back(std::move(step));
  } else {
    MC_FAIL(origin, ": pre_tokenizer '", type,
            "' is not supported (moecore supports ByteLevel, Split, Digits and Sequence: byte-level BPE)");
  }
}

void BpeTokenizer::Impl::load_post_processor(const json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const auto& sub : p.at("processors")) load_post_processor(sub);
    return;
  }
  MC_CHECK(type == "TemplateProcessing", origin, ": post_processor '", type,
           "' is not supported (moecore supports ByteLevel, TemplateProcessing and Sequence)");
  bool after = false;
  for (const auto& item : p.at("single")) {
    if (item.contains("Sequence")) {
      after = true;
      continue;
    }
    const std::string name = item.at("SpecialToken").at("id").get<std::string>();
    const json& spec = p.at("special_tokens").at(name);
    for (const auto& id : spec.at("ids")) (after ? suffix_ids : prefix_ids).push_back(id.get<int64_t>());
  }
}

void BpeTokenizer::Impl::load(const json& j) {
  MC_CHECK(j.is_object() && j.contains("model"), origin, ": not a tokenizer.json (no \"model\" section)");
  const json& model = j.at("model");
  const std::string type = model.value("type", "BPE");
  MC_CHECK(type == "BPE", origin, ": model type '", type, "' is not supported (moecore reads byte-level BPE)");
  MC_CHECK(model.contains("vocab") && model.at("vocab").is_object(), origin, ": model.vocab must be an object {token: id}");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    MC_CHECK(!model.contains(key) || model.at(key).is_null() || model.at(key) == "", origin, ": model.", key,
             " is not supported (not used by byte-level BPE)");
  }
  ignore_merges = model.value("ignore_merges", false);
  for (const auto& [token, id] : model.at("vocab").items()) {
    const int64_t v = id.get<int64_t>();
    MC_CHECK(v >= 0, origin, ": vocab id of '", token, "' is negative");
    vocab[token] = v;
    vocab_size = std::max(vocab_size, v + 1);
  }
  if (j.contains("added_tokens") && j.at("added_tokens").is_array()) {
    for (const auto& t : j.at("added_tokens")) {
      AddedToken a;
      a.content = t.at("content").get<std::string>();
      a.id = t.at("id").get<int64_t>();
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.single_word = t.value("single_word", false);
      MC_CHECK(!a.content.empty() && a.id >= 0, origin, ": added token with empty content or negative id");
      vocab_size = std::max(vocab_size, a.id + 1);
      added.push_back(a);
    }
  }
  id_to_token.assign(vocab_size, std::string());
  is_added.assign(vocab_size, 0);
  for (const auto& [token, id] : vocab) id_to_token[id] = token;
  for (size_t i = 0; i < added.size(); ++i) {
    id_to_token[added[i].id] = added[i].content;
    is_added[added[i].id] = 1;
    added_by_first_byte[static_cast<unsigned char>(added[i].content[0])].push_back(static_cast<int>(i));
  }
  for (auto& list : added_by_first_byte)
    std::stable_sort(list.begin(), list.end(),
                     [&](int a, int b) { return added[a].content.size() > added[b].content.size(); });

  const auto map = bytes_to_unicode();
  for (int b = 0; b < 256; ++b) {
    byte_char[b].clear();
    append_utf8(byte_char[b], map[b]);
    char_byte[map[b]] = static_cast<unsigned char>(b);
    const auto it = vocab.find(byte_char[b]);
    byte_id[b] = it == vocab.end() ? -1 : it->second;
  }
  if (model.contains("unk_token") && model.at("unk_token").is_string()) {
    const auto it = vocab.find(model.at("unk_token").get<std::string>());
    if (it != vocab.end()) unk_id = it->second;
  }

  const json& ms = model.contains("merges") ? model.at("merges") : json::array();
  for (size_t rank = 0; rank < ms.size(); ++rank) {
    const json& m = ms[rank];
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      MC_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size(), origin, ": merge ", rank, " '", s,
               "' is not \"a b\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      MC_CHECK(m.is_array() && m.size() == 2, origin, ": merge ", rank, " is neither \"a b\" nor [a, b]");
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    MC_CHECK(ia != vocab.end() && ib != vocab.end() && iab != vocab.end(), origin, ": merge ", rank, " (", a, " ", b,
             "): '", (ia == vocab.end() ? a : ib == vocab.end() ? b : a + b), "' is not in the vocab");
    const uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint64_t>(ib->second);
    merges.emplace(key, std::make_pair(static_cast<int32_t>(rank), static_cast<int32_t>(iab->second)));  // first wins
  }

  load_normalizer(j.contains("normalizer") ? j.at("normalizer") : json());
  load_pre_tokenizer(j.contains("pre_tokenizer") ? j.at("pre_tokenizer") : json());
  load_post_processor(j.contains("post_processor") ? j.at("post_processor") : json());
  // Byte-level BPE only: its characters are GPT-2's byte mapping.
  const auto has_bytelevel = [](const json& s, const char* list, auto&& self) -> bool {
    if (!s.is_object()) return false;
    if (s.value("type", "") == "ByteLevel") return true;
    if (s.contains(list))
      for (const auto& sub : s.at(list))
        if (self(sub, list, self)) return true;
    return false;
  };
  MC_CHECK(has_bytelevel(j.value("pre_tokenizer", json()), "pretokenizers", has_bytelevel) ||
               has_bytelevel(j.value("decoder", json()), "decoders", has_bytelevel),
           origin, ": neither the pre_tokenizer nor the decoder is ByteLevel; moecore's HuggingFaceTokenizer reads "
                   "byte-level BPE only (use SentencePieceTokenizer for SentencePiece-style models)");

  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    const auto it = vocab.find(name);
    if (it != vocab.end()) {
      eod_id = it->second;
      break;
    }
    const auto at = std::find_if(added.begin(), added.end(), [&](const AddedToken& t) { return t.content == name; });
    if (at != added.end()) {
      eod_id = at->id;
      break;
    }
  }
}

void BpeTokenizer::Impl::split_added(std::string_view text, const std::function<void(std::string_view)>& on_text,
                                     const std::function<void(int64_t, std::string_view)>& on_added) const {
  if (added.empty()) {
    if (!text.empty()) on_text(text);
    return;
  }
  size_t start = 0;  // start of the pending text segment
  for (size_t i = 0; i < text.size(); ++i) {
    const auto& cands = added_by_first_byte[static_cast<unsigned char>(text[i])];
    for (int k : cands) {
      const AddedToken& t = added[k];
      if (text.compare(i, t.content.size(), t.content) != 0) continue;
      size_t b = i, e = i + t.content.size();
      if (t.single_word && ((b > 0 && is_word_byte(text[b - 1])) || (e < text.size() && is_word_byte(text[e]))))
        continue;
      if (t.lstrip)
        while (b > start && is_ascii_space(text[b - 1])) --b;
      if (t.rstrip)
        while (e < text.size() && is_ascii_space(text[e])) ++e;
      if (b > start) on_text(text.substr(start, b - start));
      on_added(t.id, text.substr(i, t.content.size()));
      start = e;
      i = e - 1;
      break;
    }
  }
  if (start < text.size()) on_text(text.substr(start));
}

void BpeTokenizer::Impl::pre_tokenize(std::string_view segment,
                                      const std::function<void(std::string_view)>& on_piece) const {
  std::vector<std::string_view> pieces{segment}, next;
  std::vector<std::unique_ptr<std::string>> storage;  // prefixed copies (stable addresses)
  for (const PreStep& step : steps) {
    next.clear();
    for (std::string_view p : pieces) {
      if (step.add_prefix_space && (p.empty() || p[0] != ' ')) {
        auto copy = std::make_unique<std::string>();
        copy->reserve(p.size() + 1);
        copy->push_back(' ');
        copy->append(p.data(), p.size());
        storage.push_back(std::move(copy));
        p = *storage.back();
      }
      if (step.regex) step.regex->split(p, next, step.removed);
      else next.push_back(p);
    }
    pieces.swap(next);
  }
  for (std::string_view p : pieces)
    if (!p.empty()) on_piece(p);
}

void BpeTokenizer::Impl::bpe_uncached(std::string_view piece, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    std::string mapped;
    for (char c : piece) mapped += byte_char[static_cast<unsigned char>(c)];
    const auto it = vocab.find(mapped);
    if (it != vocab.end()) {
      out.push_back(static_cast<int32_t>(it->second));
      return;
    }
  }
  struct Sym {
    int32_t id, prev, next;
  };
  const int n = static_cast<int>(piece.size());
  std::vector<Sym> syms(n);
  for (int i = 0; i < n; ++i) {
    const auto byte = static_cast<unsigned char>(piece[i]);
    int64_t id = byte_id[byte];
    if (id < 0) {
      MC_CHECK(unk_id >= 0, "HuggingFaceTokenizer (", origin, "): byte 0x", std::hex, int(byte), std::dec,
               " (character '", byte_char[byte], "') has no token in the vocab and there is no unk_token");
      id = unk_id;
    }
    syms[i] = {static_cast<int32_t>(id), i - 1, i + 1 < n ? i + 1 : -1};
  }
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  const auto push = [&](int i) {
    if (i < 0 || syms[i].next < 0) return;
    const int j = syms[i].next;
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(syms[i].id)) << 32) |
                         static_cast<uint32_t>(syms[j].id);
    const auto it = merges.find(key);
    if (it != merges.end()) heap.push({it->second.first, i, syms[i].id, syms[j].id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int i = c.pos, j = syms[i].next;
    if (syms[i].id != c.left || j < 0 || syms[j].id != c.right) continue;  // stale
    syms[i].id = merges.at((static_cast<uint64_t>(static_cast<uint32_t>(c.left)) << 32) |
                           static_cast<uint32_t>(c.right)).second;
    syms[j].id = -1;
    syms[i].next = syms[j].next;
    if (syms[i].next >= 0) syms[syms[i].next].prev = i;
    push(syms[i].prev);
    push(i);
  }
  for (int i = 0; i >= 0 && i < n; i = syms[i].next) out.push_back(syms[i].id);
}

void BpeTokenizer::Impl::bpe(std::string_view piece, std::vector<int64_t>& out) const {
  if (piece.size() > kMaxCachedBytes) {
    std::vector<int32_t> ids;
    bpe_uncached(piece, ids);
    out.insert(out.end(), ids.begin(), ids.end());
    return;
  }
  Shard& shard = cache[std::hash<std::string_view>()(piece) % kShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    const auto it = shard.map.find(std::string(piece));
    if (it != shard.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  bpe_uncached(piece, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() >= kShardCapacity) shard.map.clear();
  shard.map.emplace(std::string(piece), std::move(ids));
}

// ---- public ---------------------------------------------------------------------------------
BpeTokenizer::BpeTokenizer() : impl_(std::make_unique<Impl>()) {}
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer::BpeTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  namespace fs = std::filesystem;
  std::string file = path;
  if (fs::is_directory(path)) file = (fs::path(path) / "tokenizer.json").string();
  MC_CHECK(fs::exists(file), "HuggingFaceTokenizer: '", file, "' does not exist (expected a tokenizer.json or a directory holding one)");
  impl_->origin = file;
  json j;
  try {
    j = json::parse(read_file(file));
  } catch (const json::exception& e) {
    MC_FAIL(file, ": not valid JSON: ", e.what());
  }
  try {
    impl_->load(j);
  } catch (const json::exception& e) {
    MC_FAIL(file, ": unexpected tokenizer.json structure: ", e.what());
  }
  // eos_token from tokenizer_config.json beside it, as transformers reads it.
  const fs::path config = fs::path(file).parent_path() / "tokenizer_config.json";
  if (fs::exists(config)) {
    try {
      const json c = json::parse(read_file(config.string()));
      std::string eos;
      if (c.contains("eos_token") && c["eos_token"].is_string()) eos = c["eos_token"].get<std::string>();
      if (c.contains("eos_token") && c["eos_token"].is_object()) eos = c["eos_token"].value("content", "");
      if (!eos.empty()) {
        const auto it = impl_->vocab.find(eos);
        if (it != impl_->vocab.end()) impl_->eod_id = it->second;
        for (const auto& t : impl_->added)
          if (t.content == eos) impl_->eod_id = t.id;
      }
    } catch (const json::exception& e) {
      MC_FAIL(config.string(), ": not valid JSON: ", e.what());
    }
  }
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_json_text(std::string_view text, const std::string& origin) {
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->impl_->origin = origin;
  try {
    t->impl_->load(json::parse(text));
  } catch (const json::exception& e) {
    MC_FAIL(origin, ": bad tokenizer.json: ", e.what());
  }
  return t;
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view text) const {
  const Impl& m = *impl_;
  if (m.nfc) check_nfc_inert(text);
  std::vector<int64_t> ids(m.prefix_ids);
  ids.reserve(text.size() / 3 + 8);
  m.split_added(
      text, [&](std::string_view seg) { m.pre_tokenize(seg, [&](std::string_view piece) { m.bpe(piece, ids); }); },
      [&](int64_t id, std::string_view) { ids.push_back(id); });
  ids.insert(ids.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return ids;
}

std::vector<std::string> BpeTokenizer::pretokenize(std::string_view text) const {
  std::vector<std::string> out;
  impl_->split_added(
      text,
      [&](std::string_view seg) { impl_->pre_tokenize(seg, [&](std::string_view p) { out.emplace_back(p); }); },
      [&](int64_t, std::string_view content) { out.emplace_back(content); });
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  const Impl& m = *impl_;
  std::string out;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int64_t id = ids[k];
    MC_CHECK(id >= 0 && id < m.vocab_size && !m.id_to_token[id].empty(), "HuggingFaceTokenizer::decode: id ", id,
             " at position ", k, " is not a token of ", m.origin);
    const std::string& tok = m.id_to_token[id];
    if (m.is_added[id]) {
      out += tok;
      continue;
    }
    for (size_t i = 0; i < tok.size();) {
      uint32_t cp = 0;
      const size_t n = decode_utf8(tok, i, &cp);
      if (n == 0) {  // not UTF-8: pass the byte through
        out.push_back(tok[i++]);
        continue;
      }
      const auto it = m.char_byte.find(cp);
      if (it != m.char_byte.end()) out.push_back(static_cast<char>(it->second));
      else out.append(tok, i, n);
      i += n;
    }
  }
  return out;
}

int64_t BpeTokenizer::vocab_size() const { return impl_->vocab_size; }

int64_t BpeTokenizer::eod() const {
  MC_CHECK(impl_->eod_id >= 0, "HuggingFaceTokenizer (", impl_->origin,
           "): no end-of-document token (no tokenizer_config.json eos_token beside it, and none of <|endoftext|>, "
           "<|end_of_text|>, </s>, <eos> in the vocab)");
  return impl_->eod_id;
}

int64_t BpeTokenizer::token_id(const std::string& token) const {
  const auto it = impl_->vocab.find(token);
  if (it != impl_->vocab.end()) return it->second;
  for (const auto& t : impl_->added)
    if (t.content == token) return t.id;
  return -1;
}

std::vector<std::string> regex_split(const std::string& pattern, std::string_view text) {
  Regex re(pattern);
  std::vector<std::string_view> views;
  re.split(text, views, false);
  return std::vector<std::string>(views.begin(), views.end());
}

}  // namespace moecore
