// Command-line flags for moecore's subcommands, Megatron-LM style: "--name value" or
// "--name=value"; booleans are "--name" alone. Every problem (unknown flag, missing or bad
// value, stray argument) raises UsageError with one message naming the flag, and a
// suggestion when a known flag is close. A word flag (add_enum, add_choice) parses its text once,
// when it is set: a word outside its list raises Error "--name 'x': expected a, b or c".
//
// Only apps/ (the subcommands) and bench/ use this parser: library code takes option structs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moecore/core/error.h"

namespace moecore::cli {

class UsageError : public Error {
 public:
  using Error::Error;
};

class FlagSet {
 public:
  FlagSet(std::string command, std::string summary);

  void add_bool(const std::string& name, bool* target, const std::string& help);
  void add_int(const std::string& name, int64_t* target, const std::string& help);
  void add_double(const std::string& name, double* target, const std::string& help);
  void add_string(const std::string& name, std::string* target, const std::string& help);
  // A list: "--name a b c" (values up to the next flag), "--name=a", or a YAML list.
  void add_list(const std::string& name, std::vector<std::string>* target, const std::string& help);
  // One word of `choices` (Megatron's spellings), mapped to a value of T. Several spellings may
  // map to one value (the first is the one error messages list). A word outside the list raises
  // Error "--name 'x': expected a, b or c" (+ hint(x) when given). values() reports the word
  // given, or the first spelling of the current value.
  template <class T>
  void add_enum(const std::string& name, T* target, const std::vector<std::pair<std::string, T>>& choices,
                const std::string& help, std::function<std::string(const std::string&)> hint = {});
  // The same for a flag whose value stays text (the word itself is what the program keeps). An
  // empty default means "not given": "" is then accepted too (values() reports it so).
  void add_choice(const std::string& name, std::string* target, const std::vector<std::string>& choices,
                  const std::string& help, std::function<std::string(const std::string&)> hint = {});

  // The default --help shows for a flag whose stored default is a "not given" mark (e.g. -1 for a
  // value that must be positive): the value the program then uses.
  void set_default_text(const std::string& name, const std::string& text);

  // Parses args (without the program and subcommand names). Positional arguments are refused
  // unless allow_positional. Returns the positional arguments.
  std::vector<std::string> parse(const std::vector<std::string>& args, bool allow_positional = false);
  // Sets one flag from another source (a YAML config): `origin` names it in errors. Booleans take
  // true/false. Names may use '_' for '-' (Megatron YAML style).
  void set(const std::string& name, const std::string& value, const std::string& origin);
  // Loads a YAML mapping of flag names to values (lists become "[a, b]"). A key given twice is
  // refused with its line; a `config:` key loads that file at its place (relative to this one),
  // and a missing one is refused.
  void load_yaml(const std::string& path);
  // Flags given on the command line or in a config, by name.
  bool given(const std::string& name) const;
  // Flags given on the command line (not from a config file), by name.
  bool given_on_command_line(const std::string& name) const;
  // Every flag's current value as text (booleans "true"/"false"), by name: what a checkpoint
  // records so that later commands rebuild the same model.
  std::vector<std::pair<std::string, std::string>> values() const;
  bool help_requested() const { return help_requested_; }
  std::string help() const;
  const std::string& command() const { return command_; }

 private:
  struct Flag {
    std::string name;  // without "--"
    std::string kind;  // "bool", "int", "float", "string"
    std::string help;
    std::string default_text;
    std::function<void(const std::string&)> set;
    std::function<std::string()> get;
  };
  const Flag* find(const std::string& name) const;
  void load_yaml(const std::string& path, int depth);
  // add_enum's untyped core: `index_of_target` says which choice the target holds (-1: none),
  // `set_index` stores choice i.
  void add_word(const std::string& name, const std::vector<std::string>& words, std::function<int()> index_of_target,
                std::function<void(size_t)> set_index, const std::vector<size_t>& first_of_value,
                const std::string& help, std::function<std::string(const std::string&)> hint);
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void fail_unknown(const std::string& name, const std::string& where) const;

  std::string command_, summary_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
  std::vector<std::string> given_;
  std::vector<std::string> command_line_;
};

template <class T>
void FlagSet::add_enum(const std::string& name, T* target, const std::vector<std::pair<std::string, T>>& choices,
                       const std::string& help, std::function<std::string(const std::string&)> hint) {
  std::vector<std::string> words;
  std::vector<size_t> first_of_value;  // per choice: the index of the first choice with its value
  for (size_t i = 0; i < choices.size(); ++i) {
    words.push_back(choices[i].first);
    size_t first = i;
    for (size_t j = 0; j < i; ++j)
      if (choices[j].second == choices[i].second) {
        first = j;
        break;
      }
    first_of_value.push_back(first);
  }
  add_word(
      name, words,
      [target, choices] {
        for (size_t i = 0; i < choices.size(); ++i)
          if (choices[i].second == *target) return static_cast<int>(i);
        return -1;
      },
      [target, choices](size_t i) { *target = choices[i].second; }, first_of_value, help, std::move(hint));
}

// The known word closest to `word` (edit distance <= max(2, |word|/3)), or "" if none.
std::string closest(const std::string& word, const std::vector<std::string>& known);

}  // namespace moecore::cli
