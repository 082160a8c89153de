#!/usr/bin/env bash
# The test suite on a fresh machine: set up (once), then pytest, offline. Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
