"""Resolution hook on ``sglang.srt.arg_groups.platform_hook.handle_cpu_backends``.

SGLang's x86 CPU default attention backend is ``intel_amx``, which needs a CPU build of
sgl_kernel (not on PyPI). On Flying's CPU platform the default is ``torch_native``;
an explicit ``--attention-backend`` is kept.
"""

from __future__ import annotations

from typing import Any

from flying.node.config import wants_cpu_platform

STEP = "handle_cpu_backends"


def handle_cpu_backends(server_args: Any, previous) -> None:
    if wants_cpu_platform():
        from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

        from sglang_patches.cpu_platform import DEFAULT_ATTENTION_BACKEND

        cfg = resolving_view(server_args)
        if cfg.device == "cpu" and cfg.attention_backend is None:
            declare_resolution(
                server_args, "flying_cpu_platform", attention_backend=DEFAULT_ATTENTION_BACKEND
            )
    previous(server_args)
