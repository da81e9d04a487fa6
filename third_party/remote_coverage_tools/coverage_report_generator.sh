#!/bin/sh
echo "coverage is unavailable: Bazel runs offline here and has no remote_coverage_tools" >&2
exit 1
