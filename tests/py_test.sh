#!/bin/bash
# Runs a Python test script with the venv's Python: py_test.sh PYTHON SCRIPT [args...]
set -u
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
python=$1 script=$2
shift 2
exec "$python" -u "$script" "$@"
