#!/usr/bin/env bash
# Install (if needed) into .venv with the dev extra, then run the test suite; then the checkpoint and
# distributed tests again against the oldest torch the project declares (pyproject.toml's torch>=X.Y), in a
# second environment of the project's own, .venv-oldest-torch ($FAIRSEQ_OLDEST_VENV): torch.distributed.checkpoint
# and FSDP2 change between releases, and the GPU image may run the oldest (docs/testing.md).
# Extra arguments go to pytest and run the main suite only, e.g. `bash scripts/test.sh tests/unit -x`.
# `bash scripts/test.sh --oldest-torch [pytest args]` runs only the oldest-torch tier (its default tests, or
# those named); FAIRSEQ_OLDEST_TORCH=0 skips it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
only_oldest=0
if [ "${1:-}" = "--oldest-torch" ]; then
    only_oldest=1
    shift
fi
# With 2+ cores the test files are spread over pytest-xdist workers (a file's tests stay on one worker, so its
# module-scoped trainings are built once); at most 4 workers, as each distributed test starts 2 processes of
# its own. PYTEST_WORKERS=1 runs everything in this process.
workers="${PYTEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
parallel=()
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist loadfile)
fi

run_pytest() {  # pytest's status, exit 5 (nothing collected) made an error
    local rc=0
    python -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "error: pytest collected no tests" >&2
        rc=1
    fi
    return "$rc"
}

oldest_torch_tier() {
    local oldest
    oldest="$(sed -n 's/^ *"torch>=\([0-9][0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")"
    if [ -z "$oldest" ]; then
        echo "error: no \"torch>=X.Y\" in $ROOT/pyproject.toml's dependencies" >&2
        return 1
    fi
    [[ "$oldest" == *.*.* ]] || oldest="$oldest.0"
    export FAIRSEQ_VENV="${FAIRSEQ_OLDEST_VENV:-$ROOT/.venv-oldest-torch}" FAIRSEQ_TORCH="$oldest"
    export FAIRSEQ_TORCH_EXACT=1
    if [ "${FAIRSEQ_NO_INSTALL:-0}" = 1 ] && [ ! -x "$FAIRSEQ_VENV/bin/python" ]; then
        echo "== the oldest-torch tier is skipped: FAIRSEQ_NO_INSTALL=1 and no $FAIRSEQ_VENV"
        return 0
    fi
    echo "== the checkpoint and distributed tests on torch $oldest (the oldest declared), in $FAIRSEQ_VENV"
    source "$HERE/_venv.sh" dev
    cd "$ROOT"
    local tests=("$@")
    if [ "${#tests[@]}" -eq 0 ]; then
        tests=(tests/distributed tests/unit/test_checkpoint_*.py tests/unit/test_sharded_safe_load.py
               tests/unit/test_float8_flags.py
               tests/integration/test_*checkpoint*.py)
    fi
    python -c "import torch; print('== torch', torch.__version__)"
    run_pytest "${tests[@]}"
}

# Each part in a subshell (_venv.sh changes PATH and the environment's variables) that stops at its first
# failing command: errexit is set inside, where no `||` switches it off.
set +e
if [ "$only_oldest" = 1 ]; then
    (set -e; oldest_torch_tier "$@")
    exit $?
fi
(set -e; source "$HERE/_venv.sh" dev; cd "$ROOT"; run_pytest "$@")
rc=$?
if [ "$#" -eq 0 ] && [ "${FAIRSEQ_OLDEST_TORCH:-1}" != 0 ]; then
    (set -e; oldest_torch_tier)
    oldest_rc=$?
    [ "$rc" -ne 0 ] || rc=$oldest_rc
fi
exit "$rc"
