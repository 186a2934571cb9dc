"""Tests of the fused Triton kernels (a package: its test files share basenames with tests/nn)."""
