# Sourced by scripts/setup.sh, demo.sh and test.sh: makes sure a Python >= 3.10 virtual environment is active.
# An active virtual environment (venv or conda) is used as it is; otherwise `.venv/` in the repository is created
# once and activated, so nothing is installed into the system's Python.
attnres_python="${PYTHON:-python3}"
if ! "$attnres_python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: attnres needs Python >= 3.10; $attnres_python is $("$attnres_python" --version 2>&1)" \
        "(set PYTHON=/path/to/python3.1x)" >&2
    exit 2
fi
if [ -z "${CONDA_PREFIX:-}" ] && ! "$attnres_python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    if [ ! -x .venv/bin/python ]; then
        echo "[setup] creating the virtual environment .venv/ (activate it later with: source .venv/bin/activate)"
        "$attnres_python" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
unset attnres_python
