"""What of a source tree an ingest takes: --files-from (a list of paths, or stdin) and --exclude
(globs), in the walk itself and end to end through the CLI and a mount."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DLFS, Node, needs_fuse

from dlfs.errors import SourceError, UsageError
from dlfs.ingest.walk import Selection, read_list, walk


def tree(root: Path) -> Path:
    for rel, data in {"a/b/x.jpg": b"x", "a/b/y.tmp": b"y", "a/top.jpg": b"t", "c/z.jpg": b"z",
                      ".git/HEAD": b"h", "notes.txt": b"n", "d/e/f/deep.jpg": b"d"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    os.symlink("a", root / "link")
    return root


def paths(root: Path, select: Selection | None = None) -> list[str]:
    t = walk(root, select)
    # Inode numbers are dense and parents are right: the index is built from exactly these nodes.
    assert [n.ino for n in t.nodes] == list(range(1, len(t.nodes) + 1))
    by_ino = {n.ino: n for n in t.nodes}
    for n in t.nodes[1:]:
        assert by_ino[n.parent].path == (n.path.rsplit(b"/", 1)[0] if b"/" in n.path else b"")
    return sorted(n.path.decode() for n in t.nodes[1:])


def test_excludes_by_name_by_path_and_directories_only(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    assert paths(src, Selection(None, ("*.tmp",))) == [
        ".git", ".git/HEAD", "a", "a/b", "a/b/x.jpg", "a/top.jpg", "c", "c/z.jpg", "d", "d/e", "d/e/f",
        "d/e/f/deep.jpg", "link", "notes.txt"]
    # A directory pattern leaves out all under it; a trailing / spares a file of that name.
    assert paths(src, Selection(None, (".git/", "d"))) == [
        "a", "a/b", "a/b/x.jpg", "a/b/y.tmp", "a/top.jpg", "c", "c/z.jpg", "link", "notes.txt"]
    (src / "file-not-dir").write_bytes(b"")
    assert "file-not-dir" in paths(src, Selection(None, ("file-not-dir/",)))
    # With a /, the path from the root; a leading / anchors it, and * crosses directories.
    assert paths(src, Selection(None, ("/a/*.jpg", "*/f"))) == [
        ".git", ".git/HEAD", "a", "a/b", "a/b/y.tmp", "c", "c/z.jpg", "d", "d/e", "file-not-dir", "link",
        "notes.txt"]


def test_files_from_takes_listed_paths_and_the_directories_leading_to_them(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    listed = read_list([b"a/b/x.jpg\n", b"./c/\n", b"\n", str(src / "d/e").encode() + b"\r\n", b"link\n"], src)
    assert listed == {b"a/b/x.jpg", b"c", b"d/e", b"link"}
    assert paths(src, Selection(listed)) == ["a", "a/b", "a/b/x.jpg", "c", "c/z.jpg", "d", "d/e", "d/e/f",
                                             "d/e/f/deep.jpg", "link"]
    # A path listed twice over (itself and under a listed directory) is found once.
    assert paths(src, Selection(frozenset({b"a", b"a/top.jpg"}))) == ["a", "a/b", "a/b/x.jpg", "a/b/y.tmp",
                                                                       "a/top.jpg"]
    # Excludes apply to what is listed; a listed path excluded (or under an excluded directory) is no error.
    assert paths(src, Selection(frozenset({b"a", b"c/z.jpg"}), ("*.tmp", "c"))) == ["a", "a/b", "a/b/x.jpg",
                                                                                   "a/top.jpg"]


def test_files_from_errors_name_the_path(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    for lines, message in (([b"ok\n", b"../etc/passwd\n"], "line 2: ../etc/passwd is not a path inside the source"),
                           ([b"/etc/passwd\n"], f"line 1: /etc/passwd is not under the source {src}"),
                           ([str(src).encode() + b"/\n"], "is the source itself"),
                           ([b"./\n"], "line 1: ./ is not a path inside the source")):
        with pytest.raises(UsageError, match=message):
            read_list(lines, src)
    # A bucket or tar shards (root None): any absolute path is refused, relative ones are taken.
    with pytest.raises(UsageError, match="line 2: /data/x is absolute; this source is not a local directory"):
        read_list([b"a/b\n", b"/data/x\n"], None)
    assert read_list([b"./a/b/\n", b"c\n"], None) == {b"a/b", b"c"}
    with pytest.raises(SourceError, match=rf"names {src}/a/nope \(and 1 more\), which is not in the source"):
        walk(src, Selection(frozenset({b"a/nope", b"zzz", b"c/z.jpg"})))
    # Through a symlink is not through the tree: the symlink is not followed.
    with pytest.raises(SourceError, match=rf"names {src}/link/top.jpg, .*under a symlink"):
        walk(src, Selection(frozenset({b"link/top.jpg"})))
    # A file where the list has a directory.
    with pytest.raises(SourceError, match=rf"names {src}/notes.txt/x"):
        walk(src, Selection(frozenset({b"notes.txt/x"})))


@needs_fuse
@pytest.mark.timeout(90)
def test_cli_files_from_and_exclude_end_to_end(node: Node, mounted: Callable[..., Path], tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    (tmp_path / "list").write_text("a\nc/z.jpg\n")
    mnt = mounted(src, "picked", "--files-from", str(tmp_path / "list"), "--exclude", "*.tmp")
    found = sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*"))
    assert found == ["a", "a/b", "a/b/x.jpg", "a/top.jpg", "c", "c/z.jpg"]
    assert (mnt / "a/b/x.jpg").read_bytes() == b"x" and (mnt / "c/z.jpg").read_bytes() == b"z"
    # Standard input as the list.
    proc = subprocess.run([*DLFS, "ingest", str(src), "--name", "stdin", "--files-from", "-"], input="notes.txt\n",
                          capture_output=True, text=True, env=node.env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ingested stdin version 1: 1 file, 1 B in 1 chunk ")
    # A list naming what is not there, or what lies outside SRC, publishes nothing: one line, its exit code.
    (tmp_path / "bad").write_text("a\nmissing.jpg\n")
    bad = node.run("ingest", src, "--name", "bad", "--files-from", tmp_path / "bad", check=False)
    assert bad.returncode == SourceError.exit_code
    assert bad.stderr.strip() == (f"dlfs: error: --files-from names {src}/missing.jpg, which is not in the source "
                                  "(or lies under a symlink, which is not followed)")
    (tmp_path / "out").write_text("/etc/passwd\n")
    out = node.run("ingest", src, "--name", "bad", "--files-from", tmp_path / "out", check=False)
    assert out.returncode == UsageError.exit_code
    assert out.stderr.strip() == f"dlfs: error: --files-from line 1: /etc/passwd is not under the source {src}"
    nolist = node.run("ingest", src, "--name", "bad", "--files-from", tmp_path / "absent", check=False)
    assert nolist.returncode == UsageError.exit_code
    assert nolist.stderr.strip() == (f"dlfs: error: --files-from: cannot read {tmp_path / 'absent'}: "
                                     "No such file or directory")
    assert "bad" not in node.run("datasets").stdout


@pytest.mark.timeout(90)
def test_progress_without_a_terminal_is_plain_lines_that_move_within_a_big_file(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(24 << 20))  # six records of 4 MiB
    (src / "small.txt").write_bytes(b"s" * 1000)
    env = {**node.env, "DLFS_PROGRESS_EVERY": "0"}  # a line at every step, to see each
    proc = subprocess.run([*DLFS, "ingest", str(src), "--name", "prog"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ingest prog: ")]
    pattern = re.compile(r"ingest prog: (\d)/2 files, ([\d.]+) MB of 25.2 MB \((\d+)%\), [\d.]+ [kMG]?B/s, .* left")
    got = [pattern.fullmatch(ln) for ln in lines]
    assert lines and all(got), proc.stderr
    # The big file moves the bytes before it counts as done: a record (at most 4 MiB) at a time, while
    # files are still 0 of 2, up to nearly all of its 25.2 MB.
    before = [float(m[2]) for m in got if m[1] == "0"]
    assert len(before) >= 6 and before == sorted(set(before)) and before[0] <= 4.2 and before[-1] >= 25.1
    assert (got[-1][1], got[-1][3]) == ("2", "100")
    # Tar shards are listed as they are read: the totals are not known, the lines say what is done so far.
    subprocess.run(["tar", "-czf", tmp_path / "s.tar.gz", "-C", src, "."], check=True)
    proc = subprocess.run([*DLFS, "ingest", "--expand-tar", str(tmp_path / "s.tar.gz"), "--name", "progs"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ingest progs: ")]
    got = [re.fullmatch(r"ingest progs: (\d) files, ([\d.]+ [kM]?B), [\d.]+ [kMG]?B/s", ln) for ln in lines]
    assert lines and all(got), proc.stderr
    assert (got[-1][1], got[-1][2]) == ("2", "25.2 MB") and len({m[2] for m in got}) >= 6
    bad = subprocess.run([*DLFS, "ingest", str(src), "--name", "prog"], capture_output=True, text=True,
                         env={**node.env, "DLFS_PROGRESS_EVERY": "soon"}, timeout=60)
    assert bad.returncode == UsageError.exit_code
    assert bad.stderr.strip() == "dlfs: error: DLFS_PROGRESS_EVERY must be a number of seconds, not 'soon'"
