#!/usr/bin/env bash
# The accelerator figures of docs/performance.md in one run on a CUDA machine (one GPU):
# versions; bench/train_step.py on realm_base in bf16 at the paper's per-device batch (8
# queries), with cuDNN's fused attention (traced: bench/trace_summary.py prints where the device
# time went), then at 32 queries with remat, then with the config's own attention (XLA, with
# attention dropout); bench/memory.py (realm_base and ict_base on this device's compiler,
# compile only, beside the rest in three processes); bench/index_scale.py's device figures (exact top-k over 13.35M x
# 128, the BERT-base block tower's blocks/s at 288 wordpieces; --skip_scann: ScaNN is
# host-side). The 6.8 GB synthetic table is generated on the host while the train step runs.
#
#   bash bench/gpu.sh [OUT_DIR [PARTS]]   (default runs/gpu; logs and JSONL land there)
#
# PARTS (default "step memory index"; of the words step, memory, index and real): which figures
# to take; the train steps run first, alone on the device, the compile-only memory bench beside
# them. `real` (on its own: it wants the device and the deadline to itself) runs `make
# demo-real`'s recipe at its accelerator scale (`python -m realm_jax.demo_real --scale gpu`,
# workdir $REAL_WORKDIR, default runs/real_gpu;
# the SQuAD-format file $SQUAD, the seed $SEED (default 0); all-MiniLM-L6-v2 installed), with XLA's GEMM autotuning off
# (the recipe compiles ~20 programs of a small model) and JAX's compilation cache in the
# workdir (programs that took over a second to compile are read back by a resumed run and by
# later stages of the same shapes). It gets SIGTERM 45 s before the deadline and 40 s to stop
# (its stages save their steps within ~1 s on a GPU; launch/local.py and the train loop each
# allow 30 s, and a stage still running when `timeout` kills the driver runs on in its own
# session); running the part again resumes it from there; summary.json is copied to
# OUT_DIR/real_summary.json once it exists. On an H200 the whole recipe took ~525 s of the
# demo's time (2026-11-27): in one 600 s call that is DEADLINE=590.
#
# Every part has a time limit and the whole run a deadline ($DEADLINE seconds, default 560), so
# that it ends inside a 10-minute lease; a part cut short says so in its log. The script exits
# 1, naming them, when a part did not exit 0 (a time limit included; background parts too) or
# was skipped for the deadline, else 0 (trace_summary, which reads train_step_cudnn's trace, is
# skipped without a failure of its own when that part failed). It exits 2 at once, before any
# part, on an unknown PARTS word, where `nvidia-smi -L` finds no GPU or where $PYTHON's JAX
# has no GPU backend (PYTHON and DEADLINE are read from the environment; a fake nvidia-smi
# first on PATH lets it run for a test).
# Processes allocate device memory as they need it (XLA_PYTHON_CLIENT_PREALLOCATE=false), so
# that they can share the device.
set -u
out=${1:-runs/gpu}
parts=" ${2:-step memory index} "
for word in $parts; do
  case $word in
    step|memory|index|real) ;;
    *) echo "bench/gpu.sh: unknown part '$word' in PARTS (one or more of: step memory index" \
         "real)" >&2; exit 2 ;;
  esac
done
if ! nvidia-smi -L > /dev/null 2>&1; then   # else it would compile realm_base on the CPU
  echo "bench/gpu.sh: no NVIDIA GPU here (\`nvidia-smi -L\` failed): run it on a CUDA machine" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
# nor where JAX has no CUDA backend (a plain `pip install jax`, as `make install` makes)
backend=$($python -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -1)
if [ "$backend" != gpu ]; then
  echo "bench/gpu.sh: JAX finds no GPU here (its backend: ${backend:-none, jax did not import}):" \
    "install jaxlib's CUDA plugin (pip install -e '.[cuda]')" >&2
  exit 2
fi
mkdir -p "$out"
deadline=${DEADLINE:-560}
cache=runs/bench_index_scale
want() { [[ "$parts" == *" $1 "* ]]; }
failed=""   # the parts that exited non-zero (a time limit included) or were skipped: exit 1
declare -A background_pids   # name -> pid of a part run in the background
memory_logs=()   # the memory parts this run started, their logs printed at the end

quiet() { grep -v -e "^\*\*\*" -e "slow_operation_alarm" -e "Very slow compile" -e "^$"; }

part() {   # part NAME LIMIT_S COMMAND...: runs COMMAND, its output to the console and $out/NAME.log
           # (SIGTERM at the limit, SIGKILL $GRACE seconds later, default 10)
  local name=$1 limit=$2 grace=${GRACE:-10}; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped (${left}s to the deadline)"; failed="$failed $name(skipped)"; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after="$grace" "$limit" "$@" 2>&1 | tee "$out/$name.log" | quiet
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (time limit)')"
  [ "$rc" = 0 ] || failed="$failed $name"
  return "$rc"
}

