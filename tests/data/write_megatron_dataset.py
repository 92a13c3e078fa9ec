#!/usr/bin/env python3
"""An independent writer of Megatron indexed datasets (PREFIX.bin + PREFIX.idx), stdlib only.

Written from the format description (docs/formats.md), not from moecore's C++ writer,
so that tests can check that moecore reads Megatron's files and writes the same bytes.

usage: write_megatron_dataset.py PREFIX DTYPE DOCUMENTS
  DTYPE      a Megatron dtype code 1..8 or its numpy name (uint8 int8 int16 int32 int64
             float64 float32 uint16)
  DOCUMENTS  a text file, one document per line, tokens as decimal integers separated by
             spaces; an empty line is an empty document. Each document is one sequence
             (preprocess_data.py without sentence splitting).
"""
import struct
import sys

# code: (numpy name, struct format of one element)
DTYPES = {
    1: ("uint8", "B"),
    2: ("int8", "b"),
    3: ("int16", "h"),
    4: ("int32", "i"),
    5: ("int64", "q"),
    6: ("float64", "d"),
    7: ("float32", "f"),
    8: ("uint16", "H"),
}


def dtype_code(text):
    if text.isdigit():
        code = int(text)
        if code in DTYPES:
            return code
    for code, (name, _) in DTYPES.items():
        if name == text:
            return code
    raise SystemExit(f"unknown dtype {text!r}: expected 1..8 or one of "
                     + ", ".join(name for name, _ in DTYPES.values()))


def write(prefix, code, documents):
    fmt = DTYPES[code][1]
    itemsize = struct.calcsize("<" + fmt)
    lengths = []
    with open(prefix + ".bin", "wb") as out:
        for doc in documents:
            out.write(struct.pack("<%d%s" % (len(doc), fmt), *doc))
            lengths.append(len(doc))
    pointers = []
    position = 0
    for n in lengths:
        pointers.append(position)
        position += n * itemsize
    doc_starts = list(range(len(lengths) + 1))  # one sequence per document
    with open(prefix + ".idx", "wb") as out:
        out.write(b"MMIDIDX\x00\x00")
        out.write(struct.pack("<Q", 1))
        out.write(struct.pack("<B", code))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(doc_starts)))
        out.write(struct.pack("<%di" % len(lengths), *lengths))
        out.write(struct.pack("<%dq" % len(pointers), *pointers))
        out.write(struct.pack("<%dq" % len(doc_starts), *doc_starts))


def main(argv):
    if len(argv) != 4:
        raise SystemExit(__doc__)
    prefix, code = argv[1], dtype_code(argv[2])
    float_type = DTYPES[code][1] in "fd"
    documents = []
    with open(argv[3]) as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last document
    for line in lines:
        tokens = [int(t) for t in line.split()]
        documents.append([float(t) for t in tokens] if float_type else tokens)
    write(prefix, code, documents)


if __name__ == "__main__":
    main(sys.argv)
