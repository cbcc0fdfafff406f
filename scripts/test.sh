#!/usr/bin/env bash
# Install (if needed) into .venv with the dev extra, then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
cd "$ROOT"
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
