"""Export any workloads trace for other tools, above all SGLang's own serving benchmark.

``sglang.benchmark.serving`` (0.5.23) replays request times from a file with one dataset
only: ``--dataset-name mooncake`` (Mooncake's trace format, JSONL). Each line is

    {"timestamp": <ms, int>, "input_length": <tokens>, "output_length": <tokens>,
     "hash_ids": [<int>, ...]}

SGLang sends each record at ``(timestamp - first timestamp) / 1000 * --mooncake-slowdown-factor``
seconds (with ``--backend sglang``, always; ``--use-trace-timestamps`` marks the run as trace
timed) and asks for ``output_length`` tokens (EOS ignored). It ignores ``input_length``: the
prompt is built from ``hash_ids``, one block of text per id (the id followed by 128 words
"hi"), so prompt lengths come in blocks (384 tokens each with the demo model's tokenizer;
Mooncake's own traces use 512-token blocks). The export therefore gives each request
``round(prompt_len / block_tokens)`` ids, at least one, all unique across the file so that
no two prompts share a cached prefix (as the project's random-token prompts do not).
Priorities cannot be carried per request; ``--header X-Priority=high`` sets one for a run.

``load_mooncake`` goes the other way with SGLang's own loader, so the project's client can
send exactly the prompts SGLang's benchmark sends (``workloads.sidebyside``).

CLI::

    python -m workloads.export --preset cpu-burst --out trace.jsonl \\
        [--format mooncake|jsonl|vidur-csv] [--block-tokens 512 | --tokenizer DIR]
    python -m sglang.benchmark.serving --backend sglang --dataset-name mooncake \\
        --dataset-path trace.jsonl --use-trace-timestamps --num-prompts 100000 ...
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from workloads.load.cli import add_trace_args, trace_from_args
from workloads.load.trace import TraceRequest, save_trace

FORMATS = ("mooncake", "jsonl", "vidur-csv")

#: Tokens per hash block in Mooncake's published traces; used without a tokenizer.
MOONCAKE_BLOCK_TOKENS = 512


def mooncake_records(trace: Iterable[TraceRequest], block_tokens: int) -> list[dict[str, Any]]:
    """One Mooncake record per request (see the module docstring for the fields)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    records, next_id = [], 0
    for req in trace:
        blocks = max(1, round(req.prompt_len / block_tokens))
        records.append({
            "timestamp": int(round(req.arrival_s * 1000.0)),
            "input_length": req.prompt_len,
            "output_length": req.output_len,
            "hash_ids": list(range(next_id, next_id + blocks)),
        })
        next_id += blocks
    return records


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> None:
    """One compact JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def write_vidur_csv(trace: Iterable[TraceRequest], path: str | Path) -> None:
    """The Vidur/Azure CSV columns that ``workloads.load.replay`` reads."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for req in trace:
            writer.writerow([f"{req.arrival_s:.6f}", req.prompt_len, req.output_len])


def sglang_block_tokens(tokenizer: Any) -> int:
    """Tokens in one of SGLang's Mooncake prompt blocks, for ``tokenizer``."""
    return len(tokenizer.encode("0" + " ".join(["hi"] * 128), add_special_tokens=False))


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer SGLang's benchmark would use for a model directory."""
    from sglang.benchmark.utils import get_tokenizer

    return get_tokenizer(str(path))


def load_mooncake(path: str | Path, tokenizer: Any, limit: int | None = None) -> list[TraceRequest]:
    """The requests SGLang's benchmark sends for a Mooncake file, as a project trace.

    Runs SGLang's own loader and prompt builder (slowdown 0: no sleeping) so prompts,
    lengths and times are exactly SGLang's; prompts become token ids (``input_ids``).
    """
    from sglang.benchmark.datasets.mooncake import (
        MooncakeDataset,
        get_mooncake_request_over_time,
    )

    records = MooncakeDataset(str(path), "mooncake", limit or 10**9).load()
    records.sort(key=lambda r: r["timestamp"])
    origin = records[0]["timestamp"] if records else 0

    async def rows() -> list[Any]:
        return [row async for row in get_mooncake_request_over_time(records, tokenizer, 0.0, 1)]

    trace = []
    for i, (rec, row) in enumerate(zip(records, asyncio.run(rows()), strict=True)):
        ids = tokenizer.encode(row.prompt)
        trace.append(TraceRequest(
            index=i, arrival_s=(rec["timestamp"] - origin) / 1000.0, prompt_len=len(ids),
            output_len=int(row.output_len), phase="mooncake", input_ids=ids,
        ))
    return trace


def export(trace: Sequence[TraceRequest], out: str | Path, fmt: str, block_tokens: int) -> None:
    """Write ``trace`` to ``out`` in format ``fmt`` (one of FORMATS)."""
    if fmt == "mooncake":
        write_jsonl(mooncake_records(trace, block_tokens), out)
    elif fmt == "jsonl":
        save_trace(trace, out)
    elif fmt == "vidur-csv":
        write_vidur_csv(trace, out)
    else:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: write a preset or trace file in another format."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(parser)
    parser.add_argument("--out", required=True, help="file to write")
    parser.add_argument("--format", choices=FORMATS, default="mooncake")
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument("--block-tokens", type=int,
                        help=f"prompt tokens per Mooncake hash id (default "
                        f"{MOONCAKE_BLOCK_TOKENS}, or measured with --tokenizer)")
    blocks.add_argument("--tokenizer", help="model/tokenizer directory: size the Mooncake "
                        "blocks as SGLang's benchmark will tokenize them")
    args = parser.parse_args(argv)
    trace, source = trace_from_args(args)
    block = args.block_tokens or (
        sglang_block_tokens(load_tokenizer(args.tokenizer)) if args.tokenizer
        else MOONCAKE_BLOCK_TOKENS
    )
    export(trace, args.out, args.format, block)
    span = trace[-1].arrival_s if trace else 0.0
    dropped = sum(r.priority != "normal" for r in trace) if args.format == "mooncake" else 0
    print(f"wrote {len(trace)} requests spanning {span:.1f} s to {args.out} ({args.format}; "
          f"{source})")
    if args.format == "mooncake":
        print(f"prompt blocks of {block} tokens; replay with: python -m sglang.benchmark.serving"
              f" --backend sglang --dataset-name mooncake --dataset-path {args.out}"
              f" --num-prompts {len(trace)} --use-trace-timestamps")
    if dropped:
        print(f"note: {dropped} non-normal priorities are not in the file (Mooncake has no "
              "field for them; use --header X-Priority=... for a whole run)")


if __name__ == "__main__":
    main()
