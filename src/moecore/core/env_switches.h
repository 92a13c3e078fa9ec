// Environment switches: every MOECORE_* variable the library reads, in one table (name, allowed
// values, what unset means, what it does, whether the ranks of a run must agree), and the one
// accessor the code reads them through. `moecore env` prints the table with each switch's value
// in this process; docs/environment.md lists the same switches (tests/cli/env_switches_documented.sh
// fails when one is missing there).
//
// The accessor returns the raw text (nullptr when unset): each switch keeps its own parsing next to
// the code it steers, so a value's meaning (and the error for a bad one) is where it is used.
#pragma once

#include <string_view>
#include <vector>

namespace moecore {

// Whether the ranks of one run must see the same value.
enum class EnvAgreement {
  PerRank,  // each rank may differ (local speed or numerics of its own work only)
  Must,     // must agree, but nothing checks it (a difference can hang or fail a collective)
  Checked,  // must agree, and the trainer compares it across ranks at start (with the flags)
};
const char* env_agreement_name(EnvAgreement a);

struct EnvSwitch {
  const char* name;           // MOECORE_...
  const char* values;         // the values it takes
  const char* unset;          // what unset (the default) means
  const char* effect;         // what it does, and when it is read
  EnvAgreement agreement;
};

// The table, in the order `moecore env` and docs/environment.md list it.
const std::vector<EnvSwitch>& env_switches();

// The value of switch `name` in this process's environment, nullptr when unset. `name` must be
// in env_switches() (else an Error: a switch read without being listed is a bug).
const char* env_switch(std::string_view name);

}  // namespace moecore
