"""Conversation turns: a prompt that begins with an earlier request's whole prompt.

Why: a chat client sends each turn as the whole history (the earlier turns' prompts and
answers) plus a new message. An engine keeps the earlier turn in its prefix cache
(SGLang's radix tree), so the next turn on *that* engine prefills only the new tokens.
A TP group's cache lives for its session (``flying.session.tp_scope``), which ends when
the group drains, between turns; so a turn placed in a group prefills the whole history
again, and SGLang's round robin sends consecutive turns to different engines (each
finds only the turn before last cached). Measured on the hidden-1024 model, one
conversation at a time, turns of 472-1384 tokens (``workloads.chat_turns``,
docs/BENCHMARKS.md): the adaptive node (TP-2 at light load) found none cached, the third
turn on at TTFT p50 1.40x groups off (which found 73 % of their prompts cached); with
this rule 88 % cached, 0.66x.

So the controller keeps a small index of the prompts it placed and where, and the policy
sends a turn to DP, to the engine that holds its conversation (``affinity_rank``).

The index: a prompt's tokens in blocks of ``BLOCK``; each full block's key is a hash of
the previous key and the block's tokens (a chain: equal keys mean equal prefixes, up to
hash collisions, which only misplace a request: placement never changes its tokens).
For each placed prompt the key of its last full block is kept with the engine it went
to (-1: not one engine: a group, or SGLang's own dispatch), the latest ``CAPACITY``
prompts (LRU). A turn is the deepest key of a new prompt that is some earlier prompt's
last one.

A conversation's first turn looks like any other prompt; what tells chat traffic is how
often a prompt is continued: the index counts, over the latest first prompts long enough
to be continued as a turn, the share that a later turn did (``continued_share``). Where
that is at least ``CHAT_SHARE``, the policy keeps first prompts out of groups too, so the
second turn finds the first cached on an engine.

Pure: no torch, no sockets; O(prompt) per request (a hash per 64 tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: Tokens per block of the chain (a turn is matched to a block: the earlier prompt's
#: last partial block is not compared).
BLOCK = 64
#: Earlier prompts remembered (their last keys), the least recently placed dropped first.
CAPACITY = 4096
#: A request is a conversation's turn when at least this many of its prompt tokens, and
#: at least half of them, are an earlier prompt (shorter histories cost a group little
#: to prefill again; a prompt that only shares a system prompt is no turn).
MIN_TURN_TOKENS = 256
#: The engine holding a conversation keeps its next turn while it holds at most this
#: many requests (running + waiting) more than the least loaded engine; beyond, the turn
#: goes to the least loaded one (and its conversation with it).
AFFINITY_SLACK = 4
#: Continuations are counted over this many latest first prompts (``continued_share``).
FIRSTS = 32
#: At or above this share of recent first prompts continued by a later turn, the
#: adaptive policy runs a first prompt in DP too (``scheduler.policy``): a first turn in
#: a group saves at most half its prefill, and its next turn, finding nothing cached,
#: pays all of it again; so a group pays for a prompt only while it is continued less
#: than half the time.
CHAT_SHARE = 0.5


@dataclass(frozen=True)
class Turn:
    tokens: int  # prompt tokens that are the earlier prompt's (whole blocks)
    rank: int  # the engine the earlier prompt went to; -1: not one engine


def chain(ids: Sequence[int]) -> list[int]:
    """The key of each full block of ``ids``: key[i] covers ids[: (i + 1) * BLOCK]."""
    keys, key = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        key = hash((key, tuple(ids[start:start + BLOCK])))
        keys.append(key)
    return keys


def is_turn(turn_tokens: int, prompt_len: int) -> bool:
    """Whether ``turn_tokens`` of a ``prompt_len`` prompt make it a conversation's turn."""
    return turn_tokens >= MIN_TURN_TOKENS and 2 * turn_tokens >= prompt_len


def affinity_rank(holder: int, loads: dict[int, int]) -> int:
    """The engine for a turn whose conversation engine ``holder`` holds (-1: none):
    ``holder`` unless it holds more than ``AFFINITY_SLACK`` requests over the least
    loaded of ``loads`` (rank -> running + waiting, the engines a request may go to);
    otherwise the least loaded (the lowest rank among equals)."""
    least = min(loads, key=lambda r: (loads[r], r))
    if holder in loads and loads[holder] <= loads[least] + AFFINITY_SLACK:
        return holder
    return least


class ConversationIndex:
    """Where the recent prompts went (module docstring)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._ends: OrderedDict[int, int] = OrderedDict()
        #: the latest first prompts (last key -> whether a later turn continued it)
        self._firsts: OrderedDict[int, bool] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def turn_of(self, keys: Sequence[int]) -> Turn | None:
        """The earlier prompt the prompt of ``keys`` (``chain``) begins with, the longest
        one remembered; None if none."""
        for depth in range(len(keys), 0, -1):
            rank = self._ends.get(keys[depth - 1])
            if rank is not None:
                return Turn(depth * BLOCK, rank)
        return None

    def count(self, keys: Sequence[int], turn: Turn | None, prompt_len: int) -> None:
        """Count a new prompt (``keys``, ``turn``: its ``turn_of``) for
        ``continued_share``: a turn marks the prompt it continues; a first prompt long
        enough to be continued as a turn (``MIN_TURN_TOKENS``) joins the latest firsts."""
        if turn is not None and is_turn(turn.tokens, prompt_len):
            earlier = keys[turn.tokens // BLOCK - 1]
            if earlier in self._firsts:
                self._firsts[earlier] = True
        elif len(keys) * BLOCK >= MIN_TURN_TOKENS and keys[-1] not in self._firsts:
            self._firsts[keys[-1]] = False
            while len(self._firsts) > FIRSTS:
                self._firsts.popitem(last=False)

    def continued_share(self) -> float:
        """The share of the latest ``FIRSTS`` first prompts that a later turn continued
        (0.0 before any: a first prompt just placed is not continued yet, so the share
        lags a conversation's first turns by one think time)."""
        if not self._firsts:
            return 0.0
        return sum(self._firsts.values()) / len(self._firsts)

    def remember(self, keys: Sequence[int], rank: int) -> None:
        """The prompt of ``keys`` went to engine ``rank`` (-1: not one engine)."""
        if not keys:
            return
        last = keys[-1]
        self._ends[last] = rank
        self._ends.move_to_end(last)
        while len(self._ends) > self.capacity:
            self._ends.popitem(last=False)
