"""The start-up probe: TP groups open only after a group forward matched DP.

TP views are proven per model family by tests, but a server may be given any checkpoint
SGLang can serve. Rather than a hand-kept allow-list, the launcher proves the model it
serves: after SGLang's own warm-up (run in DP: the gate is still closed), it sends one
short greedy request per TP degree into a group and the same request in DP, and opens
the groups only if every group answered with DP's tokens and no session faulted.
Otherwise the node serves with groups off (DP keeps working) and the log says why.

The gate lives in the launcher's TCPStore (``GATE_KEY``): ``probing``, ``open`` or
``closed:<reason>``. The HTTP process (which runs the probe) keeps it in memory; the DP
controller reads it through ``GateReader`` (cached; re-read at most once a second until
it is decided). Probe requests carry a per-launch secret header (``PROBE_HEADER``) that
lets them into a group while the gate is not yet open; no client can know it.
"""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

GATE_KEY = "flying/groups"
PROBE_HEADER = "x-flying-probe"
PROBING, OPEN = "probing", "open"
#: Enough decode steps for the engines to measure a step in each mode (step costs).
PROBE_TOKENS = 16
#: Token ids of the probe prompt: plain ids every tokenizer of a real model has.
PROBE_PROMPT = [11, 42, 7, 300, 5, 99, 64, 128, 3, 250, 17, 81]
#: Calibration (after the probe, before the gate opens): per mode, one request alone (a
#: prefill of a CALIBRATE_PROMPT-token prompt, cached for the rest), then one staggered
#: batch on each engine of the mode's server (one group for a TP mode): its requests'
#: lengths make the batch run CALIBRATE_STEPS decode steps at each of CALIBRATE_SIZES
#: as they finish, so each mode's decode curve (``scheduler.costs``) gets a point at
#: each size, measured on the same quiet machine for every mode.
#: Measured, not interpolated, because this CPU's steps are not linear at small batches
#: (hidden-1024 model, quiet: TP-2 22.5 / 37.1 / 43.8 / 35.1 ms at batch 1 / 2 / 3 / 4,
#: one engine 32 / 57 / 83 / 67): a line from batch 1 to 4 read batches 2-3 25-34 % low.
#: And sizes up to 32, not 4: past its last point a curve grows by its last segment's
#: slope, which batches 3-4 leave flat (the lower-is-kept points), so with points to 4
#: only, the first burst was predicted from flat decode steps in every mode and the
#: modes' capacities from their prefill costs alone (hidden-768 model: TP-2 598 vs DP
#: 540 tok/s predicted where a TP-2 group drains 0.94x DP's tokens; one engine at batch
#: 24 / 50 steps 99 / 166 ms, not batch 4's 45). Traffic fills in the rest. A size
#: above 4 is run only where its batch fits in half an engine's KV slots without prefix
#: sharing (a group's requests share no cached prefix): ``calibration_sizes``.
CALIBRATE_SIZES = (32, 16, 8, 4, 3, 2, 1)
CALIBRATE_PROMPT, CALIBRATE_STEPS = 128, 8
#: Every mode is calibrated this many times, the modes in turn (DP, TP-2, DP, TP-2), each
#: pass with a prompt of its own (the prefill is measured again, not found cached). A
#: point keeps its lowest reading (``flying.session.step_costs``), so a pass stretched
#: by something else on the machine is outvoted by the other; with one pass, a stretch
#: stayed in the mode the node then did not serve (traffic lowers only the points of
#: the mode it runs): hidden-768 model, one engine's points 25-50 % above two other
#: starts' (batch 32: 209 vs 133 / 146 ms, a 128-token prefill 490 vs 310 / 333), the
#: node in TP-2 for the whole run, 0.65x the better static layout's goodput.
CALIBRATE_PASSES = 2
#: After the passes, one prompt of this many tokens alone on each of every mode's
#: servers (at most a quarter of an engine's KV slots: ``long_prompt_length``): an
#: extend step near SGLang's chunk, the step a deep queue is priced at
#: (``scheduler.service.queue_prefill``: no longer than a mode has measured). The
#: passes give a group one (its batch's requests share no cached prefix and reach it
#: together) but not one engine: its batch finds the pass's prompt cached, and with
#: prompts of their own its requests arrived one by one and an idle engine extended
#: what had arrived (a long step in 2 of 7 starts of the hidden-1024 model). Read on
#: its last segment's slope from ~130 tokens instead, one engine's 4,096-token step
#: came out 0.8-2.8x a prompt's own step per token (cpu-burst, sessions 86-87). Half
#: the chunk: a deep queue's steps of 2,300-4,096 tokens cost about as much a token, at
#: half the start-up time (one engine of the hidden-1024 model: ~2.7 s a prompt).
CALIBRATE_LONG = 2048


