"""Reusable host buffers for KV relayout blocks.

Why: a relayout block is megabytes (1k tokens of the hidden-1024 model: 16 MiB of K and
V), and a fresh CPU tensor that large is mapped by the allocator on demand: its first
touch faults in every 4 KiB page, 4-11 ms for 16 MiB on the 2-core CPU host, where the
copy into an already mapped buffer takes 0.3-1.5 ms (a join's source read its block in
1.5 ms or 8-11 ms, depending on whether the allocator had the pages at hand). A buffer
kept from an earlier relayout is mapped already.

Invariant: a buffer is handed out again only when nothing but this cache holds its
storage (torch's storage use count back at what it was when the buffer was made), so a
block that a join keeps until its requests land, or that a caller still reads, is never
reused under it. At most ``KEEP_BYTES`` are kept per process; a block larger than that
is allocated fresh and dropped with its last user. CUDA tensors go to torch's caching
allocator, which already reuses its blocks.
"""

from __future__ import annotations

import math

import torch

#: Bytes of buffers kept per process (an engine keeps what its largest relayouts need).
KEEP_BYTES = 256 << 20

_kept: list[tuple[torch.Tensor, int]] = []  # (flat uint8 buffer, its storage's idle use count)


def _uses(buf: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)


def _idle(entry: tuple[torch.Tensor, int]) -> bool:
    return _uses(entry[0]) <= entry[1]


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor, like ``torch.empty(shape, dtype=dtype,
    device=device)``, on the CPU from a kept buffer when one is idle and large enough."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or not 0 < nbytes <= KEEP_BYTES or not hasattr(torch._C, "_storage_Use_Count"):
        return torch.empty(shape, dtype=dtype, device=device)
    fits = [e for e in _kept if e[0].numel() >= nbytes and _idle(e)]
    if fits:
        buf = min(fits, key=lambda e: e[0].numel())[0]
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        _keep(buf)
    return buf[:nbytes].view(dtype).view(shape)


def _keep(buf: torch.Tensor) -> None:
    """Keep ``buf`` (idle now), dropping idle kept buffers, smallest first, to stay
    within ``KEEP_BYTES``; if that is not enough it is not kept."""
    global _kept
    entry = (buf, _uses(buf))
    total = sum(e[0].numel() for e in _kept) + buf.numel()
    for old in sorted((e for e in _kept if _idle(e)), key=lambda e: e[0].numel()):
        if total <= KEEP_BYTES:
            break
        _kept = [e for e in _kept if e is not old]
        total -= old[0].numel()
    if total <= KEEP_BYTES:
        _kept.append(entry)


def kept_bytes() -> int:
    """Bytes of buffers this process keeps (idle or in use)."""
    return sum(e[0].numel() for e in _kept)
