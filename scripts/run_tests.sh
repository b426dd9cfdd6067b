#!/usr/bin/env bash
# The test suite as `make test` runs it: pytest-xdist, one worker per core, whole modules per worker (module
# fixtures build each engine once), sharing one compile cache; logged to $TEST_LOG_DIR. A worker that dies of
# a native fault is named by xdist ("crashed while running"); that line and the head of Python's fault report
# are repeated at the very end, where a CI log's tail shows them.
set -uo pipefail
PY=${PY:-.venv/bin/python}
LOGS=${TEST_LOG_DIR:-.test-logs}
WORKERS=${TEST_WORKERS:-$(nproc)}
mkdir -p "$LOGS"
# the workers share one fresh persistent compile cache (tests/conftest.py); removed afterwards
export ATLAS_JAX_TEST_CACHE=$(mktemp -d /tmp/atlas_jax_tests_XXXXXX)
trap 'rm -rf "$ATLAS_JAX_TEST_CACHE"' EXIT
log="$LOGS/pytest.log"
"$PY" -m pytest -q -n "$WORKERS" --dist loadfile --durations=25 "$@" tests/ 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && grep -q "crashed while running\|Fatal Python error" "$log"; then
    echo "=== a pytest worker died (exit $rc): ==="
    grep "crashed while running" "$log"
    grep -A 40 "Fatal Python error" "$log" | grep -v "site-packages/\(pluggy\|_pytest\|execnet\|xdist\)" | head -60
fi
exit $rc
