#!/usr/bin/env bash
# Builds one libFuzzer target from tests/fuzz/ with clang (outside CMake) and runs it.
#
#   scripts/fuzz.sh TARGET [SECONDS] [libFuzzer flags...]
#
# TARGET: "indexed_dataset" or "fuzz_indexed_dataset" -> tests/fuzz/fuzz_indexed_dataset.cpp.
# SECONDS: how long to fuzz (default 60); 0 only builds.
# The target file names what else to compile and link in two comment lines:
#   // fuzz-sources: src/moecore/... .cpp files (paths relative to the repository root)
#   // fuzz-libs:    extra linker flags (e.g. -lfmt), may be empty
# Output goes to $FUZZ_DIR (default build-fuzz/): the binary, the corpus (corpus-TARGET/,
# kept between runs; the target may seed it through $MOECORE_FUZZ_SEED_DIR) and crash
# artifacts (artifacts-TARGET/). Exit status: 0 when no problem was found.
# Environment: CXX_FUZZ (clang++ to use), FUZZ_SANITIZERS (default fuzzer,address,undefined),
# FUZZ_JOBS unused by design (one process: the machine is shared).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  echo "targets:"; ls "$root/tests/fuzz" 2>/dev/null | sed -n 's/^fuzz_\(.*\)\.cpp$/  \1/p'
  exit 2
fi
name="${1#fuzz_}"; name="${name%.cpp}"
seconds="${2:-60}"
shift; [[ $# -gt 0 ]] && shift
source_file="$root/tests/fuzz/fuzz_${name}.cpp"
if [[ ! -f "$source_file" ]]; then
  echo "fuzz.sh: no target '$name' ($source_file not found); targets:" >&2
  ls "$root/tests/fuzz" | sed -n 's/^fuzz_\(.*\)\.cpp$/  \1/p' >&2
  exit 2
fi
if ! [[ "$seconds" =~ ^[0-9]+$ ]]; then
  echo "fuzz.sh: SECONDS must be a whole number, got '$seconds'" >&2
  exit 2
fi

# ---- compiler with libFuzzer ----------------------------------------------------------
cxx="${CXX_FUZZ:-}"
if [[ -z "$cxx" ]]; then
  for c in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$c" >/dev/null; then cxx="$c"; break; fi
  done
fi
if [[ -z "$cxx" ]]; then
  echo "fuzz.sh: clang++ not found. Install clang (Debian/Ubuntu: apt-get install clang) or set CXX_FUZZ." >&2
  exit 1
fi
sanitizers="${FUZZ_SANITIZERS:-fuzzer,address,undefined}"
work="${FUZZ_DIR:-$root/build-fuzz}"
mkdir -p "$work"
probe="$work/.probe.cpp"
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' > "$probe"
if ! "$cxx" -fsanitize="$sanitizers" "$probe" -o "$work/.probe" 2>"$work/.probe.log"; then
  version="$("$cxx" --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)"
  echo "fuzz.sh: $cxx cannot link -fsanitize=$sanitizers (libFuzzer/sanitizer runtimes missing):" >&2
  sed 's/^/  /' "$work/.probe.log" | head -5 >&2
  echo "Install the compiler-rt runtimes for clang ${version:-N}: Debian 12 / Ubuntu: apt-get install libclang-rt-${version:-N}-dev" >&2
  echo "(older Debian/Ubuntu ship them in clang-${version:-N} itself, or use clang's own release from apt.llvm.org)." >&2
  exit 1
fi
rm -f "$probe" "$work/.probe" "$work/.probe.log"

# ---- build ----------------------------------------------------------------------------
read -r -a extra_sources <<<"$(sed -n 's|^// fuzz-sources:\(.*\)$|\1|p' "$source_file" | head -1)"
read -r -a extra_libs <<<"$(sed -n 's|^// fuzz-libs:\(.*\)$|\1|p' "$source_file" | head -1)"
sources=("$source_file")
for s in "${extra_sources[@]}"; do sources+=("$root/$s"); done
binary="$work/fuzz_${name}"
echo "fuzz.sh: building $binary with $cxx -fsanitize=$sanitizers"
"$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer -fsanitize="$sanitizers" -fno-sanitize-recover=undefined \
  -DMOECORE_WITH_CUDA=0 -DMOECORE_VERSION='"fuzz"' -I"$root/src" "${sources[@]}" "${extra_libs[@]}" -o "$binary"
[[ "$seconds" -eq 0 ]] && exit 0

# ---- run ------------------------------------------------------------------------------
corpus="$work/corpus-$name"
artifacts="$work/artifacts-$name"
mkdir -p "$corpus" "$artifacts"
echo "fuzz.sh: running $name for ${seconds}s (corpus $corpus, crashes in $artifacts)"
MOECORE_FUZZ_SEED_DIR="$corpus" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" "$corpus"
