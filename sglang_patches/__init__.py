"""Every hook Flying puts into SGLang, as one ordered table (the table of contents).

Each row names the SGLang target, the kind of hook, the function in this package that
implements it, and why. ``apply_all()`` registers the rows in order, applies them through
SGLang's ``HookRegistry``, then checks that every target really was patched and raises if
not: SGLang itself only logs a hook that failed to apply, and a half-patched engine is
worse than one that does not start.

Files here are thin glue, one per patched SGLang module; logic lives in ``flying/`` and
``scheduler/``.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Hook kinds: HookRegistry's four, plus "resolution" for ServerArgs resolution steps
# (``sglang.srt.arg_groups.resolution_hooks``), whose target is the step's function.
KINDS = ("before", "after", "around", "replace", "resolution")


@dataclass(frozen=True)
class Patch:
    target: str  # dotted path of the SGLang object that is patched
    kind: str  # one of KINDS
    hook: str  # "sglang_patches.<module>:<function>"
    why: str

    def load_hook(self):
        module, name = self.hook.split(":")
        return getattr(importlib.import_module(module), name)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "sglang.srt.arg_groups.serving_hook.handle_missing_default_values",
        "resolution",
        "sglang_patches.serving_hook:handle_missing_default_values",
        "CPU platform: default device 'cpu'; split cores between engines",
    ),
    Patch(
        "sglang.srt.arg_groups.platform_hook.handle_cpu_backends",
        "resolution",
        "sglang_patches.platform_hook:handle_cpu_backends",
        "CPU platform: default attention backend torch_native (intel_amx needs sgl_kernel)",
    ),
    Patch(
        "sglang.srt.distributed.bootstrap._init_cpu_threads_env",
        "around",
        "sglang_patches.bootstrap:init_cpu_threads_env",
        "CPU platform: pin each engine to its cores without sgl_kernel",
    ),
    # -- engines (sglang.srt.managers.scheduler) --
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "after",
        "sglang_patches.scheduler:init",
        "give each engine its Flying state and communicator pool",
    ),
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.process_input_requests",
        "around",
        "sglang_patches.scheduler:process_input_requests",
        "top of each loop pass: leave a TP step's state; take Bind messages out of input",
    ),
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        "around",
        "sglang_patches.scheduler:get_next_batch_to_run",
        "step boundary: start binds; a group's TP batch or one DP step between two",
    ),
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "around",
        "sglang_patches.scheduler:run_batch",
        "contain a failed TP step (that session ends, the engine keeps serving)",
    ),
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        "around",
        "sglang_patches.scheduler:process_batch_result",
        "contain a failed TP step's output processing",
    ),
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle",
        "around",
        "sglang_patches.scheduler:maybe_sleep_on_idle",
        "no idle sleep (--sleep-on-idle: up to 1 s) while Flying holds work: a bind, input",
    ),
    Patch(
        "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens",
        "around",
        "sglang_patches.scheduler:init_req_max_new_tokens",
        "note requests without a bound of their own: they may outgrow the engine into a group",
    ),
    Patch(
        "sglang.srt.managers.scheduler_components.load_inquirer.SchedulerLoadInquirer.get_loads",
        "after",
        "sglang_patches.load_inquirer:get_loads",
        "load snapshots count a group's requests once (leader) and waiting binds; stamped at input",
    ),
    Patch(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key",
        "around",
        "sglang_patches.output_streamer:is_request_level_customized_info_key",
        "where a request ran travels once per request with its output (customized_info)",
    ),
    # -- global scheduler (sglang.srt.managers.data_parallel_controller) --
    Patch(
        "sglang.srt.managers.data_parallel_controller.DataParallelController.__init__",
        "after",
        "sglang_patches.data_parallel_controller:init",
        "a bind issuer for the node's TP degrees",
    ),
    Patch(
        "sglang.srt.managers.data_parallel_controller.DataParallelController.dispatching_with_trace",
        "around",
        "sglang_patches.data_parallel_controller:dispatching_with_trace",
        "TP-marked requests become one Bind per group member, in one total order",
    ),
    # -- HTTP process (sglang.srt.managers.io_struct) --
    Patch(
        "sglang.srt.managers.io_struct.GenerateReqInput.__getitem__",
        "after",
        "sglang_patches.io_struct:generate_req_input_getitem",
        "a batch's sub-requests (n > 1, prompt lists) keep its routing key: Flying's placement",
    ),
    # -- HTTP process (sglang.srt.managers.tokenizer_manager) --
    Patch(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        "around",
        "sglang_patches.tokenizer_manager:generate_request",
        "read Flying's request headers on every endpoint",
    ),
    Patch(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        "around",
        "sglang_patches.tokenizer_manager:validate_one_request",
        "a TP-m request may use m engines' KV capacity",
    ),
    Patch(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
        "around",
        "sglang_patches.tokenizer_manager:handle_batch_output",
        "meta_info['flying']: where the request ran",
    ),
    Patch(
        "sglang.srt.entrypoints.http_server._wait_and_warmup",
        "around",
        "sglang_patches.http_server:wait_and_warmup",
        "start-up probe: TP groups open only after a group forward matched DP",
    ),
    # -- device collectives (sglang.srt.distributed.parallel_state) --
    Patch(
        "sglang.srt.distributed.parallel_state.GroupCoordinator.all_reduce",
        "around",
        "sglang_patches.parallel_state:all_reduce",
        "CPU platform: shared-memory all-reduce for groups on one host (gloo ~1 ms/call)",
    ),
    Patch(
        "sglang.srt.distributed.parallel_state.GroupCoordinator.all_gather",
        "around",
        "sglang_patches.parallel_state:all_gather",
        "CPU platform: shared-memory all-gather of sharded logits/embeddings",
    ),
    Patch(
        "sglang.srt.distributed.parallel_state.GroupCoordinator.destroy",
        "after",
        "sglang_patches.parallel_state:destroy",
        "CPU platform: unmap the group's shared-memory segment at teardown",
    ),
)


class PatchError(RuntimeError):
    """A hook could not be applied; the server must not start half-patched."""


_APPLIED: tuple[str, ...] | None = None


def _register(patch: Patch) -> None:
    hook = patch.load_hook()
    if patch.kind == "resolution":
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook(patch.target.rsplit(".", 1)[1])(hook)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(patch.target, hook, HookType(patch.kind))


def _is_applied(patch: Patch) -> bool:
    hook = patch.load_hook()
    if patch.kind == "resolution":
        from sglang.srt.arg_groups.resolution_hooks import _HOOKS

        return hook in _HOOKS.get(patch.target.rsplit(".", 1)[1], ())
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry

    if patch.target not in HookRegistry._patched:
        return False
    current = pkgutil.resolve_name(patch.target)
    current = getattr(current, "__func__", current)
    return current is hook or getattr(current, "__wrapped__", None) is not None


def apply_all(patches: tuple[Patch, ...] = PATCHES) -> tuple[str, ...]:
    """Register and apply every patch once per process; raise ``PatchError`` on any miss."""
    global _APPLIED
    if _APPLIED is not None:
        return _APPLIED
    for patch in patches:
        if patch.kind not in KINDS:
            raise PatchError(f"unknown hook kind {patch.kind!r} for {patch.target}")
        _register(patch)
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    missing = [p.target for p in patches if not _is_applied(p)]
    if missing:
        raise PatchError(
            "flying: these SGLang hooks did not apply (is this sglang "
            f"version the one Flying pins?): {missing}"
        )
    _APPLIED = tuple(p.target for p in patches)
    # Printed, not logged: SGLang's child processes load plugins before they configure
    # logging, and this line is how tests and operators see that every process is patched.
    print(
        f"flying: applied {len(_APPLIED)}/{len(patches)} hooks in pid {os.getpid()} "
        f"({multiprocessing.current_process().name}): {', '.join(_APPLIED)}",
        file=sys.stderr,
        flush=True,
    )
    return _APPLIED


def applied() -> tuple[str, ...]:
    """The targets patched in this process (empty before ``apply_all``)."""
    return _APPLIED or ()
