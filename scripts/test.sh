#!/usr/bin/env bash
# The project's tests, Rust and Python: `cargo test --workspace`, then the Python package
# built into a venv and its pytest suite.
#
# The venv lives outside the checkout, in ${TENSORSHARE_VENV:-~/.cache/tensorshare/venv}, and
# is reused while crates/tensorshare-py/requirements-test.txt is unchanged, so a fresh clone
# does not download torch (~5 GB with its CUDA libraries) again. When torch cannot be
# installed, the tests that need it are skipped and say why.
#
# Arguments go to pytest (e.g. `scripts/test.sh -k queue`); TENSORSHARE_SKIP_RUST=1 runs the
# Python part only. pytest runs its tests in TENSORSHARE_PYTEST_WORKERS processes (2 unless
# set; pytest-xdist): most of a test's time is its children starting and waiting, and every
# test names its queues, segments and children apart from the others'.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${TENSORSHARE_SKIP_RUST:-0}" != 1 ]; then
    cargo test --workspace
fi

venv="${TENSORSHARE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tensorshare/venv}"
reqs=crates/tensorshare-py/requirements-test.txt
torch_req="torch==2.15.0"
stamp="$venv/.tensorshare-requirements"
want="$(cat "$reqs"; echo "$torch_req")"

python=""
for p in python3.13 python3.12 python3.11 python3.10 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        python="$p"
        break
    fi
done
if [ -z "$python" ]; then
    echo "scripts/test.sh: the Python tests need CPython >= 3.10 with its venv module" >&2
    exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "scripts/test.sh: creating the test venv in $venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "scripts/test.sh: installing the test requirements into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -r "$reqs"
    if ! "$venv/bin/python" -m pip install -q "$torch_req"; then
        echo "scripts/test.sh: torch could not be installed; the tests that need it will be skipped" >&2
    fi
    printf '%s' "$want" >"$stamp"
fi

# The extension, built into the venv (editable: the Python sources are used in place).
log="$(mktemp)"
if ! (cd crates/tensorshare-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop --quiet) >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "scripts/test.sh: building the Python extension failed" >&2
    exit 1
fi
rm -f "$log"

"$venv/bin/ruff" check --quiet crates/tensorshare-py/python crates/tensorshare-py/tests crates/tensorshare-py/examples benches/python
"$venv/bin/ruff" format --quiet --check crates/tensorshare-py/python crates/tensorshare-py/tests crates/tensorshare-py/examples benches/python
"$venv/bin/python" -m pytest -q -n "${TENSORSHARE_PYTEST_WORKERS:-2}" crates/tensorshare-py/tests "$@"
