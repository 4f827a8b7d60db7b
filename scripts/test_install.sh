#!/usr/bin/env bash
# test_install.sh — installs attn to a fresh temporary prefix and builds the
# README's C example against it as a user would: pkg-config (shared, then
# static), find_package (attn::attn, attn::attn_static), then pkg-config and
# find_package again after the prefix has been moved, and pkg-config once more
# with a multiarch LIBDIR (lib/<triplet>: one folder deeper). Each check prints
# "ok: ..." or "FAIL: ..."; the last line counts them.
# Usage: scripts/test_install.sh [build-dir (build-install)] [cmake args...]
set -uo pipefail # no -e: a failed check is counted, the others still run

cd "$(dirname "$0")/.."
src=$PWD
build=${1:-build-install}
shift $(($# > 0 ? 1 : 0))
CC=${CC:-cc}
JOBS=${JOBS:-2}
export CC

tmp=$(mktemp -d "${TMPDIR:-/tmp}/attn-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM # so that the EXIT trap runs

passed=0 failed=0
summary() {
    echo "test-install: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    exit
}
# check <what> <command...>: one line per check; the command's output only
# when it fails.
check() {
    local what=$1
    shift
    if "$@" >"$tmp/log" 2>&1; then
        echo "ok: $what"
        passed=$((passed + 1))
    else
        echo "FAIL: $what"
        tail -n 15 "$tmp/log" | sed 's/^/    /'
        failed=$((failed + 1))
        return 1
    fi
}

# ---- the library, installed to a temporary prefix ----
# LIBDIR is given: the multiarch check below reconfigures this tree.
configure() { # configure <libdir> [cmake args...]
    local libdir=$1
    shift
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DATTN_WERROR=ON \
        -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_BENCH=OFF \
        -DATTN_BUILD_PYTHON=OFF -DCMAKE_INSTALL_LIBDIR="$libdir" "$@"
}
check "configure attn in $build" configure lib "$@" || summary
check "build attn in $build" cmake --build "$build" -j "$JOBS" || summary
prefix=$tmp/prefix
check "cmake --install to a temporary prefix" cmake --install "$build" --prefix "$prefix" || summary
pcfile=$prefix/lib/pkgconfig/attn.pc

# The README's example, extracted as the test suite does (examples/).
check "extract the README's C example" cmake -DREADME="$src/README.md" \
    -DOUT="$tmp/readme_example.c" -P cmake/readme_example.cmake || summary

# run_example <exe>: the README example's output is one line per head.
run_example() {
    "$1" >"$tmp/out" && cat "$tmp/out" && [ "$(grep -c '^head [01]: ' "$tmp/out")" = 2 ]
}

# pc_example <pc folder> <exe> [--static]: compile, link and run the example
# with flags from pkg-config only. The shared library is found at run time
# through an rpath to pkg-config's libdir; --static links libattn.a instead
# (-l:libattn.a) and must not need libattn.so.
pc_example() {
    local pcdir=$1 exe=$2 static=${3:-} cflags libs libdir
    local pc="env PKG_CONFIG_PATH=$pcdir pkg-config"
    cflags=$($pc --cflags attn) && libs=$($pc $static --libs attn) &&
        libdir=$($pc --variable=libdir attn) || return 1
    echo "cflags: $cflags"
    echo "libs:   $libs"
    if [ -n "$static" ]; then
        libs=$(printf '%s\n' "$libs" | sed 's/\(^\| \)-lattn\( \|$\)/\1-l:libattn.a\2/')
    fi
    # shellcheck disable=SC2086 # the flags are meant to split
    "$CC" -std=c11 -Wall -Wextra -Werror "$tmp/readme_example.c" -o "$exe" $cflags $libs \
        -Wl,-rpath,"$libdir" || return 1
    if [ -n "$static" ] && readelf -d "$exe" | grep -q 'NEEDED.*libattn'; then
        echo "$exe needs libattn.so"
        return 1
    fi
    run_example "$exe"
}

# cmake_example <prefix> <dir> <target...>: a project of its own that finds
# attn through CMAKE_PREFIX_PATH and links each target named.
cmake_example() {
    local pfx=$1 dir=$2
    shift 2
    mkdir -p "$dir"
    cp "$tmp/readme_example.c" "$dir/"
    {
        echo 'cmake_minimum_required(VERSION 3.18)'
        echo 'project(attn_consumer LANGUAGES C)'
        echo 'find_package(attn CONFIG REQUIRED)'
        echo 'message(STATUS "attn_DIR: ${attn_DIR}")'
        echo 'add_executable(readme_shared readme_example.c)'
        echo 'target_link_libraries(readme_shared PRIVATE attn::attn)'
        echo 'add_executable(readme_static readme_example.c)'
        echo 'target_link_libraries(readme_static PRIVATE attn::attn_static)'
    } >"$dir/CMakeLists.txt"
    cmake -S "$dir" -B "$dir/build" -DCMAKE_PREFIX_PATH="$pfx" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF || return 1
    # The package found must be the one just installed.
    grep -q "^attn_DIR:PATH=$pfx/" "$dir/build/CMakeCache.txt" || return 1
    local t
    for t in "$@"; do
        cmake --build "$dir/build" --target "$t" && run_example "$dir/build/$t" || return 1
    done
}

# ---- what was installed names no paths of this machine ----
check "attn.pc finds its prefix from \${pcfiledir}" grep -q '^prefix=${pcfiledir}/' "$pcfile"
check "attn.pc links by flags, no absolute paths" \
    sh -c '! grep -E "^(Libs|Libs.private|Cflags):.*(^|[ :])(-[LI])?/" "$1"' _ "$pcfile"
check "attnTargets*.cmake hold no absolute paths" \
    sh -c '! grep -nE "(INTERFACE_[A-Z_]+|IMPORTED_[A-Z_]+) \"([^\"]*;)?/" "$@"' _ \
    "$prefix"/lib/cmake/attn/attnTargets*.cmake

# ---- pkg-config and find_package, as installed ----
check "pkg-config: README example, shared libattn" \
    pc_example "$prefix/lib/pkgconfig" "$tmp/readme_pc"
if [ -e "$prefix/lib/libattn.a" ]; then
    check "pkg-config --static: README example, libattn.a" \
        pc_example "$prefix/lib/pkgconfig" "$tmp/readme_pc_static" --static
fi
check "find_package: README example with attn::attn and attn::attn_static" \
    cmake_example "$prefix" "$tmp/consumer" readme_shared readme_static

# ---- the same tree moved elsewhere: nothing may point at the old place ----
mkdir -p "$tmp/moved/deeper"
mv "$prefix" "$tmp/moved/deeper/attn"
moved=$tmp/moved/deeper/attn
check "moved prefix, pkg-config: README example, shared libattn" \
    pc_example "$moved/lib/pkgconfig" "$tmp/readme_pc_moved"
check "moved prefix, find_package: README example with attn::attn" \
    cmake_example "$moved" "$tmp/consumer_moved" readme_shared

# ---- LIBDIR one level deeper (Debian's lib/x86_64-linux-gnu) ----
multiarch=lib/$("$CC" -dumpmachine)
install_multiarch() {
    configure "$multiarch" "$@" && cmake --install "$build" --prefix "$tmp/multiarch"
}
check "reconfigure with CMAKE_INSTALL_LIBDIR=$multiarch, install" install_multiarch "$@" &&
    check "LIBDIR=$multiarch, pkg-config: README example, shared libattn" \
        pc_example "$tmp/multiarch/$multiarch/pkgconfig" "$tmp/readme_pc_multiarch"
summary
