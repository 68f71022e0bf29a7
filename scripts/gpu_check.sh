#!/usr/bin/env bash
# The GPU check (CONTRIBUTING.md, "GPU check"): the runner and its checks live in tests/ with the tests they run.
exec "$(dirname "$0")/../tests/gpu_check.sh" "$@"
