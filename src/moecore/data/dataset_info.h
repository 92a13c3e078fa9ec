// moecore dataset-info PREFIX: describes a Megatron indexed dataset (PREFIX.bin + PREFIX.idx;
// a trailing ".bin" or ".idx" on PREFIX is dropped). Prints human-readable lines, then one JSON
// line last:
//   {"prefix", "idx_bytes", "bin_bytes", "dtype", "dtype_code", "sequences", "documents",
//    "tokens", "min_sequence_length", "max_sequence_length", "mean_sequence_length",
//    "empty_sequences"}
// A damaged dataset raises the reader's Error (the binary prints it and exits 1).
#pragma once

#include <string>

namespace moecore {

// Describes the dataset at `prefix` (with the unigram entropy when `unigram_entropy`) on stdout.
// Returns 0; errors throw. The flags of `moecore dataset-info` are in apps/dataset_info_command.cpp.
int dataset_info(std::string prefix, bool unigram_entropy);

}  // namespace moecore
