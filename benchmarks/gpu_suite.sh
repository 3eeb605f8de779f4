#!/usr/bin/env bash
# The GPU machine's work in one command: build the operators with CUDA, then the steps
# named (default: all of them). Logs and JSON go to $OUT (default ./out). Uses the
# machine's own python3 and torch, and bladesmith from src/.
#   bash benchmarks/gpu_suite.sh [cuda-tests] [cuda-ops-tests] [cuda-families-tests] [tests]
#       [bench-ops] [bench-passes] [bench-optimize] [bench-optimize-b1] [probe-reload] [bench-models] [bench-scripted]
#       [bench-families] [family-NAME] [probe-capture] [probe-capture-rcnn] [probe-rcnn]
#       [probe-rcnn-compiled]
#       [probe-serve-batches] [probe-serve-host] [compiled-artifact]
#       [artifact-MODEL] [artifact-settings] [artifact-tests] [fp8-MODEL] [fp8-tests] [serve-artifact] [bench-serve]
#       [bench-serve-http|grpc|shm|uint8]
# cuda-tests runs only the tests marked `cuda` (the rest run in CI on the CPU);
# cuda-ops-tests only those of the custom operators, cuda-families-tests those of the
# detector families. family-NAME runs bench_families.py
# for one family (retinanet, fcos, ssd300, ...) at the batch sizes in $FAMILY_BATCHES
# (default 1), in a process of its own; artifact-MODEL runs compiled_artifact.py for one
# model (resnet50_b1, ssdlite, bert_base_b8x128, ...), artifact-settings the Inductor settings
# (default, max_autotune, freezing) for $ARTIFACT_MODELS (default resnet50_b1),
# artifact-tests the `cuda` tests of
# the compiled artifact; fp8-MODEL runs fp8_gpu.py for one model (vit_b_16, bert_base; torchao
# from the carried wheels where they hold it; options from $FP8_OPTIONS, e.g. --search-only),
# fp8-tests the `cuda` tests of the fp8 pass.
# bench-serve* serve with $SERVE_INSTANCES instances
# (default 2) at the concurrencies $SERVE_CONCURRENCY (default 1,8,32,128), batching
# requests for up to $SERVE_DELAY_US microseconds (default 2000). probe-rcnn probes
# $RCNN_FAMILY (default faster_rcnn) in float32, then with the passes $RCNN_PASSES
# (default fixed_shape,fp16,channels_last,conv_fusion); probe-rcnn-compiled probes those
# passes with every stage compiled by Inductor. A step written NAME:SECONDS is stopped after
# that many seconds (its log so far is kept), so that a call to a machine with a time
# limit still returns every step's log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export BLADESMITH_CACHE=${BLADESMITH_CACHE:-/tmp/bladesmith-cache} MAX_JOBS=${MAX_JOBS:-16}
steps=${*:-cuda-tests bench-ops bench-optimize}
status=0
limit=0  # seconds for the step being run (0: no limit)
step() {  # step NAME COMMAND...: run it, log to $out/NAME.log, remember a failure
    local name=$1; shift
    echo "=== $name: $*"
    local start=$SECONDS
    local stop=()
    [ "$limit" -gt 0 ] && stop=(timeout -k 10 "$limit")
    "${stop[@]}" "$@" 2>&1 | tee "$out/$name.log" | tail -n 60
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
serve_artifact() {  # RetinaNet for batch 32, once per machine; the passes its last
    # measured run rejected are left out to keep it short
    step serve-artifact python3 -m bladesmith optimize --device cuda --batch 32 --warmup 3 \
        --iters 10 --exclude head_packing --exclude cudnn_benchmark --out /tmp/rn32.ptc
}
pytest=(python3 -X faulthandler -m pytest -q -ra -p no:cacheprovider)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$out/gpu.txt"
step build python3 -m bladesmith ops build --cuda
for s in $steps; do
    limit=0
    case $s in *:*) limit=${s#*:}; s=${s%%:*} ;; esac
    case $s in
        cuda-tests) step cuda-tests "${pytest[@]}" --maxfail=25 -m cuda tests ;;
        cuda-ops-tests) step cuda-ops-tests "${pytest[@]}" --maxfail=25 -m cuda tests/ops ;;
        cuda-families-tests) step cuda-families-tests "${pytest[@]}" --maxfail=25 -m cuda \
            tests/families ;;
        tests) step tests "${pytest[@]}" tests ;;
        bench-ops)
            step bench-ops-fp32 python3 benchmarks/bench_postprocess.py --json "$out/bench_postprocess_fp32.json"
            step bench-ops-fp16 python3 benchmarks/bench_postprocess.py --dtype float16 --json "$out/bench_postprocess_fp16.json" ;;
        bench-passes)  # the default combos, with their kernel times
            for batch in 1 32; do
                step "bench-passes-b$batch" python3 benchmarks/bench_passes.py --batches "$batch" \
                    --profile --json "$out/bench_passes_b$batch.json"
            done ;;
        bench-optimize)  # one process per batch size: a failure in one keeps the other
            for batch in 1 32; do
                step "bench-optimize-b$batch" python3 benchmarks/bench_optimize.py --batches "$batch" \
                    --json "$out/bench_optimize_b$batch.json"
            done ;;
        bench-optimize-b1) step bench-optimize-b1 python3 benchmarks/bench_optimize.py --batches 1 \
            --json "$out/bench_optimize_b1.json" ;;
        probe-reload) step probe-reload python3 -X faulthandler benchmarks/probe_reload.py \
            --device cuda --out /tmp/probe-reload ;;
        bench-models) step bench-models python3 benchmarks/bench_models.py --device cuda \
            --json "$out/bench_models.json" ;;
        bench-scripted) step bench-scripted python3 benchmarks/bench_scripted_retinanet.py \
            --device cuda --batches 1 32 --warmup 5 --iters 30 --json "$out/bench_scripted.json" ;;
        probe-capture) step probe-capture python3 benchmarks/probe_capture.py --out /tmp/probe-capture ;;
        probe-capture-rcnn) step probe-capture-rcnn python3 benchmarks/probe_capture.py \
            --family faster_rcnn mask_rcnn ;;
        bench-families) step bench-families python3 benchmarks/bench_families.py \
            --json "$out/bench_families.json" ;;
        family-*) step "$s" python3 benchmarks/bench_families.py --families "${s#family-}" \
            --batches ${FAMILY_BATCHES:-1} --warmup 5 --iters 25 --json "$out/$s.json" ;;
        probe-rcnn)  # an R-CNN's stages, float32 then with the passes o1 kept
            family=${RCNN_FAMILY:-faster_rcnn}
            step probe-rcnn-$family-fp32 python3 benchmarks/probe_rcnn.py --family $family \
                --passes fixed_shape
            step probe-rcnn-$family-fp16 python3 benchmarks/probe_rcnn.py --family $family \
                --passes ${RCNN_PASSES:-fixed_shape,fp16,channels_last,conv_fusion} ;;
        probe-rcnn-compiled) family=${RCNN_FAMILY:-faster_rcnn}
            step probe-rcnn-$family-inductor python3 benchmarks/probe_rcnn.py --family $family \
                --passes ${RCNN_PASSES:-fixed_shape,fp16,channels_last,conv_fusion} --compile ;;
        compiled-artifact)  # the .ptc reloaded in a new process against in-process
            step compiled-artifact python3 benchmarks/compiled_artifact.py --device cuda \
                --json "$out/compiled_artifact.json" ;;
        artifact-settings) step artifact-settings python3 benchmarks/compiled_artifact.py \
            --device cuda --models ${ARTIFACT_MODELS:-resnet50_b1} \
            --settings default,max_autotune,freezing --json "$out/artifact_settings.json" ;;
        artifact-tests) step artifact-tests "${pytest[@]}" -m cuda \
            tests/runtimes/test_compiled_program.py ;;
        artifact-*) step "$s" python3 benchmarks/compiled_artifact.py --device cuda \
            --models "${s#artifact-}" --json "$out/$s.json" ;;
        fp8-tests) step fp8-tests "${pytest[@]}" -m cuda tests/passes/test_float8.py ;;
        fp8-*)
            [ -d /tmp/site ] || ! ls .whl/*.whl >/dev/null 2>&1 || python3 -m pip install -q \
                --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
            step "$s" env PYTHONPATH="$PYTHONPATH:/tmp/site" python3 benchmarks/fp8_gpu.py \
                --models "${s#fp8-}" --search-iters 10 ${FP8_OPTIONS:-} --json "$out/$s.json" ;;
        probe-serve-batches) step probe-serve-batches python3 benchmarks/probe_serve_batches.py ;;
        probe-serve-host)
            [ -f /tmp/rn32.ptc ] || serve_artifact
            step probe-serve-host python3 benchmarks/probe_serve_host.py --artifact /tmp/rn32.ptc \
                --trust ;;
        serve-artifact) serve_artifact ;;
        bench-serve*)  # Triton from the carried wheels (.whl, see benchmarks/README.md)
            [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile \
                --target /tmp/site .whl/*.whl
            export PYTHONPATH=$PYTHONPATH:/tmp/site
            [ -f /tmp/rn32.ptc ] || serve_artifact
            serve=(python3 benchmarks/bench_serve.py --artifact /tmp/rn32.ptc --trust
                --instances ${SERVE_INSTANCES:-2} --concurrency ${SERVE_CONCURRENCY:-1,8,32,128}
                --max-queue-delay-us ${SERVE_DELAY_US:-2000})
            case $s in bench-serve|bench-serve-http) step bench-serve "${serve[@]}" \
                --json "$out/bench_serve.json" --log "$out/triton.log" ;; esac
            case $s in bench-serve|bench-serve-grpc) step bench-serve-grpc "${serve[@]}" \
                --grpc --image-dtype uint8 --json "$out/bench_serve_grpc.json" ;; esac
            case $s in bench-serve|bench-serve-shm) step bench-serve-shm "${serve[@]}" \
                --shared-memory --json "$out/bench_serve_shm.json" ;; esac
            case $s in bench-serve|bench-serve-uint8) step bench-serve-uint8 "${serve[@]}" \
                --image-dtype uint8 --json "$out/bench_serve_uint8.json" ;; esac ;;
        *) echo "unknown step $s"; status=1 ;;
    esac
done
exit $status
