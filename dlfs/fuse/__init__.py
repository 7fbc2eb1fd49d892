"""The read-only FUSE mount (pyfuse3 + trio)."""

# Before anything here imports pyfuse3: the C helper's session hook must be bound first.
import dlfs.native  # noqa: F401
