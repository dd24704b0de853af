"""SGLang-like continuous batching of one server: an engine in DP, or a group session.

What a server does at each step boundary, as SGLang 0.5.23's scheduler does it by
default (no mixed chunks, FCFS):

- a request being chunk-prefilled continues first; then waiting requests are admitted
  in arrival order while the step's new-token budget (the chunked-prefill size), the
  running-request cap and the KV admission allow; the first that does not fit stops
  admission (FCFS: nobody overtakes it); the last admitted one may be cut into a chunk;
- if anything was admitted or continued, the step is a prefill (extend) step of those
  tokens and the running batch waits: prefill runs before the next decode step;
- otherwise every running request decodes one token.

A request's first token comes at the end of the step that prefilled its last prompt
token; each decode step adds one token to every running request; a request ends with
its ``max_new`` tokens. Step times come from the profile's ``Costs`` (the policy's own
interpolation): ``prefill(degree, new tokens)`` and ``decode(degree, batch)``.

Under SGLang's overlap loop (``Scheduler.event_loop_overlap``) a step's result is
processed after the next step has been launched; where the forward runs inside the
launch (a CPU engine) the step's tokens reach the client when that next step ends, or
at once where no step follows (SGLang leaves a request whose last token is in flight
out of the next batch: ``_reqs_finishing_inflight``). ``complete(..., defer=True)``
holds a step's tokens back and ``reveal`` stamps them with the time they are processed.

KV is the caller's (``admit`` reserves a request's KV or refuses it; ``on_done`` gives
it back), so the same batching serves an engine (its own pool) and a group (slots
reserved on every member when its bind was admitted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.costs import Costs


@dataclass(eq=False)
class SimRequest:
    """One request's life in the simulation (times in seconds on the trace clock)."""

    index: int
    rid: str
    arrival: float
    prompt: int
    max_new: int
    priority: int = 0
    explicit: int = 0  # an X-Flying-TP degree (0: none)
    prefilled: int = 0
    out: int = 0
    times: list[float] = field(default_factory=list)  # each output token's time
    queued_at: float | None = None  # entered a server's waiting queue
    admitted_at: float | None = None  # first scheduled in a prefill step
    degree: int = 1  # where it started (what a streamed response reports)
    ranks: tuple[int, ...] = ()
    reason: str = ""
    moved: str = ""  # it changed layout mid-request (moved to DP, joined a group)
    slots: int = 0  # KV it holds: tokens on its DP engine, or slots per group member
    where: object = None  # its engine or session (None: in a bind, or not placed)
    error: str | None = None
    status: int = 200  # 400: rejected where it entered
    done: bool = False
    done_at: float | None = None

    @property
    def budget(self) -> int:
        """KV tokens SGLang's admission needs for it in DP: prompt + max_new."""
        return self.prompt + self.max_new

    @property
    def kv_len(self) -> int:
        """Tokens of KV a decoding request holds (all but its last output token)."""
        return self.prompt + self.out - 1


@dataclass
class Step:
    kind: str  # "prefill" | "decode"
    reqs: list[SimRequest]
    tokens: list[int]  # prefill: new tokens per request
    ms: float


class Batcher:
    """One server's queues and step formation (see the module docstring)."""

    def __init__(self, degree: int, costs: Costs, chunk_tokens: int, max_running: int):
        self.degree = degree
        self.costs = costs
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.chunk: SimRequest | None = None  # being chunk-prefilled
        self.prefilling: list[SimRequest] = []  # in the prefill step now running
        self.last_kind = ""
        #: tokens the overlap loop has not processed yet: (request, index in its times)
        self.unseen: list[tuple[SimRequest, int]] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunk is not None or self.prefilling)

    def load(self) -> tuple[int, int]:
        """(running, waiting) as SGLang's load snapshot counts them (a request being
        prefilled is running)."""
        pre = len(self.prefilling) or (self.chunk is not None)
        return len(self.running) + pre, len(self.waiting)

    def remove(self, req: SimRequest) -> None:
        """Take ``req`` out wherever it is (an abort, a move); its KV is the caller's."""
        if self.chunk is req:
            self.chunk = None
        if req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def form(self, now: float, admit: Callable[[SimRequest], bool]) -> Step | None:
        budget = self.chunk_tokens
        batch: list[SimRequest] = []
        tokens: list[int] = []
        if self.chunk is not None:
            take = min(self.chunk.prompt - self.chunk.prefilled, budget)
            batch.append(self.chunk)
            tokens.append(take)
            budget -= take
        busy = len(self.running) + len(batch)
        while self.waiting and budget > 0 and busy < self.max_running:
            req = self.waiting[0]
            if not admit(req):
                break
            self.waiting.popleft()
            req.admitted_at = now
            take = min(req.prompt - req.prefilled, budget)
            batch.append(req)
            tokens.append(take)
            budget -= take
            busy += 1
        if batch:
            self.prefilling = list(batch)
            self.last_kind = "prefill"
            return Step("prefill", batch, tokens, self.costs.prefill(self.degree, sum(tokens)) or 0.0)
        if self.running:
            self.last_kind = "decode"
            return Step("decode", list(self.running), [],
                        self.costs.decode(self.degree, len(self.running)) or 0.0)
        return None

    def complete(self, step: Step, now: float, on_done: Callable[[SimRequest], None],
                 defer: bool = False) -> None:
        """Apply ``step`` at its end ``now``: tokens, new running requests, finished ones
        (``on_done`` for each; aborted requests, already done, are skipped). A server
        runs one step at a time, so nothing but an abort changes its requests between
        ``form`` and ``complete``. With ``defer`` (the overlap loop) the step's tokens
        wait for ``reveal``; the requests' state (running, finished, KV) changes now."""
        finished = False
        if step.kind == "prefill":
            self.prefilling = []
            for req, k in zip(step.reqs, step.tokens, strict=True):
                if req.done:
                    continue
                req.prefilled += k
                if req.prefilled < req.prompt:
                    self.chunk = req
                    continue
                if self.chunk is req:
                    self.chunk = None
                req.out = 1
                self._token(req, now, defer)
                if req.out >= req.max_new:
                    on_done(req)
                else:
                    self.running.append(req)
            return
        for req in step.reqs:
            if req.done:
                continue
            req.out += 1
            self._token(req, now, defer)
            if req.out >= req.max_new:
                finished = True
                on_done(req)
        if finished:
            self.running = [r for r in self.running if not r.done]

    def _token(self, req: SimRequest, now: float, defer: bool) -> None:
        req.times.append(now)
        if defer:
            self.unseen.append((req, len(req.times) - 1))

    def reveal(self, at: float) -> None:
        """The overlap loop processes the last step's result at ``at``: the end of the
        step launched after it, or now where none is (module docstring)."""
        for req, i in self.unseen:
            req.times[i] = at
            if req.done and req.error is None and i == len(req.times) - 1:
                req.done_at = at
        self.unseen = []
