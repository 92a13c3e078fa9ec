#!/usr/bin/env bash
# Fine-grained activation offloading changes no number: a tiny MoE model (a dense first layer, a
# shared expert, input jitter, global_aux_loss) trains 3 iterations with and without
# --fine-grained-activation-offloading -- every module; expert_fc1 + moe_act with moe_act and
# core_attn recomputed; core_attn + mlp_norm with core_attn, mlp and shared_experts recomputed;
# attn_proj alone (it shares its bytes with core_attn's output) -- on one rank and under TP2+SP,
# PP2 (1F1B over 4 micro-batches), PP2 with 2 virtual stages per rank, EP2 and CP2 (without
# core_attn recomputation, which CP refuses; mpirun, CPU ranks), and logs bit-identical lm loss, balancing loss and grad norm; one rank also saves
# bit-identical checkpoints (the weights after 3 updates: the gradients were the same). Offloading
# every module lowers the peak of allocated memory, and --memory-report shows the offloaded
# activations out of the device peak (its parts still sum to the peak within 3%) with a
# host_offloaded line and record.
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-layers 4 --moe-layer-freq "[0,1,1,1]"
      --moe-shared-expert-intermediate-size 32 --moe-input-jitter-eps 0.05
      --moe-router-load-balancing-type global_aux_loss)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
MIN_LOGGED=9
. "$(dirname "$0")/layout_compare.sh"  # run
peak() { grep -o '"mem_max_allocated_bytes":[0-9]*' "$1" | cut -d: -f2 | sort -n | tail -n 1; }
offload=(--fine-grained-activation-offloading --offload-modules)
options=("attn_norm core_attn attn_proj mlp_norm expert_fc1 moe_act"
         "expert_fc1 moe_act --recompute-granularity selective --recompute-modules moe_act core_attn"
         "core_attn mlp_norm --recompute-granularity selective --recompute-modules core_attn mlp shared_experts"
         "attn_proj")
tp="--tensor-model-parallel-size 2 --sequence-parallel"
ep="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
pp="--pipeline-model-parallel-size 2"
for layout in "1" "2 $tp" "2 $pp" "2 $pp --num-layers-per-virtual-pipeline-stage 1" "2 $ep" \
              "2 --context-parallel-size 2"; do
  read -r -a l <<<"$layout"
  save=()
  [ "${l[0]}" = 1 ] && save=(--save "$dir/ckpt_plain" --save-interval 3)
  run plain "${l[0]}" "${base[@]}" "${l[@]:1}" "${save[@]}"
  for option in "${options[@]}"; do
    # CP: core_attn recomputation is not available there (its own refusal)
    [[ "$layout" == *context-parallel* && "$option" == *"recompute-modules"*core_attn* ]] && continue
    read -r -a o <<<"$option"
    save=()
    if [ "${l[0]}" = 1 ]; then
      rm -rf "$dir/ckpt_offload"
      save=(--save "$dir/ckpt_offload" --save-interval 3)
    fi
    run offloaded "${l[0]}" "${base[@]}" "${l[@]:1}" "${offload[@]}" "${o[@]}" "${save[@]}"
    cmp <(values "$dir/plain.jsonl") <(values "$dir/offloaded.jsonl") ||
      { echo "FAIL: np ${l[*]} with --offload-modules $option differs from keeping everything"; exit 1; }
    echo "np ${l[*]} --offload-modules $option: bit-identical"
    if [ "${l[0]}" = 1 ]; then
      for f in $(cd "$dir/ckpt_plain" && find . -name '*.safetensors'); do
        cmp "$dir/ckpt_plain/$f" "$dir/ckpt_offload/$f" || { echo "FAIL: checkpoint $f differs with $option"; exit 1; }
      done
      [ -n "$(cd "$dir/ckpt_plain" && find . -name '*.safetensors')" ] || { echo "FAIL: no checkpoint saved"; exit 1; }
      echo "  the same weights after 3 updates"
    fi
    if [ "${l[0]}" = 1 ] && [ "$option" = "${options[0]}" ]; then
      [ "$(peak "$dir/offloaded.jsonl")" -lt "$(peak "$dir/plain.jsonl")" ] ||
        { echo "FAIL: peak $(peak "$dir/offloaded.jsonl") not below $(peak "$dir/plain.jsonl")"; exit 1; }
      echo "  peak allocated $(peak "$dir/offloaded.jsonl") < $(peak "$dir/plain.jsonl") bytes"
    fi
  done
done

# --memory-report: 6 layers, expert_fc1 + moe_act offloaded. fc1's output (the report's
# expert_fc1) leaves the device peak, the parts still sum to the peak, host_offloaded names both.
report=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 2 --lr-warmup-iters 1 --log-interval 2
        --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-layers 6 --memory-report)
MIN_LOGGED=3  # one logged iteration
run plain 1 "${report[@]}"
run offloaded 1 "${report[@]}" "${offload[@]}" expert_fc1 moe_act
grep -q 'check: the parts sum to .*(within 3%)' "$dir/offloaded.log" || { cat "$dir/offloaded.log"; echo "FAIL: check line"; exit 1; }
grep -qE '^ +host_offloaded [0-9.]+ MB at most in host memory, not in the peak \(expert_fc1 [0-9.]+, moe_act [0-9.]+\)' \
  "$dir/offloaded.log" || { cat "$dir/offloaded.log"; echo "FAIL: no host_offloaded line"; exit 1; }
grep -q host_offloaded "$dir/plain.log" && { echo "FAIL: a host_offloaded line without offloading"; exit 1; }
python3 - "$dir/plain.jsonl" "$dir/offloaded.jsonl" <<'PY'
import json, sys
def report(path):
    return [json.loads(l) for l in open(path) if "memory_report" in l][0]["memory_report"][0]
plain, off = report(sys.argv[1]), report(sys.argv[2])
parts = ["weights", "gradients", "optimizer_state", "activations", "communication", "workspace", "untagged",
         "allocator_overhead"]
total = sum(off[p] for p in parts)
assert abs(total / off["peak_reserved_bytes"] - 1) <= 0.03, (total, off["peak_reserved_bytes"])
assert off["peak_reserved_bytes"] < plain["peak_reserved_bytes"], (off["peak_reserved_bytes"], plain["peak_reserved_bytes"])
fc1 = lambda r: r["activation_modules"].get("expert_fc1", 0)
assert fc1(off) < fc1(plain), f"fc1's output at the peak: {fc1(off)} offloaded, {fc1(plain)} kept"
assert "host_offloaded_bytes" not in plain, plain
mods = off["host_offloaded_modules"]
assert set(mods) == {"expert_fc1", "moe_act"} and off["host_offloaded_bytes"] >= max(mods.values()) > 0, off
print("memory report: peak", plain["peak_reserved_bytes"], "->", off["peak_reserved_bytes"], "bytes; expert_fc1",
      fc1(plain), "->", fc1(off), "; host", off["host_offloaded_bytes"], mods)
PY
echo PASS
