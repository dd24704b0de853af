"""The patch table against the installed SGLang: a version move must fail here, loudly."""

from __future__ import annotations

import pkgutil

import pytest

import sglang_patches
from sglang_patches import KINDS, PATCHES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_target_resolves_in_installed_sglang(patch):
    obj = pkgutil.resolve_name(patch.target)
    assert callable(obj), patch.target


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_hook_exists_and_kind_is_known(patch):
    assert patch.kind in KINDS
    assert callable(patch.load_hook())
    assert patch.why


def test_resolution_targets_are_overridable_steps():
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    for p in PATCHES:
        if p.kind == "resolution":
            assert p.target.rsplit(".", 1)[1] in _OVERRIDABLE_HOOKS


def test_missing_target_fails_loudly(monkeypatch):
    bogus = sglang_patches.Patch(
        "sglang.srt.distributed.bootstrap.no_such_function",
        "around",
        "sglang_patches.bootstrap:init_cpu_threads_env",
        "test",
    )
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(sglang_patches, "_APPLIED", None)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    with pytest.raises(sglang_patches.PatchError, match="no_such_function"):
        sglang_patches.apply_all((bogus,))


def test_docs_list_every_target():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "SGLANG_INTERNALS.md").read_text()
    for p in PATCHES:
        assert p.target in text, p.target
