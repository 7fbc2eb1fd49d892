"""The client side: talking to the cluster, and the chunk cache."""
