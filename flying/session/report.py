"""Where a request ran, reported by the engine with the request's own output.

The engine that runs a request knows where it ran: a group's members (the leader's
output is the one sent), or DP after a group failed or did not form. It puts
``{"degree": m, "reason": ...}`` under ``REPORT_KEY`` in the SGLang ``Req``'s
``customized_info``; SGLang sends it with the request's output (once per request: the
output streamer treats the key as request-level, ``sglang_patches.output_streamer``)
and the HTTP process reads it for ``meta_info["flying"]``. No store round trip.
"""

from __future__ import annotations

REPORT_KEY = "flying"


def mark(scheduler, rid: str, degree: int, reason: str = "") -> None:
    """Report ``degree`` (and why, for DP) for the request ``rid`` just handed to
    SGLang (the newest in the current waiting queue)."""
    for req in reversed(scheduler.waiting_queue):
        if req.rid == rid:
            info = {"degree": degree, **({"reason": reason} if reason else {})}
            req.customized_info = {**(req.customized_info or {}), REPORT_KEY: [info]}
            return


def moved(req, degree: int, reason: str) -> None:
    """Report that ``req`` (a Req) changed layout mid-request: left its TP-``degree``
    group for DP, or joined one (a long-context upgrade). A stream's report goes out
    with its first chunk, so only answers sent after the move (non-streamed ones) carry
    this."""
    info = {"degree": degree, "reason": reason}
    req.customized_info = {**(req.customized_info or {}), REPORT_KEY: [info]}

