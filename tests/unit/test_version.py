from __future__ import annotations

import pytest

from flying.version import SGLANG_PIN, VersionMismatch, check_sglang_version, installed_sglang

pytestmark = pytest.mark.unit


def test_installed_version_is_the_pin():
    assert installed_sglang() == SGLANG_PIN
    check_sglang_version()


def test_other_version_refused_with_install_hint():
    with pytest.raises(VersionMismatch, match=f"sglang=={SGLANG_PIN}.*found 0.5.22"):
        check_sglang_version("0.5.22")
