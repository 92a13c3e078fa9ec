#!/usr/bin/env bash
# check-identical.sh OLD_BIN NEW_BIN: the same short CPU trainings with two moecore binaries (before
# and after a change that must not change behaviour, e.g. a refactor), compared exactly: every
# metrics.jsonl field except timings and the EP load report (losses, norms, learning rate, tokens per expert, memory,
# host waits) and the validation lines. Cases: one rank with the router, balancing, capacity,
# recompute and activation options, the two benchmark presets scaled down, and under mpirun
# EP=2 (alltoall, allgather), EP=2 x ETP=2, TP=2+SP with EP=2, CP=2, PP=2 with virtual stages and
# the distributed optimizer with both overlaps, DP=4 with EP=2. IGNORE_PEAK=1 leaves out the
# peak allocation (which a change of allocation order may move). Prints one line per case and
# "ALL IDENTICAL" last; exit 1 when any case differs or fails. Needs mpirun; a few minutes on
# 2 cores.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_BIN NEW_BIN" >&2; exit 2; }
old_bin=$(readlink -f "$1"); new_bin=$(readlink -f "$2")
src=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tiny=(train --config $src/configs/tiny.yaml --device cpu --train-iters 6 --lr-warmup-iters 1 --log-interval 1 --eval-interval 3 --eval-iters 2)
PL=--moe-per-layer-logging
small=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 --seq-length 64 --max-position-embeddings 64
       --vocab-size 512 --micro-batch-size 2 --global-batch-size 4 --train-iters 5 --log-interval 1 --device cpu)
cases=(
 "fp32|1|${tiny[*]} $PL"
 "bf16|1|${tiny[*]} --bf16 $PL"
 "sigmoid_bias_z_jitter_global|1|${tiny[*]} --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-z-loss-coeff 1e-3 --moe-input-jitter-eps 0.01 --moe-router-load-balancing-type global_aux_loss $PL"
 "groups_shared_gate_seqaux|1|${tiny[*]} --num-experts 8 --moe-router-topk 2 --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 96 --moe-shared-expert-gate --moe-router-load-balancing-type seq_aux_loss $PL"
 "capacity_pad_recompute|1|${tiny[*]} --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --recompute-granularity selective --recompute-modules moe_act $PL"
 "capacity_drop_prob_gelu|1|${tiny[*]} --swiglu=false --moe-expert-capacity-factor 0.75 --moe-token-drop-policy position --moe-router-pre-softmax $PL"
 "sinkhorn|1|${tiny[*]} --moe-router-load-balancing-type sinkhorn --moe-router-topk 1 $PL"
 "mixtral_small_scaled|1|train --config $src/configs/mixtral-small.yaml ${small[*]} --ffn-hidden-size 352 --moe-ffn-hidden-size 352 $PL"
 "finegrained_small_scaled|1|train --config $src/configs/finegrained-small.yaml ${small[*]} --ffn-hidden-size 256 --moe-ffn-hidden-size 32 $PL"
 "ep2_alltoall|2|${tiny[*]} --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall $PL"
 "ep2_allgather|2|${tiny[*]} --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather $PL"
 "ep2_etp2_alltoall_distopt|4|${tiny[*]} --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer $PL --micro-batch-size 4"
 "ep2_etp2_allgather_cap|4|${tiny[*]} --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type allgather --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity $PL --micro-batch-size 4"
 "tp2_sp_ep2|4|${tiny[*]} --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-shared-expert-intermediate-size 64 $PL --micro-batch-size 4"
 "cp2|2|${tiny[*]} --context-parallel-size 2 $PL"
 "pp2_vp_dp2_overlap|4|${tiny[*]} --num-layers 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --micro-batch-size 4"
 "dp4_ep2_distopt_overlap|4|${tiny[*]} --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer --overlap-grad-reduce $PL --micro-batch-size 4"
)
fail=0
# values NAME BIN: run case NAME with BIN, write the compared values to $out/NAME.BIN_TAG
values() {
  local file=$1; shift
  local work; work=$(mktemp -d)
  if ! timeout 900 "$@" --metrics-file "$work/m.jsonl" > "$work/log" 2>&1; then
    echo "RUN FAILED: $*"; tail -5 "$work/log"; rm -rf "$work"; return 1
  fi
  { python3 -c 'import json, os, sys
# (the reserved peak follows the caching of the allocator, not the numerics)
skip = {"ms_per_iteration", "tflops_per_gpu", "tokens_per_s", "timers_ms_per_iteration", "mem_max_reserved_bytes"}
# The EP load report: timings, and rows per EP rank that follow from tokens_per_expert (compared).
skip |= {k for l in open(sys.argv[1]) for k in json.loads(l) if k.startswith("moe_ep_")}
if os.environ.get("IGNORE_PEAK"): skip.add("mem_max_allocated_bytes")
for l in open(sys.argv[1]):
    j = json.loads(l)
    print(sorted((k, v) for k, v in j.items() if k not in skip))' "$work/m.jsonl"
    grep -i "validation" "$work/log" | sed 's/elapsed.*//'; } > "$file"
  rm -rf "$work"
}
for c in "${cases[@]}"; do
  name=${c%%|*}; rest=${c#*|}; np=${rest%%|*}; cmd=${rest#*|}
  launch=(); [ "$np" = 1 ] || launch=(mpirun -np "$np")
  values "$out/$name.old" "${launch[@]}" "$old_bin" $cmd || { echo "$name: FAILED with OLD_BIN"; fail=1; continue; }
  values "$out/$name.new" "${launch[@]}" "$new_bin" $cmd || { echo "$name: FAILED with NEW_BIN"; fail=1; continue; }
  if cmp -s "$out/$name.old" "$out/$name.new"; then echo "$name: IDENTICAL ($(wc -l < "$out/$name.old") logged steps)"
  else echo "$name: DIFFERS"; diff "$out/$name.old" "$out/$name.new" | head -6; fail=1; fi
done
[ $fail = 0 ] && echo "ALL IDENTICAL" || echo "SOME CASES DIFFER OR FAILED"
exit $fail
