#!/usr/bin/env bash
# --tp-comm-overlap on two GPUs (BIN SRC MPI; MPI: a launcher command line for two GPUs, e.g.
# "mpirun -np 2 ..."; scripts/gpu-dist.sh): TP2+SP with the chunked sequence collectives on the
# communication stream against TP2+SP without them. The tiny MoE model (a shared expert: its MLP
# overlapped too; micro-batch 4: chunks inside sequences) in fp32 and in bf16, and mixtral-small
# (2 layers, bf16), train 3 steps with and without the flag. Each pair must log the same lm loss,
# balancing loss and grad norm: bit for bit is what the CPU ranks give (tests/cli); on a GPU a
# chunk's GEMM has fewer rows, for which cuBLASLt may pick another kernel (another summation
# order), so a pair that is not bit-identical must agree within 1e-5 (fp32) or 2e-3 (bf16) and
# says so; a misplaced chunk changes the losses far more than that.
set -euo pipefail
bin=$1; src=$2; mpi=${3:?"a launcher for two GPUs, e.g. 'mpirun -np 2'"}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
tp=(--tensor-model-parallel-size 2 --sequence-parallel)
tiny=(train --config "$src/configs/tiny.yaml" --device cuda --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --moe-shared-expert-intermediate-size 64 "${tp[@]}")
mixtral=(train --config "$src/configs/mixtral-small.yaml" --device cuda --num-layers 2 --train-iters 3 --lr-warmup-iters 1
         --log-interval 1 --eval-interval 0 --global-batch-size 16 "${tp[@]}")
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
run() {  # name flags...
  local name=$1; shift
  rm -f "$dir/$name.jsonl"
  $mpi "$bin" "$@" --metrics-file "$dir/$name.jsonl" >"$dir/$name.log" 2>&1 || { cat "$dir/$name.log"; exit 1; }
  [ "$(values "$dir/$name.jsonl" | wc -l)" -ge 6 ] || { cat "$dir/$name.log"; echo "FAIL: $name logged nothing"; exit 1; }
}
same() {  # tolerance label: the runs "off" and "on"
  if cmp -s <(values "$dir/off.jsonl") <(values "$dir/on.jsonl"); then
    echo "$2: --tp-comm-overlap bit-identical (losses, grad norm)"; return
  fi
  paste <(values "$dir/on.jsonl") <(values "$dir/off.jsonl") | awk -v tol="$1" -v label="$2" '
    { d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2 + 1e-30); if (r > worst) worst = r
      if (NF != 2 || r > tol) bad = 1 }
    END { if (bad) { print "FAIL: " label ": --tp-comm-overlap changes the logged values (worst relative " worst ")"; exit 1 }
          print label ": --tp-comm-overlap within " tol " (worst relative " worst "), not bit-identical" }'
}
run off "${tiny[@]}"
run on "${tiny[@]}" --tp-comm-overlap
same 1e-5 "tiny fp32 TP2+SP"
run off "${tiny[@]}" --bf16
run on "${tiny[@]}" --bf16 --tp-comm-overlap
same 2e-3 "tiny bf16 TP2+SP"
run off "${mixtral[@]}"
run on "${mixtral[@]}" --tp-comm-overlap
same 2e-3 "mixtral-small (2 layers) TP2+SP"
echo PASS
