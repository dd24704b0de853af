"""SGLang's own model for a checkpoint, loaded in this process on CPU as one tp_size=1
engine loads it (no server): for checks and benchmarks of Flying's views and toggles on
SGLang's real layer classes."""

from __future__ import annotations


def publish(model_path: str):
    """Publish SGLang's config for one tp_size=1 engine on CPU; returns its ServerArgs."""
    from sglang.srt.runtime_context import SpawnRanks
    from sglang.srt.runtime_context import publish as publish_args
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_path, device="cpu", dtype="float32",
        attention_backend="torch_native",
    )
    publish_args(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=0, gpu_id=0))
    return args


def init_engine(model_path: str) -> None:
    """Flying's plugin and SGLang's one-rank process groups, as in an engine (once per
    process, before ``load``)."""
    from sglang.srt.distributed.bootstrap import _init_parallel_groups
    from sglang.srt.plugins import load_plugins

    from workloads.measure.server import free_port

    load_plugins()  # Flying's CPU platform and hooks
    _init_parallel_groups(
        backend="gloo", dist_init_method=f"tcp://127.0.0.1:{free_port()}",
        server_args=publish(model_path), gpu_id=0,
    )


def load(model_path: str):
    """SGLang's model (e.g. ``LlamaForCausalLM``) with the checkpoint's weights."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    args = publish(model_path)
    return get_model(
        model_config=ModelConfig.from_server_args(args),
        load_config=LoadConfig(load_format="auto"), device_config=DeviceConfig("cpu", 0),
    )
