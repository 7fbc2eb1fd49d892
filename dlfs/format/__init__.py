"""On-disk formats: the only code that knows their bytes."""
