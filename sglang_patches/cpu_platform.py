"""``FlyingCpuPlatform``: SGLang's CPU device operations as an out-of-tree platform.

Imported only when the platform is activated (see ``platform.py``), because it imports
sglang.srt.platforms, which is heavy.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

#: The attention backend that needs nothing beyond torch.
DEFAULT_ATTENTION_BACKEND = "torch_native"


class FlyingCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device ops (memory, gloo) with out-of-tree identity.

    Invariants: no triton, no graph capture, no pynccl; the device string is "cpu";
    torch.distributed uses gloo.
    """

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return DEFAULT_ATTENTION_BACKEND

    def get_dispatch_key_name(self) -> str:
        return "native"

    def is_pin_memory_available(self, device=None) -> bool:
        return False
