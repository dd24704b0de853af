"""Reusable relayout buffers (``flying.substrate.scratch``): a buffer comes back only
when nobody holds its storage, within the kept budget."""

from __future__ import annotations

import pytest
import torch

from flying.substrate import scratch

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(scratch, "_kept", [])
    monkeypatch.setattr(scratch, "KEEP_BYTES", 1 << 20)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_an_idle_buffer_is_reused_and_a_held_one_is_not():
    a = scratch.empty((4, 256), torch.float32)
    assert a.shape == (4, 256) and a.dtype == torch.float32 and a.is_contiguous()
    first = _ptr(a)
    held = a[1:3]  # a view keeps the storage in use after the tensor itself is gone
    del a
    b = scratch.empty((2, 100), torch.float32)
    assert _ptr(b) != first  # the first buffer is still read through ``held``
    held.fill_(7.0)
    assert torch.all(held == 7.0)
    del held
    c = scratch.empty((8, 64), torch.bfloat16)  # idle again: reused, any dtype and shape
    assert _ptr(c) == first and c.shape == (8, 64)
    d = scratch.empty((2, 100), torch.float32)  # b is held: not handed out twice
    assert _ptr(d) not in (_ptr(b), _ptr(c))


def test_the_smallest_idle_buffer_that_fits_is_taken():
    big, small = scratch.empty((4096,), torch.float32), scratch.empty((64,), torch.float32)
    pbig, psmall = _ptr(big), _ptr(small)
    del big, small
    assert _ptr(scratch.empty((32,), torch.float32)) == psmall
    assert _ptr(scratch.empty((1000,), torch.float32)) == pbig


def test_the_kept_bytes_stay_within_the_budget():
    over = scratch.empty((scratch.KEEP_BYTES // 4 + 1,), torch.float32)  # above it: not kept
    assert scratch.kept_bytes() == 0 and over.numel() == scratch.KEEP_BYTES // 4 + 1
    a = scratch.empty((scratch.KEEP_BYTES // 8,), torch.float32)  # half the budget, held
    b = scratch.empty((scratch.KEEP_BYTES // 8,), torch.float32)  # the other half, held
    assert scratch.kept_bytes() == scratch.KEEP_BYTES
    c = scratch.empty((16,), torch.float32)  # no room and nothing idle: not kept
    assert scratch.kept_bytes() == scratch.KEEP_BYTES and c.numel() == 16
    del a
    scratch.empty((scratch.KEEP_BYTES // 16,), torch.float32)  # fits a's idle buffer
    assert scratch.kept_bytes() == scratch.KEEP_BYTES
    del b
    scratch.empty((scratch.KEEP_BYTES // 4 - 8,), torch.float32)  # drops idle ones to fit
    assert scratch.kept_bytes() <= scratch.KEEP_BYTES


def test_empty_shapes_and_meta_are_plain_tensors():
    assert scratch.empty((0, 4), torch.float32).numel() == 0
    assert scratch.empty((3,), torch.float32, "meta").is_meta
    assert scratch.kept_bytes() == 0
