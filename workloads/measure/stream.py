"""Pure helpers for reading SGLang's streamed responses, kept free of I/O so they test easily.

Both endpoints stream Server-Sent Events: ``data: {json}`` lines separated by blank lines and
terminated by ``data: [DONE]``. Token counts come from the server where possible
(``meta_info.completion_tokens`` on ``/generate``, ``usage.completion_tokens`` on
``/v1/completions`` with continuous usage stats), because one chunk may carry several tokens
and a chunk's text need not map to one token.
"""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"

# meta_info keys that name a timing; any numeric key with one of these suffixes is kept too.
TIMING_KEYS = ("queue_time", "prefill_launch_delay", "prefill_launch_latency", "e2e_latency")
TIMING_SUFFIXES = ("_time", "_latency", "_delay")


class LineSplitter:
    """Reassembles text lines from arbitrary byte chunks (network reads split lines anywhere)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        """Complete lines contained in the data seen so far, without their line endings."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in lines]

    def flush(self) -> list[str]:
        """The unterminated last line, if any."""
        rest, self._buffer = self._buffer, b""
        return [rest.decode("utf-8", errors="replace")] if rest.strip() else []


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON payload of a ``data:`` line, ``DONE`` for the terminator, else None."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == DONE:
        return DONE
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def chunk_error(chunk: dict[str, Any]) -> str | None:
    """An error carried inside a stream chunk (SGLang sends aborts this way), else None."""
    err = chunk.get("error")
    if err:
        return error_text(err)
    finish = (chunk.get("meta_info") or {}).get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"aborted: {finish.get('message', '')}".strip()
    return None


def error_text(body: Any) -> str:
    """A short message out of an error body (``{"error": {"message": ...}}``, ``{"message"}``)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner.get("detail") or inner)
        return str(inner)
    return str(body)


def generate_token_count(chunk: dict[str, Any], previous: int) -> int:
    """Running output-token count after a ``/generate`` chunk."""
    meta = chunk.get("meta_info") or {}
    count = meta.get("completion_tokens")
    if isinstance(count, int):
        return count
    ids = chunk.get("output_ids")
    return len(ids) if isinstance(ids, list) else previous + 1


def openai_token_count(chunk: dict[str, Any], previous: int) -> int:
    """Running output-token count after a ``/v1/completions`` chunk.

    Prefers the server's usage; otherwise counts one token per chunk that carries text.
    """
    usage = chunk.get("usage") or {}
    count = usage.get("completion_tokens")
    if isinstance(count, int) and count >= previous:
        return count
    choices = chunk.get("choices") or []
    if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
        return previous + 1
    return previous


def finish_reason(chunk: dict[str, Any]) -> str | None:
    """The finish reason of a chunk of either endpoint, as a short string."""
    reason: Any = (chunk.get("meta_info") or {}).get("finish_reason")
    if reason is None:
        choices = chunk.get("choices") or []
        reason = choices[0].get("finish_reason") if choices else None
    if isinstance(reason, dict):
        reason = reason.get("type")
    return str(reason) if reason is not None else None


def timing_fields(meta: dict[str, Any]) -> dict[str, float]:
    """Timing-like numbers of a ``meta_info``; which ones exist varies by SGLang version."""
    out: dict[str, float] = {}
    for key, value in meta.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key in TIMING_KEYS or key.endswith(TIMING_SUFFIXES):
            out[key] = float(value)
    return out


class TokenClock:
    """Turns (time, running token count) observations into TTFT and inter-token latencies.

    A chunk bringing k > 1 new tokens after the first contributes k equal gaps, so ITLs stay
    per token; extra tokens in the first chunk get no ITL (see ``RequestRecord``).
    """

    def __init__(self, send_time: float) -> None:
        self.send_time = send_time
        self.first_time: float | None = None
        self.last_time = send_time
        self.tokens = 0
        self.itl: list[float] = []

    def observe(self, now: float, total_tokens: int) -> None:
        """Record that ``total_tokens`` tokens have arrived by ``now``."""
        new = total_tokens - self.tokens
        if new <= 0:
            return
        if self.first_time is None:
            self.first_time = now
        else:
            gap = (now - self.last_time) / new
            self.itl.extend([gap] * new)
        self.tokens = total_tokens
        self.last_time = now

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first token, if one arrived."""
        return None if self.first_time is None else self.first_time - self.send_time
