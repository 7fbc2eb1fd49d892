"""Tar and zip shards as an ingest source (`dlfs ingest --expand-tar`): the mounted dataset equals what
`tar -x` makes of the shards (plain, gzip and zstd, GNU and pax headers; zip too), --flatten, shard
order kept in the chunks, damaged shards publishing nothing, and the selection applied to members."""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from conftest import Node, needs_fuse, running_node
from damage import inode_of

from dlfs.errors import SourceError, UsageError
from dlfs.format.index import Index
from dlfs.ingest.tar import TarShards, find_shards
from dlfs.ingest.walk import Node as Entry
from dlfs.ingest.walk import Selection, Tree

MiB = 1 << 20
LONG_DIR = "d" * 120  # a path over 100 bytes (GNU longname / pax path) ...
LONG_NAME = "n" * 150  # ... and one over 255


# --- building shards ----------------------------------------------------------------------------
def source_tree(root: Path, tag: str = "") -> Path:
    """Directories, an empty file, a 3 MiB file, long names, a symlink and a hard link; mtimes set."""
    (root / "a/b").mkdir(parents=True)
    (root / LONG_DIR / LONG_DIR).mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / f"a/b/x{tag}.txt").write_bytes(b"x" * 1000 + tag.encode())
    (root / f"empty{tag}").write_bytes(b"")
    (root / f"big{tag}.bin").write_bytes(os.urandom(3 * MiB + 123))
    (root / LONG_DIR / LONG_DIR / f"{LONG_NAME}{tag}").write_bytes(b"long " + tag.encode())
    (root / f"exec{tag}.sh").write_bytes(b"#!/bin/sh\n")
    (root / f"exec{tag}.sh").chmod(0o750)
    os.symlink(f"a/b/x{tag}.txt", root / f"link{tag}")
    os.link(root / f"big{tag}.bin", root / f"hard{tag}.bin")
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):  # files before the directories holding them
        # Fractions of a second too: pax headers keep them, GNU headers (and tar -x of them) do not.
        os.utime(p, ns=(1_600_000_000_000_000_000 + i * 1_000_000_000 + 123_456_789,) * 2, follow_symlinks=False)
    return root


def tar_shard(src: Path, out: Path, *opts: str) -> Path:
    """`tar -c` of src's content (GNU format unless opts say otherwise); .tar.zst with the zstd module
    where there is no zstd program."""
    if out.name.endswith(".zst") and not shutil.which("zstd"):
        plain = subprocess.run(["tar", *opts, "-cf", "-", "-C", src, "."], check=True, capture_output=True).stdout
        out.write_bytes(zstandard.ZstdCompressor().compress(plain))
    else:
        comp = ["-z"] if out.name.endswith(".gz") else ["--zstd"] if out.name.endswith(".zst") else []
        subprocess.run(["tar", *opts, *comp, "-cf", out, "-C", src, "."], check=True, capture_output=True)
    return out


def zip_shard(src: Path, out: Path) -> Path:
    """A zip of src (directories, files stored and deflated, a symlink as Info-ZIP keeps one)."""
    with zipfile.ZipFile(out, "w") as zf:
        for p in sorted(src.rglob("*")):
            rel = str(p.relative_to(src))
            if p.is_symlink():
                zi = zipfile.ZipInfo(rel, time.localtime(p.lstat().st_mtime)[:6])
                zi.create_system, zi.external_attr = 3, (stat.S_IFLNK | 0o777) << 16
                zf.writestr(zi, os.readlink(p))
            else:
                zf.write(p, rel, zipfile.ZIP_DEFLATED if p.suffix == ".txt" else zipfile.ZIP_STORED)
    return out


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """What a user sees of every entry under root: type, permissions, owner, mtime, links, size and
    content (symlinks: their target), and which names share an inode."""
    out: dict[str, tuple[object, ...]] = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                body: object = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    body = hashlib.sha256(f.read()).hexdigest()
                inodes.setdefault(st.st_ino, []).append(rel)
            else:
                body = None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns,
                        st.st_nlink, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, body)
    for names in inodes.values():
        for rel in names:
            out[rel] += (tuple(sorted(names)),)
    return out


