#!/usr/bin/env python3
"""Faults against a real cluster while readers check every byte: a table of what readers saw.

A three-node cluster (replicas = 2, one etcd member) on this machine serves a generated dataset
(--files files of 20-120 KB in 256 KiB chunks). For each scenario a fresh mount is made and
--readers threads read its files round and round with `open(p, "rb").read()`, comparing every byte
with the source and timing every read (tests/chaoslab.py; each file's pages are dropped after its
read, so reads keep reaching the mount). Once the readers have read the dataset twice, the fault
happens; once it is over they read it twice more, then stop. The faults are in tests/chaosfaults.py.

  sigstop         the mount's first replica (n1) frozen (SIGSTOP) for --hold seconds, then SIGCONT
  partition       n1's link cut for --hold seconds, then restored (network namespaces: root, ip, nsenter)
  kill            n2 SIGKILLed, then started again
  rolling         each node in turn stopped (SIGTERM) and started again
  restart-all     every node stopped (SIGTERM) at once, then all started again (the downtime is printed)
  etcd-kill       etcd's one member SIGKILLed for at least --hold seconds, then started again on its data;
                  meanwhile an ingest and a gc (each must fail in one line naming etcd), afterwards both
                  again (each must work; nothing the failed ingest stored may stay once collected)
  disk-full       n3's chunk store (a tmpfs: root) filled, then a replicas=2 ingest of another dataset in
                  64 KiB chunks: it must complete on n1 and n2 (`dlfs verify`: 2 good replicas each)
  corrupt-repair  every chunk n1 and n2 both hold spoiled on n1 (a byte of each record), then deleted;
                  `dlfs repair` copies them back from n2; then n2 is stopped (n1's new copies are the
                  only ones) and started again; read through two mounts, one reading n1's chunk files
                  itself (short-circuit), one through the data daemons

The mounts read through the data daemons (--no-short-circuit, but for corrupt-repair's second; on the
namespaced cluster they run on a machine outside the cluster, c1), with the default --retry-timeout
(60 s). With --cache-size smaller than the dataset (the chunks are 256 KiB: 2M is a few windows), the
mounts' reads are what a dataset bigger than memory gets: each file a record fetched alone, by the
mount's serving threads from the data daemons themselves once the random order shows (scan mode).
The "outcome" column says what the commands run during a fault answered; a fault whose expectations
did not hold says so on stderr, and the exit status is then 1, as for any read error.

    sudo .venv/bin/python scripts/chaos.py [--files 300] [--readers 4] [--hold 5] [--only sigstop,etcd-kill]
                                           [--cache-size 2M]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from chaosfaults import CHUNK_SIZE, NODES, Cluster, Outcome, Row, run_scenario, scenarios  # noqa: E402
from chaoslab import make_files  # noqa: E402
from etcdlab import etcd_available  # noqa: E402
from netlab import NetLab, netns_available  # noqa: E402

SCENARIOS = list(scenarios(0, {}))
TIGHT_SLACK = 8 << 20  # the small chunk store's room past the dataset (n3 holds at most one copy of each chunk)


def table(rows: list[Row]) -> str:
    head = ["scenario", "reads", "errors", "wrong bytes", "longest read", "p99 read", "reads > 1 s", "fault",
            "outcome"]
    body = []
    for r in rows:
        o = r.outcome
        if r.log is None:
            body.append([r.scenario, "-", "-", "-", "-", "-", "-", o.fault, o.outcome])
            continue
        body.append([r.scenario, str(r.log.reads), str(len(r.log.errors)), str(len(r.log.wrong)),
                     f"{r.log.longest:.3f} s", f"{r.log.percentile(0.99) * 1e3:.0f} ms", str(r.log.slow), o.fault,
                     o.outcome + (f"; {len(o.problems)} PROBLEMS" if o.problems else "")])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in [head, *body]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def report(row: Row) -> None:
    """A scenario's line on stderr as it ends, with what went wrong in it."""
    log = row.log
    print(f"{row.scenario}: {log.reads if log else 0} reads, {row.outcome.fault}; {row.outcome.outcome}",
          file=sys.stderr, flush=True)
    for what in row.outcome.details:
        print(f"  {row.scenario}: {what}", file=sys.stderr, flush=True)
    for what in [*row.outcome.problems, *(log.errors[:5] if log else []), *(log.wrong[:5] if log else [])]:
        what = f"PROBLEM: {what}" if what in row.outcome.problems else what
        print(f"  {row.scenario}: {what}", file=sys.stderr, flush=True)


def run_on(base: Path, lab: NetLab | None, names: list[str], files: dict[str, bytes], src: Path,
           args: argparse.Namespace) -> list[Row]:
    todo = scenarios(args.hold, files)
    tight = sum(map(len, files.values())) + TIGHT_SLACK if any(todo[n].needs == "tight" for n in names) else None
    cluster = Cluster(base, lab, tight_store=tight,
                      mount_args=["--cache-size", args.cache_size] if args.cache_size else [])
    try:
        cluster.start_all()
        cluster.cli("ingest", src, "--name", "chaos", "--chunk-size", CHUNK_SIZE, node="n1", timeout=300)
        rows = []
        for name in names:
            if todo[name].needs == "tight" and cluster.tight is None:
                row = Row(name, None, Outcome(f"skipped: {cluster.tight_why}"))
            else:
                row = run_scenario(cluster, todo[name], files, args.readers)
            report(row)
            rows.append(row)
        return rows
    finally:
        cluster.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=300, help="files in the dataset (default 300)")
    ap.add_argument("--readers", type=int, default=4, help="reader threads (default 4)")
    ap.add_argument("--hold", type=float, default=5.0,
                    help="seconds a node stays frozen or cut off, and etcd down at least (default 5)")
    ap.add_argument("--only", default=",".join(SCENARIOS),
                    help=f"scenarios, comma-separated (default all: {','.join(SCENARIOS)})")
    ap.add_argument("--dir", help="work here (default: a temporary directory, removed after)")
    ap.add_argument("--cache-size", metavar="SIZE",
                    help="the mounts' --cache-size (default theirs); below the dataset's size: scan mode")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios: {', '.join(sorted(unknown))} (known: {', '.join(SCENARIOS)})")
    no_etcd = etcd_available()
    if no_etcd:
        ap.error(no_etcd)
    todo = scenarios(args.hold, {})
    with tempfile.TemporaryDirectory(prefix="dlfs-chaos-", dir=args.dir) as tmp:
        base = Path(tmp)
        os.chmod(base, 0o700)
        src = base / "src"
        files = make_files(src, args.files, seed=7)
        rows: list[Row] = []
        local = [n for n in names if todo[n].needs != "netns"]
        if local:
            (base / "local").mkdir()
            rows += run_on(base / "local", None, local, files, src, args)
        namespaced = [n for n in names if todo[n].needs == "netns"]
        if namespaced:
            why = netns_available()
            if why:
                rows += [Row(n, None, Outcome(f"skipped: {why}")) for n in namespaced]
            else:
                (base / "netns").mkdir()
                with NetLab([*NODES, "c1", "e1"]) as lab:
                    rows += run_on(base / "netns", lab, namespaced, files, src, args)
        rows.sort(key=lambda r: names.index(r.scenario))
    print(table(rows))
    bad = sum(len(r.log.errors) + len(r.log.wrong) for r in rows if r.log) + sum(len(r.outcome.problems) for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
