// Command-line flags for moecore's subcommands, Megatron-LM style: "--name value" or
// "--name=value"; booleans are "--name" alone. Every problem (unknown flag, missing or bad
// value, stray argument) raises UsageError with one message naming the flag, and a
// suggestion when a known flag is close.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
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

  // Parses args (without the program and subcommand names). Positional arguments are refused
  // unless allow_positional. Returns the positional arguments.
  std::vector<std::string> parse(const std::vector<std::string>& args, bool allow_positional = false);
  // Sets one flag from another source (a YAML config): `origin` names it in errors. Booleans take
  // true/false. Names may use '_' for '-' (Megatron YAML style).
  void set(const std::string& name, const std::string& value, const std::string& origin);
  // Loads a YAML mapping of flag names to values (lists become "[a, b]").
  void load_yaml(const std::string& path);
  // Flags given on the command line or in a config, by name.
  bool given(const std::string& name) const;
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
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void fail_unknown(const std::string& name, const std::string& where) const;

  std::string command_, summary_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
  std::vector<std::string> given_;
};

// The known word closest to `word` (edit distance <= max(2, |word|/3)), or "" if none.
std::string closest(const std::string& word, const std::vector<std::string>& known);

}  // namespace moecore::cli
