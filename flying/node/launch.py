"""``python -m flying.launch``: SGLang's server with the Flying plugin and flag group.

Every SGLang server flag is accepted and passed through unchanged; ``--flying-*`` flags
are Flying's. Without ``--model-path`` the embedded demo model is created (once) and
served with 2 engines on a CPU-only machine, one engine per GPU otherwise.

On the CPU platform a few SGLang defaults that do not suit a CPU are filled in when the
user did not give them, each logged: ``--dtype float32`` for float32 checkpoints (auto
would run them in fp16) and a bounded ``--max-total-tokens`` (otherwise the KV pool
takes most of the RAM and long to allocate).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

from flying.node import config as flying_config

logger = logging.getLogger("flying.node.launch")

#: KV pool size per engine on the CPU platform when --max-total-tokens is not given.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def split_argv(argv: list[str]) -> tuple[flying_config.FlyingConfig, list[str]]:
    """Separate Flying's flags from SGLang's; validate Flying's."""
    parser = argparse.ArgumentParser(add_help=False)
    flying_config.add_cli_args(parser)
    known, rest = parser.parse_known_args(argv)
    return flying_config.from_cli_args(known), rest


def _checkpoint_dtype(model_path: str) -> str | None:
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    return data.get("torch_dtype") or data.get("dtype")


def fill_defaults(argv: list[str], cfg: flying_config.FlyingConfig, on_cpu: bool) -> list[str]:
    """Return SGLang argv with Flying's defaults added where the user gave none."""
    argv = list(argv)
    demo = not _has_flag(argv, "--model-path", "--model")
    if demo:
        from flying.node.demo_model import ensure_demo_model

        path = ensure_demo_model(cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None)
        logger.info("no --model-path given: serving the embedded demo model at %s", path)
        argv += ["--model-path", str(path)]
        if not _has_flag(argv, "--dp-size", "--data-parallel-size", "--dp"):
            argv += ["--dp-size", str(2 if on_cpu else max(1, _gpu_count()))]
    if on_cpu:
        model_path = _flag_value(argv, "--model-path") or _flag_value(argv, "--model")
        if not _has_flag(argv, "--dtype") and model_path:
            if _checkpoint_dtype(model_path) == "float32":
                logger.info("CPU platform: float32 checkpoint, adding --dtype float32")
                argv += ["--dtype", "float32"]
        if not _has_flag(argv, "--max-total-tokens"):
            logger.info(
                "CPU platform: adding --max-total-tokens %d per engine",
                CPU_DEFAULT_MAX_TOTAL_TOKENS,
            )
            argv += ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]
        if not _has_flag(argv, "--sleep-on-idle"):
            # An idle SGLang scheduler busy-polls a core; with 2 engines on 2 cores that
            # starves everything else on the machine. Sleeping wakes on the next message.
            logger.info("CPU platform: adding --sleep-on-idle")
            argv.append("--sleep-on-idle")
    return argv


def resolve_degrees(argv: list[str], cfg: flying_config.FlyingConfig) -> flying_config.FlyingConfig:
    """Fix the TP degrees for this node from the model's head counts and the engine count."""
    from dataclasses import replace

    from flying.substrate.layout import allowed_degrees, validate_degrees

    engines = int(
        _flag_value(argv, "--dp-size") or _flag_value(argv, "--data-parallel-size") or 1
    )
    per_engine_tp = int(_flag_value(argv, "--tp-size") or _flag_value(argv, "--tensor-parallel-size") or 1)
    requested = cfg.degree_list()
    model_path = _flag_value(argv, "--model-path") or _flag_value(argv, "--model")
    config_file = Path(model_path or "") / "config.json"
    if engines < 2 or per_engine_tp != 1 or not config_file.is_file():
        if requested:
            raise flying_config.ConfigError(
                f"--flying-tp-degrees {cfg.tp_degrees} needs --dp-size >= 2, --tp-size 1 "
                "and a local checkpoint directory"
            )
        return replace(cfg, tp_degrees="none")
    page = _flag_value(argv, "--page-size")
    if page is not None and page.strip().isdigit() and int(page) != 1:  # SGLang checks the rest
        # A group's KV view splits each DP slot's heads over its members, one token per
        # slot (flying.substrate.kv_adaptor); SGLang's paged allocator hands out whole
        # pages, which the view and the moves between layouts do not keep.
        why = f"TP groups need SGLang's --page-size 1 (given {page})"
        if requested:
            raise flying_config.ConfigError(f"--flying-tp-degrees {cfg.tp_degrees}: {why}")
        logger.warning("Flying: %s; serving as DP replicas", why)
        return replace(cfg, tp_degrees="none")
    hf = json.loads(config_file.read_text())
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads", heads))
    try:
        degrees = (
            allowed_degrees(engines, kv_heads, heads)
            if requested is None
            else validate_degrees(requested, engines, kv_heads, heads)
        )
    except ValueError as exc:
        raise flying_config.ConfigError(str(exc)) from None
    return replace(cfg, tp_degrees=",".join(map(str, degrees)) or "none")


