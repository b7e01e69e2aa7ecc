#!/bin/sh
echo "coverage tools are not available offline in this project; run 'bazel test' without --collect_code_coverage" >&2
exit 1
