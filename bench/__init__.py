"""Benchmarks (commands, never timed tests)."""
