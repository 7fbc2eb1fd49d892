"""The read-only FUSE mount (pyfuse3 + trio)."""
