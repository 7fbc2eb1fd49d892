"""Ingest from S3 (`dlfs ingest s3://BUCKET/PREFIX`) against a real S3 server (moto's, on localhost):
a bucket of thousands of objects listed in many pages, byte for byte and time for time through a
mount; a server that fails a tenth of its requests; wrong credentials, a missing bucket, an object
changed or deleted mid-ingest and keys that cannot be paths, each one line that publishes nothing;
Ctrl-C; --files-from and --exclude over a bucket; the read-ahead's bound on memory and its threads'
end. The bucket is filled once per module; one node serves every test, each under names of its own."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import DLFS, Node, needs_fuse, running_node
from s3server import FAULTS, FlakyProxy, MotoServer, aws_env

from dlfs.errors import SourceError, UsageError
from dlfs.ingest.s3 import S3Prefix, mtime_ns, parse_url
from dlfs.ingest.s3file import GAP, member_ranges
from dlfs.ingest.tar import TarShards
from dlfs.ingest.walk import Selection

BUCKET = "bucket"
N_SMALL = 1000
# One object uploaded in 5 parts (S3 takes parts of 5 MiB and more), bigger than the read-ahead window of
# test_read_ahead_holds_at_most_its_window_and_its_threads_end.
BIG = 40_000_000
BIG_PART = 8_000_000


@dataclass
class Bucket:
    objects: dict[str, bytes]  # the keys under data/, relative to it, with their bytes
    listing: dict[str, Any]  # key -> the listing's entry (LastModified, ETag, Size), the whole bucket


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("s3")


@pytest.fixture(scope="module")
def aws(scratch: Path) -> Iterator[None]:
    """Credentials moto takes, no AWS config of the user's, for this process and the CLI it runs."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in aws_env(scratch).items():
            if v is None:
                mp.delenv(k, raising=False)
            else:
                mp.setenv(k, v)
        mp.delenv("DLFS_S3_PAGE_SIZE", raising=False)
        yield


@pytest.fixture(scope="module")
def moto(scratch: Path, aws: None) -> Iterator[MotoServer]:
    server = MotoServer(scratch / "moto.log")
    try:
        yield server
    finally:
        server.stop()


def put_all(s3: Any, objects: dict[str, bytes]) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: s3.put_object(Bucket=BUCKET, Key=kv[0], Body=kv[1]), objects.items()))


@pytest.fixture(scope="module")
def made(moto: MotoServer) -> None:
    """The bucket, for the tests that put objects of their own in it."""
    moto.client().create_bucket(Bucket=BUCKET)


@pytest.fixture(scope="module")
def bucket(moto: MotoServer, made: None) -> Bucket:
    """data/: N_SMALL small objects (some empty, some *.tmp) under nested prefixes, a directory marker
    of an empty directory and one of a full one, and BIG bytes uploaded in parts; beside it, keys
    that share the prefix's letters but not its directory (database/, data.txt)."""
    s3 = moto.client()
    rng = random.Random(7)
    objects: dict[str, bytes] = {}
    for i in range(N_SMALL):
        size = 0 if i % 97 == 0 else rng.choice((rng.randint(1, 2000), rng.randint(2000, 40000)))
        name = f"f{i:04d}.tmp" if i % 50 == 7 else f"f{i:04d}.bin"
        objects[f"d{i % 6}/e{i // 6 % 4}/{name}"] = rng.randbytes(size)
    objects.update({f"top{i}.bin": rng.randbytes(100 * i) for i in range(5)})
    put_all(s3, {f"data/{k}": v for k, v in objects.items()} | {
        "data/empty-dir/": b"", "data/d0/": b"", "database/x.bin": b"x", "data.txt": b"t"})
    big = rng.randbytes(BIG)
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key="data/big/blob.bin")["UploadId"]
    parts = []
    for n, start in enumerate(range(0, BIG, BIG_PART), 1):
        etag = s3.upload_part(Bucket=BUCKET, Key="data/big/blob.bin", UploadId=upload, PartNumber=n,
                              Body=big[start:start + BIG_PART])["ETag"]
        parts.append({"ETag": etag, "PartNumber": n})
    s3.complete_multipart_upload(Bucket=BUCKET, Key="data/big/blob.bin", UploadId=upload,
                                 MultipartUpload={"Parts": parts})
    objects["big/blob.bin"] = big
    listing = {o["Key"]: o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
               for o in page.get("Contents", [])}
    assert listing["data/big/blob.bin"]["ETag"].endswith('-5"')  # multipart, really
    return Bucket(objects, listing)