def calibration_sizes(kv_slots: int) -> tuple[int, ...]:
    """The sizes of CALIBRATE_SIZES to run on engines of ``kv_slots`` KV slots each (0:
    unknown): batches 1-4 always, a bigger one if it fits in half of them."""
    longest = CALIBRATE_PROMPT + CALIBRATE_STEPS * len(CALIBRATE_SIZES)
    return tuple(n for n in CALIBRATE_SIZES if n <= 4 or n * longest <= kv_slots // 2)


def stagger_lengths(sizes: tuple[int, ...] = CALIBRATE_SIZES,
                    steps: int = CALIBRATE_STEPS) -> list[int]:
    """max_new_tokens of a batch that decodes ``steps`` steps at each of ``sizes``
    (descending): ``sizes[t] - sizes[t + 1]`` requests stop after ``(t + 1) * steps``
    tokens. Sorted ascending; ``len`` is ``sizes[0]``."""
    tiers = [*sizes, 0]
    return [steps * (t + 1) for t in range(len(sizes))
            for _ in range(tiers[t] - tiers[t + 1])]


_SECRET = secrets.token_hex(16)  # HTTP process only; never leaves it
_STATE = {"gate": PROBING}


def secret() -> str:
    return _SECRET


def gate() -> str:
    """This process's view of the gate (the HTTP process runs the probe)."""
    return _STATE["gate"]


def groups_open() -> bool:
    return _STATE["gate"] == OPEN


def is_probe(headers) -> bool:
    return headers is not None and headers.get(PROBE_HEADER) == _SECRET


def closed_reason() -> str:
    g = _STATE["gate"]
    if g == PROBING:
        return "TP groups are not open yet: the start-up probe is running"
    return f"TP groups are off on this node: {g.partition(':')[2]}"


def _set(store, value: str) -> None:
    _STATE["gate"] = value
    if store is not None:
        store.set(GATE_KEY, value)


class GateReader:
    """The gate as another process (the DP controller) sees it: cached, re-read at
    most every ``every_s`` until it is decided (open or closed for good)."""

    def __init__(self, store, every_s: float = 1.0):
        self.store = store
        self.every_s = every_s
        self.value = PROBING
        self._at = 0.0

    def open(self) -> bool:
        if self.value == PROBING and time.monotonic() - self._at >= self.every_s:
            self._at = time.monotonic()
            try:
                if self.store.check([GATE_KEY]):
                    self.value = self.store.get(GATE_KEY).decode()
            except RuntimeError:
                pass
        return self.value == OPEN


def _counts(url: str) -> tuple[int, int]:
    import requests

    totals = requests.get(url + "/flying/status", timeout=30).json().get("totals", {})
    return totals.get("faulted_sessions", 0), totals.get("aborted_binds", 0)


def _kv_slots(url: str) -> int:
    """The fewest KV slots of any engine (0: not known)."""
    import requests

    try:
        engines = requests.get(url + "/flying/status", timeout=30).json().get("engines", [])
        return min((int(e.get("total_kv_slots") or 0) for e in engines), default=0)
    except Exception:  # noqa: BLE001 - unknown: the small batches only
        return 0


def _ask(url: str, degree: int, prompt: list[int] = PROBE_PROMPT,
         tokens: int = PROBE_TOKENS, engine: int | None = None) -> list[int]:
    import requests

    headers = {"X-Flying-TP": str(degree), PROBE_HEADER: _SECRET} if degree > 1 else {}
    body: dict = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }
    if engine is not None:
        body["routed_dp_rank"] = engine
    resp = requests.post(url + "/generate", json=body, headers=headers, timeout=300)
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json()["output_ids"]


