#!/bin/bash
# Issue 40 reproducer: optional spinning processes (SPINCPUS="0 0 1 1"), then
# issue40_pinned.py (in-process spinners: SPIN=2; build them with
# `gcc -O2 -shared -fPIC -o ci/repro/libspin.so ci/repro/spin.c -lpthread`).
pids=()
for c in ${SPINCPUS:-0 0 1 1}; do taskset -c $c sh -c 'while :; do :; done' >/dev/null 2>&1 & pids+=($!); done
timeout ${TMO:-100} ${PYTHON:-target/py-venv/bin/python} $(dirname "$0")/issue40_pinned.py initiator 2>&1 | tail -${TAIL:-12}
kill "${pids[@]}"
