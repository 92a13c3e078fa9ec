#!/usr/bin/env bash
# Installs moecore's build dependencies from the Debian/Ubuntu archive. Idempotent: does
# nothing when every package is present (the GPU machines have them all and no archive).
set -euo pipefail
packages=(libopenblas-dev libopenmpi-dev openmpi-bin libgtest-dev libbenchmark-dev
          libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libfmt-dev libspdlog-dev)
missing=()
for tool in cmake:cmake g++:g++ make:make; do  # tools may come from elsewhere (pip's cmake, say)
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