def guard_cuda_groups(
    cfg: flying_config.FlyingConfig, on_cpu: bool
) -> flying_config.FlyingConfig:
    """Turn TP groups off on CUDA engines unless ``--flying-experimental-cuda-groups``.

    Group steps have only been proven on the CPU platform: on CUDA, graphs captured for
    DP batch sizes would replay in group mode and the attention backends (flashinfer,
    triton) are built with DP head counts. Until a GPU run proves them, a GPU node serves
    as plain DP replicas and says why.
    """
    from dataclasses import replace

    if on_cpu or not cfg.degree_list() or cfg.experimental_cuda_groups:
        return cfg
    logger.warning(
        "Flying: TP groups are off on CUDA engines (group steps on CUDA are unverified: "
        "DP CUDA graphs and attention backends); serving as DP replicas. Pass "
        "--flying-experimental-cuda-groups to try them."
    )
    return replace(cfg, tp_degrees="none")


def add_routes(num_engines: int, enable_metrics: bool = False) -> None:
    """Flying's HTTP endpoints, on SGLang's own FastAPI app: ``/flying/status``,
    ``/metrics`` with Flying's series only under SGLang's ``--enable-metrics`` (as SGLang
    serves its own), the header check (a bad Flying header or routing-key header is
    a plain 400 on every endpoint, streaming ones included), the ``X-Flying-Node``
    response header (which node served, behind a router) and ``/get_load`` (the node's
    load with group sessions counted, as sglang-router polls it)."""
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints.http_server import app

    from flying.node import metrics
    from flying.node.node_name import NodeHeader
    from flying.node.request_tags import HeaderCheck
    from flying.session import status
    from flying.substrate.comm_pool import hosted_store

    app.add_middleware(HeaderCheck)
    app.add_middleware(NodeHeader)  # outermost: a 400 from HeaderCheck names the node too

    def read_status() -> dict:
        store = hosted_store()
        if store is None:
            return {"engines": []}
        doc = status.read_all(store, num_engines)
        doc["store_keys"] = store.num_keys()  # flat over time: no key outlives its bind
        return doc

    async def flying_status():
        doc = read_status()
        doc["tp_degrees"] = flying_config.get_config().degree_list() or []
        return JSONResponse(doc)

    app.add_api_route("/flying/status", flying_status, methods=["GET"])
    from flying.node import load

    load.mount(app, read_status, num_engines)  # the router's power_of_two reads it
    if enable_metrics:
        metrics.mount(app, read_status)
    from flying.session import faults

    if faults.enabled():  # test-only fault injection (FLYING_TEST_FAULTS=1)
        faults.mount(app, hosted_store)




def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="python -m flying.launch",
        description="SGLang server with online DP <-> TP switching (Flying). "
        "Without --model-path, serves an embedded demo model.",
    )
    ServerArgs.add_cli_args(parser)
    flying_config.add_cli_args(parser)
    parser.print_help()


def check_port_free(host: str | None, port: int) -> None:
    """Exit with a clear error if the HTTP port cannot be bound now. SGLang starts its
    engines first and binds the port last; where the port is taken it logs the failed
    bind and its process tree stays up, serving nobody. A check before any process
    starts catches the usual case (another server on the port); a port taken in the
    minute between this check and SGLang's bind is not caught."""
    host = host or "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SystemExit(f"error: --host {host!r} does not resolve: {exc}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise SystemExit(
                f"error: cannot serve on {host}:{port}: {exc.strerror or exc} "
                "(another server on that port? choose one with --port)"
            ) from exc


def _banner(server_args) -> str:
    host = server_args.host or "127.0.0.1"
    url = f"http://{host}:{server_args.port}"
    return (
        f"\nFlying is starting on {url} (model {server_args.model_path}).\n"
        f"When it is ready, try:\n"
        f"  curl {url}/generate -H 'Content-Type: application/json' "
        "-d '{\"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 16}}'\n"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    if _has_flag(argv, "-h", "--help"):
        print_help()
        return
    try:
        cfg, sglang_argv = split_argv(argv)
    except flying_config.ConfigError as exc:
        raise SystemExit(f"error: {exc}") from exc

    from flying.version import VersionMismatch, check_sglang_version

    try:
        check_sglang_version()
    except VersionMismatch as exc:
        raise SystemExit(f"error: {exc}") from exc

    from flying.node.config import wants_cpu_platform

    flying_config.publish(cfg)  # the platform choice below reads it
    on_cpu = wants_cpu_platform()
    sglang_argv = fill_defaults(sglang_argv, cfg, on_cpu=on_cpu)
    try:
        cfg = resolve_degrees(sglang_argv, cfg)
    except flying_config.ConfigError as exc:
        raise SystemExit(f"error: {exc}") from exc
    cfg = guard_cuda_groups(cfg, on_cpu)
    # Publish before SGLang starts any process, so every process sees the same config.
    flying_config.publish(cfg, replace=True)
    from flying.session.messages import new_secret

    new_secret()  # this launch's routing-key marker secret, inherited by every SGLang process
    from flying.substrate.comm_pool import STORE_ENV, host_store, set_hosted_store

    store, os.environ[STORE_ENV] = host_store()
    set_hosted_store(store)
    logger.info("Flying TP degrees: %s", cfg.tp_degrees)

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(sglang_argv)
    check_port_free(server_args.host, server_args.port)
    from flying.node.node_name import with_node_name

    # Named before SGLang starts any process: every process reports the same name.
    cfg = with_node_name(cfg, server_args.host, server_args.port)
    flying_config.publish(cfg, replace=True)
    logger.info("Flying node name: %s", cfg.node_name)
    from flying.substrate import status_board

    if cfg.degree_list():  # the engines' status slots, before they start
        status_board.create(server_args.dp_size)
        status_board.unlink_when_mapped()
    add_routes(server_args.dp_size, bool(getattr(server_args, "enable_metrics", False)))
    print(_banner(server_args), flush=True)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
