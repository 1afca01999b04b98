#!/usr/bin/env bash
# DESIGN.md's rules as checks (`make lint`; tests/test_lint.sh runs each in `make test`).
#   scripts/lint.sh [check...]        checks: format columns state cuda includes commits places (default: all)
#   scripts/lint.sh state [source...] the state check on some sources only (dsk_par.h, kernels/moe.cu)
# Each check prints `ok   <check>: ...` or `FAIL <check>: ...` with what it found, file by file;
# the script exits non-zero when one failed.
#   format   lines changed since LINT_BASE are as clang-format (.clang-format) writes them
#   columns  lines changed since LINT_BASE in the library headers, kernels/, examples/ and
#            tests/*.c stay within 120 columns (the older ones over it are counted, not failed)
#   state    no mutable static storage in the library (dsk_*.h, kernels/) but the documented
#            exceptions (STATE_ALLOWED) and what tests/lint_baseline.txt still allows
#   cuda     no CUDA runtime call in the library outside the CUDA helper: kernels/*.cu and .cuh,
#            which include kernels/dsk_cuda.cuh; tests/lint_baseline.txt holds today's count per file
#   includes the library's #include lines (dsk_*.h, kernels/*.cu, .cuh) have no cycle; a header
#            includes only headers on lower floors of DESIGN.md's diagram, listed after its `->`,
#            and nothing in kernels/; a kernels/*.cu includes its owner (the header declaring its
#            launchers), headers below that and kernels/*.cuh; the .cuh helper builds on floor 0
#   commits  commits after LINT_COMMIT_BASE: subject of at most 72 characters; a non-merge
#            commit has a blank line, then the why
#   places   DESIGN.md section 6's counts of the places to touch, recomputed on a case each (PLACES_CLAIMS)
# LINT_BASE (a commit): what `format` and `columns` compare the working tree with; default the
# merge-base with main, or HEAD~1 on main itself. tests/lint_baseline.txt can only go down: a
# count above it fails, and so does one below it until the file is lowered to match.
set -u
cd "$(dirname "$0")/.."
BASELINE=${LINT_BASELINE:-tests/lint_baseline.txt}
# The last commit of main when the commit check came in; older history is not checked.
LINT_COMMIT_BASE=${LINT_COMMIT_BASE:-306214db16b6f8551020543cc5197a91d076451a}
COLUMNS_MAX=120
SUBJECT_MAX=72
# The documented exceptions to "no global mutable state" (DESIGN.md, Status and errors;
# Ownership and options), as file:symbol:
STATE_ALLOWED=(
    dsk_tensor.h:dsk__errbuf     # the thread-local error message behind dsk_last_error()
    dsk_tensor.h:dsk__mem_live   # the allocator's per-device counters (dsk_tensor_mem_stats),
    dsk_tensor.h:dsk__mem_peak   #   updated atomically
    dsk_tensor.h:dsk__mem_allocs
)
failed=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; shift; [ $# -eq 0 ] || printf '%s\n' "$@" | sed 's/^/     /'; failed=1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

lib_files() { ls dsk_*.h kernels/*; }
# C and C++ sources the format check reads (tracked files; new files count once added).
c_sources() { git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cpp'; }
column_sources() { git ls-files 'dsk_*.h' 'kernels/*' 'examples/*.c' 'examples/*.h' 'tests/*.c'; }

base_commit() { # prints LINT_BASE or its default; fails when there is none (or no git repository)
    git rev-parse -q --verify HEAD >/dev/null 2>&1 || return 1
    if [ -n "${LINT_BASE:-}" ]; then git rev-parse --verify -q "$LINT_BASE^{commit}"; return; fi
    local head main
    head=$(git rev-parse -q --verify HEAD) || return 1
    main=$(git rev-parse -q --verify main) || main=
    if [ -z "$main" ] || [ "$head" = "$main" ] || [ "$(git symbolic-ref -q --short HEAD)" = main ]; then
        git rev-parse -q --verify HEAD~1
    else
        git merge-base HEAD "$main"
    fi
}

# Baseline: lines `<check> <key> <count>` (# comments); prints the allowed count of a key, 0 if none.
baseline_of() { awk -v c="$1" -v k="$2" '$1 == c && $2 == k { n = $3 } END { print n + 0 }' "$BASELINE"; }
# Compares the counts found (lines `key count` in $2) with the baseline of check $1 over the keys
# whose file is in $3 (one file a line): above fails, below fails until the baseline is lowered.
ratchet() {
    local check=$1 found=$2 files=$3 key n allowed over=() under=()
    [ -f "$BASELINE" ] || { : >"$tmp/empty"; BASELINE=$tmp/empty; }
    while read -r key n; do
        allowed=$(baseline_of "$check" "$key")
        [ "$n" -gt "$allowed" ] && over+=("$key: $n, baseline $allowed")
    done <"$found"
    while read -r _ key allowed; do
        grep -qxF "${key%%:*}" "$files" || continue
        n=$(awk -v k="$key" '$1 == k { print $2 }' "$found")
        [ "${n:-0}" -lt "$allowed" ] && under+=("$key: ${n:-0}, baseline $allowed: lower $BASELINE to ${n:-0}")
    done < <(awk -v c="$check" '$1 == c' "$BASELINE")
    [ ${#over[@]} -eq 0 ] && [ ${#under[@]} -eq 0 ] && return 0
    [ ${#over[@]} -gt 0 ] && printf 'above the baseline: %s\n' "${over[@]}"
    [ ${#under[@]} -gt 0 ] && printf 'below the baseline (it can only go down): %s\n' "${under[@]}"
    return 1
}

check_format() {
    local base out
    if ! base=$(base_commit); then ok "format: skipped (no base commit to compare with)"; return; fi
    if ! command -v git-clang-format >/dev/null && ! git clang-format -h >/dev/null 2>&1; then
        ok "format: skipped (git clang-format is not installed)"; return
    fi
    mapfile -t files < <(c_sources)
    out=$(git clang-format --diff --extensions c,h,cu,cuh,cpp "$base" -- "${files[@]}" 2>&1)
    if [ -z "$out" ] || echo "$out" | grep -qE '^(no modified files to format|clang-format did not modify any files)$'; then
        ok "format: lines changed since ${base:0:12} are as clang-format writes them"
    else
        bad "format: lines changed since ${base:0:12} differ from clang-format (.clang-format); the diff to apply" \
            "(git clang-format $base, or clang-format --lines):"
        echo "$out" | head -60 | sed 's/^/     | /'
    fi
}

# Lines over the limit among the lines added since the base: `file:line: N columns`.
long_changed_lines() {
    git diff -U0 --no-color --no-ext-diff "$1" -- "${@:2}" | awk -v max="$COLUMNS_MAX" '
        /^\+\+\+ / { f = substr($0, 7); next }
        /^@@ / { split($3, a, ","); ln = substr(a[1], 2) + 0; next }
        /^\+/ { s = substr($0, 2); if (length(s) > max) print f ":" ln ": " length(s) " columns"; ln++ }'
}

check_columns() {
    local base long total
    if ! base=$(base_commit); then ok "columns: skipped (no base commit to compare with)"; return; fi
    mapfile -t files < <(column_sources)
    total=$(awk -v max="$COLUMNS_MAX" 'length($0) > max' "${files[@]}" | wc -l)
    long=$(long_changed_lines "$base" "${files[@]}")
    if [ -z "$long" ]; then
        ok "columns: no line changed since ${base:0:12} is over $COLUMNS_MAX columns ($total older lines are)"
    else
        bad "columns: $(echo "$long" | wc -l) lines changed since ${base:0:12} are over $COLUMNS_MAX columns" \
            "$(echo "$long" | head -20)"
    fi
}

# Compiles one library source as the Makefile does (a header with its IMPLEMENTATION macro; a
# .cu file as host C++ against the CUDA emulator, as build/emu does) into $tmp/state/<n>.o.
# -Og: gcc folds a static it proves is never written into read-only data or away, so what is
# left in writable sections is state the code writes (or whose address escapes); -O0 folds
# nothing, and -Og finds what -O1 does in two thirds of the time.
compile_source() {
    local src=$1 obj=$tmp/state/$(echo "$1" | tr '/.' '__').o cc
    local common=(-Og -g -fno-common -fno-pie -I. -Itests/cuda_emu/include -DDSK_CUDA -c -o "$obj")
    case $src in
    dsk_*.h)
        local m=${src#dsk_}; m=${m%.h}
        local pre=(); [ "$m" = moe ] && pre=(-include dsk_amp.h) # as LIB_PRE_moe
        cc=(gcc -std=c11 -fopenmp "-DDSK_$(echo "$m" | tr a-z A-Z)_IMPLEMENTATION" "${pre[@]}" -include "$src"
            -x c /dev/null) ;;
    *.cu) cc=(g++ -std=c++17 -x c++ -DDSK_CUDA_EMU "$src") ;;
    *) return 0 ;;
    esac
    "${cc[@]}" "${common[@]}" >"$obj.log" 2>&1 || { echo "$src: does not compile: $(head -3 "$obj.log")" >"$obj.err"; }
}

# Writable static objects of one object file: `file:line<TAB>file:symbol` (file: the library file
# that declares it; line unknown for thread-locals, which nm cannot place: the compiled source).
# Sections: .data, .bss, .tdata, .tbss and their subsections, not .data.rel.ro; under the
# emulator __shared__ arrays sit in cuda_emu_shared (per block on a GPU, not global state).
writable_symbols() {
    local obj=$1 src=$2
    objdump -t "$obj" | sed -nE 's/^[0-9a-f]+ (.{7}) (\.(data|bss|tdata|tbss)(\.[^[:space:]]*)?)\t[0-9a-f]+ (.*)$/\1|\2|\5/p' |
        awk -F'|' 'substr($1, 6, 1) != "d" && substr($1, 7, 1) != "f" && $2 !~ /^\.data\.rel\.ro/ { print $3 }' |
        sort -u >"$obj.syms"
    nm -l --defined-only "$obj" | awk -F'\t' 'NF > 1 { split($1, a, " "); print a[3] "\t" $2 }' >"$obj.where"
    local sym where file name
    while read -r sym; do
        where=$(awk -F'\t' -v s="$sym" '$1 == s { print $2; exit }' "$obj.where")
        where=${where#"$PWD"/}; where=${where#./}
        [ -n "$where" ] || where="$src:?"
        file=${where%:*}
        case $file in dsk_*.h | kernels/*) ;; *) continue ;; esac # system and emulator headers: not ours
        # CUDA's __shared__ memory is per block, not global state (template ones leave cuda_emu_shared)
        [ "${where##*:}" != "?" ] && sed -n "${where##*:}p" "$file" | grep -q '__shared__' && continue
        name=$(echo "$sym" | c++filt); name=${name%.[0-9]*}; name=${name// /} # gcc's function-static suffix
        printf '%s\t%s:%s\n' "$where" "$file" "$name"
    done <"$obj.syms"
}

check_state() {
    local srcs=("$@") s obj
    [ ${#srcs[@]} -gt 0 ] || mapfile -t srcs < <(ls dsk_*.h kernels/*.cu)
    mkdir -p "$tmp/state"
    local jobs=0 max=$(nproc 2>/dev/null || echo 2)
    for s in "${srcs[@]}"; do
        compile_source "$s" &
        jobs=$((jobs + 1)); [ "$jobs" -ge "$max" ] && { wait -n; jobs=$((jobs - 1)); }
    done
    wait
    if cat "$tmp"/state/*.err >"$tmp/errs" 2>/dev/null && [ -s "$tmp/errs" ]; then
        bad "state: sources that do not compile" "$(cat "$tmp/errs")"; return
    fi
    for s in "${srcs[@]}"; do
        obj=$tmp/state/$(echo "$s" | tr '/.' '__').o
        [ -f "$obj" ] && writable_symbols "$obj" "$s"
    done | sort -u >"$tmp/state.list"
    awk -F'\t' 'NR == FNR { a[$0] = 1; next } !($2 in a)' <(printf '%s\n' "${STATE_ALLOWED[@]}") "$tmp/state.list" \
        >"$tmp/state.bad"
    cut -f2 "$tmp/state.bad" | sort | uniq -c | awk '{ print $2, $1 }' >"$tmp/found"
    printf '%s\n' "${srcs[@]}" >"$tmp/files"
    local n_allowed n_bad
    n_allowed=$(($(wc -l <"$tmp/state.list") - $(wc -l <"$tmp/state.bad")))
    n_bad=$(wc -l <"$tmp/state.bad")
    local listing
    listing=$(awk -F'\t' '{ print $1 ": " $2 }' "$tmp/state.bad")
    if ratchet state "$tmp/found" "$tmp/files" >"$tmp/ratchet"; then
        ok "state: ${#srcs[@]} sources; $n_allowed documented exceptions; $n_bad others, all in $BASELINE"
        [ -z "$listing" ] || echo "$listing" | sed 's/^/     in the baseline: /'
    else
        bad "state: mutable static storage outside the documented exceptions (STATE_ALLOWED)" \
            "$(cat "$tmp/ratchet")" "every one found:" "$listing"
    fi
}

# CUDA runtime calls (`cudaXxx(`) in code, comments and string literals removed.
# Fails when gcc cannot read the file (an unterminated comment), rather than count nothing.
cuda_calls() {
    local code
    code=$(gcc -fpreprocessed -dD -E -P -x c "$1" 2>/dev/null) || return 1
    echo "$code" | sed -E 's/"([^"\\]|\\.)*"/""/g' |
        grep -oE '(^|[^A-Za-z0-9_])cuda[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | wc -l
}

check_cuda() {
    local f n listing="" total=0
    : >"$tmp/cuda.found"
    lib_files >"$tmp/cuda.files"
    while read -r f; do
        case $f in
        kernels/dsk_cuda.cuh) continue ;;                                  # the helper itself
        kernels/*.cu | kernels/*.cuh) grep -q '#include "dsk_cuda.cuh"' "$f" && continue ;; # behind it
        esac
        n=$(cuda_calls "$f") || { bad "cuda: gcc cannot strip the comments of $f"; return; }
        [ "$n" -gt 0 ] || continue
        echo "$f $n" >>"$tmp/cuda.found"; listing+="${listing:+, }$f $n"; total=$((total + n))
    done <"$tmp/cuda.files"
    if ratchet cuda "$tmp/cuda.found" "$tmp/cuda.files" >"$tmp/ratchet"; then
        ok "cuda: $total CUDA runtime calls outside the helper (${listing:-none}), as the baseline allows"
    else
        bad "cuda: CUDA runtime calls outside the helper (kernels/dsk_cuda.cuh and the .cu files behind it)" \
            "$(cat "$tmp/ratchet")" "found: ${listing:-none}"
    fi
}

check_commits() {
    local c subject second parents problems=() n=0
    if ! git rev-parse -q --verify "$LINT_COMMIT_BASE^{commit}" >/dev/null 2>&1; then
        ok "commits: skipped (base ${LINT_COMMIT_BASE:0:12} is not in this clone)"; return
    fi
    for c in $(git rev-list "$LINT_COMMIT_BASE..HEAD"); do
        n=$((n + 1))
        subject=$(git log -1 --format=%s "$c")
        second=$(git log -1 --format=%B "$c" | sed -n 2p)
        parents=$(git log -1 --format=%p "$c" | wc -w)
        [ ${#subject} -le "$SUBJECT_MAX" ] ||
            problems+=("${c:0:12} subject of ${#subject} characters (at most $SUBJECT_MAX): $subject")
        [ -z "$second" ] || problems+=("${c:0:12} no blank line after the subject: $subject")
        [ "$parents" -gt 1 ] || [ -n "$(git log -1 --format=%b "$c" | tr -d '[:space:]')" ] ||
            problems+=("${c:0:12} no body (the what and why): $subject")
    done
    if [ ${#problems[@]} -eq 0 ]; then
        ok "commits: $n commits after ${LINT_COMMIT_BASE:0:12}: subjects within $SUBJECT_MAX characters, then the why"
    else
        bad "commits: ${#problems[@]} problems in $n commits after ${LINT_COMMIT_BASE:0:12}" "${problems[@]}"
    fi
}

# The enclosing function of each line (file, line numbers on stdin): its name, or `line N` for a
# line outside every function (an enum, a list entry, a declaration). Universal ctags' end lines.
enclosing_units() {
    local file=$1
    ctags --output-format=u-ctags -f - --fields=+ne --kinds-C=f --language-force=C "$file" 2>/dev/null |
        sed -nE 's/^([^\t]+)\t.*\tline:([0-9]+).*\tend:([0-9]+).*$/\1 \2 \3/p' >"$tmp/units"
    awk 'NR == FNR { n++; name[n] = $1; lo[n] = $2; hi[n] = $3; next }
         { u = "line " $1; for (i = 1; i <= n; i++) if ($1 >= lo[i] && $1 <= hi[i]) u = name[i]; print u }' \
        "$tmp/units" - | sort -u
}

number_word() { # one..twenty, or digits, as a number
    local w=(zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
             seventeen eighteen nineteen twenty) i
    [[ $1 =~ ^[0-9]+$ ]] && { echo "$1"; return; }
    for i in "${!w[@]}"; do [ "${w[$i]}" = "${1,,}" ] && { echo "$i"; return; }; done
    echo "?"
}

# C source with comments and string literals blanked, line for line (line numbers kept).
strip_comments() {
    awk '!inc && index($0, "/") == 0 && index($0, "\"") == 0 { print; next } # nothing to blank: as is
    {
        out = ""; n = length($0); i = 1
        while (i <= n) {
            c = substr($0, i, 1); d = substr($0, i, 2)
            if (inc) { if (d == "*/") { inc = 0; i += 2 } else i++; continue }
            if (ins) { if (c == "\\") i += 2; else { if (c == "\"") ins = 0; i++ } continue }
            if (d == "/*") { inc = 1; i += 2; continue }
            if (d == "//") break
            if (c == "\"") { ins = 1; out = out "\"\""; i++; continue }
            out = out c; i++
        }
        ins = 0; print out
    }' "$1"
}

