"""Compiled kernel runs: with CUDA and without Triton's interpreter (`make gpu-check`), the
kernel tests that use the `kernel_device` fixture build their tensors, modules and random
generators on CUDA, so the same tests check the compiled kernels (on CPU tensors the kernels
never run outside the interpreter: those tests would compare the reference with itself). Under
the interpreter nothing changes: CPU tensors, with the kernels `forced`."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from megalab import kernels

_Generator = torch.Generator


def compiled() -> bool:
    """True where the kernels compile for a GPU (CUDA present, interpreter off)."""
    return torch.cuda.is_available() and not kernels.interpreting()


@pytest.fixture
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """The device the kernel tests run on: CUDA when compiled, else the CPU (interpreter)."""
    if not compiled():
        yield torch.device("cpu")
        return
    monkeypatch.setattr(torch, "Generator", functools.partial(_Generator, device="cuda"))
    torch.set_default_device("cuda")
    try:
        yield torch.device("cuda")
    finally:
        torch.set_default_device("cpu")
