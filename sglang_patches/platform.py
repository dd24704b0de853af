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

import os

from flying.config import get_config

PLATFORM_CLASS = "sglang_patches.cpu_platform.FlyingCpuPlatform"


def cuda_visible() -> bool:
    """True when torch sees a CUDA device. Cheap when CUDA_VISIBLE_DEVICES is empty."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    import torch

    return bool(torch.cuda.is_available())


def wants_cpu_platform() -> bool:
    """Whether this process should serve on Flying's CPU platform."""
    mode = get_config().platform
    if mode == "native":
        return False
    if mode == "cpu":
        return True
    return not cuda_visible()


def activate() -> str | None:
    """SGLang platform entry point: the platform class path, or None to stay out."""
    return PLATFORM_CLASS if wants_cpu_platform() else None
