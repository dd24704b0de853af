"""The SGLang version Flying is built against, checked at plugin load and launch.

Flying patches SGLang internals (listed in docs/SGLANG_INTERNALS.md); any other
version may have moved them, so a mismatch is refused rather than half-working.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SGLANG_PIN = "0.5.23"


class VersionMismatch(RuntimeError):
    pass


def installed_sglang() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version(found: str | None = None) -> None:
    """Raise ``VersionMismatch`` unless the installed SGLang is exactly the pin."""
    found = installed_sglang() if found is None else found
    if found != SGLANG_PIN:
        raise VersionMismatch(
            f"Flying requires sglang=={SGLANG_PIN}, found {found or 'no sglang'}. "
            f"Install it with: pip install 'sglang=={SGLANG_PIN}'"
        )
