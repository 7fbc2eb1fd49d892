"""Byte-stream transports behind one interface: TCP and Unix sockets (RDMA joins here)."""
