"""A request's own SLOs: ``X-Flying-SLO-TTFT-Ms`` / ``X-Flying-SLO-TPOT-Ms`` headers, or
the body's ``custom_params`` (``flying_slo_ttft_ms`` / ``flying_slo_tpot_ms``).

Why the body too: a router or gateway in front of the node may drop unknown headers,
but it forwards the request body whole. ``custom_params`` is the body field SGLang 0.5.23
already carries from every endpoint to the scheduler side (/generate:
``sampling_params.custom_params``; the OpenAI endpoints: the top-level ``custom_params``,
which SGLang copies into the sampling parameters), and SGLang itself uses it as a
private transport. The HTTP process copies a header's value there (the header wins), so
the DP controller, which never sees headers, reads one place.

Invariant: a value that reaches the policy is a finite number of milliseconds > 0;
anything else is a ValueError (HTTP 400) in the HTTP process, before the request is
queued.
"""

from __future__ import annotations

import math

#: header name (lower case) -> custom_params key
HEADERS = {
    "x-flying-slo-ttft-ms": "flying_slo_ttft_ms",
    "x-flying-slo-tpot-ms": "flying_slo_tpot_ms",
}
TTFT_KEY, TPOT_KEY = HEADERS.values()
#: A longer target than a day is a typo, not an SLO.
MAX_MS = 86_400_000.0


def parse(value, name: str) -> float:
    """``value`` (a header's text or a body's number) as ms; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"invalid {name} {value!r}: expected milliseconds > 0")
    try:
        ms = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid {name} {value!r}: expected milliseconds > 0") from None
    if not math.isfinite(ms) or ms <= 0 or ms > MAX_MS:
        raise ValueError(f"invalid {name} {value!r}: expected milliseconds in (0, {MAX_MS:.0f}]")
    return ms


def from_headers(one) -> dict[str, float]:
    """The SLO headers present, as custom_params entries; ``one(name)`` returns a
    header's single value or None (and raises on conflicting values)."""
    found = {}
    for header, key in HEADERS.items():
        value = one(header)
        if value is not None:
            found[key] = parse(value, f"{header} header")
    return found


def apply(sampling_params, found: dict[str, float]):
    """``sampling_params`` (a dict, a list of dicts for a batch, or None) with ``found``
    written into each request's ``custom_params`` (a header wins over the body)."""
    if not found:
        return sampling_params
    if sampling_params is None:
        return {"custom_params": dict(found)}
    for params in _items(sampling_params):
        custom = params.get("custom_params")
        params["custom_params"] = {**(custom if isinstance(custom, dict) else {}), **found}
    return sampling_params


def of(sampling_params) -> tuple[float, float]:
    """(TTFT, TPOT) SLO in ms of one request (0.0: none of its own), from its sampling
    parameters (a dict in the HTTP process, SGLang's SamplingParams in the controller).
    ValueError for a value that is not a positive number of ms."""
    if isinstance(sampling_params, dict):
        custom = sampling_params.get("custom_params")
    else:
        custom = getattr(sampling_params, "custom_params", None)
    if not isinstance(custom, dict):
        return 0.0, 0.0
    ttft, tpot = custom.get(TTFT_KEY), custom.get(TPOT_KEY)
    return (
        0.0 if ttft is None else parse(ttft, f"custom_params.{TTFT_KEY}"),
        0.0 if tpot is None else parse(tpot, f"custom_params.{TPOT_KEY}"),
    )


def _items(sampling_params) -> list:
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    return [p for p in items if isinstance(p, dict)]


def check(sampling_params) -> None:
    """ValueError (HTTP 400) for a body SLO that is not a positive number of ms, in any
    request of a batch."""
    for params in _items(sampling_params):
        of(params)


def strip(sampling_params) -> None:
    """Drop the body's SLOs (``--flying-client-priority ignore``: clients do not set
    their own priority or SLOs)."""
    for params in _items(sampling_params):
        custom = params.get("custom_params")
        if isinstance(custom, dict) and (TTFT_KEY in custom or TPOT_KEY in custom):
            params["custom_params"] = {
                k: v for k, v in custom.items() if k not in (TTFT_KEY, TPOT_KEY)
            } or None
