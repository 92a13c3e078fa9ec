#!/usr/bin/env bash
# Installs moecore's build dependencies from the Debian/Ubuntu archive. Idempotent: does
# nothing when every package is present (the GPU machines have them all and no archive).
set -euo pipefail
packages=(libopenblas-dev libopenmpi-dev openmpi-bin libgtest-dev libbenchmark-dev
          libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libfmt-dev libspdlog-dev)
# Optional (tokenizers: PCRE2 for HuggingFace tokenizer.json regexes, SentencePiece): installed
# when the archive has them; without them the build works and those tokenizers say what is missing.
optional=(pkg-config libpcre2-dev libsentencepiece-dev)
missing=()
for tool in cmake:cmake g++:g++ make:make; do  # tools may come from elsewhere (pip's cmake, say)
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
missing_optional=()
for p in "${optional[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_optional+=("$p")
done
[ ${#missing[@]} -eq 0 ] && [ ${#missing_optional[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -ne 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ ${#missing_optional[@]} -ne 0 ]; then
  echo "install-deps: installing optional ${missing_optional[*]}"
  { [ ${#missing[@]} -ne 0 ] || $sudo apt-get update -qq; } 2>/dev/null &&
    $sudo apt-get install -y -qq --no-install-recommends "${missing_optional[@]}" >/dev/null 2>&1 ||
    echo "install-deps: optional packages not installed (${missing_optional[*]}); the build goes on without them"
fi
exit 0
