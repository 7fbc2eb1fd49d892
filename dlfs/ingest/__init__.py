"""Ingest: walk a source tree, pack its files into chunks, store them, commit the index."""
