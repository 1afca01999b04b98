#!/usr/bin/env bash
# Regenerates tests/golden/moe_cpu.txt from the MoE layer before issue 13's redesign (commit
# 7a9d942 by default; REV=... for another) built against this tree's dsk_tensor.h and
# dsk_comm.h, its GEMM on the portable micro-kernel (see gen_moe_golden.c). Run from anywhere.
set -eu
cd "$(dirname "$0")/../.."
REV=${REV:-7a9d942}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git show "$REV:dsk_moe.h" >"$tmp/dsk_moe.h"
gcc -std=c11 -O2 -g -fopenmp -Wall -Wextra -Werror -D_GNU_SOURCE -I"$tmp" -I. tests/golden/gen_moe_golden.c \
    -o "$tmp/gen" -lm -lpthread
OMP_NUM_THREADS=2 "$tmp/gen" >tests/golden/moe_cpu.txt
wc -l tests/golden/moe_cpu.txt
