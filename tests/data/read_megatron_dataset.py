#!/usr/bin/env python3
"""An independent reader of Megatron indexed datasets (PREFIX.bin + PREFIX.idx), stdlib only.

Written from the format description (docs/formats.md), not from moecore's C++ reader, so
that tests can check the files moecore writes. Checks every field and exits non-zero with a
message on the first inconsistency.

usage: read_megatron_dataset.py PREFIX
prints "dtype NAME sequences S documents D" and then one line per sequence: its tokens as
decimal integers separated by spaces (an empty line for an empty sequence).
"""
import struct
import sys

DTYPES = {1: ("uint8", "B"), 2: ("int8", "b"), 3: ("int16", "h"), 4: ("int32", "i"),
          5: ("int64", "q"), 6: ("float64", "d"), 7: ("float32", "f"), 8: ("uint16", "H")}


def fail(msg):
    raise SystemExit("read_megatron_dataset: " + msg)


def main(argv):
    if len(argv) != 2:
        raise SystemExit(__doc__)
    prefix = argv[1]
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    if idx[:9] != b"MMIDIDX\x00\x00":
        fail("bad magic %r" % idx[:9])
    (version,) = struct.unpack_from("<Q", idx, 9)
    if version != 1:
        fail("version %d, expected 1" % version)
    code = idx[17]
    if code not in DTYPES:
        fail("dtype code %d" % code)
    name, fmt = DTYPES[code]
    size = struct.calcsize("<" + fmt)
    seqs, docs = struct.unpack_from("<QQ", idx, 18)
    off = 34
    expected = off + 4 * seqs + 8 * seqs + 8 * docs
    if len(idx) != expected:
        fail(".idx has %d bytes, expected %d" % (len(idx), expected))
    lengths = struct.unpack_from("<%di" % seqs, idx, off)
    pointers = struct.unpack_from("<%dq" % seqs, idx, off + 4 * seqs)
    doc_idx = struct.unpack_from("<%dq" % docs, idx, off + 12 * seqs)
    pos = 0
    for i, (n, p) in enumerate(zip(lengths, pointers)):
        if n < 0 or p != pos:
            fail("sequence %d: length %d pointer %d, expected pointer %d" % (i, n, p, pos))
        pos += n * size
    if pos != len(data):
        fail(".bin has %d bytes, the index says %d" % (len(data), pos))
    if docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != seqs or list(doc_idx) != sorted(doc_idx):
        fail("document indices %r do not run from 0 to %d" % (doc_idx[:8], seqs))
    out = ["dtype %s sequences %d documents %d" % (name, seqs, docs - 1)]
    for n, p in zip(lengths, pointers):
        tokens = struct.unpack_from("<%d%s" % (n, fmt), data, p)
        out.append(" ".join(str(int(t)) for t in tokens))
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv)
