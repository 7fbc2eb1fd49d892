"""What every client of the cluster uses: connections and placement (cluster.py), reads from replicas
with hedging and retries (replicas.py), the transport choice (transport.py) and RDMA reads
(rdmareads.py), and checking and healing replicas (repair.py). The mount's own parts are in dlfs/mount/."""
