"""Hooks on ``sglang.srt.distributed.parallel_state.GroupCoordinator``.

On the CPU platform every device collective of SGLang's layers (row-parallel
``all_reduce``, the vocab-parallel embedding's ``all_reduce``, the logits ``all_gather``)
is a gloo call costing ~1 ms; SGLang's own CPU shortcut needs sgl_kernel CPU ops. These
hooks route CPU tensors through ``flying.shm_allreduce`` instead:

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

from flying.shm_allreduce import ShmAllReduce
from sglang_patches.platform import wants_cpu_platform

_ATTR = "_flying_shm"
_UNSET = object()


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
        if comm is not None and comm.can_reduce(input_):
            return comm.all_reduce_(input_)
    return original(group, input_)


def all_gather(original, group, input_, dim=-1, output_tensor_list=None):
    if output_tensor_list is None and group.world_size > 1 and input_.is_cpu:
        comm = _comm(group)
        if comm is not None and comm.fits(input_):
            return comm.all_gather(input_, dim)
    return original(group, input_, dim, output_tensor_list)


def destroy(result, group, *args, **kwargs) -> None:
    comm = group.__dict__.pop(_ATTR, None)
    if comm is not None:
        comm.close()