# strip_comments of a file, kept in $tmp/stripped for the next claim that reads it; prints its path.
stripped() {
    local out=$tmp/stripped/${1//\//__}
    [ -f "$out" ] || { mkdir -p "$tmp/stripped" && strip_comments "$1" >"$out"; }
    echo "$out"
}

# DESIGN.md section 6's counts, each recomputed on an existing case: `title|case|library regex|test regex`.
# A place is a function of the library (universal ctags) or a top-level line (an enum, a list entry, a
# declaration) whose code, comments and strings aside, matches the library regex (definitions and
# declarations, not callers); each test file whose code matches the test regex is one place (its case).
# DESIGN.md states each as "<title> ...: N places in M files" in the paragraph the title opens.
PLACES_CLAIMS=(
    'An elementwise op of the BINARY form|dsk_mul|\bDSK_EW_MUL\b|dsk_status dsk_mul\(|\bdsk_mul\('
    'An elementwise op of its own form|dsk_axpy|\bDSK_EW_AXPY\b|dsk_status dsk_axpy\(|\bdsk_axpy\('
    'Any other tensor op|dsk_silu|DSK_HD float dsk_silu(_grad)?_f\(|dsk_status dsk_(cuda_)?silu(_backward)?\(|void dsk__k_silu(_bwd)?\(|\bdsk_silu(_backward)?\('
    'A router score function|DSK_MOE_SIGMOID|\bDSK_MOE_SIGMOID\b|\bsigmoid\b|\bDSK_MOE_SIGMOID\b'
)

# places_of <library regex> <test regex>: prints `places files`; the places go to $tmp/where.
places_of() {
    local lib_re=$1 test_re=$2 f lines units n=0 nf=0
    : >"$tmp/where"
    for f in $(ls dsk_*.h kernels/*); do
        lines=$(grep -nE "$lib_re" "$(stripped "$f")" | cut -d: -f1)
        [ -n "$lines" ] || continue
        units=$(echo "$lines" | enclosing_units "$f")
        nf=$((nf + 1)); n=$((n + $(echo "$units" | wc -l)))
        echo "$f: $(echo "$units" | paste -sd, - | sed 's/,/, /g')" >>"$tmp/where"
    done
    for f in $(git ls-files 'tests/*.c' 2>/dev/null || ls tests/*.c tests/gpu/*.c); do
        grep -qE "$test_re" "$(stripped "$f")" || continue
        nf=$((nf + 1)); n=$((n + 1)); echo "$f: its case" >>"$tmp/where"
    done
    echo "$n $nf"
}

check_places() {
    local claim title case lib_re test_re design want_p want_f got words n_ok=0 summary=()
    if ! ctags --version 2>/dev/null | grep -q 'Universal Ctags'; then
        ok "places: skipped (universal ctags is not installed)"; return
    fi
    tr '\n' ' ' <DESIGN.md | sed 's/  */ /g' >"$tmp/design"
    for claim in "${PLACES_CLAIMS[@]}"; do
        IFS='|' read -r title case lib_re test_re <<<"$claim"
        lib_re=${claim#"$title|$case|"}; lib_re=${lib_re%|*} # the library regex may hold '|'
        test_re=${claim##*|}
        design=
        # the paragraph: from its bold title to the next one (awk: bash's ${x#*pat} on the whole file is slow)
        design=$(awk -v t="**$title" '{ i = index($0, t); if (!i) exit; s = substr($0, i + length(t))
                                        s = substr(s, index(s, "**") + 2); k = index(s, " **"); print k ? substr(s, 1, k - 1) : s }' \
                     "$tmp/design" | grep -oE '[A-Za-z0-9]+ places in [a-z0-9]+ files' | head -1)
        if [ -z "$design" ]; then
            bad "places: DESIGN.md section 6 no longer says \"$title ...: N places in M files\""; continue
        fi
        read -r -a words <<<"$design"
        want_p=$(number_word "${words[0]}"); want_f=$(number_word "${words[3]}")
        got=$(places_of "$lib_re" "$test_re")
        if [ "$got" = "$want_p $want_f" ]; then
            n_ok=$((n_ok + 1)); summary+=("$case ${got% *}/${got#* }")
        else
            bad "places: ${title,} (as $case) is ${got% *} places in ${got#* } files; DESIGN.md section 6 says" \
                "$want_p in $want_f (\"$design\"):" "$(cat "$tmp/where")"
        fi
    done
    [ "$n_ok" -eq ${#PLACES_CLAIMS[@]} ] &&
        ok "places: DESIGN.md section 6's counts (places/files) recomputed: ${summary[*]}"
}

# The floors of DESIGN.md's diagram (section 1), as `header floor dep,dep,...` (the `-> a, b` list of the
# modules a header builds on, from its line or its continuation lines, indented past column 10).
design_floors() {
    awk '/^## 1\. The house/ { on = 1 } on && /^```/ { if (inside) exit; inside = 1; next }
         inside {
             line = $0
             if (match(line, /^floor [0-9]+/)) { floor = substr(line, 7, RLENGTH - 6) + 0; line = substr(line, RLENGTH + 1) }
             n = split(line, w, " ")
             if (n > 0 && w[1] ~ /^dsk_[a-z_]+\.h$/) { if (h != "") print h, f, deps; h = w[1]; f = floor; deps = "-" }
             else if (n > 0 && w[1] !~ /^dsk_/ && line !~ /^           /) { if (h != "") print h, f, deps; h = "" }
             if (h != "" && match(line, /-> .*$/)) { d = substr(line, RSTART + 3); gsub(/[ ]/, "", d); deps = d }
         }
         END { if (h != "") print h, f, deps }' DESIGN.md
}

# The library's own includes (`#include "..."` in dsk_*.h and kernels/: .cu, .cuh, .h), as
# `file line target`; a target resolves next to the file first (kernels/x.cuh), then at the root.
library_includes() {
    local f dir line target
    for f in $(include_files); do
        dir=$(dirname "$f")
        grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[^"]+"' "$f" | sed -E 's/^([0-9]+):.*"([^"]+)".*/\1 \2/' |
            while read -r line target; do
                if [ -f "$dir/$target" ]; then target=$(realpath -m --relative-to=. "$dir/$target")
                elif [ -f "$target" ]; then target=$(realpath -m --relative-to=. "$target")
                else continue; fi # not a library file (a system header in quotes)
                echo "$f $line $target"
            done
    done
}

include_files() { ls dsk_*.h kernels/*.cu kernels/*.cuh kernels/*.h 2>/dev/null; }

# The header that owns kernels/<name>.cu: the one whose CUDA launchers section names it
# (`/* ---- <title> (kernels/<name>.cu`).
kernel_owner() { grep -lE "^/\* ---- [^(]*\(kernels/$(basename "$1")" dsk_*.h 2>/dev/null | head -1; }

check_includes() {
    local problems=() f line target ff ft owner deps n_files n_edges cycle
    design_floors >"$tmp/floors"
    library_includes >"$tmp/includes"
    floor_of() { awk -v h="$1" '$1 == h { print $2 }' "$tmp/floors"; }
    for f in $(ls dsk_*.h); do [ -n "$(floor_of "$f")" ] || problems+=("$f: not on a floor of DESIGN.md's diagram"); done
    for f in $(ls kernels/*.cu 2>/dev/null); do
        [ -n "$(kernel_owner "$f")" ] || problems+=("$f: no owner (no header's CUDA launchers section names it)")
    done
    while read -r f line target; do
        case $f in
        dsk_*.h)
            ff=$(floor_of "$f"); ft=$(floor_of "$target")
            case $target in
            kernels/*) problems+=("$f:$line: includes $target (a header includes no kernels/ file: they sit behind it)") ;;
            *) [ -n "$ff" ] && [ -n "$ft" ] && [ "$ft" -ge "$ff" ] &&
                   problems+=("$f:$line: includes $target (floor $ft, not below $f's floor $ff)")
               deps=$(awk -v h="$f" '$1 == h { print $3 }' "$tmp/floors")
               m=${target#dsk_}; m=${m%.h}
               [ -n "$deps" ] && ! echo ",$deps," | grep -q ",$m," &&
                   problems+=("$f:$line: includes $target, which DESIGN.md's diagram does not list after $f's ->") ;;
            esac ;;
        kernels/*.cu)
            owner=$(kernel_owner "$f")
            case $target in
            kernels/*.cuh | kernels/*.h) ;;
            dsk_*.h) [ -n "$owner" ] && [ "$target" != "$owner" ] && ff=$(floor_of "$owner") && ft=$(floor_of "$target") &&
                         [ -n "$ft" ] && [ "$ft" -ge "$ff" ] &&
                         problems+=("$f:$line: includes $target (floor $ft, not below its owner $owner's floor $ff)") ;;
            *) problems+=("$f:$line: includes $target (a kernel includes its owner, headers below it and kernels/*.cuh)") ;;
            esac ;;
        kernels/*) # the helpers (.cuh, .h)
            case $target in
            kernels/*.cuh | kernels/*.h) ;;
            dsk_*.h) [ "$(floor_of "$target")" = 0 ] ||
                         problems+=("$f:$line: includes $target (the CUDA helper builds on floor 0 only)") ;;
            *) problems+=("$f:$line: includes $target") ;;
            esac ;;
        esac
    done <"$tmp/includes"
    # Cycles, whatever the floors say: tsort names the files of a loop.
    awk '$1 == $3 { print "self" }' "$tmp/includes" | grep -q self &&
        problems+=("a file includes itself: $(awk '$1 == $3 { print $1 ":" $2 }' "$tmp/includes" | paste -sd' ')")
    cycle=$(awk '$1 != $3 { print $1, $3 }' "$tmp/includes" | tsort 2>&1 >/dev/null | grep -v 'input contains a loop' |
        sed 's/^tsort: //' | paste -sd' ')
    [ -z "$cycle" ] || problems+=("an include cycle through: $cycle")
    n_files=$(include_files | wc -l); n_edges=$(wc -l <"$tmp/includes")
    if [ ${#problems[@]} -eq 0 ]; then
        ok "includes: $n_files files, $n_edges includes: no cycle, headers include lower floors only, each kernel its owner"
    else
        bad "includes: ${#problems[@]} problems in the library's includes (DESIGN.md, The house)" "${problems[@]}"
    fi
}

checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(format columns state cuda includes commits places)
case ${checks[0]} in
state) shift; check_state "$@" ;;
*) for c in "${checks[@]}"; do
       case $c in
       format | columns | state | cuda | includes | commits | places) "check_$c" ;;
       *) echo "scripts/lint.sh: unknown check '$c' (format columns state cuda includes commits places)" >&2; exit 2 ;;
       esac
   done ;;
esac
exit $failed
