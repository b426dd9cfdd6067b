#!/usr/bin/env bash
# The test suite as `make test` runs it: two pytest processes (tests/test_[a-l]*, tests/test_[m-z]*) sharing one
# compile cache, each logged to $TEST_LOG_DIR. When one dies of a native fault, the head of Python's fault report (which test,
# which frames) is repeated at the very end, where a CI log's tail shows it.
set -uo pipefail
PY=${PY:-.venv/bin/python}
LOGS=${TEST_LOG_DIR:-.test-logs}
mkdir -p "$LOGS"
# both processes share one fresh persistent compile cache (tests/conftest.py); removed afterwards
export ATLAS_JAX_TEST_CACHE=$(mktemp -d /tmp/atlas_jax_tests_XXXXXX)
trap 'rm -rf "$ATLAS_JAX_TEST_CACHE"' EXIT
status=0
for half in "a-l" "m-z"; do
    log="$LOGS/pytest-$half.log"
    "$PY" -m pytest -q --durations=15 "$@" tests/test_[$half]*.py 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        status=$rc
        if grep -q "Fatal Python error" "$log"; then
            echo "=== tests/test_[$half]*: pytest died (exit $rc); the fault report's head ==="
            grep -A 40 "Fatal Python error" "$log" | grep -v "site-packages/\(pluggy\|_pytest\)" | head -60
        fi
    fi
done
exit $status
