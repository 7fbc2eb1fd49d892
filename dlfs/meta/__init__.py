"""The metadata daemon: the catalog of datasets and their index files."""
