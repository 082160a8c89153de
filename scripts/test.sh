#!/usr/bin/env bash
# The test suite on a fresh machine: set up (once), then pytest, offline. Arguments are passed to pytest.
#
# Besides the main environment (setup.sh, the newest Transformers), setup_engines.sh makes the environments in which
# tests run other systems for real: vLLM's CPU build (tests/test_vllm.py requires it here) and the lowest supported
# Transformers. Run without arguments, the suite runs in full in the main environment, then the model, generation,
# remote-code, conversion and family tests run again on the lowest Transformers (not the demo, which only strings
# conversion and training together, a minute of CI, nor the real Gemma 3 conversion, three). Both runs spread their
# tests over two worker processes (pytest-xdist), one per core: most tests are tiny models, bound by one core's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup.sh
bash scripts/setup_engines.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false ATTNRES_REQUIRE_ENGINES=1
status=0
python -m pytest -q -n 2 --dist worksteal "$@" || status=$?
if [ $# -eq 0 ]; then
    echo "[test] again on the lowest supported Transformers ($(.engines/lowest/bin/python -c 'import transformers; print(transformers.__version__)')):" \
        "the model, generation, remote-code, conversion and family tests"
    .engines/lowest/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal \
        tests/test_modeling.py tests/test_transformers_integration.py tests/test_conversion.py tests/test_remote_code.py \
        tests/test_families.py \
        --deselect tests/test_conversion.py::test_demo_runs_offline_on_the_default_model \
        --deselect tests/test_families.py::test_a_real_gemma3_checkpoint_converts_exactly \
        || status=$?
fi
exit "$status"
