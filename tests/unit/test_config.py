from __future__ import annotations

import argparse

import pytest

from flying.node import config
from flying.node.launch import fill_defaults, split_argv

pytestmark = pytest.mark.unit


def test_defaults_roundtrip_json():
    cfg = config.FlyingConfig()
    assert config.FlyingConfig.from_json(cfg.to_json()) == cfg


def test_invalid_values_name_the_flag():
    with pytest.raises(config.ConfigError, match="--flying-cpu-threads"):
        config.FlyingConfig(cpu_threads=-1).validate()
    with pytest.raises(config.ConfigError, match="--flying-platform"):
        config.FlyingConfig(platform="tpu").validate()
    with pytest.raises(config.ConfigError, match="--flying-preempt"):
        config.FlyingConfig(preempt="gentle").validate()
    assert config.FlyingConfig(preempt="soft").validate().preempt == "soft"


def test_unknown_setting_in_env_is_rejected():
    with pytest.raises(config.ConfigError, match="unknown Flying settings"):
        config.FlyingConfig.from_json('{"nope": 1}')


def test_cli_group_defaults_come_from_dataclass():
    parser = argparse.ArgumentParser()
    config.add_cli_args(parser)
    assert config.from_cli_args(parser.parse_args([])) == config.FlyingConfig()
    args = parser.parse_args(["--flying-platform", "cpu", "--flying-cpu-threads", "3"])
    assert config.from_cli_args(args) == config.FlyingConfig(platform="cpu", cpu_threads=3)


def test_split_argv_passes_sglang_flags_through():
    cfg, rest = split_argv(["--dp-size", "2", "--flying-cpu-threads", "1", "--port", "9"])
    assert cfg.cpu_threads == 1
    assert rest == ["--dp-size", "2", "--port", "9"]


def test_fill_defaults_on_cpu_keeps_explicit_flags(tmp_path):
    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    cfg = config.FlyingConfig()
    out = fill_defaults(["--model-path", str(tmp_path)], cfg, on_cpu=True)
    assert out[out.index("--dtype") + 1] == "float32"
    assert "--max-total-tokens" in out and "--sleep-on-idle" in out
    out = fill_defaults(
        ["--model-path", str(tmp_path), "--dtype", "bfloat16", "--max-total-tokens=64"],
        cfg,
        on_cpu=True,
    )
    assert out.count("--dtype") == 1 and "--max-total-tokens" not in out
    assert fill_defaults(["--model-path", str(tmp_path)], cfg, on_cpu=False) == [
        "--model-path",
        str(tmp_path),
    ]


def test_flag_reference_documented():
    """docs/FLAGS.md lists every Flying flag with its default."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "FLAGS.md").read_text()
    for flag, default, _help in config.flag_reference():
        assert flag in text, flag
        assert default in text, (flag, default)


def test_groups_are_off_on_cuda_unless_experimental():
    from dataclasses import replace

    from flying.node.launch import guard_cuda_groups

    cfg = replace(config.FlyingConfig(), tp_degrees="2")
    assert guard_cuda_groups(cfg, on_cpu=True).degree_list() == [2]
    assert guard_cuda_groups(cfg, on_cpu=False).degree_list() == []
    on = replace(cfg, experimental_cuda_groups=True)
    assert guard_cuda_groups(on, on_cpu=False).degree_list() == [2]
    args = config.add_cli_args  # the flag is a plain switch
    import argparse

    parser = argparse.ArgumentParser()
    args(parser)
    assert parser.parse_args(["--flying-experimental-cuda-groups"]).flying_experimental_cuda_groups
    assert not parser.parse_args([]).flying_experimental_cuda_groups


def test_groups_need_sglangs_page_size_1(tmp_path):
    """A group's KV view splits one token's heads over its members; SGLang's paged
    allocator (``--page-size`` > 1) hands out whole pages: groups default to off there
    (a DP node, said at start-up; the start-up probe's group failed before), and asking
    for them is a clear error."""
    import json
    from dataclasses import replace

    from flying.node.launch import resolve_degrees

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 8, "num_key_value_heads": 4}))
    argv = ["--model-path", str(tmp_path), "--dp-size", "2"]
    assert resolve_degrees(argv, config.FlyingConfig()).degree_list() == [2]
    assert resolve_degrees([*argv, "--page-size", "1"], config.FlyingConfig()).degree_list() == [2]
    assert resolve_degrees([*argv, "--page-size", "16"], config.FlyingConfig()).degree_list() == []
    assert resolve_degrees([*argv, "--page-size=16"], config.FlyingConfig()).degree_list() == []
    # not a number: SGLang's own parser says so
    assert resolve_degrees([*argv, "--page-size", "x"], config.FlyingConfig()).degree_list() == [2]
    with pytest.raises(config.ConfigError, match="--page-size 1"):
        resolve_degrees([*argv, "--page-size", "16"], replace(config.FlyingConfig(), tp_degrees="2"))


def test_help_renders_every_flag():
    """``--help`` formats each help text with argparse's %-formatting: a bare % in a
    text crashed ``python -m flying.launch --help``."""
    import argparse

    parser = argparse.ArgumentParser()
    config.add_cli_args(parser)
    text = parser.format_help()
    for flag, _default, _help in config.flag_reference():
        assert flag in text, flag


def test_a_taken_http_port_stops_the_launcher_before_sglang_starts():
    """SGLang binds its HTTP port last and stays up unserved where it is taken; the
    launcher says so at once instead."""
    import socket

    from flying.node.launch import check_port_free

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot serve on 127.0.0.1:{port}.*--port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again: no error
    with pytest.raises(SystemExit, match="does not resolve"):
        check_port_free("no-such-host.invalid", port)
