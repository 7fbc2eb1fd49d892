"""The C helper's contracts: the index accessors check their own arguments (an entry out of range or a
name outside the names section is an error, never a read outside the mapping), and a mount whose serving
thread is stuck in a read of a hung disk still stops: the thread is abandoned at the stop's deadline,
the mount says so in its log, and the process exits."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import force_unmount, mount_pids, needs_fuse, pid_alive, running_node, wait_for
from damage import inode_of

from dlfs.format.chunk import FLAG_BLOCK_SUMS
from dlfs.format.index import DIRENT, Index, IndexWriter
from dlfs.native import native

needs_native = pytest.mark.skipif(native is None, reason="dlfs's C helper is not built")
MiB = 1 << 20
STALLFS = Path(__file__).with_name("stallfs.py")


@needs_native
def test_dirent_checks_its_own_index(tmp_path: Path) -> None:
    """Entries 0..4 of a crafted index, entry 3's name 10,000 bytes past the names section: each good one
    reads as written, and an index past the last entry, or a huge one, or entry 3, is IndexError."""
    w = IndexWriter(2, 1 << 16)
    for name in (b"a", b"b", b"c", b"d", b"e"):
        off, n = w.add_name(name)
        w.dirents += DIRENT.pack(off + (10_000 if name == b"d" else 0), n, 2)
    w.set_inode(1, 0o040755, 0, 0, 2, 0, 0, 0, 5, 1)
    w.set_inode(2, 0o100644, 0, 0, 1, 0, 0, 0, 0, 1)
    path = tmp_path / "crafted.idx"
    with open(path, "wb") as out:
        w.write(out)
    index = Index(path)
    view = native.IndexView(index.sections())
    try:
        assert [view.dirent(k) for k in (0, 1, 2, 4)] == [(b"a", 2), (b"b", 2), (b"c", 2), (b"e", 2)]
        for bad in (3, 5, 6, 1 << 40, (1 << 64) - 1):
            with pytest.raises(IndexError, match=f"dirent {bad} is outside the index"):
                view.dirent(bad)
    finally:
        view.close()
    with pytest.raises(ValueError, match="dirent on a closed IndexView"):
        view.dirent(0)
    index.close()


@needs_fuse
@needs_native
@pytest.mark.timeout(240)
def test_a_serving_thread_stuck_on_a_hung_disk_is_abandoned_and_the_mount_exits(tmp_path: Path) -> None:
    """A random read inside a big record is served by a native thread from this machine's chunk file;
    that file is made one on a hung disk (tests/stallfs.py: READ is never answered, and only a fatal
    signal ends the wait). SIGTERM to the mount: it exits all the same, its log names the abandoned
    thread, and the reader gets an error, not bytes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(8 * MiB))
    stall_mnt = tmp_path / "stall"
    stall_mnt.mkdir()
    with running_node(tmp_path / "home", tmp_path) as node:
        node.ingest(src, "stuck")
        idx = Index(node.home / "meta/index/stuck/1.idx")
        try:
            rec = idx.extent(idx.inode(inode_of(idx, "f")).ref)
            cid = idx.chunk(rec.chunk).id.hex()
        finally:
            idx.close()
        assert rec.record.flags & FLAG_BLOCK_SUMS  # so the engine reads its blocks itself
        chunk = node.home / "data/chunks" / cid[:2] / cid
        stall = subprocess.Popen([sys.executable, STALLFS, stall_mnt, str(chunk.stat().st_size)],
                                 stdout=subprocess.PIPE)
        pid = None
        try:
            assert stall.stdout is not None and stall.stdout.readline() == b"ready\n"
            mnt = node.mount("stuck", tmp_path / "mnt")
            [pid] = mount_pids(node.home)
            chunk.unlink()
            chunk.symlink_to(stall_mnt / "stall")
            failed: list[int] = []

            def reader() -> None:
                fd = os.open(mnt / "f", os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one 4 KiB READ, no read-ahead
                try:
                    os.pread(fd, 4096, MiB + 8192)
                except OSError as exc:
                    failed.append(exc.errno)
                finally:
                    try:
                        os.close(fd)
                    except OSError:  # FLUSH to a mount that is gone (ENOTCONN)
                        pass

            t = threading.Thread(target=reader, daemon=True)
            t.start()
            assert stall.stdout.readline() == b"read\n"  # the serving thread now waits on the hung disk
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not pid_alive(pid), 60, "the mount process exits with a thread stuck in I/O")
            t.join(30)
            assert not t.is_alive() and failed and failed[0] in (errno.ENOTCONN, errno.EIO), failed
            log = node.mount_log("stuck").read_text()
            assert "1 serving thread(s) still busy 2 s after the unmount" in log, log[-3000:]
            assert "Traceback" not in log, log[-3000:]  # the abandoned thread's index is kept, not closed
        finally:
            if pid is not None and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            stall.kill()
            stall.wait()
            force_unmount(tmp_path)
