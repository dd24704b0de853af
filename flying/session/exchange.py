"""The per-step exchange of a group session: two small collectives per step.

Every step each member contributes the signature of the batch it formed; the leader's
values reach everyone, with the leader's pending offers and abort announcements, and the
count of members that have DP work waiting (a sum). Before the batch is formed, a
second collective (``offer``, ``MAX_ADMITS`` wide) shares the binds the leader admits at this
boundary. Layout of the shared ints (fixed width, so
every member issues the identical collective)::

    [signature: SIG][n_offers, offers: MAX_OFFERS][n_aborts, aborts: MAX_ABORTS]

The signature covers what must be identical on every member for the group to be in
lockstep: the batch size, the tokens in the batch (prompt + output lengths), the forward
mode, and a checksum of the requests' last output token ids (the leader's, shared every
step by ``Member.share_tokens_``). A member whose signature differs raises
``LockstepError``; containment ends the session on every member.
"""

from __future__ import annotations

from dataclasses import dataclass

SIG = 4
#: Pending binds the step's exchange carries: whether any wait (the session goes on) and
#: an upgrade's, which is offered alone. Admission itself takes up to ``MAX_ADMITS``.
MAX_OFFERS = 8
#: Binds admitted at one boundary (the width of ``offer``): a burst for the group joins in
#: one prefill, as SGLang's own scheduler takes every waiting request its prefill budget
#: fits. At 8, 24 requests arriving at once were prefilled in waves of 8 back to back,
#: and the first ones admitted waited ~1 s between two tokens (SGLang's TP-2: one wave of
#: 23, ~150 ms); the collective grows by 24 ints a step.
MAX_ADMITS = 32
MAX_ABORTS = 4  # client aborts announced per step
WIDTH = SIG + 1 + MAX_OFFERS + 1 + MAX_ABORTS
_CHECKSUM_MOD = 1 << 40


class LockstepError(RuntimeError):
    """A member formed a different batch than the leader."""


@dataclass(frozen=True)
class Shared:
    #: bind keys pending on the leader after the batch was formed: the session does not
    #: end with them (they are offered again, and admitted, at the next boundary: ``offer``)
    offers: list[int]
    aborts: list[int]  # rid keys the leader announces as aborted
    dp_waiting: int  # members with DP work waiting for this session to end
    busy: int = 0  # members with session requests still waiting or running
    #: members whose running DP requests need KV slots this session holds to decode
    dp_held: int = 0
    #: members where DP requests arrived during the session (``GroupSession.dp_arrived``)
    dp_arrived: int = 0
    #: members holding, at the head of their queue, the bind of a larger group for the
    #: session's request that outgrows it (``flying.session.regroup``): at m of m the
    #: request is parked at the next boundary, on every member alike
    parking: int = 0

    @property
    def done(self) -> bool:
        """Every member has drained and nothing joins or leaves: the session ends, at
        the same step on every member (a member never decides that on its own)."""
        return not self.busy and not self.offers and not self.aborts


def offer(member, offers: list[int]) -> list[int]:
    """The leader's ``offers`` (bind keys for this session's group, at most
    ``MAX_ADMITS``) on every member: a boundary's first collective, before its batch is
    formed, so that every member admits the same binds at this boundary."""
    shared, _ = member.share_ints(_padded(offers[:MAX_ADMITS], MAX_ADMITS), 1 + MAX_ADMITS)
    return shared[1 : 1 + shared[0]]


def signature(batch) -> list[int]:
    if batch is None:
        return [0] * SIG
    lens = sum(len(r.origin_input_ids) + len(r.output_ids) for r in batch.reqs)
    check = sum(r.output_ids[-1] + 1 for r in batch.reqs if r.output_ids) % _CHECKSUM_MOD
    return [len(batch.reqs), lens, int(batch.forward_mode.value) + 1, check]


def _padded(values: list[int], width: int) -> list[int]:
    return [len(values), *values, *[0] * (width - len(values))]


#: the summed ``own`` carries five counts, a byte each: DP work, busy, DP held for KV,
#: DP arrivals, parking (``Member.share_ints`` keeps all 48 bits exact)
_BUSY = 1 << 8
_HELD = 1 << 16
_ARRIVED = 1 << 24
_PARKING = 1 << 32


def exchange(
    member, batch, offers: list[int], aborts: list[int], dp_work: bool, busy: bool,
    dp_held: bool = False, dp_arrived: bool = False, parking: bool = False,
) -> Shared:
    """One collective: check lockstep, learn the leader's offers and aborts, and how many
    members have DP work waiting, session work left, DP requests held for KV, or DP
    requests that arrived during the session."""
    mine = signature(batch)
    values = mine + _padded(offers[:MAX_OFFERS], MAX_OFFERS) + _padded(aborts[:MAX_ABORTS], MAX_ABORTS)
    own = (int(dp_work) + _BUSY * int(busy) + _HELD * int(dp_held)
           + _ARRIVED * int(dp_arrived) + _PARKING * int(parking))
    shared, own = member.share_ints(values, WIDTH, own=own)
    if shared[:SIG] != mine:
        raise LockstepError(
            f"flying: TP group out of lockstep: leader batch {shared[:SIG]}, "
            f"member {member.tp_rank} batch {mine}"
        )
    o = SIG
    a = o + 1 + MAX_OFFERS
    counts = [own // unit % 256 for unit in (1, _BUSY, _HELD, _ARRIVED, _PARKING)]
    return Shared(shared[o + 1 : o + 1 + shared[o]], shared[a + 1 : a + 1 + shared[a]], *counts)
