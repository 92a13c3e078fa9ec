#!/usr/bin/env bash
# docs-help.sh BIN [--write]: docs/usage.md quotes every subcommand's --help text in its section
# "`--help` texts" (one block after each "`moecore SUB --help`:" line). Without --write: exit 1
# naming each block that differs from what BIN prints (a test runs this, so the quotes cannot go
# stale); with --write: replace the blocks with BIN's output.
set -euo pipefail
bin=$1; mode=${2:-check}
doc="$(cd "$(dirname "$0")/.." && pwd)/docs/usage.md"
python3 - "$bin" "$mode" "$doc" <<'PY'
import re, subprocess, sys
bin_, mode, doc = sys.argv[1:]
text = open(doc).read()
pattern = re.compile(r"(`moecore ([a-z-]+) --help`:\n\n```\n)(.*?)(```\n)", re.S)
stale, subs = [], []
def replace(m):
    sub = m.group(2); subs.append(sub)
    out = subprocess.run([bin_, sub, "--help"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"docs-help: '{bin_} {sub} --help' exited {out.returncode}")
    current = out.stdout if out.stdout.endswith("\n") else out.stdout + "\n"
    if current != m.group(3): stale.append(sub)
    return m.group(1) + current + m.group(4)
new = pattern.sub(replace, text)
if not subs: sys.exit("docs-help: no `moecore SUB --help` blocks found in " + doc)
if mode == "--write":
    open(doc, "w").write(new); print("docs-help: wrote", ", ".join(subs))
elif stale:
    sys.exit("docs-help: docs/usage.md quotes an old --help of: " + ", ".join(stale) +
             " (scripts/docs-help.sh build/moecore --write updates them)")
else:
    print("docs-help: current:", ", ".join(subs))
PY
