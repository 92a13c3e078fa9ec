// --tokenizer-type SentencePieceTokenizer: a thin wrapper over libsentencepiece (optional
// dependency, libsentencepiece-dev). encode = EncodeAsIds (no BOS/EOS added, as Megatron's
// _SentencePieceTokenizer.tokenize); decode = DecodeIds; vocab = GetPieceSize();
// eod = the model's eos id (an Error if the model has none).
// --tokenizer-type Llama2Tokenizer (llama2 = true): the same, with the model's BOS id before every
// encoded text, as Megatron's Llama2Tokenizer.tokenize (bos=True, eos=False); a model without a
// BOS piece is an Error.
// Built without the library, make_sentencepiece_tokenizer raises an Error naming the package.
#pragma once

#include <memory>
#include <string>

#include "moecore/data/tokenizer.h"

namespace moecore {

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path, bool llama2 = false);

}  // namespace moecore
