"""The data daemon: chunks on local disk, served by byte range."""
