"""Parallelism beyond Lightning's data-parallel strategies: chunk (sequence) parallelism."""
