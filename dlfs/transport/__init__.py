"""Transports: TCP and Unix socket byte streams (tcp.py), RDMA verbs (rdma.py), and which one a
command uses (verbs.py)."""
