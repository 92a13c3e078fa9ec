#include "moecore/cli/flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <sstream>

#include <yaml-cpp/yaml.h>

namespace moecore::cli {

namespace {
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

std::string closest(const std::string& word, const std::vector<std::string>& known) {
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& k : known) {
    const size_t d = edit_distance(word, k);
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

FlagSet::FlagSet(std::string command, std::string summary) : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagSet::fail(const std::string& message) const {
  throw UsageError(command_ + ": " + message + " (see '" + command_ + " --help')", __FILE__, __LINE__);
}

void FlagSet::add_bool(const std::string& name, bool* target, const std::string& help) {
  flags_.push_back({name, "bool", help, *target ? "true" : "false",
                    [target](const std::string& v) { *target = v != "__false__"; },
                    [target] { return std::string(*target ? "true" : "false"); }});
}

void FlagSet::add_int(const std::string& name, int64_t* target, const std::string& help) {
  flags_.push_back({name, "int", help, std::to_string(*target), [this, name, target](const std::string& v) {
                      errno = 0;
                      char* end = nullptr;
                      const long long x = std::strtoll(v.c_str(), &end, 10);
                      if (v.empty() || *end != '\0' || errno == ERANGE)
                        fail("flag '--" + name + "' expects an integer, got '" + v + "'");
                      *target = x;
                    },
                    [target] { return std::to_string(*target); }});
}

void FlagSet::add_double(const std::string& name, double* target, const std::string& help) {
  std::ostringstream def;
  def << *target;
  flags_.push_back({name, "float", help, def.str(), [this, name, target](const std::string& v) {
                      char* end = nullptr;
                      const double x = std::strtod(v.c_str(), &end);
                      if (v.empty() || *end != '\0' || !std::isfinite(x))
                        fail("flag '--" + name + "' expects a finite number, got '" + v + "'");
                      *target = x;
                    },
                    [target] {
                      std::ostringstream os;
                      os.precision(17);
                      os << *target;
                      return os.str();
                    }});
}

void FlagSet::add_string(const std::string& name, std::string* target, const std::string& help) {
  flags_.push_back({name, "string", help, *target, [target](const std::string& v) { *target = v; },
                    [target] { return *target; }});
}

void FlagSet::fail_unknown(const std::string& name, const std::string& where) const {
  std::vector<std::string> names;
  for (const Flag& k : flags_) names.push_back(k.name);
  const std::string guess = closest(name, names);
  fail("unknown flag '--" + name + "'" + where + (guess.empty() ? "" : "; did you mean '--" + guess + "'?"));
}

std::vector<std::pair<std::string, std::string>> FlagSet::values() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Flag& f : flags_) out.emplace_back(f.name, f.get());
  return out;
}

bool FlagSet::given(const std::string& name) const {
  return std::find(given_.begin(), given_.end(), name) != given_.end();
}

bool FlagSet::given_on_command_line(const std::string& name) const {
  return std::find(command_line_.begin(), command_line_.end(), name) != command_line_.end();
}

void FlagSet::set(const std::string& raw_name, const std::string& value, const std::string& origin) {
  std::string name = raw_name;
  std::replace(name.begin(), name.end(), '_', '-');
  const Flag* f = find(name);
  if (!f) fail_unknown(name, " in " + origin);
  if (f->kind == "bool") {
    if (value == "true" || value == "1") {
      f->set("");
    } else if (value != "false" && value != "0") {
      fail("flag '--" + name + "' in " + origin + " expects true or false, got '" + value + "'");
    } else {
      f->set("__false__");
    }
  } else {
    f->set(value);
  }
  given_.push_back(name);
}

void FlagSet::load_yaml(const std::string& path) { load_yaml(path, 0); }

void FlagSet::load_yaml(const std::string& path, int depth) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("config file '" + path + "' is a directory; expected a YAML file");
  if (!std::filesystem::exists(path, ec)) fail("cannot read config file '" + path + "': no such file");
  if (depth > 8) fail("config file '" + path + "': more than 8 nested config: keys (a file that includes itself?)");
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    fail("cannot read config file '" + path + "'");
  } catch (const YAML::Exception& e) {
    fail("config file '" + path + "' is not valid YAML: " + e.what());
  } catch (const std::exception& e) {
    fail("cannot read config file '" + path + "': " + e.what());
  }
  if (root.IsNull()) return;
  if (!root.IsMap()) fail("config file '" + path + "' must be a mapping of flag names to values");
  std::vector<std::pair<std::string, int>> seen;  // normalised key, line
  for (const auto& kv : root) {
    const int line = kv.first.Mark().line + 1;
    const std::string where = "config file '" + path + "' line " + std::to_string(line);
    if (!kv.first.IsScalar()) fail(where + ": a key must be a flag name (a plain word), not a list, a mapping or empty");
    const std::string key = kv.first.as<std::string>();
    std::string normalised = key;
    std::replace(normalised.begin(), normalised.end(), '_', '-');
    for (const auto& [earlier, earlier_line] : seen)
      if (earlier == normalised)
        fail(where + ": key '" + key + "' is given twice (first on line " + std::to_string(earlier_line) +
             "); expected each flag once");
    seen.emplace_back(normalised, line);
    const YAML::Node& v = kv.second;
    std::string text;
    if (v.IsSequence()) {
      text = "[";
      for (size_t i = 0; i < v.size(); ++i) {
        if (!v[i].IsScalar()) fail(where + ": the list of '" + key + "' must hold scalars");
        text += (i ? "," : "") + v[i].as<std::string>();
      }
      text += "]";
    } else if (v.IsScalar()) {
      text = v.as<std::string>();
    } else if (v.IsNull()) {
      continue;  // "key:" with no value keeps the default
    } else {
      fail(where + ": value of '" + key + "' must be a scalar or a list");
    }
    if (normalised == "config") {
      // A nested config file is read at this point (keys after it override it), relative to this file.
      std::filesystem::path nested = text;
      if (nested.is_relative()) nested = std::filesystem::path(path).parent_path() / nested;
      if (!std::filesystem::exists(nested, ec)) fail(where + ": config file '" + nested.string() + "' does not exist");
      load_yaml(nested.string(), depth + 1);
      continue;
    }
    set(key, text, where);
  }
}

