#!/bin/sh
# The GPU check in one command, from the working tree alone (docs/plugin.md,
# "Running the GPU check"): python3 with torch, gcc. Verdicts and packed logs
# go to $OUT (or --out DIR); the last line printed is the one verdict.
cd "$(dirname "$0")/../.." || exit 2
exec "${PYTHON:-python3}" -m bench.gpu "$@"
