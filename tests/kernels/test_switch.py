"""The kernel switches: environment, `disabled`, `forced`, and refusal of unknown names."""

from __future__ import annotations

import pytest
import torch

from megalab import kernels


def test_env_switch_selects_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGALAB_KERNELS", "0")
    assert not any(kernels.enabled(k) for k in kernels.KERNELS)
    monkeypatch.setenv("MEGALAB_KERNELS", "ema,attention")
    assert [k for k in kernels.KERNELS if kernels.enabled(k)] == ["ema", "attention"]
    monkeypatch.setenv("MEGALAB_KERNELS", "-attention")
    assert not kernels.enabled("attention") and kernels.enabled("timestep_norm")
    monkeypatch.setenv("MEGALAB_KERNELS", "ema,-attention")
    with pytest.raises(ValueError, match="mixes names"):
        kernels.enabled("ema")
    monkeypatch.setenv("MEGALAB_KERNELS", "flash")
    with pytest.raises(ValueError, match="unknown kernel name"):
        kernels.enabled("ema")


def test_cpu_tensors_take_the_reference_unless_forced_in_the_interpreter() -> None:
    x = torch.zeros(2)
    assert not kernels.use_kernel("ema", x)
    with kernels.forced("ema"):
        assert kernels.use_kernel("ema", x) == (
            kernels.triton_available() and kernels.interpreting()
        )
        with kernels.disabled("ema"):
            assert not kernels.use_kernel("ema", x)
    assert not kernels.use_kernel("ema", x)
    with pytest.raises(ValueError, match="unknown kernel name"), kernels.disabled("nope"):
        pass


def test_every_switch_name_has_a_kernel_behind_it() -> None:
    """A name in `KERNELS` that no code asks for would accept `MEGALAB_KERNELS=<name>` and turn
    nothing on: each name is asked for with `use_kernel("<name>", ...)` somewhere."""
    from pathlib import Path

    import megalab

    source = "".join(p.read_text() for p in Path(megalab.__file__).parent.rglob("*.py"))
    unused = [name for name in kernels.KERNELS if f'use_kernel("{name}"' not in source]
    assert not unused, f"switch names with no kernel: {unused}"
