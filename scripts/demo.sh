#!/usr/bin/env bash
# make demo: what this version can show. Training on the default corpus arrives with the
# single-device training and data work; until then the demo shows the machine as moecore
# sees it and one GEMM measurement.
set -euo pipefail
build=${1:-build}
"$build"/moecore env
echo
"$build"/bench/bench_gemm --quick --repeats 3
echo
echo "demo: training ('moecore train') is not in this version yet; it arrives with the single-device training work."
