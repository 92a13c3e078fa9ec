#!/usr/bin/env python3
"""Builds the HuggingFace tokenizer fixtures for moecore's BPE tests (run where the `tokenizers`
package is installed, e.g. the GPU machine):

  python3 tools/make_bpe_fixture.py OUT_DIR

trains two small byte-level BPE tokenizers on the repository's own text (README and docs):
  gpt2_style: ByteLevel pre-tokenizer with its GPT-2 regex
  llama3_style: Split on the Llama-3 regex, then ByteLevel without regex (ignore_merges)
with a special token, saves OUT_DIR/<name>.tokenizer.json, and writes OUT_DIR/<name>.expected.json
with the ids `tokenizers` gives for the test texts below. tests/unit/test_hf_tokenizer_fixture.cpp
holds moecore's encoder to those ids, token for token.
"""
import json
import pathlib
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = [
    "Hello world! It's a test: we'll see 12345 tokens.",
    "  Two  spaces,\ttabs\tand\nnew lines\n\n  end.",
    "Mixture-of-Experts routers (top-k=8) don't drop tokens <|endoftext|> after this.",
    "Unicode: café, naïve, 中文字符, emoji \U0001F600 and 3.14159!",
    "def forward(x):\n    return x * 2  # comment",
]


def corpus():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f.read_text(encoding="utf-8") for f in files]


def build(name, out):
    tok = Tokenizer(models.BPE(ignore_merges=(name == "llama3_style")))
    if name == "gpt2_style":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.save(str(out / f"{name}.tokenizer.json"))
    expected = [{"text": t, "ids": tok.encode(t).ids} for t in TEXTS]
    (out / f"{name}.expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1), encoding="utf-8")
    print(name, "vocab", tok.get_vocab_size(), "ids of text 0:", expected[0]["ids"])


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for n in ("gpt2_style", "llama3_style"):
        build(n, out)