void FlagSet::add_list(const std::string& name, std::vector<std::string>* target, const std::string& help) {
  flags_.push_back({name, "list", help, "",
                    [target](const std::string& v) {
                      // YAML lists arrive as "[a,b,c]"; command-line values one at a time.
                      if (v.size() >= 2 && v.front() == '[' && v.back() == ']') {
                        target->clear();
                        std::stringstream ss(v.substr(1, v.size() - 2));
                        std::string item;
                        while (std::getline(ss, item, ',')) {
                          while (!item.empty() && item.front() == ' ') item.erase(item.begin());
                          while (!item.empty() && item.back() == ' ') item.pop_back();
                          if (!item.empty()) target->push_back(item);
                        }
                      } else {
                        target->push_back(v);
                      }
                    },
                    [target] {
                      std::string out = "[";
                      for (size_t i = 0; i < target->size(); ++i) out += (i ? "," : "") + (*target)[i];
                      return out + "]";
                    }});
}

void FlagSet::add_word(const std::string& name, const std::vector<std::string>& words,
                       std::function<int()> index_of_target, std::function<void(size_t)> set_index,
                       const std::vector<size_t>& first_of_value, const std::string& help,
                       std::function<std::string(const std::string&)> hint) {
  // The word last given, so that values() reports an alternative spelling ("wsd") as given.
  auto given = std::make_shared<std::string>();
  const int initial = index_of_target();
  const std::string default_text = initial < 0 ? "" : words[static_cast<size_t>(initial)];
  flags_.push_back({name, "string", help, default_text,
                    [=](const std::string& v) {
                      for (size_t i = 0; i < words.size(); ++i)
                        if (words[i] == v) {
                          set_index(i);
                          *given = v;
                          return;
                        }
                      std::vector<std::string> listed;
                      for (size_t i = 0; i < words.size(); ++i)
                        if (first_of_value[i] == i && !words[i].empty()) listed.push_back(words[i]);
                      std::string expected;
                      for (size_t i = 0; i < listed.size(); ++i)
                        expected += (i == 0 ? "" : i + 1 == listed.size() ? " or " : ", ") + listed[i];
                      throw Error("--" + name + " '" + v + "': expected " + expected + (hint ? hint(v) : ""), __FILE__,
                                  __LINE__);
                    },
                    [=] {
                      const int i = index_of_target();
                      if (i < 0) return std::string();
                      for (size_t j = 0; j < words.size(); ++j)
                        if (words[j] == *given && first_of_value[j] == first_of_value[static_cast<size_t>(i)]) return *given;
                      return words[first_of_value[static_cast<size_t>(i)]];
                    }});
}

