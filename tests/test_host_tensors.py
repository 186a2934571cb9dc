"""The host-tensor check (tests/host_tensors.py) finds what would fail on a GPU, and only that."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from host_tensors import HostTensors, unmark

HERE = (str(Path(__file__).parent),)  # this file's calls count, as megalab's do in use


class _Positions(nn.Module):
    """Adds its positions to x: made without a device (`bad`), or on x's device."""

    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.bad = bad
        self.register_buffer("table", torch.arange(8.0))
        self.kept = torch.arange(8.0)  # neither parameter nor buffer: `.to(device)` skips it

    def forward(self, x: torch.Tensor, use_kept: bool = False) -> torch.Tensor:
        L = x.shape[1]
        if use_kept:
            return x + self.kept[:L]
        pos = torch.arange(L, dtype=x.dtype) if self.bad else torch.arange(L, device=x.device)
        return x + pos + self.table[:L]


def _run(module: nn.Module, **kwargs: bool) -> HostTensors:
    x = torch.randn(2, 5)
    check = HostTensors(watch=False, roots=HERE)
    with check:
        unmark(module)
        with check.region():
            module(x, **kwargs)
    return check


def test_a_tensor_made_without_a_device_that_meets_the_input_is_found() -> None:
    check = _run(_Positions(bad=True))
    assert len(check.meetings) == 1
    ((met, made),) = check.meetings.items()
    assert "torch.arange(L, dtype=x.dtype)" in made and "(add)" in met


def test_a_tensor_made_on_the_inputs_device_is_not_a_meeting() -> None:
    assert not _run(_Positions(bad=False)).meetings


def test_a_tensor_the_module_keeps_outside_its_buffers_is_found() -> None:
    with HostTensors(roots=HERE):  # built inside: what it keeps is made on the host
        module = _Positions(bad=False)
    assert _run(module, use_kept=True).meetings


def test_scalars_indexing_moves_and_shapes_are_allowed_on_a_gpu() -> None:
    x = torch.randn(4, 3)
    check = HostTensors(watch=False, roots=HERE)
    with check, check.region():
        host = torch.arange(4)
        _ = x * torch.tensor(2.0)  # a 0-dim host tensor: allowed
        _ = x[host % 2 == 0]  # a host index: allowed
        _ = x + torch.ones(3).to(x.device)  # moved
        _ = x.new_zeros(3) + x  # follows x
        _ = torch.zeros(4, 3).copy_(x)  # copies between devices are allowed
        _ = (host * 2).float().expand_as(x.T)  # host arithmetic, x's shape only
    assert not check.meetings


def test_copies_between_the_host_and_the_device_are_recorded() -> None:
    """Allowed on a GPU, but each is a stream sync there: moving a host tensor, indexing with a
    host index and `copy_` between host and device are `copies`; device tensors are not."""
    x = torch.randn(4, 3)
    check = HostTensors(watch=False, roots=HERE)
    with check, check.region():
        host = torch.arange(4)
        _ = x[host % 2 == 0]
        _ = x + torch.ones(3).to(x.device)
        _ = torch.zeros(4, 3).copy_(x)
        _ = x * torch.tensor(2.0)  # a 0-dim host tensor is read as a scalar: no copy
        _ = x.new_zeros(3).to(x.device) + x[x[:, 0] > 0].sum()  # on the device already
    assert not check.meetings
    kinds = sorted(met.rsplit(" (", 1)[1].rstrip(")") for met in check.copies)
    assert kinds == ["__getitem__", "copy_", "to"]
    assert "torch.ones(3)" in check.report(check.copies)


def test_outside_the_region_nothing_is_marked() -> None:
    x = torch.randn(3)
    check = HostTensors(watch=False, roots=HERE)
    with check:
        _ = x + torch.arange(3)
    assert not check.meetings


@pytest.mark.parametrize("made", ["cat", "matmul", "embedding"])
def test_every_kind_of_meeting_is_found(made: str) -> None:
    x, w = torch.randn(2, 3), torch.randn(5, 3)
    check = HostTensors(roots=HERE)
    with check:
        unmark((x, w))
        if made == "cat":
            torch.cat([x, torch.zeros(1, 3)])
        elif made == "matmul":
            x @ torch.eye(3)
        else:
            nn.functional.embedding(torch.tensor([[0, 4]]), w)
    assert len(check.meetings) == 1


def test_only_lines_under_the_roots_count() -> None:
    x = torch.randn(3)
    check = HostTensors()  # megalab's package: this file's lines do not count
    with check:
        _ = x + torch.arange(3)
    assert not check.meetings
