"""SGLang general-plugin entry point (``sglang.srt.plugins:flying``).

SGLang calls :func:`load` early in every process it starts. It checks the SGLang version
and applies every hook. SGLang catches and only logs exceptions from plugins, so a
failure here ends the process with ``SystemExit`` instead: a server must not run with
Flying half-loaded.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    from flying.version import VersionMismatch, check_sglang_version
    from sglang_patches import PatchError, apply_all

    try:
        check_sglang_version()
        apply_all()
    except (VersionMismatch, PatchError) as exc:
        logger.critical("%s", exc)
        raise SystemExit(f"flying: {exc}") from exc
