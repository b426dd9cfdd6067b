#!/usr/bin/env bash
# The test suite as `make test` runs it: two pytest processes (tests/test_[a-l]*, tests/test_[m-z]*), each
# logged to $TEST_LOG_DIR. When one dies of a native fault, the head of Python's fault report (which test,
# which frames) is repeated at the very end, where a CI log's tail shows it.
set -uo pipefail
PY=${PY:-.venv/bin/python}
LOGS=${TEST_LOG_DIR:-.test-logs}
mkdir -p "$LOGS"
status=0
for half in "a-l" "m-z"; do
    log="$LOGS/pytest-$half.log"
    "$PY" -m pytest -q "$@" tests/test_[$half]*.py 2>&1 | tee "$log"
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