void FlagSet::add_choice(const std::string& name, std::string* target, const std::vector<std::string>& choices,
                         const std::string& help, std::function<std::string(const std::string&)> hint) {
  std::vector<std::pair<std::string, std::string>> pairs;
  // An empty default means "not given": "" stays accepted (a checkpoint records it so), unlisted.
  if (target->empty()) pairs.emplace_back("", "");
  for (const std::string& c : choices) pairs.emplace_back(c, c);
  add_enum(name, target, pairs, help, std::move(hint));
}

void FlagSet::set_default_text(const std::string& name, const std::string& text) {
  for (Flag& f : flags_)
    if (f.name == name) {
      f.default_text = text;
      return;
    }
  MC_CHECK(false, "FlagSet::set_default_text: no flag --", name);
}

const FlagSet::Flag* FlagSet::find(const std::string& name) const {
  for (const Flag& f : flags_)
    if (f.name == name) return &f;
  return nullptr;
}

std::vector<std::string> FlagSet::parse(const std::vector<std::string>& args, bool allow_positional) {
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      if (!allow_positional) fail("unexpected argument '" + arg + "'");
      positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const Flag* f = find(name);
    if (!f) fail_unknown(name, "");
    given_.push_back(name);
    command_line_.push_back(name);
    if (f->kind == "bool") {
      if (inline_value) {
        // --flag=false turns off a boolean a config file turned on
        if (value == "true" || value == "1") {
          f->set("");
        } else if (value == "false" || value == "0") {
          f->set("__false__");
        } else {
          fail("flag '--" + name + "' takes no value (or =true / =false), got '" + value + "'");
        }
        continue;
      }
      f->set("");
      continue;
    }
    if (f->kind == "list") {
      // The command line replaces a list from a config file.
      f->set("[]");
      if (inline_value) {
        f->set(value);
        continue;
      }
      size_t taken = 0;
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        f->set(args[++i]);
        ++taken;
      }
      if (taken == 0) fail("flag '--" + name + "' needs at least one value");
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= args.size()) fail("flag '--" + name + "' needs a value (" + f->kind + ")");
      value = args[++i];
    }
    f->set(value);
  }
  return positional;
}

std::string FlagSet::help() const {
  std::ostringstream os;
  os << "usage: " << command_ << " [flags]\n\n" << summary_ << "\n";
  if (!flags_.empty()) os << "\nFlags:\n";
  for (const Flag& f : flags_) {
    std::string left = "  --" + f.name + (f.kind == "bool" ? "" : " <" + f.kind + ">");
    if (left.size() < 30) left.resize(30, ' ');
    os << left << " " << f.help;
    if (f.kind != "bool" && !f.default_text.empty()) os << " (default: " << f.default_text << ")";
    os << "\n";
  }
  os << "  --help                         show this help\n";
  return os.str();
}

}  // namespace moecore::cli
