#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine that has torch but none of the product's
# services: the CUDA tests (without the suite's PostgreSQL/S3/valkey session fixtures: only
# the engine's conftest is loaded), then the long-context grid on a random-weight
# Llama-3-8B shape with the default KV codec and with fp16, chunks from the CPU-memory tier
# and the GPU tier. Results go to $OUT (or ./gpu-out):
# checks.txt (environment and tests), grid.txt (the tables), lc.tar (each run's JSON) and
# decode.txt / decode.json (decode tokens/s at batch 1 and 16 beside the HBM's bound) and
# profile.txt (host against device time of a 4,096-token reuse and blend; PROFILE=0 skips it).
#   bash bench/gpu_checks.sh [PYTHON]      # e.g. PYTHON=.venv/bin/python; LAYERS=2 to smoke-test
# TESTS=0 skips the tests; GRID and CODECS (below) choose the runs; the passes run as CUDA
# graphs (ENGINE_COMPILE, kvservice.blend.graphs), and 4,096 tokens once more without them
# (EAGER=0 skips that run).
set -u
PY=${1:-python3}
OUT=${OUT:-gpu-out}
DEVICE=${DEVICE:-cuda}
LAYERS=${LAYERS:-}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
layers=${LAYERS:+--layers $LAYERS}

checks="$OUT/checks.txt"
[ "${TESTS:-1}" = 0 ] && checks="$OUT/checks-notests.txt"  # a second call keeps the first's log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$checks"
"$PY" -c 'import torch, sys; print(sys.version, torch.__version__, torch.cuda.is_available())' \
  2>&1 | tee -a "$checks"

[ "${TESTS:-1}" = 0 ] || timeout 200 "$PY" -m pytest -q -p no:cacheprovider -p no:django --confcutdir=tests/kvservice \
  -o addopts=-ra -m "gpu or not slow" tests/kvservice/test_cuda.py \
  tests/kvservice/test_graphs.py tests/kvservice/test_decode_graph.py \
  tests/kvservice/test_half_precision.py tests/kvservice/test_kernels.py \
  "tests/kvservice/store/test_codec.py::test_decoding_on_cuda_gives_the_cpu_values" \
  "tests/kvservice/store/test_codec.py::test_encoding_on_cuda_gives_the_cpu_object_up_to_rounding" \
  "tests/kvservice/store/test_codec.py::test_the_loader_decodes_runs_of_layers_in_one_call" \
  "tests/kvservice/store/test_tiers.py::test_a_pinned_tier_holds_page_locked_blocks_and_counts_their_size" \
  "tests/kvservice/store/test_loader.py::test_a_requests_chunks_in_memory_are_decoded_together" \
  "tests/kvservice/store/test_loader.py::test_a_loaders_chunks_placed_by_runs_of_layers_fill_the_cache_as_layer_by_layer" \
  --deselect "tests/kvservice/test_kernels.py::test_the_worker_reads_and_checks_engine_precision_and_kernel" \
  2>&1 | tee -a "$checks"

grid() {  # context chunks codec [extra bench args]; NAME: the JSON's suffix
  local ctx=$1 chunks=$2 codec=$3 json="lc_$1_$3${NAME:-}.json"; shift 3
  echo "== context $ctx, $chunks chunks, KV_CODEC=$codec ENGINE_COMPILE=${ENGINE_COMPILE:-on} $*"
  KV_CODEC=$codec timeout 130 "$PY" -m kvservice.bench --synthetic llama3-8b $layers \
    --context "$ctx" --chunks "$chunks" --modes full,reuse,blend --ratio 0.15 \
    --device "$DEVICE" --json "$OUT/$json" "$@" 2>&1
  tar -rf "$OUT/lc.tar" -C "$OUT" "$json" && rm "$OUT/$json"
}
# GRID: context:chunks pairs in order of importance (every run also reads from the GPU tier,
# the first from the disk tier too); CODECS likewise. After the first pair: the same context
# with the passes as the engine runs them (ENGINE_COMPILE=off; EAGER=0 skips it), and the
# decode bench, so that a call cut short still has the comparisons that matter most.
GRID=${GRID-4096:6 16384:12 32768:20 8192:8}  # set but empty: no grid
CODECS=${CODECS-kivi4k3v-v4early fp16}
decode() {  # decode beside its limit: batch 1 and 16 over 4,096 cached tokens, bfloat16,
  # the steps recorded as CUDA graphs, then (unless EAGER=0) as the engine runs them
  timeout 200 "$PY" -m bench.decode --synthetic llama3-8b $layers --device "$DEVICE" \
    --dtype bfloat16 --batch 1,16 --context 4096 --steps 32 --json "$OUT/decode.json" 2>&1 \
    | tee "$OUT/decode.txt"
  [ "${EAGER:-1}" = 0 ] || ENGINE_COMPILE=off timeout 200 "$PY" -m bench.decode --synthetic \
    llama3-8b $layers --device "$DEVICE" --dtype bfloat16 --batch 1,16 --context 4096 \
    --steps 32 --json "$OUT/decode_eager.json" 2>&1 | tee -a "$OUT/decode.txt"
}
first=1
for ctx_chunks in $GRID; do
  also=(--also-tiers device)
  [ "$first" = 1 ] && also=(--also-tiers device,disk)
  ctx=${ctx_chunks%:*} chunks=${ctx_chunks#*:}
  for codec in $CODECS; do grid "$ctx" "$chunks" "$codec" "${also[@]}" | tee -a "$OUT/grid.txt"; done
  if [ "$first" = 1 ]; then
    [ "${EAGER:-1}" = 0 ] || ENGINE_COMPILE=off NAME=_eager grid "$ctx" "$chunks" \
      "${CODECS%% *}" --also-tiers device | tee -a "$OUT/grid.txt"
    [ "${DECODE:-1}" = 0 ] || decode
    first=0
  fi
done
# Last, where time is left: where a 4,096-token reuse and blend spend host and device time
# (torch.profiler, the passes as CUDA graphs), for the breakdown against the bars.
[ "${PROFILE:-1}" = 0 ] || timeout 150 "$PY" -m bench.gpu_profile --synthetic llama3-8b $layers \
  --device "$DEVICE" --context 4096 --chunks 6 --tier cpu --modes reuse,blend --rows 20 \
  > "$OUT/profile.txt" 2>&1