@pytest.fixture(scope="module")
def s3node(scratch: Path, aws: None) -> Iterator[Node]:
    """One node for the module: each test ingests under names of its own."""
    with running_node(scratch / "home", scratch) as node:
        yield node


def one_line_error(proc: Any) -> str:
    assert proc.returncode == SourceError.exit_code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def published(node: Node) -> set[str]:
    return {ln.split()[0] for ln in node.run("datasets").stdout.splitlines()[1:]}


def read_tree(root: Path) -> tuple[dict[str, bytes], list[str]]:
    """Every file's bytes under root, and every directory, by path relative to it."""
    files, dirs = {}, []
    for d, subdirs, names in os.walk(root):
        rel = Path(d).relative_to(root)
        dirs += [str(rel / s) for s in subdirs]
        files.update({str(rel / n): (Path(d) / n).read_bytes() for n in names})
    return files, sorted(dirs)


@pytest.mark.timeout(30)
def test_urls_name_a_bucket_and_a_directory_of_keys() -> None:
    assert parse_url("s3://b") == ("b", "")
    assert parse_url("s3://b/") == ("b", "")
    # A trailing / changes nothing: the prefix is a directory (train/ and not train-old/).
    assert parse_url("s3://b/train") == parse_url("s3://b/train/") == ("b", "train/")
    assert parse_url("s3://b/a/b//") == ("b", "a/b/")
    for bad, message in (("s3://", "'' is not a bucket name"), ("s3:///x", "'' is not a bucket name"),
                         ("s3://b@d/x", "'b@d' is not a bucket name"), ("http://b/x", "is not an s3:// URL")):
        with pytest.raises(UsageError, match=message):
            parse_url(bad)


