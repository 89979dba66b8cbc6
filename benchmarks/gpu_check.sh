#!/usr/bin/env bash
# GPU figures from one prepared script (issue 40): parity of the kernels in bf16, throughput and
# MFU of a 1B LLaMA (Hugging Face eager, the recipe, the recipe compiled), explain against the
# run, and `slapo-fn train` on CUDA with checkpoints and a bit-identical resume. Under 8 minutes
# on one H100 or H200; writes OUT/gpu_check.json (the figures, each part's status and error),
# OUT/gpu_check.log (what it printed) and, where the recipe is short of its goal, profiler
# kernel tables (OUT/profile_*.txt). The parts and their time shares: benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh OUT            # on the GPU machine
#   bash benchmarks/gpu_check.sh OUT --smoke    # every part on a tiny model on CPU (the test suite)
#   make gpu-check OUT=folder                   # the same as the first line
# SLAPO_FN_WHEELHOUSE=DIR: wheels from DIR instead of .whl/; PYTHON=...: another interpreter.
#
# With the device tool of this workplace (one call; the machine has no network):
#   1. here, once: `make wheelhouse` (the tested transformers as a wheel in .whl/, ignored by git;
#      the machine's 5.17 is the fallback: the script drops the wheelhouse if it breaks imports);
#   2. run(command="bash benchmarks/gpu_check.sh $OUT", carry=[".whl"], timeout_s=540):
#      the script stops itself at 465 s of work, so a 540 s limit leaves the session's
#      15 device minutes room for one more, shorter call;
#   3. copy $OUT/gpu_check.json to benchmarks/results/<device>-<date>.json and the figures into
#      the README's table of GPU figures.
# What the machine has: Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, tokenizers,
# safetensors, einops, tqdm, accelerate, triton; no datasets, flash-attn or optuna.
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: bash benchmarks/gpu_check.sh OUT [--smoke [--quick]] [--parts parity,throughput,explain,train,levers,cp]" >&2
    exit 2
fi
out=$1
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=${PYTHON:-python3}
smoke=0
for arg in "$@"; do
    [[ $arg == --smoke ]] && smoke=1
done

log=$out/gpu_check.log
: >"$log"
say() { echo "$@" | tee -a "$log"; }

say "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname); $("$py" --version 2>&1) at $(command -v "$py")"
if command -v nvidia-smi >/dev/null; then
    say "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
else
    say "nvidia-smi: not found"
fi

# The wheelhouse (make wheelhouse) on PYTHONPATH after the checkout and before the machine's own packages.
wheels=${SLAPO_FN_WHEELHOUSE:-.whl}
site=""
if [[ $smoke == 0 ]] && compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/slapo-fn-site.XXXXXX)
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl >>"$log" 2>&1; then
        say "wheelhouse: $(cd "$wheels" && ls -- *.whl | tr '\n' ' ')-> $site"
    else
        say "wheelhouse: pip could not install $wheels/*.whl (see above); the machine's packages only"
        site=""
    fi
else
    say "wheelhouse: none (the machine's packages only)"
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export SLAPO_FN_WHEELHOUSE_SITE=$site PYTHONUNBUFFERED=1

# Every part runs whatever the others did; the exit code says whether all succeeded.
set +e
"$py" benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee -a "$log"
code=${PIPESTATUS[0]}
set -e
if [[ ! -s $out/gpu_check.json ]]; then  # the driver itself broke: the JSON says so
    printf '{"script": "benchmarks/gpu_check.sh", "ok": false, "error": "gpu_check.py exited with %s before writing figures; see gpu_check.log"}\n' \
        "$code" >"$out/gpu_check.json"
fi
exit "$code"
