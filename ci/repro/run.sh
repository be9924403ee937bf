#!/bin/bash
# run2.sh: spinners on cpu0 and cpu1, then the python repro; spinners killed after.
pids=()
for c in ${SPINCPUS:-0 0 1 1}; do taskset -c $c sh -c 'while :; do :; done' >/dev/null 2>&1 & pids+=($!); done
timeout ${TMO:-100} ${PYTHON:-target/py-venv/bin/python} $(dirname "$0")/issue40_pinned.py initiator 2>&1 | tail -${TAIL:-12}
kill "${pids[@]}"