background() {   # background NAME LIMIT_S COMMAND...: as part, in the background, log only;
                 # skipped as part skips, its limit cut to the deadline as part's
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "== $name: skipped (a limit of ${limit}s, ${left}s to the deadline)"
    failed="$failed $name(skipped)"; return 1
  fi
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1 &
  background_pids[$name]=$!
}

waited() {   # waited NAME: waits for background part NAME (none if it was skipped); its
             # failure recorded, said
  [ -n "${background_pids[$1]:-}" ] || return 0
  local rc=0
  wait "${background_pids[$1]}" || rc=$?
  [ "$rc" = 0 ] || { echo "== $1 (background): exit $rc"; failed="$failed $1"; }
  unset "background_pids[$1]"
}

{
  # the host CPU: x86's /proc/cpuinfo names it; an aarch64 host (Grace) only through lscpu
  grep -m1 "^model name" /proc/cpuinfo || lscpu 2>/dev/null | grep -m1 "^Model name" \
    || echo "model name: unknown ($(uname -m))"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $python -c "import jax, jaxlib, flax, optax, orbax.checkpoint as o, numpy, sys; \
print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, \
'numpy', numpy.__version__); print(jax.devices())"
} 2>&1 | tee "$out/versions.log"

# The index bench's table, on the host (index_scale reuses its cache).
want index && background table $((deadline - 60)) $python bench/index_scale.py --table_only \
  --cache "$cache"
# Memory: compile only, without GEMM autotuning (it times kernels; the plan's sizes hardly move).
want memory && for cases in "realm_base --dtype bfloat16" "realm_base --dtype float32" \
    "ict_base"; do
  set -- $cases
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" background "memory_$1_${3:-all}" \
    $((deadline - 40)) $python bench/memory.py --only $cases --out "$out/memory.jsonl" \
    && memory_logs+=("$out/memory_$1_${3:-all}.log")
done

cudnn=(--set model.attention=cudnn --set model.attention_dropout_rate=0)
if want step; then
  if part train_step_cudnn 270 $python bench/train_step.py --only base --batch 8 --steps 10 \
      "${cudnn[@]}" --profile "$out/trace" --out "$out/train_step.jsonl"; then
    part trace_summary 60 $python bench/trace_summary.py "$out/trace/base" --top 25
  else   # no trace to read: its failure is train_step_cudnn's, counted once
    echo "== trace_summary: skipped (train_step_cudnn did not exit 0)"
  fi
fi
if want index; then
  if [ -n "${background_pids[table]:-}" ]; then   # (not where it was skipped: an old log)
    waited table; tr '\r' '\n' < "$out/table.log" | tail -1
  fi
  part index_scale 220 $python bench/index_scale.py --skip_scann --qps_seconds 5 \
    --embed_batch 256 --embed_batches 4 --cache "$cache" --out "$out/index_scale.jsonl"
fi
if want step; then
  part train_step_cudnn_b32 200 $python bench/train_step.py --only base --batch 32 --steps 5 \
    "${cudnn[@]}" --set model.remat=matmuls --out "$out/train_step.jsonl"
  part train_step_xla 200 $python bench/train_step.py --only base --batch 8 --steps 10 \
    --out "$out/train_step.jsonl"
fi
if want real; then
  real=${REAL_WORKDIR:-runs/real_gpu}
  limit=$((deadline - SECONDS - 45))   # SIGTERM then: 40 s to save before the deadline
  if [ "$limit" -lt 60 ]; then
    echo "== demo_real: skipped ($((deadline - SECONDS))s to the deadline)"
    failed="$failed demo_real(skipped)"
  else
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
      JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$real/jax_cache}" \
      GRACE=40 part demo_real "$limit" $python -m realm_jax.demo_real --workdir "$real" \
      --scale gpu ${SQUAD:+--squad "$SQUAD"} ${SEED:+--seed "$SEED"}
  fi
  [ -f "$real/summary.json" ] && cp "$real/summary.json" "$out/real_summary.json"
fi
for name in "${!background_pids[@]}"; do waited "$name"; done
if want memory; then
  for log in "${memory_logs[@]}"; do   # this run's (not an earlier run's in the same OUT)
    echo "== $log"; quiet < "$log" | tail -9
  done
fi
if [ -n "$failed" ]; then echo "== parts that did not exit 0:$failed"; exit 1; fi
echo "== every part exited 0"
