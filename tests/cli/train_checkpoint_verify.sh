#!/usr/bin/env bash
# What --load verifies (CPU): each tensor's CRC32C from meta.json (a flipped byte in the tensor
# data names the tensor; a checkpoint without checksums still loads, with a note), and meta.json's
# fields (required keys, ranges), each failure naming the file.
set -uo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
common=(train --config "$src/configs/tiny.yaml" --device cpu --log-interval 1 --eval-interval 0 --lr-warmup-iters 1)
fail() { echo "FAIL: $*"; exit 1; }
"$bin" "${common[@]}" --train-iters 2 --save "$dir/good" >"$dir/save.log" 2>&1 || { cat "$dir/save.log"; fail "save"; }
ckpt=$dir/good/iter_0000002
grep -q '"crc32c"' "$ckpt/meta.json" || fail "meta.json holds no checksums"
fresh() { rm -rf "$dir/c"; cp -r "$dir/good" "$dir/c"; }
load() { "$bin" "${common[@]}" --train-iters 3 --override-opt-param-scheduler --load "$dir/c" >"$dir/load.log" 2>&1; }

# a flipped byte in the last tensor's data: the error names the tensor
fresh
python3 - "$dir/c/iter_0000002/model_optim.safetensors" <<'PY'
import json, struct, sys
p = sys.argv[1]; b = bytearray(open(p, 'rb').read())
n = struct.unpack('<Q', b[:8])[0]; header = json.loads(b[8:8 + n])
name, info = max(((k, v) for k, v in header.items() if k != '__metadata__'), key=lambda kv: kv[1]['data_offsets'][0])
b[8 + n + info['data_offsets'][0]] ^= 0x40
open(p, 'wb').write(b); print(name)
PY
load && fail "a damaged tensor loaded"
cat "$dir/load.log"
grep -q "tensor '.*' fails its CRC32C checksum" "$dir/load.log" || fail "the mismatch is not reported by tensor"

# an old checkpoint without checksums loads, with a note
fresh
python3 -c "import json,sys; p=sys.argv[1]; m=json.load(open(p)); del m['crc32c']; json.dump(m, open(p,'w'))" "$dir/c/iter_0000002/meta.json"
load || { cat "$dir/load.log"; fail "a checkpoint without checksums did not load"; }
grep -q "has no tensor checksums (written by an older version)" "$dir/load.log" || fail "no note about the missing checksums"

# meta.json: a negative iteration, a missing "args"
for edit in "m['iteration'] = -3" "del m['args']" "m['consumed_samples'] = 'x'"; do
  fresh
  python3 -c "import json,sys; p=sys.argv[1]; m=json.load(open(p)); $edit; json.dump(m, open(p,'w'))" "$dir/c/iter_0000002/meta.json"
  load && fail "meta.json with $edit loaded"
  cat "$dir/load.log"
  grep -q "'$dir/c/iter_0000002/meta.json': " "$dir/load.log" || fail "$edit: the error does not name meta.json"
  grep -q "internal error\|adamw" "$dir/load.log" && fail "$edit: not a clean error"
done
echo PASS
