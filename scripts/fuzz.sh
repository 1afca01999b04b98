#!/usr/bin/env bash
# Fuzzes the safetensors header parser (tests/fuzz_ckpt.c) with libFuzzer under ASan and UBSan
# for a bounded time: FUZZ_SECONDS (default 60). Seeds come from tests/fuzz_corpus/; new
# inputs go to build-fuzz/corpus/ckpt (kept out of the tree). Exits non-zero on a crash.
set -eu
cd "$(dirname "$0")/.."
CLANG=${CLANG:-clang}
seconds=${FUZZ_SECONDS:-60}
out=build-fuzz
mkdir -p "$out/corpus/ckpt"
"$CLANG" -std=c11 -g -O1 -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  tests/fuzz_ckpt.c -o "$out/fuzz_ckpt" -lm -lpthread
# tokens of both grammars, so mutations reach past the JSON syntax into the validation
cat >"$out/ckpt.dict" <<'DICT'
"{"
"}"
"["
"]"
":"
","
"\""
"\\u"
"\\ud83d\\ude00"
"__metadata__"
"dtype"
"shape"
"data_offsets"
"F32"
"BF16"
"F8_E4M3"
"F4"
"C64"
"I16"
"dsk.crc32c."
"dsk.attempt"
"format"
"dsk-ckpt"
"version"
"step"
"world_size"
"files"
"rank"
"size"
"crc32c"
"tensors"
"generation"
"attempt"
"slices"
"dsk.box."
"dsk.name."
"dsk.blocks."
"1048576:"
"-1"
"18446744073709551615"
"1e9"
DICT
"$out/fuzz_ckpt" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -dict="$out/ckpt.dict" "$out/corpus/ckpt" tests/fuzz_corpus
echo "fuzz_ckpt: no crash in $seconds s"
