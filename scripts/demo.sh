#!/usr/bin/env bash
# The main job on a fresh machine: set up (once), then `attnres demo` on the embedded SmolLM2-135M-Instruct, in the
# folder this is run from. Arguments are passed to `attnres demo` (see `attnres demo --help`).
set -euo pipefail
here="$(pwd)"
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup.sh
cd "$here"
export HF_HUB_OFFLINE=1
attnres demo "$@"
