#!/usr/bin/env bash
# moecore convert shows progress (bytes read and written, rate, ETA, the tensor it is at) on stderr
# for hf -> moecore and moecore -> hf, and the progress changes none of the files written: the
# outputs with progress lines equal those without (a tiny Mixtral from tests/data/write_hf_checkpoint.py;
# --progress-interval 0.000001 makes every tensor print, the default 1 s keeps a tiny model quiet).
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
python3 "$src/tests/data/write_hf_checkpoint.py" "$dir/hf" --arch mixtral --dtype bf16 --shards 2
line='^convert: [0-9.]+[kMG]?/[0-9.]+[kMG]? B \([0-9.]+%\), [0-9.]+[kMG]? B/s, ETA [0-9hms?]+, (reading|writing) tensor [0-9]+/[0-9]+$'

"$bin" convert --from hf --to moecore --input "$dir/hf" --output "$dir/quiet" > "$dir/quiet.out" 2> "$dir/quiet.err"
[ ! -s "$dir/quiet.err" ] || { cat "$dir/quiet.err"; fail "a quick conversion printed progress at the default interval"; }
"$bin" convert --from hf --to moecore --input "$dir/hf" --output "$dir/ck" --progress-interval 0.000001 \
  > "$dir/ck.out" 2> "$dir/ck.err"
grep -Eq "$line" "$dir/ck.err" || { cat "$dir/ck.err"; fail "hf -> moecore: no progress line"; }
grep -q "reading tensor 1/" "$dir/ck.err" && grep -q "writing tensor 1/" "$dir/ck.err" || fail "hf -> moecore: no reading and writing lines"
grep -q "(100.0%), .*writing tensor" "$dir/ck.err" || { cat "$dir/ck.err"; fail "hf -> moecore: the last line is not at 100%"; }
bad=$(grep -Evc "$line" "$dir/ck.err" || true)
[ "$bad" -eq 0 ] || { cat "$dir/ck.err"; fail "hf -> moecore: other lines on stderr"; }
sed "s|$dir/quiet|$dir/ck|" "$dir/quiet.out" | cmp - "$dir/ck.out" || fail "stdout differs with progress lines"
for f in iter_0000000/model_optim.safetensors iter_0000000/meta.json latest_checkpointed_iteration.txt; do
  cmp "$dir/quiet/$f" "$dir/ck/$f" || fail "hf -> moecore: $f differs with progress lines"
done

for shard in 5GB 2KB; do
  "$bin" convert --from moecore --to hf --input "$dir/ck" --output "$dir/q$shard" --max-shard-size "$shard" > /dev/null 2> "$dir/q.err"
  [ ! -s "$dir/q.err" ] || { cat "$dir/q.err"; fail "moecore -> hf printed progress at the default interval"; }
  "$bin" convert --from moecore --to hf --input "$dir/ck" --output "$dir/p$shard" --max-shard-size "$shard" \
    --progress-interval 0.000001 > /dev/null 2> "$dir/p.err"
  grep -Eq "$line" "$dir/p.err" || { cat "$dir/p.err"; fail "moecore -> hf ($shard shards): no progress line"; }
  grep -q "(100.0%), .*writing tensor" "$dir/p.err" || { cat "$dir/p.err"; fail "moecore -> hf: the last line is not at 100%"; }
  (cd "$dir/q$shard" && ls) > "$dir/q.ls"; (cd "$dir/p$shard" && ls) > "$dir/p.ls"
  cmp "$dir/q.ls" "$dir/p.ls" || fail "moecore -> hf ($shard shards): other files with progress lines"
  for f in $(cat "$dir/q.ls"); do cmp "$dir/q$shard/$f" "$dir/p$shard/$f" || fail "moecore -> hf: $f differs with progress lines"; done
done
grep -c "" "$dir/ck.err" | sed 's/^/hf -> moecore progress lines: /'
tail -1 "$dir/ck.err"
tail -1 "$dir/p.err"
echo "PASS: progress lines on stderr, outputs unchanged"
