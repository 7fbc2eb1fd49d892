"""The edge-case source tree the integration tests ingest, mount and compare with ordinary tools.

Everything a dataset tree can hold that a file system must reproduce exactly: odd names (spaces, a
newline, bytes that are not UTF-8, unicode), every small-size boundary, files bigger than a chunk,
compressible text, hard links, symlinks of every kind, unusual permission bits, foreign owners and
nanosecond mtimes, plus a fifo and a unix socket that ingest must skip with a warning.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# Relative (bytes) paths of the special files ingest skips: they are absent from the mount.
SPECIALS = (b"special/fifo", b"special/sock")
# Files whose bytes the tests look at by name.
BIG = b"big/one megabyte.bin"  # spans many chunks at --chunk-size 64K
TEXT = b"text/lorem.txt"  # compresses well (exercises --compress lz4)
MANY_DIR = b"many"  # MANY_FILES small files, for concurrent reads
MANY_FILES = 200
DEPTH = 30
OWNER = (1234, 5678)
BASE_NS = 1_600_000_000_123_456_789  # mtimes are BASE_NS + k * 1_000_001_001 (odd nanoseconds)


def _write(path: bytes, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _bind_socket(path: bytes) -> None:
    """A unix socket file at `path` (bound from its own directory: sun_path holds 108 bytes at most)."""
    here = os.getcwd()
    os.chdir(os.path.dirname(path))
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(os.path.basename(path))
        finally:
            s.close()  # the socket file stays behind, which is all the tree needs
    finally:
        os.chdir(here)


def make_edge_tree(root: str | os.PathLike[str] | bytes) -> None:
    """Create the edge-case tree under `root` (which must not exist yet). Deterministic."""
    base = os.fsencode(root)
    os.mkdir(base)
    rng = random.Random(20261202)

    def p(rel: bytes) -> bytes:
        return os.path.join(base, rel)

    def mkdirs(*rels: bytes) -> None:
        for rel in rels:
            os.makedirs(p(rel), exist_ok=True)

    mkdirs(b"sizes", b"big", b"text", b"names", b"links", b"perms", b"owners", b"empty/inner-empty",
           b"special", MANY_DIR, b"sticky")

    # Sizes around the page boundary, and larger ones.
    for n in (0, 1, 4095, 4096, 4097):
        _write(p(b"sizes/%d.bin" % n), rng.randbytes(n))
    _write(p(b"sizes/100k.bin"), rng.randbytes(100_000))
    _write(p(b"sizes/300k.bin"), rng.randbytes(300_000))
    _write(p(BIG), rng.randbytes(1 << 20))
    _write(p(b"big/two and a half MB.bin"), rng.randbytes(2_500_000))

    # Compressible text.
    words = [b"lorem", b"ipsum", b"dolor", b"sit", b"amet", b"consectetur", b"adipiscing", b"elit"]
    text = b"\n".join(b" ".join(rng.choice(words) for _ in range(12)) for _ in range(6000))
    _write(p(TEXT), text)
    _write(p(b"text/small.txt"), b"hello, dlfs\n" * 20)
    _write(p(b"text/zeros.dat"), bytes(200_000))

    # Names.
    _write(p(b"names/with spaces.txt"), b"spaces\n")
    _write(p(b"names/new\nline"), b"newline\n")
    _write(p(b"names/bad\xff\xfe-bytes"), b"not utf-8\n")
    _write(p("names/ünïcødé-日本語-😀.txt".encode()), "unicode ✓\n".encode())
    _write(p(b"names/-leading-dash"), b"dash\n")
    _write(p(b"names/.hidden"), b"hidden\n")
    _write(p(b"names/" + b"L" * 255), b"longest name\n")
    mkdirs(b"names/dir with spaces", b"names/\xff\xfe dir")
    _write(p(b"names/\xff\xfe dir/inside"), b"inside a non-utf-8 directory\n")

    # Nested 30 deep, with a file at the bottom.
    deep = b"/".join(b"d%02d" % i for i in range(DEPTH))
    mkdirs(deep)
    _write(p(deep + b"/bottom.txt"), b"the bottom\n")

    # Hard links: a pair across directories, a triple within one.
    _write(p(b"links/pair-a"), rng.randbytes(5000))
    os.link(p(b"links/pair-a"), p(b"names/pair-b"))
    _write(p(b"links/triple-1"), rng.randbytes(70_000))
    os.link(p(b"links/triple-1"), p(b"links/triple-2"))
    os.link(p(b"links/triple-1"), p(b"links/triple-3"))

    # Symlinks.
    os.symlink(b"../sizes/4096.bin", p(b"links/relative"))
    os.symlink(p(b"text/small.txt"), p(b"links/absolute"))
    os.symlink(b"does/not/exist", p(b"links/dangling"))
    os.symlink(b"../names", p(b"links/to-dir"))
    os.symlink(b"with spaces.txt", p(b"names/link to spaces"))
    os.symlink(b"\xff\xfe dir/inside", p(b"names/link-to-bad-bytes"))

    # Many small files, for concurrent reads.
    for i in range(MANY_FILES):
        _write(p(MANY_DIR + b"/f%03d.bin" % i), rng.randbytes(rng.randrange(0, 30_000)))

    # Special files: skipped by ingest with a warning.
    os.mkfifo(p(SPECIALS[0]))
    _bind_socket(p(SPECIALS[1]))
    _write(p(b"special/regular"), b"a regular file next to the special ones\n")

    # Owners (before modes: chown clears setuid).
    _write(p(b"owners/foreign"), b"owned by 1234:5678\n")
    _write(p(b"owners/group-only"), b"group 5678\n")
    os.symlink(b"foreign", p(b"owners/foreign-link"))
    os.chown(p(b"owners/foreign"), *OWNER)
    os.chown(p(b"owners/group-only"), 0, OWNER[1])
    os.chown(p(b"owners/foreign-link"), *OWNER, follow_symlinks=False)
    os.chown(p(b"owners"), *OWNER)

    # Permission bits.
    for name, mode in ((b"0600", 0o600), (b"0755", 0o755), (b"4755-setuid", 0o4755), (b"2755-setgid", 0o2755),
                       (b"0000", 0o000), (b"0444", 0o444)):
        _write(p(b"perms/" + name), b"mode %o\n" % mode)
        os.chmod(p(b"perms/" + name), mode)
    mkdirs(b"perms/dir-0700", b"perms/dir-0555")
    os.chmod(p(b"perms/dir-0700"), 0o700)
    os.chmod(p(b"perms/dir-0555"), 0o555)
    _write(p(b"sticky/inside"), b"in a sticky dir\n")
    os.chmod(p(b"sticky"), 0o1777)

    # Explicit mtimes with nanoseconds on every file, symlink and directory, deepest first so that
    # setting a child never disturbs its parent's time afterwards.
    entries: list[bytes] = []
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            entries.append(os.path.join(dirpath, name))
    entries.sort(key=lambda e: e.count(b"/"), reverse=True)
    for k, path in enumerate(entries + [base]):
        ns = BASE_NS + k * 1_000_001_001
        os.utime(path, ns=(ns, ns), follow_symlinks=False)


def specials_of(root: str | os.PathLike[str] | bytes) -> list[bytes]:
    """Absolute paths of the special files in a tree made by make_edge_tree."""
    return [os.path.join(os.fsencode(root), rel) for rel in SPECIALS]


__all__ = ["BIG", "DEPTH", "MANY_DIR", "MANY_FILES", "OWNER", "SPECIALS", "TEXT", "make_edge_tree", "specials_of"]


if __name__ == "__main__":  # python tests/treegen.py DEST: look at the tree by hand
    import sys

    make_edge_tree(Path(sys.argv[1]))
