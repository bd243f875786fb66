"""Kernel selection rules, on CPU: the innermost `use_kernel` is in charge and its exit hands charge
back; a name is never silently taken over; RINGTRAIN_ATTN_BACKEND names a registered kernel or is
refused; the flash kernels' limits and version probe (stubbed, no GPU); RINGTRAIN_ATTN_VARLEN=off
keeps packed documents off flash-attn's varlen kernel. (The trainer's verification test relies on a
kernel put in charge with `use_kernel`.)
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from tests.support.attention_cases import install_flash_attn
from workers.attention import kernels
from workers.attention.kernels import register_kernel, select_kernel, use_kernel
from workers.attention.varlen import FlashAttnVarlen, LoopVarlen, select_varlen

CPU = torch.device("cpu")


@dataclass(frozen=True)
class _Tagged:
    """TorchMath under another name: which kernel is selected is what these tests look at."""

    name: str

    def forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        return kernels.TorchMath().forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):  # type: ignore[no-untyped-def]
        return kernels.TorchMath().backward(dout, q, k, v, out, lse, causal, scale)


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations here stay here."""
    monkeypatch.setattr(kernels, "_BACKENDS", dict(kernels._BACKENDS))
    monkeypatch.delenv("RINGTRAIN_ATTN_BACKEND", raising=False)


def test_the_innermost_kernel_in_use_is_selected() -> None:
    outer, inner = _Tagged("guard_outer"), _Tagged("guard_inner")
    assert select_kernel(CPU, torch.float32).name == "torch_cpu_flash"
    with use_kernel(outer):
        assert select_kernel(CPU, torch.float32) is outer
        with use_kernel(inner):
            assert select_kernel(CPU, torch.float32) is inner
        assert select_kernel(CPU, torch.float32) is outer
    assert select_kernel(CPU, torch.float32).name == "torch_cpu_flash"


def test_a_taken_name_is_refused_and_the_same_kernel_is_welcome() -> None:
    with pytest.raises(ValueError, match="already registered as 'torch_math'"):
        register_kernel(_Tagged("torch_math"))
    assert kernels._BACKENDS["torch_math"] == kernels.TorchMath()
    register_kernel(_Tagged("guard_once"))
    register_kernel(_Tagged("guard_once"))  # equal (frozen dataclass): idempotent
    assert kernels._BACKENDS["guard_once"] == _Tagged("guard_once")


def test_forced_backend_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", "torch_math")
    assert select_kernel(CPU, torch.float32).name == "torch_math"
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", "no_such_kernel")
    with pytest.raises(ValueError, match="RINGTRAIN_ATTN_BACKEND='no_such_kernel'"):
        select_kernel(CPU, torch.float32)


def test_flash_runs_up_to_head_dim_256_on_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash kernels' limits (head_dim <= 256, compute capability >= 8.0), with the capability
    query stubbed so the rule is checked without a GPU."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernels._flash_runs(cuda, 256) and kernels._flash_runs(cuda, None)
    assert not kernels._flash_runs(cuda, 257)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not kernels._flash_runs(cuda, 64)


def test_flash_attn_older_than_2_6_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn 2.5's private forward takes one window_size but no softcap: neither supported
    call convention fits it, so the probe reports no flash-attn (the kernels would be called wrong)."""

    def fwd_2_5(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax
    ):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_forward = fwd_2_5  # type: ignore[attr-defined]
    mod._flash_attn_backward = fwd_2_5  # type: ignore[attr-defined]
    install_flash_attn(monkeypatch, mod)
    try:
        assert kernels._flash_attn_api() is None
        assert not kernels.flash_attn_available()
    finally:
        kernels._flash_attn_api.cache_clear()


def test_varlen_off_forbids_the_flash_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With flash-attn in charge, packed documents take its varlen twin unless
    RINGTRAIN_ATTN_VARLEN=off; values other than '', loop, off are refused."""

    def fa_2_7(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    for name in ("forward", "backward", "varlen_forward", "varlen_backward"):
        setattr(mod, f"_flash_attn_{name}", fa_2_7)
    install_flash_attn(monkeypatch, mod)
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", "flash_attn")
    try:
        monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", "")
        assert select_varlen(CPU, torch.bfloat16, 64) == FlashAttnVarlen()
        monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", "off")
        assert select_varlen(CPU, torch.bfloat16, 64) is None
        monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", "loop")
        assert select_varlen(CPU, torch.bfloat16, 64) == LoopVarlen(kernels.FlashAttn())
        for bad in ("on", "1", "LOOP"):
            monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", bad)
            with pytest.raises(ValueError, match="RINGTRAIN_ATTN_VARLEN"):
                select_varlen(CPU, torch.bfloat16, 64)
    finally:
        kernels._flash_attn_api.cache_clear()