def extract(shards: list[Path], into: Path, flatten: bool = False) -> Path:
    """What `tar -x` makes of the shards: each in a folder named for it (or all at the top)."""
    for shard in shards:
        dest = into if flatten else into / shard.name.split(".")[0]
        dest.mkdir(parents=True, exist_ok=True)
        if shard.name.endswith(".zst") and not shutil.which("zstd"):
            plain = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
            subprocess.run(["tar", "-xf", "-", "-C", dest], input=plain, check=True, capture_output=True)
        else:
            subprocess.run(["tar", "-xf", shard, "-C", dest], check=True, capture_output=True)
    return into


def read_all(source: TarShards, select: Selection | None = None) -> dict[str, bytes]:
    """Walk and read every file as the packer does, in pieces: path -> bytes."""
    return {node.path.decode(): data for node, data in _read_each(source, source.walk(select))}


def listed(source: TarShards, select: Selection | None = None) -> Tree:
    """The whole tree of `source`: shards are listed as they are read, so every member is read."""
    tree = source.walk(select)
    for _ in _read_each(source, tree):
        pass
    return tree


def _read_each(source: TarShards, tree: Tree) -> Iterator[tuple[Entry, bytes]]:
    for node, f in source.files(tree):
        try:
            buf = bytearray(node.size)
            view, got = memoryview(buf), 0
            while got < node.size:
                n = f.readinto(view[got : got + 100_000])
                assert n, node.path
                got += n
            f.finish()
        finally:
            f.close()
        yield node, bytes(buf)


