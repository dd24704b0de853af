"""The CPU platform: lets real SGLang serve on machines without a GPU.

Entry point ``sglang.srt.platforms:flying_cpu`` -> :func:`activate`. SGLang calls it
while resolving ``current_platform``; returning a class path activates this platform,
returning ``None`` leaves SGLang's own choice (CUDA etc.) untouched.

Why an out-of-tree platform rather than SGLang's in-tree CPU one: the in-tree CPU path
(``SGLANG_USE_CPU_ENGINE=1``) needs sgl_kernel CPU ops, and no CPU build of sgl_kernel
is on PyPI. Being out-of-tree (``PlatformEnum.OOT``) makes SGLang's layers take their
``forward_native`` paths, which need only torch.
"""

from __future__ import annotations

from flying.node.config import wants_cpu_platform

PLATFORM_CLASS = "sglang_patches.cpu_platform.FlyingCpuPlatform"


def activate() -> str | None:
    """SGLang platform entry point: the platform class path, or None to stay out."""
    return PLATFORM_CLASS if wants_cpu_platform() else None
