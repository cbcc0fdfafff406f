#!/usr/bin/env bash
# Install (if needed) into .venv with the dev extra, then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
cd "$ROOT"
# With 2+ cores the test files are spread over pytest-xdist workers (a file's tests stay on one worker, so its
# module-scoped trainings are built once); at most 4 workers, as each distributed test starts 2 processes of
# its own. PYTEST_WORKERS=1 runs everything in this process.
workers="${PYTEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
parallel=()
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist loadfile)
fi
set +e
python -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
