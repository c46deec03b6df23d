"""Helpers for tests, benchmarks and CLIs that run several local ranks."""
