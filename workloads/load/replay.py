"""Replay of recorded traces, scaled to the machine at hand.

Production traces (the Azure 2023 conversation and code traces, in Vidur's processed form:
``arrived_at,num_prefill_tokens,num_decode_tokens``; see ``PUBLIC_TRACES``) carry the real
arrival pattern and length mix, but their rates and lengths target large GPU clusters. Replay
keeps the pattern and rescales: inter-arrival gaps are multiplied by one factor (or chosen to
hit a mean rate), lengths are multiplied and clamped.

The traces are not part of the repository (their owners publish them; we do not re-host them).
Named trace files are looked up in the directory given by ``--traces-dir`` or the
``FLYING_TRACES_DIR`` environment variable, else ``~/.cache/flying/traces``; files shipped in
``workloads/traces/`` (a small synthetic sample) are found without either.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workloads.load.trace import (
    DEFAULT_TOKEN_ID_RANGE,
    PRIORITIES,
    TraceRequest,
    attach_input_ids,
    pick_fraction,
)

#: Environment variable naming the directory that holds trace files.
TRACES_ENV = "FLYING_TRACES_DIR"
#: Where trace files are looked up when neither the flag nor the variable is set.
DEFAULT_TRACES_DIR = Path.home() / ".cache" / "flying" / "traces"
#: Trace files shipped with the package (small, synthetic; see its README.md).
BUNDLED_TRACES_DIR = Path(__file__).parents[1] / "traces"

AZURE_CONV = "azure_conv_2023.csv"
AZURE_CODE = "azure_code_2023.csv"
SAMPLE = "sample_trace.csv"


@dataclass(frozen=True)
class PublicTrace:
    """Where a named public trace comes from, so a missing file says how to get it."""

    description: str
    source: str
    licence: str


_VIDUR_FORM = (
    "Vidur's processed form (github.com/microsoft/vidur, data/processed_traces/; MIT licence) "
    "of the Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset, "
    "AzureLLMInferenceDataset2023.md; data licence CC-BY 4.0, cite Patel et al., Splitwise, "
    "ISCA 2024)"
)
PUBLIC_TRACES: dict[str, PublicTrace] = {
    AZURE_CONV: PublicTrace(
        "Azure conversation service, 2023: 19,366 requests over ~1 h",
        _VIDUR_FORM, "CC-BY 4.0 (data), MIT (Vidur's processing)",
    ),
    AZURE_CODE: PublicTrace(
        "Azure code-completion service, 2023: 8,819 requests over ~1 h",
        _VIDUR_FORM, "CC-BY 4.0 (data), MIT (Vidur's processing)",
    ),
}


def traces_dir(override: str | Path | None = None) -> Path:
    """The trace directory: ``override`` (a flag), else ``$FLYING_TRACES_DIR``, else the default."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get(TRACES_ENV)
    return Path(env).expanduser() if env else DEFAULT_TRACES_DIR


def trace_path(name: str, directory: str | Path | None = None) -> Path:
    """The file of trace ``name`` (a file name, or a path used as given when it exists).

    Looked up in ``traces_dir(directory)`` first, then among the bundled traces; a missing
    public trace raises FileNotFoundError that names its source and the ways to point at it.
    """
    given = Path(name).expanduser()
    if given.is_absolute() or given.parent != Path("."):
        if given.is_file():
            return given
        raise FileNotFoundError(f"trace file {given} does not exist")
    for folder in (traces_dir(directory), BUNDLED_TRACES_DIR):
        if (folder / name).is_file():
            return folder / name
    hint = ""
    if name in PUBLIC_TRACES:
        info = PUBLIC_TRACES[name]
        hint = f" It is {info.description}, from {info.source}."
    raise FileNotFoundError(
        f"trace {name!r} not found in {traces_dir(directory)} (or the bundled "
        f"{BUNDLED_TRACES_DIR}).{hint} Put the file there, or point --traces-dir or "
        f"${TRACES_ENV} at the directory that holds it."
    )


@dataclass(frozen=True)
class ReplayOptions:
    """How to cut and rescale a recorded trace.

    Give at most one of ``time_scale`` (multiplies every inter-arrival gap) and
    ``target_rate`` (mean req/s of the selected window after scaling). The window is the
    requests from ``offset`` (a request count) or from the first arrival at or after ``start_s``
    (seconds in the file's clock), at most ``limit`` of them. Lengths are rounded after scaling,
    kept at least 1, then clamped to the ``*_clamp`` bounds when given.
    """

    time_scale: float | None = None
    target_rate: float | None = None
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    prompt_clamp: tuple[int, int] | None = None
    output_clamp: tuple[int, int] | None = None
    offset: int = 0
    start_s: float | None = None
    limit: int | None = None
    high_priority_fraction: float = 0.0
    phase: str = "replay"


