"""The node's load as SGLang's router reads it: ``GET /get_load``, group sessions counted.

sglang-router (0.3.2, the ``router`` extra) polls ``GET /get_load`` on every worker for
its ``power_of_two`` policy and sums ``num_tokens`` over the array it gets back (one
entry per DP rank, SGLang's former format). SGLang 0.5.23 no longer serves that path
(its load API is ``/v1/loads``), so against a plain SGLang 0.5.23 node the router records
-1 for every worker and power-of-two compares equal loads: it picks at random. Flying
serves the path, so the router's view is real again.

Each entry starts from SGLang's own per-engine load snapshot (``/v1/loads``' source) and
adds what that snapshot does not show: an engine inside a Flying group session runs the
session's steps within one of its scheduler steps, so SGLang's snapshot of it stands still
for the session's length and never contains the session's requests. The session's KV
use comes from Flying's engine status (``flying/session/status.py``: the session's pool
while bound), so a node whose engines are busy in a TP group looks busy to the router.
A snapshot published at a session's edge may count some of its tokens twice; the
router only compares nodes, and the error is at most one session's tokens.
"""

from __future__ import annotations

from collections.abc import Callable


def engine_loads(snapshots: list[dict], status: dict, num_engines: int) -> list[dict]:
    """One ``/get_load`` entry per engine from SGLang's load snapshots (``/v1/loads``
    core fields) and Flying's status document (``/flying/status``)."""
    by_rank = {int(s.get("dp_rank", -1)): s for s in snapshots}
    engines = {int(e.get("rank", -1)): e for e in status.get("engines", [])}
    out = []
    for rank in range(num_engines):
        snap = by_rank.get(rank, {})
        eng = engines.get(rank, {})
        mode = str(eng.get("mode", "unknown"))
        dp_tokens = int(snap.get("num_used_tokens", 0)) + int(
            snap.get("num_waiting_uncached_tokens", 0)
        )
        session_tokens = 0
        if mode.startswith("tp"):  # bound in a group: its pool is the session's
            session_tokens = max(
                0, int(eng.get("total_kv_slots", 0)) - int(eng.get("free_kv_slots", 0))
            )
        out.append(
            {
                "dp_rank": rank,
                "num_reqs": int(snap.get("num_running_reqs", 0)),
                "num_waiting_reqs": int(snap.get("num_waiting_reqs", 0))
                + int(eng.get("pending_binds", 0)),
                "num_tokens": dp_tokens + session_tokens,
                "flying": {"mode": mode, "session_tokens": session_tokens},
            }
        )
    return out


def mount(app, read_status: Callable[[], dict], num_engines: int) -> None:
    """``GET /get_load`` on SGLang's app (a JSON array, as the router parses it)."""
    from fastapi.responses import JSONResponse

    async def get_load():
        from sglang.srt.entrypoints.http_server import get_global_state

        manager = get_global_state().tokenizer_manager
        snapshots = [s.to_dict({"core"}) for s in await manager.get_loads(include=["core"])]
        return JSONResponse(engine_loads(snapshots, read_status(), num_engines))

    app.add_api_route("/get_load", get_load, methods=["GET"])
