"""Hooks on ``sglang.srt.distributed.parallel_state.GroupCoordinator``.

On the CPU platform every device collective of SGLang's layers (row-parallel
``all_reduce``, the vocab-parallel embedding's ``all_reduce``, the logits ``all_gather``)
is a gloo call costing ~1 ms; SGLang's own CPU shortcut needs sgl_kernel CPU ops. These
hooks route CPU tensors through ``flying.substrate.shm_allreduce`` instead:

- ``all_reduce`` (AROUND): shared-memory sum when the group has a shared segment and the
  tensor fits; else the original (gloo).
- ``all_gather`` (AROUND): likewise for the concat-style all-gather (``output_tensor_list``
  callers keep the original).
- ``destroy`` (AFTER): drop the group's mapping.

The segment is created lazily, on the group's first CPU collective: every member issues
that collective at the same point of its sequence, so the setup's gloo calls on the
group's CPU group cannot deadlock, and groups that never reduce cost nothing. Off the
CPU platform (``wants_cpu_platform()`` false) the hooks always call the original.
"""

from __future__ import annotations

import logging

from flying.node.config import wants_cpu_platform
from flying.substrate.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)

_ATTR = "_flying_shm"
_UNSET = object()


def _note(comm: ShmAllReduce, op: str, path: str, t) -> None:
    """Log the first time a group's ``op`` takes ``path``, so logs say what runs."""
    key = (op, path)
    if key not in comm.noted:
        comm.noted.add(key)
        logger.info(
            "flying: %s: %s of %s %s (%d B) via %s",
            comm.label, op, list(t.shape), t.dtype, t.numel() * t.element_size(), path,
        )


def _comm(group) -> ShmAllReduce | None:
    """The group's shared-memory communicator, set up on first use (collective)."""
    comm = group.__dict__.get(_ATTR, _UNSET)
    if comm is _UNSET:
        comm = None
        if wants_cpu_platform():
            comm = ShmAllReduce.create(
                group.cpu_group,
                group.rank_in_group,
                group.world_size,
                label=f"group {group.unique_name} (ranks {group.ranks})",
            )
        setattr(group, _ATTR, comm)
    return comm


def all_reduce(original, group, input_):
    if group.world_size > 1 and input_.is_cpu:
        comm = _comm(group)
        if comm is not None:
            if comm.can_reduce(input_):
                return comm.all_reduce_(input_)
            _note(comm, "all_reduce", "gloo (above the slot or not a float type)", input_)
    return original(group, input_)


def all_gather(original, group, input_, dim=-1, output_tensor_list=None):
    if output_tensor_list is None and group.world_size > 1 and input_.is_cpu:
        comm = _comm(group)
        if comm is not None:
            if comm.fits(input_):
                if comm.calls_gather == 0:
                    _note(comm, "all_gather", "shared memory", input_)
                return comm.all_gather(input_, dim)
            _note(comm, "all_gather", "gloo (above the slot)", input_)
    return original(group, input_, dim, output_tensor_list)


def destroy(result, group, *args, **kwargs) -> None:
    comm = group.__dict__.pop(_ATTR, None)
    if comm is not None:
        comm.close()
