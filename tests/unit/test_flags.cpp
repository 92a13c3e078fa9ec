#include <gtest/gtest.h>

#include "moecore/cli/flags.h"

using namespace moecore::cli;

TEST(Flags, ParsesEveryKindAndBothSpellings) {
  int64_t layers = 2;
  double lr = 1e-3;
  std::string name = "x";
  bool bf16 = false;
  FlagSet f("moecore train", "test");
  f.add_int("num-layers", &layers, "layers");
  f.add_double("lr", &lr, "learning rate");
  f.add_string("save", &name, "dir");
  f.add_bool("bf16", &bf16, "bf16");
  f.parse({"--num-layers", "12", "--lr=3e-4", "--save", "/tmp/ckpt", "--bf16"});
  EXPECT_EQ(layers, 12);
  EXPECT_DOUBLE_EQ(lr, 3e-4);
  EXPECT_EQ(name, "/tmp/ckpt");
  EXPECT_TRUE(bf16);
  EXPECT_NE(f.help().find("--num-layers <int>"), std::string::npos);
  EXPECT_NE(f.help().find("(default: 2)"), std::string::npos);
}

TEST(Flags, EveryMistakeNamesTheFlag) {
  int64_t layers = 2;
  double lr = 0.1;
  FlagSet f("moecore train", "test");
  f.add_int("num-layers", &layers, "layers");
  f.add_double("lr", &lr, "learning rate");
  auto message = [&](std::vector<std::string> args) {
    try {
      f.parse(args);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message({"--num-layer", "3"}),
            "moecore train: unknown flag '--num-layer'; did you mean '--num-layers'? (see 'moecore train --help')");
  EXPECT_EQ(message({"--zzz"}), "moecore train: unknown flag '--zzz' (see 'moecore train --help')");
  EXPECT_EQ(message({"--num-layers", "two"}),
            "moecore train: flag '--num-layers' expects an integer, got 'two' (see 'moecore train --help')");
  EXPECT_EQ(message({"--lr", "nan"}),
            "moecore train: flag '--lr' expects a finite number, got 'nan' (see 'moecore train --help')");
  EXPECT_EQ(message({"--lr"}), "moecore train: flag '--lr' needs a value (float) (see 'moecore train --help')");
  EXPECT_EQ(message({"stray"}), "moecore train: unexpected argument 'stray' (see 'moecore train --help')");
}

TEST(Flags, ClosestWord) {
  EXPECT_EQ(closest("trian", {"train", "generate", "env"}), "train");
  EXPECT_EQ(closest("qqqqqqqq", {"train", "env"}), "");
}

TEST(Flags, BooleansTakeTrueOrFalseAfterEquals) {
  bool x = true;
  FlagSet f("moecore train", "test");
  f.add_bool("bf16", &x, "");
  f.parse({"--bf16=false"});
  EXPECT_FALSE(x);
  f.parse({"--bf16=true"});
  EXPECT_TRUE(x);
  EXPECT_THROW(f.parse({"--bf16=maybe"}), UsageError);
}

TEST(Flags, ListsTakeValuesUpToTheNextFlag) {
  std::vector<std::string> paths;
  int64_t n = 0;
  FlagSet f("moecore train", "test");
  f.add_list("data-path", &paths, "");
  f.add_int("n", &n, "");
  f.parse({"--data-path", "0.3", "a", "0.7", "b", "--n", "2"});
  EXPECT_EQ(paths, (std::vector<std::string>{"0.3", "a", "0.7", "b"}));
  EXPECT_EQ(n, 2);
  f.set("data_path", "[x, y]", "config");
  EXPECT_EQ(paths, (std::vector<std::string>{"x", "y"}));
  EXPECT_THROW(f.parse({"--data-path", "--n", "1"}), UsageError);
}

// Word flags: the word maps to its value when set (command line or config), with Megatron's
// spellings and alternatives; values() reports the word as given; a word outside the list is one
// Error naming the flag and the choices (not a UsageError: the message has no usage hint).
TEST(Flags, EnumsMapWordsOnceWithOneErrorForm) {
  enum class Style { Linear, Cosine, Wsd };
  Style style = Style::Linear;
  std::string impl;
  FlagSet f("moecore train", "test");
  f.add_enum<Style>("lr-decay-style", &style,
                    {{"linear", Style::Linear}, {"cosine", Style::Cosine}, {"WSD", Style::Wsd}, {"wsd", Style::Wsd}},
                    "schedule");
  f.add_choice("impl", &impl, {"te", "native"}, "", [](const std::string& v) {
    return v == "fp8" ? std::string(" (no fp8 here)") : std::string();
  });
  EXPECT_NE(f.help().find("--lr-decay-style <string>"), std::string::npos) << f.help();
  EXPECT_NE(f.help().find("(default: linear)"), std::string::npos) << f.help();
  auto value_of = [&](const std::string& name) {
    for (const auto& [n, v] : f.values())
      if (n == name) return v;
    return std::string("?");
  };
  EXPECT_EQ(value_of("lr-decay-style"), "linear");
  EXPECT_EQ(value_of("impl"), "");
  f.parse({"--lr-decay-style", "wsd", "--impl=native"});
  EXPECT_EQ(style, Style::Wsd);
  EXPECT_EQ(impl, "native");
  EXPECT_EQ(value_of("lr-decay-style"), "wsd");  // as given, so a checkpoint records it unchanged
  f.set("lr_decay_style", "cosine", "config file 'x.yaml'");
  EXPECT_EQ(style, Style::Cosine);
  EXPECT_EQ(value_of("lr-decay-style"), "cosine");
  auto error_of = [&](const std::vector<std::string>& args) {
    try {
      f.parse(args);
    } catch (const UsageError& e) {
      return std::string("usage error: ") + e.what();
    } catch (const moecore::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of({"--lr-decay-style", "step"}), "--lr-decay-style 'step': expected linear, cosine or WSD");
  EXPECT_EQ(style, Style::Cosine);
  EXPECT_EQ(error_of({"--impl", "fp8"}), "--impl 'fp8': expected te or native (no fp8 here)");
  EXPECT_EQ(error_of({"--impl", "x"}), "--impl 'x': expected te or native");
  f.set("impl", "", "checkpoint");  // the recorded "not given" of a flag with an empty default
  EXPECT_EQ(impl, "");
}

// A flag whose stored default means "not given" shows the value used instead in --help.
TEST(Flags, DefaultTextOverridesTheNotGivenMark) {
  int64_t history = -1;
  FlagSet f("t", "");
  f.add_int("history", &history, "kept values");
  EXPECT_NE(f.help().find("(default: -1)"), std::string::npos);
  f.set_default_text("history", "1");
  EXPECT_NE(f.help().find("kept values (default: 1)"), std::string::npos) << f.help();
  EXPECT_EQ(f.help().find("(default: -1)"), std::string::npos);
  EXPECT_THROW(f.set_default_text("missing", "1"), moecore::Error);
}
