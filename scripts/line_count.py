#!/usr/bin/env python3
"""Lines of Rust source, as issue 38 counts them, at git revisions of this repository.

usage: scripts/line_count.py [REV ...]            (default: HEAD)
       scripts/line_count.py --commits BASE [REV]  (each commit of BASE..REV, merges left out)

For each REV: `issue` counts every line (`wc -l`) of every tracked .rs file outside a tests/ or
fixtures/ folder, the issue's own measure; `non_test` leaves out test code that lives under
src/ as well: `#[cfg(test)] mod NAME { ... }` blocks and the files of `#[cfg(test)] mod NAME;`
(found by name: tests.rs, *_tests.rs). `--commits` prints one line per commit: the change of
`non_test` it made, its short hash and subject, then the sum; the sum equals the difference of
`non_test` between BASE and REV when the merges resolved no conflict.
"""
import re
import subprocess
import sys

OUTSIDE = re.compile(r"(^|/)(tests|fixtures)/")
TEST_FILE = re.compile(r"(^|/)(tests|\w+_tests)\.rs$")
TEST_MOD = re.compile(r"\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*\{")


def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def test_module_lines(text):
    """Lines inside `#[cfg(test)] mod NAME { ... }` blocks (braces counted per line)."""
    lines = text.splitlines()
    inside, i = 0, 0
    while i < len(lines):
        if lines[i].strip() == "#[cfg(test)]" and i + 1 < len(lines) and TEST_MOD.match(lines[i + 1]):
            depth, j = 0, i + 1
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                j += 1
                if depth <= 0:
                    break
            inside += j - i
            i = j
        else:
            i += 1
    return inside


def measure(rev, path):
    """(issue, non_test) lines of one file at `rev`; (0, 0) where it does not count or exist."""
    if not path.endswith(".rs") or OUTSIDE.search(path):
        return 0, 0
    r = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    if r.returncode != 0:
        return 0, 0
    total = len(r.stdout.splitlines())
    return total, 0 if TEST_FILE.search(path) else total - test_module_lines(r.stdout)


def tree(rev):
    sums = [0, 0]
    for path in git("ls-tree", "-r", "--name-only", rev).split("\n"):
        for k, n in enumerate(measure(rev, path)):
            sums[k] += n
    return sums


def commits(base, head):
    total = 0
    for c in git("rev-list", "--reverse", "--no-merges", f"{base}..{head}").split():
        paths = git("diff-tree", "--no-commit-id", "-r", "--name-only", "--no-renames", c + "^", c)
        delta = sum(measure(c, p)[1] - measure(c + "^", p)[1] for p in paths.split())
        total += delta
        print(f"{delta:+7d} {c[:7]} {git('log', '-1', '--format=%s', c).strip()[:150]}")
    print(f"{total:+7d} in all, {base}..{head}")


if __name__ == "__main__":
    a = sys.argv[1:]
    if a and a[0] == "--commits":
        if len(a) not in (2, 3):
            sys.exit("usage: scripts/line_count.py --commits BASE [REV]")
        commits(a[1], a[2] if len(a) == 3 else "HEAD")
    else:
        for rev in a or ["HEAD"]:
            issue, non_test = tree(rev)
            print(f"{rev}: issue {issue} non_test {non_test}")
