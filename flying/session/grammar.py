"""Constrained decoding in a group: every member's copy of a request has its grammar
before any step forms.

SGLang compiles a request's grammar (``regex``, ``json_schema``, ``ebnf``,
``structural_tag``) asynchronously: ``handle_generate_request`` puts a request whose
grammar is not cached into its grammar queue, and each prefill formation moves the ready
ones to the waiting queue. In SGLang's own ``--tp-size`` server the ranks agree on which
are ready with an all-gather over their group (``GrammarManager.get_ready_grammar_requests``);
a Flying engine is its own one-rank group, so there each member would move the request
when its own compile finished, and a request ready on one member and not on another
would enter one member's batch only: lockstep broken.

So where a TP request is handed to SGLang (``Scope.hand``, in the session's TP state,
whose grammar queue is the session's own), a request SGLang queued for its grammar is
waited for here and moved to the waiting queue by SGLang's own
``get_ready_grammar_requests`` (its sync group the engine alone: no collective).
Invariant: the session's grammar queue is empty at every step boundary on every member,
so the request enters every member's waiting queue at the same boundary, in the same
order. Either way a member's copy arrives there: compiled now, or found in its grammar
cache (compiled earlier for the engine's own DP traffic), with the same grammar state.
A grammar that fails to compile fails on every member alike (SGLang aborts the request
with the reason); one not compiled within ``WAIT_S`` raises, and the session's
containment ends the group (its requests re-run in DP).

From then on the members keep their copies' grammars in step without help: each masks
the same logits with the same grammar state, the leader's tokens win (the token sync)
and each member's SGLang accepts the same token into its own copy.
"""

from __future__ import annotations

from concurrent import futures

#: How long a member waits for one request's grammar (SGLang's own bound, poll interval
#: x max iterations, is of the same order; a JSON schema compiles in milliseconds).
WAIT_S = 60.0


class GrammarTimeout(RuntimeError):
    """A TP request's grammar was not compiled within ``WAIT_S`` on this member."""


def settle(scheduler, rid: str) -> None:
    """Move request ``rid`` from the grammar queue to the waiting queue once its grammar
    is compiled (no-op if SGLang did not queue it: no grammar, or a cached one)."""
    manager = scheduler.grammar_manager
    queued = [r for r in manager.grammar_queue if r.rid == rid]
    if not queued:
        return
    if manager.grammar_sync_size != 1:  # an engine of several SGLang ranks: theirs to sync
        raise RuntimeError("flying: a group member must be a one-rank SGLang engine")
    for req in queued:
        if isinstance(req.grammar, futures.Future):
            try:
                req.grammar.exception(timeout=WAIT_S)  # a compile error: SGLang aborts it
            except futures.TimeoutError as exc:
                raise GrammarTimeout(f"flying: the grammar of {rid} took over {WAIT_S:.0f} s "
                                     "to compile") from exc
            except futures.CancelledError:
                pass  # SGLang's own path answers for a cancelled compile
    for req in manager.get_ready_grammar_requests():
        scheduler._add_request_to_queue(req)  # as SGLang's prefill formation does
