"""The wire: frames, numbered messages, and the cluster-key handshake."""
