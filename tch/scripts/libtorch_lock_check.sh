#!/usr/bin/env bash
# Checks by hand that two runs of scripts/libtorch.sh at once on one prefix are safe: a stand-in
# for `python3 -m pip install --target DIR` (no download: it writes libtorch.so in 5 slow parts
# and logs each install) is put first on PATH, two runs start 0.2 s apart on a fresh prefix, and
# this prints how many installs ran and whether the result is whole.
#
# usage:  tch/scripts/libtorch_lock_check.sh [path/to/libtorch.sh]    (default: the repository's)
# Safe:   exit codes 0 0, 1 install, 5 lines, the marker, and "waiting for it" from the second run.
# Unsafe (the script before its lock): 2 installs, and a libtorch.so of more than 5 lines.
set -uo pipefail
script=${1:-$(dirname "$0")/../../scripts/libtorch.sh}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/bin"
cat >"$dir/bin/python3" <<'PIP'
#!/usr/bin/env bash
target=""; prev=""
for a in "$@"; do [ "$prev" = "--target" ] && target=$a; prev=$a; done
echo "install $$ into $target" >>"$FAKE_LOG"
mkdir -p "$target/torch/lib" "$target/nvidia/cu13/include" || exit 1
for i in 1 2 3 4 5; do
  echo "part $i" >>"$target/torch/lib/libtorch.so" || exit 1
  sleep 0.4
done
mkdir -p "$target/nvidia/cu13/include/crt" && echo x >"$target/nvidia/cu13/include/crt/host_defines.h"
PIP
chmod +x "$dir/bin/python3"
export FAKE_LOG=$dir/log OOMGUARD_LIBTORCH_PREFIX=$dir/lt PATH=$dir/bin:$PATH
bash "$script" >"$dir/a.out" 2>"$dir/a.err" &
a=$!
sleep 0.2
bash "$script" >"$dir/b.out" 2>"$dir/b.err" &
b=$!
wait $a; ra=$?
wait $b; rb=$?
echo "exit codes: $ra $rb"
echo "installs: $(grep -c 'into .*/lt$' "$dir/log")"
echo "libtorch.so lines (5 = whole): $(wc -l <"$dir/lt/torch/lib/libtorch.so" 2>/dev/null || echo missing)"
echo "complete marker: $([ -e "$dir/lt/.complete" ] && echo yes || echo no)"
cat "$dir/a.err" "$dir/b.err"
