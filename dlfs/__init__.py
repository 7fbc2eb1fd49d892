"""dlfs: a user-level distributed file system for deep-learning datasets."""

__version__ = "0.1.0"
