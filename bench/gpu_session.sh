#!/usr/bin/env bash
# The one prepared GPU check of issue 28, run by the device tool on a lent H100/H200 (or DEVICE=cpu here, a dry
# run of the script's plumbing). Every stage has its own time limit, so a slow or hung stage costs only its
# share; each writes one log under $OUT (at most 8 files come back), and the end prints a summary.
#
#   run: bash bench/gpu_session.sh   (WHL_DIR: wheels of what the device image lacks; TOK_DIR: smollm2's tokenizer)
#   STAGES="kernels attention" bash bench/gpu_session.sh   runs a subset
#   stages: env prebuild lorastack graphs tests kernels check e2e throughput attention serve sanitizer isa peak
#   isa: the host CPU's SIMD paths (AVX-512 VNNI, AMX where present) against the scalar reference, no GPU needed
#   peak: bench/isa_peak.py on the host CPU (the multiply-add instructions' peaks, AMX's too, beside the A16 GEMM)
#   check: e2e's determinism and greedy-token check alone (e2e also measures throughput)
#   Two copies may run at once (a CPU-only one beside the GPU one) when each has its own SUMMARY file.
set -u
OUT=${OUT:-/tmp/gpu_out}
DEVICE=${DEVICE:-cuda}
STAGES=${STAGES:-"env graphs kernels e2e attention serve sanitizer"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
WHL_DIR=${WHL_DIR:-.whl}  # wheels of what the device image lacks (trio, quart, pyzmq, gguf, llguidance, ...)
TOK_DIR=${TOK_DIR:-.gpu/tok}  # smollm2's tokenizer files, for the served random-weight model
SUMMARY=${SUMMARY:-/tmp/gpu_summary.txt}  # one per copy of this script running at once
: >"$SUMMARY"

stage() {  # stage NAME LIMIT_S CMD...: run CMD with a limit, log to $OUT/NAME.log, note rc and seconds
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc in $(($(date +%s) - t0))s" | tee -a "$SUMMARY"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

want() { [[ " $STAGES " == *" $1 "* ]]; }

env_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
    nvcc --version | tail -n 2 || true
    "$PY" - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import cupy
    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as e:  # noqa: BLE001 - a report, not a check
    print("cupy missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "SMs", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30, 1))
PY
    lscpu | grep -E "Model name|^CPU\(s\)" || true
}

serve_check() {  # kvgate serve on the device with a random-weight smollm2-shaped model, then bench/serve.py
    local dir=/tmp/kvgate-rnd port=8011 key i
    rm -f /tmp/kvgate-gpu.db*  # a fresh store prints a fresh demo key
    "$PY" bench/gpu_model_dir.py "$dir" --tokenizer-from "$TOK_DIR" || return 1
    "$PY" -m gateway serve --model "$dir" --served-model-name rnd --device "$DEVICE" --dtype "${SERVE_DTYPE:-bfloat16}" \
        --db /tmp/kvgate-gpu.db --port $port --log-format text >"$OUT/server.log" 2>&1 &
    SERVER_PID=$!  # global: the EXIT trap runs after this function's locals are gone
    trap 'kill -INT $SERVER_PID 2>/dev/null; sleep 3; pkill -9 -f kvgate-rnd' EXIT TERM
    local pid=$SERVER_PID
    for i in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
        kill -0 $pid 2>/dev/null || { echo "server exited"; tail -n 40 "$OUT/server.log"; return 1; }
        sleep 1
    done
    key=$(grep -o 'KVGATE_API_KEY=[^ ]*' "$OUT/server.log" | head -n 1 | cut -d= -f2)
    curl -s -m 60 "http://127.0.0.1:$port/v1/chat/completions" -H "Authorization: Bearer $key" \
        -H 'Content-Type: application/json' \
        -d '{"model":"rnd","messages":[{"role":"user","content":"Hello"}],"max_tokens":8,"temperature":0}'
    echo
    for c in ${SERVE_CS:-1 16 64}; do
        KVGATE_API_KEY=$key "$PY" bench/serve.py --base-url "http://127.0.0.1:$port" --model rnd \
            --num-prompts $((c == 1 ? 8 : 2 * c)) --max-concurrency $c --random-input-len 128 \
            --random-output-len "${SERVE_OUT:-128}" --max-duration 60 --output-json "/tmp/serve_c$c.json" | grep -E \
            "Successful|Output token throughput|Mean TTFT|Mean TPOT|errors"
    done
}

isa_check() {  # the A16 GEMM harness on the host CPU: every path bit-equal to scalar, and one thread's GMAC/s
    lscpu | grep -E "Model name|^CPU\(s\)|family|Model:" || true
    grep -o -w -E "avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16" /proc/cpuinfo \
        | sort | uniq -c || true
    g++ -O3 -ffp-contract=off -std=c++17 -Ikernels_cupy/cpu bench/qgemm16_harness.cpp -o /tmp/h16 || return 1
    local run  # one harness per core at once (each is one thread): "isa bits shapes"
    # vnni512 / vnni256: the VNNI lane kernel on 512- or 256-bit vectors (qgemm_core.h, vnni_zmm), AMX off
    for run in "best 4 12" "best 8 12" "vnni512 4 12" "vnni512 8 12" "vnni256 4 12" "vnni256 8 12" "avx2 4 4" \
        "avx2 8 4"; do
        set -- $run
        KVGATE_QGEMM_ISA=$1 /tmp/h16 "$2" "$3" >"/tmp/h16_$1_$2.txt" &
    done
    wait
    for run in best_4 best_8 vnni512_4 vnni512_8 vnni256_4 vnni256_8 avx2_4 avx2_8; do
        echo "-- $run: ok $(grep -c ' ok$' "/tmp/h16_$run.txt") MISMATCH $(grep -c MISMATCH "/tmp/h16_$run.txt")"
        grep -E "K=  576 M=(   1|  16| 512) |K= 1536 M=(   1|  16| 512) " "/tmp/h16_$run.txt"
    done
    tail -n +1 /tmp/h16_*.txt >"$OUT/h16_all.txt"  # every line, for the RESULTS tables
}

export -f env_info serve_check isa_check
export OUT DEVICE PY TOK_DIR SERVE_DTYPE SERVE_CS SERVE_OUT SANITIZE_TESTS

if want env; then
    if ls "$WHL_DIR"/*.whl >/dev/null 2>&1; then
        stage env 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHL_DIR"/*.whl
        export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
    stage env 30 bash -c env_info
fi
if want prebuild; then  # the C++ CPU kernels once, before xdist workers would each wait on the build lock
    stage prebuild "${PREBUILD_LIMIT:-300}" "$PY" -c "from kernels_cupy.cpu.prebuild import main; main()"
fi
if want lorastack; then  # the LoRA stack tests alone in one process (a SIGSEGV there on the ninth session's H100)
    stage lorastack "${LORASTACK_LIMIT:-240}" "$PY" -X faulthandler -m pytest --noconftest -p no:cacheprovider -q \
        -rfE tests/test_lora_stack.py
fi
if want graphs; then  # CUDA graphs of the decode step against eager steps
    stage graphs "${GRAPHS_LIMIT:-50}" "$PY" -m pytest --noconftest -p no:cacheprovider -q -rfE tests/test_cuda_graphs.py
fi
if want tests; then  # the GPU tests other than the kernel grid: graphs, row kernels, tiled GEMMs, LoRA, nvcc builds
    stage tests "${TESTS_LIMIT:-150}" "$PY" -m pytest --noconftest -p no:cacheprovider -q -rfE --timeout 120 \
        -n "${XDIST:-4}" ${GPU_TESTS:-tests/test_cuda_graphs.py tests/test_rows_cuda.py tests/test_kernels_compile.py}
fi
if want e2e || want check; then  # greedy tokens and determinism on the device (fp32, bf16), then tok/s against transformers (bf16)
    stage e2e "${CHECK_LIMIT:-75}" "$PY" bench/gpu_e2e.py --device "$DEVICE" \
        --check bench/data/gpu_expect_smollm2.json
fi
if want e2e || want throughput; then
    stage e2e "${E2E_LIMIT:-110}" "$PY" bench/gpu_e2e.py --device "$DEVICE" --throughput \
        --json "$OUT/e2e_throughput.json" ${E2E_ARGS:-}
fi
if want kernels; then  # the GPU test file; xdist spreads NVRTC compiles over the CPU cores
    stage kernels "${KERNELS_LIMIT:-130}" "$PY" -m pytest --noconftest -p no:cacheprovider -q -rfE \
        --timeout 120 -n "${XDIST:-16}" --durations 8 tests/test_kernels_gpu.py
fi
if want attention; then
    stage attention 40 "$PY" bench/attention.py --batches 1,16,64 --contexts 512,4096,32768
    stage attention 30 "$PY" bench/attention.py --batches 1,16,64 --contexts 512,4096,32768 --heads 9 \
        --kv-heads 3 --head-dim 64
fi
if want serve; then
    stage serve "${SERVE_LIMIT:-80}" bash -c serve_check
fi
if want sanitizer; then  # a few small cases under memcheck and racecheck (slow: every launch is instrumented)
    for tool in memcheck racecheck; do
        stage sanitizer "${SANITIZE_LIMIT:-45}" compute-sanitizer --tool $tool --error-exitcode 9 "$PY" -m pytest --noconftest \
            -p no:cacheprovider -q ${SANITIZE_TESTS:-"tests/test_kernels_gpu.py::test_never_reads_unwritten_slots[always]" \
            "tests/test_kernels_gpu.py::test_decode_grid[always-8-2048-smollm2-fp16]"}
    done
fi
if want isa; then  # the CPU paths this workplace's 2-core machines may lack, then their tests (tiny models only)
    [ "${ISA_HARNESS:-1}" = 1 ] && stage isa "${ISA_LIMIT:-150}" bash -c isa_check  # ISA_HARNESS=0: tests only
    [ "${ISA_PYTEST:-1}" = 1 ] && stage isa "${ISA_TESTS_LIMIT:-300}" "$PY" -m pytest --noconftest -p no:cacheprovider -q -rfE --timeout 280 \
        -n "${XDIST:-8}" -k "not smollm2" ${ISA_TESTS:-tests/test_qgemm_a16.py tests/test_quantization.py \
        tests/test_fgemm.py tests/test_decode_stack.py tests/test_determinism.py tests/test_cpu_kernel.py \
        tests/test_kv_int8.py tests/test_lora_add_kernel.py}
fi
if want peak; then  # one thread per instruction and per GEMM call, so run it while the other cores are quiet-ish
    stage peak "${PEAK_LIMIT:-180}" "$PY" bench/isa_peak.py --rounds "${PEAK_ROUNDS:-2}"
fi
echo "== summary"
cat "$SUMMARY"