# (arrival_s, prompt_len, output_len, priority)
Row = tuple[float, int, int, str]


def read_csv_rows(path: str | Path) -> list[Row]:
    """Rows of a Vidur/Azure-style CSV: ``arrived_at,num_prefill_tokens,num_decode_tokens``."""
    rows: list[Row] = []
    with open(path, newline="", encoding="utf-8") as f:
        for rec in csv.DictReader(f):
            rows.append(
                (
                    float(rec["arrived_at"]),
                    int(float(rec["num_prefill_tokens"])),
                    int(float(rec["num_decode_tokens"])),
                    "normal",
                )
            )
    return rows


def read_jsonl_rows(path: str | Path) -> list[Row]:
    """Rows of a JSONL file with ``arrival_s, prompt_len, output_len[, priority]`` per line."""
    rows: list[Row] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            priority = str(rec.get("priority", "normal"))
            if priority not in PRIORITIES:
                raise ValueError(f"{path}: unknown priority {priority!r}")
            rows.append(
                (float(rec["arrival_s"]), int(rec["prompt_len"]), int(rec["output_len"]), priority)
            )
    return rows


def read_rows(path: str | Path) -> list[Row]:
    """Rows of a CSV or JSONL trace (chosen by suffix), sorted by arrival."""
    suffix = Path(path).suffix.lower()
    rows = read_jsonl_rows(path) if suffix in (".jsonl", ".json") else read_csv_rows(path)
    rows.sort(key=lambda r: r[0])
    return rows


def select_window(rows: list[Row], options: ReplayOptions) -> list[Row]:
    """The slice of ``rows`` that ``options`` asks for."""
    start = options.offset
    if options.start_s is not None:
        start = next((i for i, r in enumerate(rows) if r[0] >= options.start_s), len(rows))
    end = len(rows) if options.limit is None else start + options.limit
    return rows[start:end]


def gap_factor(arrivals: list[float], options: ReplayOptions) -> float:
    """The factor applied to inter-arrival gaps."""
    if options.time_scale is not None and options.target_rate is not None:
        raise ValueError("give time_scale or target_rate, not both")
    if options.time_scale is not None:
        if options.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        return options.time_scale
    if options.target_rate is not None:
        if options.target_rate <= 0:
            raise ValueError("target_rate must be > 0")
        span = arrivals[-1] - arrivals[0] if arrivals else 0.0
        if len(arrivals) < 2 or span <= 0:
            return 1.0
        return (len(arrivals) - 1) / span / options.target_rate
    return 1.0


def scale_length(value: int, scale: float, clamp: tuple[int, int] | None) -> int:
    """``value * scale`` rounded, at least 1, clamped to ``clamp`` when given."""
    out = max(1, int(round(value * scale)))
    if clamp is not None:
        out = min(max(out, clamp[0]), clamp[1])
    return out


def replay_trace(
    path: str | Path,
    options: ReplayOptions | None = None,
    seed: int = 0,
    with_input_ids: bool = True,
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> list[TraceRequest]:
    """A trace replaying ``path`` (CSV or JSONL) rescaled by ``options``; arrivals start at 0.

    A bare file name is resolved with ``trace_path`` (trace directory, then bundled traces).
    """
    options = options or ReplayOptions()
    rows = select_window(read_rows(trace_path(str(path))), options)
    arrivals = [r[0] for r in rows]
    factor = gap_factor(arrivals, options)
    origin = arrivals[0] if arrivals else 0.0
    high = pick_fraction(np.random.default_rng(seed), len(rows), options.high_priority_fraction)
    trace = [
        TraceRequest(
            index=i,
            arrival_s=(arrival - origin) * factor,
            prompt_len=scale_length(prompt, options.prompt_scale, options.prompt_clamp),
            output_len=scale_length(output, options.output_scale, options.output_clamp),
            priority="high" if i in high else priority,
            phase=options.phase,
        )
        for i, (arrival, prompt, output, priority) in enumerate(rows)
    ]
    if with_input_ids:
        attach_input_ids(trace, seed, token_id_range)
    return trace
