"""Everything a mount is: the read-only FUSE file system of one dataset version (pyfuse3 + trio over
the native serving engine).

  lifecycle.py   fetch and open the index, start the FUSE session and the engine, serve, unmount
  ops.py         pyfuse3 handlers: what the native engine passes on (misses, and what C does not answer)
  cache.py       the chunk cache: slabs in shared memory, read-ahead, the fetch pipeline
  localchunks.py this machine's chunk files read in place (a source of the cache)
  diskcache.py   the compute node's disk cache (a source of the cache, filled from the replicas)
  pressure.py    giving memory back under cgroup pressure or when idle
  directsock.py  the socket where dlfs.direct clients attach to the shared cache
  pinrows.py     the pin table's rows held by those clients
  statsfile.py   the counters published for `dlfs stats` and Prometheus
  records.py     the mount's record under $DLFS_HOME/run/mounts/ (what `dlfs mounts` lists)
"""

# Before anything here imports pyfuse3: the C helper's session hook must be bound first.
import dlfs.native  # noqa: F401
