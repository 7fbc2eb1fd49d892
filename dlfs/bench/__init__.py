"""Benchmarks and demo workloads."""