@needs_fuse
@pytest.mark.timeout(180)
def test_a_prefix_ingests_every_byte_size_and_time(s3node: Node, moto: MotoServer, bucket: Bucket, scratch: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLFS_S3_PAGE_SIZE", "80")  # 13 pages
    proc = s3node.run("ingest", f"s3://{BUCKET}/data", "--name", "s3data", "--endpoint-url", moto.url)
    n_files = len(bucket.objects)
    assert proc.stdout.startswith(f"ingested s3data version 1: {n_files} files, "), proc.stdout
    mnt = s3node.mount("s3data", scratch / "mnt-data")
    try:
        files, dirs = read_tree(mnt)
        assert files.keys() == bucket.objects.keys()  # database/ and data.txt are not under data/
        for rel, data in bucket.objects.items():
            assert files[rel] == data, rel
        assert "empty-dir" in dirs and not os.listdir(mnt / "empty-dir")
        # Times are the objects' LastModified; a directory marker's is its own; modes are fixed.
        listing = bucket.listing
        for rel in [*bucket.objects, "empty-dir/", "d0/"]:
            st = os.stat(mnt / rel)
            obj = listing[f"data/{rel}"]
            when = obj["LastModified"]
            assert st.st_mtime_ns == int(when.timestamp()) * 10**9 + when.microsecond * 1000, rel
            if rel.endswith("/"):
                assert stat.S_IMODE(st.st_mode) == 0o755 and stat.S_ISDIR(st.st_mode)
            else:
                assert st.st_size == obj["Size"] and stat.S_IMODE(st.st_mode) == 0o644
            assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    finally:
        s3node.umount(mnt)


@needs_fuse
@pytest.mark.timeout(120)
def test_a_server_failing_a_tenth_of_requests_is_retried_to_the_exact_bytes(
        s3node: Node, moto: MotoServer, made: None, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    objects = {f"flaky/{i % 5}/o{i:03d}": rng.randbytes(rng.randint(0, 5000)) for i in range(200)}
    objects |= {f"flaky/big{i}": rng.randbytes(20 << 20) for i in range(2)}  # three ranges each
    put_all(moto.client(), objects)
    proxy = FlakyProxy(moto.url, fail_rate=0.1, seed=5)
    try:
        monkeypatch.setenv("DLFS_S3_PAGE_SIZE", "20")
        s3node.run("ingest", f"s3://{BUCKET}/flaky", "--name", "flaky", "--endpoint-url", proxy.url)
    finally:
        proxy.close()
    # Every kind of fault was met, and got through: 503 SlowDown, 500, a reset, a body cut short.
    assert set(proxy.faults) == set(FAULTS), proxy.faults
    mnt = s3node.mount("flaky", scratch / "mnt-flaky")
    try:
        files, _ = read_tree(mnt)
        assert files == {k.removeprefix("flaky/"): v for k, v in objects.items()}
    finally:
        s3node.umount(mnt)


@pytest.mark.timeout(120)
def test_ctrl_c_stops_an_ingest_reading_a_bucket(s3node: Node, moto: MotoServer, bucket: Bucket) -> None:
    proxy = FlakyProxy(moto.url)
    reading = threading.Event()

    def slowly(method: str, path: str) -> None:
        if method == "GET" and "list-type" not in path:
            reading.set()
            time.sleep(0.05)  # the bucket's 1000 objects would take a while

    proxy.hooks.append(slowly)
    cmd = [*DLFS, "ingest", f"s3://{BUCKET}/data", "--name", "stopped", "--endpoint-url", proxy.url]
    try:
        proc = subprocess.Popen(cmd, env=s3node.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert reading.wait(30), "the ingest never read an object"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # its fetch threads do not hold it up
    finally:
        proxy.close()
    assert (proc.returncode, err) == (130, "dlfs: interrupted\n")
    assert "ingests in progress 0" in s3node.run("status").stdout
    assert "stopped" not in published(s3node)


@pytest.mark.timeout(120)
def test_credentials_and_buckets_that_fail_say_so_in_one_line(s3node: Node, moto: MotoServer, made: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = f"s3://{BUCKET}/data"
    nobody = moto.iam_user("nobody")  # a real key, with no permission at all
    with moto.auth():
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        proc = s3node.run("ingest", src, "--name", "denied", "--endpoint-url", moto.url, check=False)
        assert one_line_error(proc) == (
            f"dlfs: error: s3://{BUCKET}: access denied (InvalidAccessKeyId): the credentials are not accepted by "
            f"{moto.url}: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile (AWS_PROFILE)")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", nobody[0])
        proc = s3node.run("ingest", src, "--name", "denied", "--endpoint-url", moto.url, check=False)
        assert "(SignatureDoesNotMatch)" in one_line_error(proc)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", nobody[1])
        proc = s3node.run("ingest", src, "--name", "denied", "--endpoint-url", moto.url, check=False)
        assert one_line_error(proc) == (f"dlfs: error: s3://{BUCKET}: access denied (AccessDenied): these "
                                        "credentials may not read it: check the bucket's policy, or "
                                        "AWS_ACCESS_KEY_ID / the profile")
    proc = s3node.run("ingest", "s3://no-such-bucket/x", "--name", "denied", "--endpoint-url", moto.url, check=False)
    assert one_line_error(proc) == f"dlfs: error: s3://no-such-bucket: no such bucket at {moto.url}"
    proc = s3node.run("ingest", f"s3://{BUCKET}/nothing-here", "--name", "denied", "--endpoint-url", moto.url,
                      check=False)
    assert one_line_error(proc) == (f"dlfs: error: s3://{BUCKET}/nothing-here/: no objects under it "
                                    "(s3://BUCKET/PREFIX takes the keys that start PREFIX/)")
    assert "denied" not in published(s3node)


@pytest.mark.timeout(90)
def test_an_object_changed_after_the_listing_fails_the_ingest(s3node: Node, moto: MotoServer, made: None) -> None:
    s3 = moto.client()
    put_all(s3, {f"changing/o{i:02d}": b"o" * i for i in range(20)} | {"changing/target": b"before"})
    old = s3.head_object(Bucket=BUCKET, Key="changing/target")["ETag"]
    proxy = FlakyProxy(moto.url)

    def rewrite(method: str, path: str) -> None:
        # Between the listing and the GET, as another writer would.
        if method == "GET" and path.split("?")[0].endswith("/changing/target"):
            s3.put_object(Bucket=BUCKET, Key="changing/target", Body=os.urandom(8))

    proxy.hooks.append(rewrite)
    try:
        proc = s3node.run("ingest", f"s3://{BUCKET}/changing", "--name", "changed", "--endpoint-url", proxy.url,
                          check=False)
        assert one_line_error(proc) == (f"dlfs: error: s3://{BUCKET}/changing/target changed while being ingested "
                                        f"(ETag {old}); nothing was published")
        # A store that ignores If-Match: the answer's own ETag tells.
        proxy.strip_if_match = True
        listed = s3.head_object(Bucket=BUCKET, Key="changing/target")["ETag"]
        proc = s3node.run("ingest", f"s3://{BUCKET}/changing", "--name", "changed", "--endpoint-url", proxy.url,
                          check=False)
        now = s3.head_object(Bucket=BUCKET, Key="changing/target")["ETag"]
        assert one_line_error(proc) == (f"dlfs: error: s3://{BUCKET}/changing/target changed while being ingested "
                                        f"(ETag {listed} -> {now}); nothing was published")
    finally:
        proxy.close()
    assert "changed" not in published(s3node)


@pytest.mark.timeout(60)
def test_an_object_deleted_after_the_listing_is_named(moto: MotoServer, made: None) -> None:
    s3 = moto.client()
    put_all(s3, {"deleting/a": b"a", "deleting/b": b"", "deleting/c": b"c"})
    for gone in ("deleting/b", "deleting/c"):  # an empty object is checked too
        src = S3Prefix(f"s3://{BUCKET}/deleting", endpoint_url=moto.url)
        tree = src.walk(None)
        s3.delete_object(Bucket=BUCKET, Key=gone)
        with pytest.raises(SourceError) as err:
            for node, f in src.files(tree):
                f.readinto(memoryview(bytearray(node.size + 1)))
                f.finish()
        assert str(err.value) == f"s3://{BUCKET}/{gone} was deleted while being ingested; nothing was published"
        s3.put_object(Bucket=BUCKET, Key=gone, Body=b"")


@pytest.mark.timeout(60)
def test_without_credentials_requests_go_unsigned(moto: MotoServer, made: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    put_all(moto.client(), {"public/a": b"a", "public/b/c": b"c"})
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    src = S3Prefix(f"s3://{BUCKET}/public", endpoint_url=moto.url)
    assert not src.client.signed
    assert [n.path for n in src.walk(None).files] == [b"a", b"b/c"]


@pytest.mark.timeout(90)
def test_a_key_that_cannot_be_a_path_is_named(s3node: Node, moto: MotoServer, made: None) -> None:
    long = "n" * 256
    put_all(moto.client(), {"bad1/ok": b"1", "bad1/a//b": b"2", "bad2/f": b"3", "bad2/f/g": b"4",
                            "bad3/x/../y": b"5", f"bad4/{long}": b"6", "bad5/m": b"7", "bad5/m/": b""})
    proc = s3node.run("ingest", f"s3://{BUCKET}/bad1", "--name", "bad", "--endpoint-url", moto.url, check=False)
    assert one_line_error(proc) == (f"dlfs: error: s3://{BUCKET}/bad1/a//b cannot be a path: a component is "
                                    "empty (// or a leading /)")
    assert "bad" not in published(s3node)
    for prefix, message in (
            ("bad2", f"s3://{BUCKET}/bad2/f/g cannot be a path: s3://{BUCKET}/bad2/f is an object too, and a file "
                     "system cannot hold a file and a directory of one name"),
            ("bad3", f"s3://{BUCKET}/bad3/x/../y cannot be a path: a component is .."),
            ("bad4", f"s3://{BUCKET}/bad4/{long} cannot be a path: a component is 256 bytes (a name is at most 255)"),
            ("bad5", f"s3://{BUCKET}/bad5/m/ cannot be a path: s3://{BUCKET}/bad5/m is an object too")):
        with pytest.raises(SourceError) as err:
            S3Prefix(f"s3://{BUCKET}/{prefix}", endpoint_url=moto.url).walk(None)
        assert str(err.value).startswith(message)
    # What --exclude leaves out is never a problem.
    tree = S3Prefix(f"s3://{BUCKET}/bad1", endpoint_url=moto.url).walk(Selection(None, ("a",)))
    assert [n.path for n in tree.nodes[1:]] == [b"ok"]


@needs_fuse
@pytest.mark.timeout(120)
def test_files_from_and_exclude_over_a_bucket(s3node: Node, moto: MotoServer, bucket: Bucket, scratch: Path) -> None:
    (scratch / "list").write_text("d1/e2\ntop3.bin\nempty-dir/\n")
    s3node.run("ingest", f"s3://{BUCKET}/data", "--name", "picked", "--endpoint-url", moto.url,
               "--files-from", scratch / "list", "--exclude", "*.tmp")
    want = {k: v for k, v in bucket.objects.items()
            if (k.startswith("d1/e2/") and not k.endswith(".tmp")) or k == "top3.bin"}
    assert len(want) >= N_SMALL // 25  # d1/e2/ holds one in 24 of the small objects, less the *.tmp ones
    mnt = s3node.mount("picked", scratch / "mnt-picked")
    try:
        files, dirs = read_tree(mnt)
        assert files == want
        assert dirs == ["d1", "d1/e2", "empty-dir"]
    finally:
        s3node.umount(mnt)
    (scratch / "missing").write_text("d1/e2\nd9\n")
    proc = s3node.run("ingest", f"s3://{BUCKET}/data", "--name", "missing", "--endpoint-url", moto.url,
                      "--files-from", scratch / "missing", check=False)
    assert one_line_error(proc) == f"dlfs: error: --files-from names d9, which is not in s3://{BUCKET}/data"
    (scratch / "absolute").write_text("d1/e2\n/data/d9\n")  # a bucket has no place in this machine's tree
    proc = s3node.run("ingest", f"s3://{BUCKET}/data", "--name", "missing", "--endpoint-url", moto.url,
                      "--files-from", scratch / "absolute", check=False)
    assert proc.returncode == UsageError.exit_code and proc.stderr == (
        "dlfs: error: --files-from line 2: /data/d9 is absolute; this source is not a local directory: list paths "
        "relative to it, as the dataset will have them\n")


@pytest.mark.timeout(120)
def test_read_ahead_holds_at_most_its_window_and_its_threads_end(moto: MotoServer, bucket: Bucket) -> None:
    window = 24 << 20
    src = S3Prefix(f"s3://{BUCKET}/data/big", endpoint_url=moto.url, range_size=4 << 20, window_bytes=window)
    files = src.files(src.walk(None))
    node, f = next(files)
    assert node.size == BIG
    digest, buf, left = hashlib.sha256(), bytearray(3 << 20), BIG
    while left:
        n = f.readinto(memoryview(buf)[:left])
        assert n
        digest.update(memoryview(buf)[:n])
        left -= n
    f.finish()
    f.close()
    assert next(files, None) is None
    assert digest.digest() == hashlib.sha256(bucket.objects["big/blob.bin"]).digest()
    assert src.ahead is not None and 0 < src.ahead.peak_bytes <= window
    assert not any(t.is_alive() for t in src.ahead.threads)
    # Left in the middle (the packer's error, or Ctrl-C): closing the files stops every thread.
    files = src.files(src.walk(None))
    _, f = next(files)
    f.readinto(memoryview(buf))
    threads = src.ahead.threads
    assert any(t.is_alive() for t in threads)
    files.close()
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(30)
def test_the_ring_places_ranges_in_order_without_overlap() -> None:
    from collections import deque

    from dlfs.ingest.s3 import _Ring

    rng = random.Random(1)
    for size in (1, 7, 64, 1000):
        ring, live, placed = _Ring(size), deque[tuple[int, int]](), 0
        for _ in range(5000):
            length = rng.choice((0, 1, rng.randint(1, size)))
            off = ring.place(length) if rng.random() < 0.6 or not live else None
            if off is None:
                assert live  # an empty ring always has room
                ring.free(*live.popleft())
                continue
            assert 0 <= off and off + length <= size
            for o, n in live:  # no two ranges in use share a byte
                assert off + length <= o or o + n <= off or not (n and length)
            live.append((off, length))
            placed += 1
            assert ring.used == sum(n for _, n in live)
        assert placed > 1000


@pytest.mark.timeout(30)
def test_page_size_is_checked(monkeypatch: pytest.MonkeyPatch, aws: None) -> None:
    monkeypatch.setenv("DLFS_S3_PAGE_SIZE", "0")
    with pytest.raises(UsageError, match="DLFS_S3_PAGE_SIZE must be a number of keys from 1 to 1000, not '0'"):
        S3Prefix("s3://b/x")


@pytest.mark.timeout(30)
def test_times_are_exact() -> None:
    from datetime import UTC, datetime

    assert mtime_ns(datetime(2024, 2, 29, 23, 59, 58, 123000, tzinfo=UTC)) == 1709251198_123000000


# --- tar shards in a bucket ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(moto: MotoServer, made: None, scratch: Path) -> Path:
    """shards/ in the bucket and on disk: a plain (pax) tar, a gzip and a zstd one, a zip, and a plain tar
    of 400 small members; beside them an object that is no shard and one in a deeper prefix."""
    from test_ingest_tar import source_tree, tar_shard, zip_shard

    local = scratch / "shards"
    local.mkdir()
    tar_shard(source_tree(scratch / "t1", "1"), local / "train-000000.tar", "--format=pax")
    tar_shard(source_tree(scratch / "t2", "2"), local / "train-000001.tar.gz")
    tar_shard(source_tree(scratch / "t3", "3"), local / "train-000002.tar.zst")
    zip_shard(source_tree(scratch / "t4", "4"), local / "train-000003.zip")
    small = scratch / "t5"
    rng = random.Random(11)
    for i in range(400):
        (small / f"{i % 7}").mkdir(parents=True, exist_ok=True)
        (small / f"{i % 7}/{i:04d}.jpg").write_bytes(rng.randbytes(rng.randint(0, 60_000)))
    tar_shard(small, local / "train-000004.tar")
    put_all(moto.client(), {f"shards/{p.name}": p.read_bytes() for p in local.iterdir()} |
            {"shards/README.txt": b"not a shard", "shards/old/train-000009.tar": b""})
    return local


@pytest.mark.timeout(120)
def test_shards_in_a_bucket_read_as_the_same_shards_on_disk(moto: MotoServer, shards: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from test_ingest_tar import listed, read_all

    here = read_all(TarShards([str(shards)]))
    assert len(here) == 4 * 5 + 1 + 400  # five files a tree (a tar's hard link is one; a zip's a copy), and the small
    there = TarShards([f"s3://{BUCKET}/shards/"], endpoint_url=moto.url)
    assert read_all(there) == here
    assert "skipping 2 entries of s3://bucket/shards/ that are not shards" in caplog.text
    # The same tree: names, kinds, sizes, links, members' owners and times (the top and the shard folders
    # are the user's and the objects' own).
    tree_here = listed(TarShards([str(shards)]))
    tree_there = listed(TarShards([f"s3://{BUCKET}/shards/"], endpoint_url=moto.url))
    def shape(tree: Any) -> list[tuple[Any, ...]]:
        return [(n.path, n.mode, n.size, n.nlink, n.target) + ((n.uid, n.gid, n.mtime_ns) if b"/" in n.path else ())
                for n in tree.nodes]
    assert shape(tree_there) == shape(tree_here)
    # One shard by name; a selection; an s3:// and a local shard in one ingest.
    one = TarShards([f"s3://{BUCKET}/shards/train-000002.tar.zst"], endpoint_url=moto.url)
    assert read_all(one) == {k: v for k, v in here.items() if k.startswith("train-000002/")}
    select = Selection(None, ("*.jpg", "big*"))
    assert read_all(TarShards([f"s3://{BUCKET}/shards"], endpoint_url=moto.url), select) == \
        read_all(TarShards([str(shards)]), select)
    mixed = TarShards([str(shards / "train-000000.tar"), f"s3://{BUCKET}/shards/train-000004.tar"],
                      endpoint_url=moto.url)
    assert read_all(mixed) == {k: v for k, v in here.items() if k.startswith(("train-000000/", "train-000004/"))}


@pytest.mark.timeout(60)
def test_shards_in_a_bucket_are_downloaded_once(moto: MotoServer, shards: Path) -> None:
    """Each shard is listed as it is read: its bytes come from the store once (the zip, read at any
    offset, in blocks; each shard's first bytes to tell what it is), not once to list and again to pack."""
    from test_ingest_tar import read_all

    proxy = FlakyProxy(moto.url)
    try:
        got = read_all(TarShards([f"s3://{BUCKET}/shards/"], endpoint_url=proxy.url))
    finally:
        proxy.close()
    assert got == read_all(TarShards([str(shards)]))
    sizes = {p.name: p.stat().st_size for p in shards.iterdir()}
    streamed = sum(n for name, n in sizes.items() if not name.endswith(".zip"))
    assert streamed + sizes["train-000003.zip"] <= proxy.served <= streamed + 2 * sizes["train-000003.zip"] + 16 * len(sizes), \
        (proxy.served, sizes)


@pytest.mark.timeout(60)
def test_shards_in_a_bucket_that_fail_say_so(moto: MotoServer, shards: Path) -> None:
    from test_ingest_tar import listed

    def walk(*srcs: str) -> None:
        listed(TarShards(list(srcs), endpoint_url=moto.url))

    with pytest.raises(SourceError, match=f"^cannot read s3://{BUCKET}/shards/nope.tar: no such object$"):
        walk(f"s3://{BUCKET}/shards/nope.tar")
    with pytest.raises(SourceError, match=f"^s3://{BUCKET}/nothing/ holds no shards"):
        walk(f"s3://{BUCKET}/nothing")
    with pytest.raises(SourceError, match="is not a tar or zip file"):
        walk(f"s3://{BUCKET}/shards/old/train-000009.tar")
    with pytest.raises(UsageError, match=r"^the shards of one ingest are in one bucket \(a, bucket given\)$"):
        walk(f"s3://{BUCKET}/shards/", "s3://a/x.tar")
    with pytest.raises(SourceError, match="is named twice"):
        walk(f"s3://{BUCKET}/shards/", f"s3://{BUCKET}/shards/train-000000.tar")
    # Rewritten after the listing: every GET carries the listed ETag.
    s3 = moto.client()
    s3.put_object(Bucket=BUCKET, Key="rewritten/a.tar", Body=(shards / "train-000000.tar").read_bytes())
    src = TarShards([f"s3://{BUCKET}/rewritten/"], endpoint_url=moto.url)
    tree = src.walk(None)
    s3.put_object(Bucket=BUCKET, Key="rewritten/a.tar", Body=(shards / "train-000004.tar").read_bytes())
    with pytest.raises(SourceError, match=f"^s3://{BUCKET}/rewritten/a.tar changed while being ingested"):
        for node, f in src.files(tree):
            f.readinto(memoryview(bytearray(node.size + 1)))


@needs_fuse
@pytest.mark.timeout(120)
def test_shards_in_a_bucket_mount_as_tar_x_makes_them(s3node: Node, moto: MotoServer, shards: Path,
                                                      scratch: Path) -> None:
    from test_ingest_tar import extract, snapshot

    proc = s3node.run("ingest", "--expand-tar", f"s3://{BUCKET}/shards/", "--name", "s3shards", "--endpoint-url",
                      moto.url)
    assert proc.stdout.startswith("ingested s3shards version 1: 421 files, "), proc.stdout
    tars = sorted(p for p in shards.iterdir() if not p.name.endswith(".zip"))
    ref = extract(tars, scratch / "shards-x")
    mnt = s3node.mount("s3shards", scratch / "mnt-shards")
    try:
        got = {k: v for k, v in snapshot(mnt).items() if not k.startswith("train-000003")}
        want = snapshot(ref)
        # tar -x gives a shard's folder the time of its ./ member, or now; dlfs the member's, or the object's.
        folders = {p.name.split(".")[0] for p in tars}
        assert {k: v for k, v in got.items() if k not in folders} == {k: v for k, v in want.items() if k not in folders}
        assert (mnt / "train-000003/a/b/x4.txt").read_bytes() == b"x" * 1000 + b"4"
    finally:
        s3node.umount(mnt)


def test_members_close_together_are_one_get() -> None:
    assert member_ranges([]) == []
    assert member_ranges([(512, 10), (1536, 0), (2048, 100)]) == [(512, 1636)]  # a header between: one GET
    assert member_ranges([(0, 10), (10 + GAP, 5)]) == [(0, 10), (10 + GAP, 5)]  # far apart: two
    assert member_ranges([(0, 20)], range_size=8) == [(0, 8), (8, 8), (16, 4)]  # none over range_size
