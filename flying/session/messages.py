"""What travels between Flying's processes, and how a request is marked for TP.

A request that must run in a TP group carries a marker in SGLang's ``routing_key``
field, the one per-request string that SGLang already carries from the HTTP layer to
the DP controller: ``flying:<secret>:tp=<m>:<why>`` (a user's own routing key is kept
after a ``;``). The controller strips the marker before the request reaches an engine.

The marker is an internal control channel, so a client must not be able to write it:
the HTTP process refuses any client routing key that starts with ``flying:`` (HTTP 400,
``check_routing_key``), and a marker only counts when it carries this launch's secret
(``FLYING_MARK_SECRET``: random per launch, set by the launcher before SGLang starts a
process, so every process of one server shares it). A ``flying:`` key without the
secret (one that entered some other way) is dropped, never obeyed. ``read_mark`` never
raises: whatever the routing key holds, the answer is a ``Marker``.

``Bind`` goes from the controller to every member of a group, in the controller's one
total order; it is pickled by SGLang's IPC (not a msgspec type). ``Upgrade`` goes the
other way: an engine asks the controller to bind a group around one of its running DP
requests (``flying.session.upgrade``), so that bind too takes its place in that order.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

PREFIX = "flying:"
#: Environment variable holding this launch's marker secret.
SECRET_ENV = "FLYING_MARK_SECRET"
#: Why a request was marked: explicit X-Flying-TP, long context, priority, or the
#: policy (static-tp).
REASONS = ("explicit", "long", "priority", "policy")
#: Longest routing key a client may send (SGLang itself sets no bound).
MAX_ROUTING_KEY_LEN = 1024
MAX_DEGREE = 1 << 10


def secret() -> str:
    """This launch's marker secret; created (and exported to child processes) if absent."""
    value = os.environ.get(SECRET_ENV)
    if not value:
        value = os.environ[SECRET_ENV] = secrets.token_hex(16)
    return value


def new_secret() -> str:
    """A fresh secret for this launch (the launcher, before SGLang starts a process)."""
    value = os.environ[SECRET_ENV] = secrets.token_hex(16)
    return value


def mark(routing_key: str | None, degree: int, reason: str = "explicit") -> str:
    """``routing_key`` carrying Flying's TP marker (the user's own key kept after ``;``)."""
    if reason not in REASONS:
        raise ValueError(f"unknown mark reason {reason!r}")
    if not 1 < degree <= MAX_DEGREE:
        raise ValueError(f"TP degree {degree} cannot be marked")
    head = f"{PREFIX}{secret()}:tp={degree}:{reason}"
    return head + (f";{routing_key}" if routing_key else "")


def upgrade_endpoint() -> str:
    """Where engines send ``Upgrade`` asks: an IPC address the DP controller's input
    socket binds besides SGLang's own, one per launch (named after this launch's secret,
    which every process of the launch shares). On Linux it is in the abstract socket
    namespace (``@``): no file, so nothing is left behind in the temp directory however
    the server ends; elsewhere a socket file there."""
    digest = hashlib.sha256(secret().encode()).hexdigest()[:16]
    if sys.platform.startswith("linux"):
        return f"ipc://@flying-{digest}-upgrade"
    return f"ipc://{tempfile.gettempdir()}/flying-{digest}-upgrade"


@dataclass(frozen=True)
class Marker:
    """What a routing key says: the requested degree (0: none), why, the user's key."""

    degree: int = 0
    reason: str = ""
    user_key: str | None = None
    #: It carried Flying's prefix without this launch's secret (dropped, not obeyed).
    forged: bool = False


def read_mark(routing_key: Any) -> Marker:
    """Parse ``routing_key``; never raises."""
    try:
        if not isinstance(routing_key, str) or not routing_key.startswith(PREFIX):
            return Marker(user_key=routing_key if isinstance(routing_key, str) else None)
        head, _, rest = routing_key.partition(";")
        user_key = rest or None
        parts = head[len(PREFIX) :].split(":")
        if len(parts) != 3 or not hmac.compare_digest(parts[0].encode(), secret().encode()):
            return Marker(user_key=user_key, forged=True)
        tp, reason = parts[1], parts[2]
        digits = tp[3:] if tp.startswith("tp=") else ""
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 4):
            return Marker(user_key=user_key, forged=True)
        degree = int(digits)
        if not 1 < degree <= MAX_DEGREE or reason not in REASONS:
            return Marker(user_key=user_key, forged=True)
        return Marker(degree, reason, user_key)
    except Exception:  # noqa: BLE001 - a malformed key is "no marker", never an error
        return Marker(forged=True)


def unmark(routing_key: Any) -> tuple[int, str | None]:
    """(requested TP degree or 0, the user's own routing key); never raises."""
    m = read_mark(routing_key)
    return m.degree, m.user_key


def check_routing_key(value: Any, source: str) -> None:
    """A client's routing key (body ``routing_key`` or the ``x-smg-routing-key``
    header): a ValueError (HTTP 400) if it is not a string, too long, holds control
    characters, or starts with Flying's reserved prefix."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"invalid {source}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_ROUTING_KEY_LEN:
        raise ValueError(
            f"invalid {source}: {len(value)} characters, at most {MAX_ROUTING_KEY_LEN}"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"invalid {source}: control characters are not allowed")
    if value.lstrip().lower().startswith(PREFIX):
        raise ValueError(f"invalid {source} {value[:40]!r}: the prefix {PREFIX!r} is reserved")


@dataclass(frozen=True)
class Upgrade:
    """A running request outgrows its engine (or its group): it asks for a larger group.

    ``rid`` runs on engine ``holder`` (or in the group ``holder`` leads); the request has
    no max_new_tokens of its own and is within a few tokens of its length limit there
    (``flying.session.upgrade``, ``flying.session.regroup``)."""

    rid: str
    holder: int  # the engine's dp_rank (a group's leader, for a group's request)
    asked_at: float  # the engine's time.time()
    #: the degree the request runs at now: 1 in DP, or the TP group it outgrows, whose
    #: members hand it to a larger aligned group around them (``flying.session.regroup``)
    from_degree: int = 1


@dataclass
class Bind:
    """Run ``req`` as one TP session on the group ``ranks`` (leader = ranks[0]); or,
    for an ``upgrade`` bind (``req`` None), bind the group around that running DP
    request, which joins it with its KV (``flying.session.upgrade``)."""

    bind_id: str
    degree: int
    ranks: tuple[int, ...]
    req: Any  # TokenizedGenerateReqInput, routing key already unmarked
    issued_at: float  # controller's time.time(), for switch-latency accounting
    #: why the request runs in a group: one of ``REASONS`` ("policy": the adaptive
    #: policy's light-load rule, whose groups hand their requests to DP when DP work
    #: arrives; the others keep them, unless --flying-move-to-dp all)
    reason: str = "explicit"
    upgrade: Upgrade | None = None
    #: the request's TPOT SLO in ms when bound: its own, else the node's (0: none
    #: known); the leader's hold reads it (``scheduler.hold.pause_breaks``)
    slo_tpot_ms: float = 0.0

    @property
    def rid(self) -> str:
        """The request this bind is for."""
        return self.upgrade.rid if self.upgrade is not None else self.req.rid
