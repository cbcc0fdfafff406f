# Sourced by quickstart.sh and test.sh: create or reuse .venv and install the project into it.
# torch==$FAIRSEQ_TORCH (default 2.13.0) is installed only where no torch is importable (a user's own torch is
# kept); FAIRSEQ_TORCH_EXACT=1 also replaces another version (test.sh's oldest-torch environment, its own).
# FAIRSEQ_NO_INSTALL=1 uses $FAIRSEQ_VENV as it is (no venv created, nothing installed): the docs tests run
# the quickstart this way, in the environment under test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FAIRSEQ_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
if [ "${FAIRSEQ_NO_INSTALL:-0}" != 1 ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        PY="${PYTHON:-python3}"
        "$PY" -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is required"'
        echo "== creating the virtual environment $VENV"
        "$PY" -m venv "$VENV"
    fi
    PYBIN="$VENV/bin/python"
    TORCH="${FAIRSEQ_TORCH:-2.13.0}"
    have="$("$PYBIN" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
    if [ -z "$have" ] || { [ "${FAIRSEQ_TORCH_EXACT:-0}" = 1 ] && [ "$have" != "$TORCH" ]; }; then
        echo "== installing torch==$TORCH into $VENV (a download of a few hundred MB to a few GB: minutes)"
        "$PYBIN" -m pip install -q "torch==$TORCH"
    fi
    stamp="$VENV/.fairseq-installed${EXTRAS:+-$EXTRAS}"
    if [ -z "$EXTRAS" ] && [ -f "$VENV/.fairseq-installed-dev" ] && [ ! -f "$stamp" ]; then
        stamp="$VENV/.fairseq-installed-dev"  # the dev install (scripts/test.sh) includes the base one
    fi
    if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
        echo "== installing fairseq${EXTRAS:+[$EXTRAS]} into $VENV (pip install -e; about a minute)"
        "$PYBIN" -m pip install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}"
        touch "$stamp"
    fi
fi
export PATH="$VENV/bin:$PATH"