def calibration_asks(degree: int, engines: int, sizes: tuple[int, ...] = CALIBRATE_SIZES
                     ) -> list[tuple[int | None, int]]:
    """The staggered batch of one mode: (engine or None, max_new_tokens) per request.
    DP names each request's engine (``routed_dp_rank``) so every engine runs the whole
    stagger; a TP mode sends one stagger to its group."""
    lengths = stagger_lengths(sizes)
    if degree == 1:
        return [(e, n) for e in range(engines) for n in lengths]
    return [(None, n) for n in lengths]


def calibration_prompt(n: int) -> list[int]:
    """Pass ``n``'s prompt: CALIBRATE_PROMPT plain ids, its first differing from every
    other pass's (no pass finds another's prefix cached)."""
    return [n + PROBE_PROMPT[i % len(PROBE_PROMPT)] + i % 7 for i in range(CALIBRATE_PROMPT)]


def long_prompt_length(kv_slots: int) -> int:
    """Tokens of the long calibration prompt: CALIBRATE_LONG, at most a quarter of an
    engine's KV slots; 0 (none) where that is not twice the passes' prompt."""
    tokens = min(CALIBRATE_LONG, kv_slots // 4)
    return tokens if tokens >= 2 * CALIBRATE_PROMPT else 0


def long_prompt(n: int, tokens: int) -> list[int]:
    """Mode ``n``'s long prompt: ``tokens`` plain ids, its first (``n + 51``) and second
    differing from every pass's prompt (``calibration_prompt``: ``n + 11``), so none
    finds another's prefix cached."""
    return [40 + n + PROBE_PROMPT[i % len(PROBE_PROMPT)] + i % 7 for i in range(tokens)]


def calibrate_long(url: str, degrees: list[int], engines: int, tokens: int) -> None:
    """The long prompt alone on each of every mode's servers (``CALIBRATE_LONG``): the
    DP engines together (each runs on its own cores, ``flying.substrate.cpu_threads``,
    as they serve a burst), then each degree's group. Its own failure (a model whose
    context is shorter rejects the prompt) loses this point alone, not the passes'
    curves."""
    prompt = long_prompt(0, tokens)
    try:
        with ThreadPoolExecutor(engines) as pool:  # every engine's ask runs, then any fault
            asks = [pool.submit(_ask, url, 1, prompt, 1, e) for e in range(engines)]
        for ask in asks:
            ask.result()
        for n, degree in enumerate(degrees, start=1):
            _ask(url, degree, long_prompt(n, tokens), tokens=1)
    except Exception as exc:  # noqa: BLE001
        logger.warning("Flying: the long extend step not calibrated: %s", exc)


def calibration_passes(degrees: list[int], passes: int = CALIBRATE_PASSES
                       ) -> list[tuple[int, list[int]]]:
    """(degree, prompt) in the order they are calibrated: DP and every degree in turn,
    ``passes`` times, each (degree, pass) with its own prompt."""
    modes = (1, *degrees)
    return [(d, calibration_prompt(n * len(modes) + i))
            for n in range(passes) for i, d in enumerate(modes)]


def calibrate(url: str, degrees: list[int], engines: int) -> None:
    """Step-cost calibration: for DP and each degree (``calibration_passes``), a prompt
    alone on each of the mode's servers (its prefill) and a staggered batch
    (``calibration_asks``), then a long prompt alone on each (``calibrate_long``); the
    engines time the steps (``flying.session.step_costs``). Never raises: the curves
    are advice."""
    kv_slots = _kv_slots(url)
    started, sizes = time.monotonic(), calibration_sizes(kv_slots)
    try:
        for degree, prompt in calibration_passes(degrees):
            for engine in range(engines) if degree == 1 else (None,):
                # alone: a prefill of the prompt, which the batch then finds cached
                _ask(url, degree, prompt, tokens=2, engine=engine)
            asks = calibration_asks(degree, engines, sizes)
            with ThreadPoolExecutor(len(asks)) as pool:
                list(pool.map(lambda a, d=degree, p=prompt: _ask(url, d, p, a[1], a[0]), asks))
    except Exception as exc:  # noqa: BLE001
        logger.warning("Flying: step-cost calibration incomplete: %s", exc)
    long = long_prompt_length(kv_slots)
    if long:
        calibrate_long(url, degrees, engines, long)
    logger.info("Flying: step costs calibrated in %.1f s (decode batches %s, a %d-token "
                "prefill)", time.monotonic() - started, "/".join(map(str, sorted(sizes))),
                long)


def _log_slo(store, degrees: list[int], engines: int) -> None:
    """Print the node's SLOs as the adaptive policy derives them from the calibrated
    costs (the controller logs the ones it uses with its first placement)."""
    try:
        from flying.node.config import get_config
        from flying.node.costs_reader import merge
        from flying.session import status
        from scheduler.policy import PolicyConfig, derive_slo

        cfg = get_config()
        costs = merge(status.read_all(store, engines)["engines"])
        slo = derive_slo(PolicyConfig(slo_ttft_ms=cfg.slo_ttft, slo_tpot_ms=cfg.slo_tpot),
                         costs, tuple(degrees))
        if slo is not None:
            logger.info("Flying: node SLOs TTFT %.0f ms, TPOT %.1f ms (%s)", slo.ttft_ms,
                        slo.tpot_ms, "configured" if cfg.slo_ttft and cfg.slo_tpot else
                        "derived: 4x / 1.5x the measured quiet service of a 256-token "
                        "prompt; the TTFT target grows with the traffic's mean prompt; "
                        "--flying-slo-ttft, --flying-slo-tpot set them")
    except Exception:  # noqa: BLE001 - a log line only
        logger.exception("Flying: could not derive the node's SLOs")


def _serving(url: str, store, engines: int) -> None:
    """The probe is done (``status.CALIBRATED_KEY``): every engine forgets the stretch
    its calibration measured at its next status refresh, which a one-token request per
    engine brings about before the gate opens (an idle engine does not refresh)."""
    from flying.session.status import CALIBRATED_KEY

    if store is not None:
        store.set(CALIBRATED_KEY, "1")
    try:
        for engine in range(engines):
            _ask(url, 1, tokens=1, engine=engine)
    except Exception as exc:  # noqa: BLE001 - advice only, as the calibration
        logger.warning("Flying: an engine did not step after the calibration: %s", exc)


def run(url: str, degrees: list[int], store, engines: int = 0) -> str:
    """Probe every degree against DP, calibrate the step costs (``engines``: the
    engine count; 0 skips it); set and return the gate. The probe is marked done
    (``_serving``) once, however it ends, and before the gate opens."""
    passed = False
    try:
        passed = _probe(url, degrees, store)
        if passed and engines:
            calibrate(url, degrees, engines)
    finally:
        _serving(url, store, engines if passed else 0)
    if passed:
        if engines:
            _log_slo(store, degrees, engines)
        logger.info("Flying: start-up probe passed for TP degrees %s: groups open", degrees)
        _set(store, OPEN)
    return gate()


def _probe(url: str, degrees: list[int], store) -> bool:
    """Whether every degree's tokens equal DP's; if not, the gate is closed (why)."""
    if not degrees:
        _set(store, "closed:no TP degree is allowed on this node")
        return False
    try:
        want = _ask(url, 1)
        for m in degrees:
            before = _counts(url)
            got = _ask(url, m)
            if _counts(url) != before:
                raise RuntimeError(f"the TP-{m} group session failed (see the engine log)")
            if got != want:
                raise RuntimeError(f"TP-{m} tokens {got} differ from DP tokens {want}")
    except Exception as exc:  # noqa: BLE001 - any failure closes the gate, never the node
        logger.error("Flying: start-up probe failed, serving with TP groups off: %s", exc)
        _set(store, f"closed:the start-up probe failed: {exc}")
        return False
    return True