def one_line_error(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlfs: error: "), proc.stderr
    return lines[0][len("dlfs: error: ") :]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node for the module: the tests publish datasets of their own names."""
    base = tmp_path_factory.mktemp("tar-node")
    with running_node(base / "home", base) as n:
        yield n


def datasets(node: Node) -> list[str]:
    return [line.split()[0] for line in node.run("datasets").stdout.splitlines()[1:] if line.split()]


# --- end to end ---------------------------------------------------------------------------------
@needs_fuse
@pytest.mark.timeout(60)
def test_mounted_shards_equal_tar_x(node: Node, tmp_path: Path) -> None:
    shards = [tar_shard(source_tree(tmp_path / "s1", "1"), tmp_path / "train-000000.tar"),
              tar_shard(source_tree(tmp_path / "s2", "2"), tmp_path / "train-000001.tar.gz"),
              tar_shard(source_tree(tmp_path / "s3", "3"), tmp_path / "train-000002.tar.zst", "--format=pax")]
    zipped = zip_shard(source_tree(tmp_path / "s4", "4"), tmp_path / "train-000003.zip")
    out = node.run("ingest", "--expand-tar", *shards, zipped, "--name", "shards")
    assert out.stdout.startswith("ingested shards version 1: 21 files, "), out.stdout
    ref = extract(shards, tmp_path / "ref")
    mnt = node.mount("shards", tmp_path / "mnt")
    try:
        got = snapshot(mnt)
        want = snapshot(ref)
        assert {k: v for k, v in got.items() if not k.startswith("train-000003")} == want
        # The hard link is one inode with two names, as tar -x makes it.
        assert os.stat(mnt / "train-000000/hard1.bin").st_ino == os.stat(mnt / "train-000000/big1.bin").st_ino
        assert os.stat(mnt / "train-000001/hard2.bin").st_nlink == 2
        assert os.readlink(mnt / "train-000002/link3") == "a/b/x3.txt"
        assert (mnt / "train-000002" / LONG_DIR / LONG_DIR / f"{LONG_NAME}3").read_bytes() == b"long 3"
        assert os.stat(mnt / "train-000002/empty3").st_mtime_ns % 10**9 == 123_456_789  # from the pax header
        # The zip: its bytes, permission bits and symlink; mtimes are the entries' (local, 2 s) times.
        src = tmp_path / "s4"
        with zipfile.ZipFile(zipped) as zf:
            for zi in zf.infolist():
                p, rel = mnt / "train-000003" / zi.filename, zi.filename.rstrip("/")
                st = os.lstat(p)
                assert st.st_mtime_ns == int(time.mktime((*zi.date_time, 0, 0, -1))) * 10**9, rel
                if (src / rel).is_symlink():
                    assert os.readlink(p) == os.readlink(src / rel)
                    continue
                assert stat.S_IFMT(st.st_mode) == stat.S_IFMT((src / rel).stat().st_mode), rel
                assert stat.S_IMODE(st.st_mode) == stat.S_IMODE((src / rel).stat().st_mode), rel
                if not zi.is_dir():
                    assert p.read_bytes() == (src / rel).read_bytes(), rel
    finally:
        node.umount(mnt)


@needs_fuse
@pytest.mark.timeout(60)
def test_flatten_and_selection_of_members(node: Node, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for k in range(2):
        src = tmp_path / f"s{k}"
        (src / "sub").mkdir(parents=True)
        for i in range(3):
            (src / f"{k}{i:04d}.jpg").write_bytes(os.urandom(1000 + i))
            (src / f"{k}{i:04d}.cls").write_text(str(i))
        (src / f"sub/{k}.txt").write_text(f"sub {k}")
        tar_shard(src, tmp_path / "d" / f"shard-{k}.tar")
    (tmp_path / "d/README.md").write_text("not a shard")
    # A directory of shards: its shards in name order, the rest skipped with a warning.
    out = node.run("ingest", "--expand-tar", tmp_path / "d", "--flatten", "--name", "flat")
    assert f"skipping 1 entry of {tmp_path / 'd'} that are not shards (files ending in " in out.stderr
    assert out.stderr.rstrip().endswith("): README.md"), out.stderr
    mnt = node.mount("flat", tmp_path / "mnt")
    try:
        assert sorted(os.listdir(mnt)) == sorted([f"{k}{i:04d}.{e}" for k in range(2) for i in range(3)
                                                  for e in ("jpg", "cls")] + ["sub"])
        assert sorted(os.listdir(mnt / "sub")) == ["0.txt", "1.txt"]
        assert (mnt / "10002.jpg").read_bytes() == (tmp_path / "s1/10002.jpg").read_bytes()
    finally:
        node.umount(mnt)
    # --files-from and --exclude name member paths as the dataset has them.
    (tmp_path / "list").write_text("shard-1/sub\nshard-0/00001.jpg\nshard-0/00001.cls\n")
    node.run("ingest", "--expand-tar", tmp_path / "d/shard-0.tar", tmp_path / "d/shard-1.tar", "--name", "picked",
             "--files-from", tmp_path / "list", "--exclude", "*.cls")
    mnt = node.mount("picked", tmp_path / "mnt2")
    try:
        assert sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*")) == [
            "shard-0", "shard-0/00001.jpg", "shard-1", "shard-1/sub", "shard-1/sub/1.txt"]
    finally:
        node.umount(mnt)
    # Two shards holding one name: one line naming it and both shards, and nothing published.
    shutil.copy(tmp_path / "s0/00000.jpg", tmp_path / "s1/00000.jpg")
    tar_shard(tmp_path / "s1", tmp_path / "d/shard-1.tar")
    (tmp_path / "d/README.md").unlink()  # no warning line
    err = one_line_error(node.run("ingest", "--expand-tar", tmp_path / "d", "--flatten", "--name", "clash",
                                  check=False), SourceError.exit_code)
    assert err == (f"--flatten: 00000.jpg is in both {tmp_path}/d/shard-0.tar and {tmp_path}/d/shard-1.tar "
                   "(leave --flatten out to keep each shard's members in a folder of its own)")
    assert "clash" not in datasets(node)


@pytest.mark.timeout(60)
def test_shard_order_is_kept_in_the_chunks(node: Node, tmp_path: Path) -> None:
    order = []
    for k, name in enumerate(["b-first.tar", "a-second.tar.gz"]):  # named in this order, not by name
        src = tmp_path / f"s{k}"
        src.mkdir()
        for i in range(12):
            (src / f"{i:02d}.bin").write_bytes(os.urandom(20_000))
        # Members in an order of their own (not by name): the shard's order is what is kept.
        members = [f"./{i:02d}.bin" for i in (5, 1, 11, 0, 7, 3, 9, 2, 10, 4, 8, 6)]
        subprocess.run(["tar", "-czf" if name.endswith(".gz") else "-cf", tmp_path / name, "-C", src, *members],
                       check=True)
        order += [f"{name.split('.')[0]}/{m[2:]}" for m in members]
    node.run("ingest", "--expand-tar", tmp_path / "b-first.tar", tmp_path / "a-second.tar.gz", "--name", "order",
             "--chunk-size", "64K")
    idx = Index(node.home / "meta/index/order/1.idx")
    try:
        places = []
        for rel in order:
            inode = idx.inode(inode_of(idx, rel))
            places.append([(idx.extent(e).chunk, idx.extent(e).record.offset)
                           for e in range(inode.ref, inode.ref + inode.count)])
    finally:
        idx.close()
    flat = [p for file in places for p in file]
    assert flat == sorted(flat)  # member after member, shard after shard, chunk after chunk
    assert flat[-1][0] >= 6  # spread over many chunks, so the order says something


@pytest.mark.timeout(60)
def test_damaged_shards_publish_nothing(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}.bin").write_bytes(os.urandom(300_000))
    good = tar_shard(src, tmp_path / "good.tar").read_bytes()
    gz = tar_shard(src, tmp_path / "good.tar.gz").read_bytes()
    infos = [(m.name, m.offset) for m in tarfile.open(tmp_path / "good.tar")]
    third = infos[3][1]  # the header of the third file
    inside = infos[2][1] + 512 + 150_000  # inside the second file: random bytes are stored about 1:1
    cases = {
        "cut.tar": (good[: third + 512 + 1000], "ends inside member ./f"),
        "cut.tar.gz": (gz[: len(gz) // 2], "the gzip stream ends early"),
        "bad-header.tar": (good[:third] + b"\x07" * 512 + good[third + 512 :], "a damaged tar header at byte"),
        # In a member's bytes: the tar is whole, the gzip checksum at its end is not.
        "bad-gzip.tar.gz": (gz[:inside] + bytes(b ^ 0x55 for b in gz[inside : inside + 100]) + gz[inside + 100 :],
                            "the gzip stream does not decompress"),
        "text.tar": (b"hello, not a tar\n" * 100, "is not a tar or zip file"),
        "bzip.tar": (b"BZh91AY&SY" + bytes(100), "is a bzip2-compressed tar"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        err = one_line_error(node.run("ingest", "--expand-tar", tmp_path / "good.tar", tmp_path / name,
                                      "--name", "damaged", check=False), SourceError.exit_code)
        assert str(tmp_path / name) in err and message in err, (name, err)
    # A member with .. in its path, and a zip member whose bytes fail their CRC (found as it is packed).
    with tarfile.open(tmp_path / "escape.tar", "w") as tf:
        info = tarfile.TarInfo("ok/../../etc/passwd")
        tf.addfile(info, io.BytesIO(b""))
    err = one_line_error(node.run("ingest", "--expand-tar", tmp_path / "escape.tar", "--name", "damaged",
                                  check=False), SourceError.exit_code)
    assert err == (f"{tmp_path}/escape.tar: member ok/../../etc/passwd has .. in its path, which could point "
                   "outside the shard: refused")
    with zipfile.ZipFile(tmp_path / "crc.zip", "w") as zf:
        zf.writestr("a.bin", b"a" * 5000)
    flipped = bytearray((tmp_path / "crc.zip").read_bytes())
    flipped[100] ^= 1
    (tmp_path / "crc.zip").write_bytes(flipped)
    err = one_line_error(node.run("ingest", "--expand-tar", tmp_path / "crc.zip", "--name", "damaged",
                                  check=False), SourceError.exit_code)
    assert err == f"{tmp_path}/crc.zip: a.bin: its bytes fail their CRC (a corrupt shard?); nothing was published"
    assert "damaged" not in datasets(node)


# --- the source alone ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_compressed_streams_of_several_members_or_frames(tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    plain = tar_shard(src, tmp_path / "one.tar").read_bytes()
    cut = len(plain) // 3 + 77  # members and frames need not end where tar members do
    (tmp_path / "multi.tar.gz").write_bytes(gzip.compress(plain[:cut]) + bytes(20) + gzip.compress(plain[cut:]))
    zc = zstandard.ZstdCompressor()
    (tmp_path / "multi.tar.zst").write_bytes(zc.compress(plain[:cut]) + zc.compress(plain[cut:]))
    (tmp_path / "named-wrong.zip").write_bytes(plain)  # what it is goes by its bytes, not its name
    expected = {f"one/{k.split('/', 1)[1]}": v for k, v in read_all(TarShards([str(tmp_path / "one.tar")])).items()}
    assert len(expected) == 5  # two names of one file are read once
    for name in ("multi.tar.gz", "multi.tar.zst", "named-wrong.zip"):
        got = read_all(TarShards([str(tmp_path / name)]))
        assert {f"one/{k.split('/', 1)[1]}": v for k, v in got.items()} == expected, name


@pytest.mark.timeout(30)
def test_a_hard_link_takes_the_bytes_of_a_file_left_out(tmp_path: Path) -> None:
    shard = tar_shard(source_tree(tmp_path / "src"), tmp_path / "s.tar")
    big = (tmp_path / "src/big.bin").read_bytes()
    # tar stores big.bin's bytes under one of the two names and the other as a link to it.
    first = next(m.name for m in tarfile.open(shard) if m.name.endswith(".bin"))
    left_out = first.rsplit("/", 1)[1]
    got = read_all(TarShards([str(shard)]), Selection(None, (left_out,)))
    assert [k for k in got if k.endswith(".bin")] == [f"s/{'hard' if left_out == 'big.bin' else 'big'}.bin"]
    assert got[f"s/{'hard' if left_out == 'big.bin' else 'big'}.bin"] == big


@pytest.mark.timeout(30)
def test_a_shard_changed_after_it_was_listed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 10_000)
    (src / "b").write_bytes(b"b" * 10_000)
    shard = tar_shard(src, tmp_path / "s.tar.gz")
    source = TarShards([str(shard)])
    tree = source.walk(None)
    files = source.files(tree)
    node, reader = next(files)  # each shard is listed as it is read: changed while being read
    os.utime(shard, ns=(1, 1))
    buf = bytearray(node.size)
    assert reader.readinto(memoryview(buf)) == node.size
    reader.finish()
    node, reader = next(files)
    assert reader.readinto(memoryview(buf)) == node.size
    reader.finish()
    with pytest.raises(SourceError, match=r"s\.tar\.gz changed while being ingested .*; nothing was published"):
        next(files)


@pytest.mark.timeout(60)
def test_each_shard_is_read_and_decompressed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlfs.ingest.tar as tar

    src = source_tree(tmp_path / "t", "1")
    shards = [tar_shard(src, tmp_path / "s.tar"), tar_shard(src, tmp_path / "g.tar.gz"),
              tar_shard(src, tmp_path / "z.tar.zst")]
    opened: list[str] = []
    inflated: list[str] = []
    real_open, real_inflate = open, tar._inflate

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(path, int):  # (a descriptor: the decompressing thread's own duplicate)
            opened.append(os.path.basename(path))
        return real_open(path, *args, **kwargs)

    def counting_inflate(shard: Any, *args: Any) -> Any:
        inflated.append(os.path.basename(shard.path))
        return real_inflate(shard, *args)

    monkeypatch.setattr(tar, "open", counting_open, raising=False)
    monkeypatch.setattr(tar, "_inflate", counting_inflate)
    got = read_all(TarShards([str(p) for p in shards]))
    assert sorted(opened) == ["g.tar.gz", "s.tar", "z.tar.zst"] and sorted(inflated) == ["g.tar.gz", "z.tar.zst"]
    expect = {os.path.relpath(os.path.join(d, f), src): open(os.path.join(d, f), "rb").read()
              for d, _, names in os.walk(src) for f in names if not os.path.islink(os.path.join(d, f))}
    per = [{k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(stem + "/")} for stem in "sgz"]
    inodes = {os.stat(src / k).st_ino for k in expect}  # a hard-linked file is read once, under its first name
    assert per[0] == per[1] == per[2] and len(per[0]) == len(inodes)
    assert all(expect[k] == v for k, v in per[0].items())

    # A file the selection leaves out gives its bytes to its hard link that it takes, which comes after
    # it: that one shard is read a second time, for those bytes alone.
    opened.clear()
    shard = crafted(tmp_path / "l.tar", (member("a"), b"the bytes of a"), (member("x"), b"x"),
                    (member("b", tarfile.LNKTYPE, "a"), b""), (member("c", tarfile.LNKTYPE, "a"), b""))
    source = TarShards([str(shard)])
    assert read_all(source, Selection(None, ("a",))) == {"l/b": b"the bytes of a", "l/x": b"x"}
    assert opened == ["l.tar", "l.tar"]
    by_path = {n.path: n for n in source._tree.nodes}  # type: ignore[union-attr]
    assert b"l/a" not in by_path and by_path[b"l/b"].nlink == 2
    # A shard with no ./ entry: its folder has the shard file's time and owner (known once it is open).
    st = os.stat(shard)
    assert (by_path[b"l"].mtime_ns, by_path[b"l"].uid, by_path[b"l"].gid) == (st.st_mtime_ns, st.st_uid, st.st_gid)
    assert sorted(name for name, ino in by_path[b"l"].children if ino == by_path[b"l/b"].ino) == [b"b", b"c"]


@pytest.mark.timeout(30)
def test_finding_shards(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    for name in ("b.tar", "a.tar.zst", "c.zip", "notes.txt", "x.tgz"):
        (d / name).write_bytes(b"")
    (d / "sub").mkdir()
    (tmp_path / "named.bin").write_bytes(b"")
    shards = find_shards([str(tmp_path / "named.bin"), str(d)])
    assert [(os.path.basename(s.path), s.folder) for s in shards] == [
        ("named.bin", b"named.bin"), ("a.tar.zst", b"a"), ("b.tar", b"b"), ("c.zip", b"c"), ("x.tgz", b"x")]
    (tmp_path / "b.tar.gz").write_bytes(b"")
    with pytest.raises(SourceError, match=r"b\.tar and .*/b\.tar\.gz would both be the folder b"):
        find_shards([str(d), str(tmp_path / "b.tar.gz")])
    assert len(find_shards([str(d), str(tmp_path / "b.tar.gz")], flatten=True)) == 5  # members may still clash
    with pytest.raises(SourceError, match=r"/d/b\.tar is named twice"):
        find_shards([str(d), str(d / "b.tar")])
    os.symlink(d / "c.zip", tmp_path / "other.zip")
    with pytest.raises(SourceError, match=r"other\.zip is named twice \(also as .*/d/c\.zip\)"):
        find_shards([str(d), str(tmp_path / "other.zip")])
    with pytest.raises(SourceError, match="holds no shards"):
        find_shards([str(d / "sub")])
    with pytest.raises(SourceError, match="cannot read .*/nope: No such file or directory"):
        find_shards([str(tmp_path / "nope")])
    with pytest.raises(UsageError, match=r"^--endpoint-url goes with s3:// shards$"):
        TarShards([str(d)], endpoint_url="http://127.0.0.1:9")


def crafted(path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tf.addfile(info, io.BytesIO(data))
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, link, mode, 1_700_000_000
    return info


@pytest.mark.timeout(60)
def test_a_skipped_member_is_said_once(node: Node, tmp_path: Path) -> None:
    """A member that is no file, directory or symlink is one line on stderr. It was two: a log warning that
    read as if the whole shard were skipped ("skipping s.tar: s/dev: a device node"), then the CLI's line."""
    shard = crafted(tmp_path / "s.tar", (member("f"), b"data"), (member("dev", tarfile.CHRTYPE), b""))
    out = node.run("ingest", "--expand-tar", shard, "--name", "devs")
    assert out.stderr.splitlines() == ["skipped s/dev (not a file, directory or symlink)"], out.stderr
    assert out.stdout.startswith("ingested devs version 1: 1 file, 4 B in 1 chunk "), out.stdout


@pytest.mark.timeout(30)
def test_links_devices_and_names_as_archives_hold_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dlfs.ingest.walk")  # a skipped member's kind (the CLI says it once)
    shard = crafted(tmp_path / "s.tar",
                    (member("./", tarfile.DIRTYPE), b""),  # the shard's folder itself, as `tar -C dir .` writes it
                    (member("/abs/./f"), b"data"),  # a leading / and a . are dropped
                    (member("l1", tarfile.LNKTYPE, "abs/f"), b""),
                    (member("l2", tarfile.LNKTYPE, "./l1"), b""),  # a link to a link: to the file
                    (member("sym", tarfile.SYMTYPE, "../outside/is/just/a/target", 0o777), b""),
                    (member("hsym", tarfile.LNKTYPE, "sym"), b""),  # a link to a symlink: a copy of it
                    (member("dev", tarfile.CHRTYPE), b""),
                    (member("fifo", tarfile.FIFOTYPE), b""))
    tree = listed(TarShards([str(shard)]))
    by_path = {n.path: n for n in tree.nodes}
    assert sorted(by_path) == [b"", b"s", b"s/abs", b"s/abs/f", b"s/hsym", b"s/sym"]
    f = by_path[b"s/abs/f"]
    assert f.nlink == 3 and stat.S_IMODE(f.mode) == 0o644 and f.mtime_ns == 1_700_000_000 * 10**9
    assert sorted(name for name, ino in by_path[b"s"].children if ino == f.ino) == [b"l1", b"l2"]
    assert by_path[b"s/sym"].target == by_path[b"s/hsym"].target == b"../outside/is/just/a/target"
    assert tree.skipped == [b"s/dev", b"s/fifo"] and f"skipping {shard}: s/dev: a device node" in caplog.text
    assert read_all(TarShards([str(shard)])) == {"s/abs/f": b"data"}
    for members, message in (
            ([(member("a/" + "x" * 256), b"")], r"member a/x+ cannot be a path: a component is 256 bytes \(a name is at most 255\)"),
            ([(member("l", tarfile.LNKTYPE, "later"), b""), (member("later"), b"")],
             r"s\.tar: l is a hard link to later, which is not before it in the shard"),
            ([(member("d", tarfile.DIRTYPE), b""), (member("l", tarfile.LNKTYPE, "d"), b"")],
             r"s\.tar: l is a hard link to a directory"),
            ([(member("f"), b"1"), (member("f"), b"2")], r"s\.tar: s/f is named twice"),
            # A file with no name was dropped without a word.
            ([(member(""), b"1")], r"s\.tar: a member that is not a directory has no name \(''\): a damaged shard"),
            ([(member("./"), b"1")], r"s\.tar: a member that is not a directory has no name \('\./'\)"),
            ([(member("f"), b"1"), (member("f/g"), b"2")], r"s\.tar: s/f is a file and also a directory")):
        with pytest.raises(SourceError, match=message):
            listed(TarShards([str(crafted(tmp_path / "s.tar", *members))]))
    # GNU tar's sparse files are refused rather than read wrong.
    with open(tmp_path / "holes", "wb") as hole:
        hole.truncate(1 << 20)
        hole.write(b"x")
    subprocess.run(["tar", "-S", "-cf", tmp_path / "sparse.tar", "-C", tmp_path, "holes"], check=True)
    with pytest.raises(SourceError, match=r"sparse\.tar: holes is a sparse file, which --expand-tar does not read"):
        listed(TarShards([str(tmp_path / "sparse.tar")]))
