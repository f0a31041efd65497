"""Size the engine's step to the machine: measure prefill speed, pick the token budget, and measure again later.

One engine step computes up to ``max_num_batched_tokens`` tokens (decodes first, then prefill chunks), and
every running stream waits for the whole step before its next token. The same budget that is fine on a Zen 4
(a 512-token chunk in ~0.5 s) stalls every stream for ~2.5 s on a Zen 1, and machines of our kind differ from
session to session. So, unless the operator fixed the budget, the worker times a short and a long prefill,
fits ``step_ms(n) = fixed_ms + per_token_ms * n`` and gives each step's prefill chunk the largest size that
stays under ``--target-step-ms``, plus one decode token for each of ``max_num_seqs`` running requests: decodes
cost far less per token than prefill, are served first, and must never crowd prefill out entirely (a budget of
only ``max_num_seqs`` would starve every waiting request while the batch is full).

A worker that starts beside other work (its siblings loading, a test suite, a compile) measures the machine
slower than it is: one such start timed 3.6 s a step and kept the floor budget for life. So the probes also
measure how much of the machine other processes used meanwhile (/proc/stat against this process's own CPU time);
where that was a tenth or more (or cannot be told), the worker probes again while idle (``Resizer``: further apart
each time, until a round runs on a quiet machine; given up at once when a message arrives) and keeps the fastest
time seen for each probe length: contention only ever adds time.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine

log = logging.getLogger("kvgate.worker.sizing")

# Defaults for --target-step-ms: a CPU step this long keeps streams readable (a few tokens a second at
# worst) and chunks large enough that the fixed cost of a step (reading every weight once) stays small; a
# GPU step is far cheaper per token, so a shorter target costs little throughput and buys a smooth stream.
DEFAULT_TARGET_STEP_MS: Final = {"cpu": 500.0, "cuda": 100.0}
CEILING: Final = 8192  # beyond this a larger chunk buys nothing but memory for activations
MIN_PREFILL_CHUNK: Final = 32  # on the slowest machine prefill still advances this much per step
# Probe prompt lengths (tokens). The long one is near where budgets land on CPUs (a 500 ms step holds ~90 prefill
# tokens on a Zen 1, ~270 on a Zen 4, for smollm2): 256 took 1.5 s a probe on a Zen 1, most of start-up's sizing.
_SHORT, _LONG = 32, 128
# The best of two per length at start-up, of three while idle: a hiccup at start costs the budget only until the
# first idle round, which nobody waits for.
_START_REPEATS: Final = 2
_IDLE_REPEATS: Final = 3
_SALT: Final = "\0step-sizing"  # never a tenant's salt: nothing of the probes is shared with real requests
# Probing again, only where start-up's probes ran beside other processes (or that cannot be told): after this long
# idle, a first round RESIZE_FIRST_S after start, each next one twice as long after the last, until one runs on a
# quiet machine, at most RESIZE_MAX_ROUNDS. Each round costs one short and one long prefill per repeat of CPU time
# nobody waits for; a message arriving between two probes ends the round, so a request waits at most one probe.
RESIZE_IDLE_S: Final = 5.0
RESIZE_FIRST_S: Final = 30.0
RESIZE_MAX_ROUNDS: Final = 6
BUSY_SHARE: Final = 0.1  # other processes used at least this share of the machine's CPUs: the probes were contended
# Each round later by a random 0-50%: the workers of one `kvgate serve --workers N` start, size and idle together,
# and rounds in step would contend with each other as their start-up probes did.
RESIZE_JITTER: Final = 0.5
_ENTROPY: Final = random.SystemRandom()  # the OS's: whatever seeds the global generator, workers still differ


@dataclass(frozen=True, slots=True)
class StepSizing:
    max_num_batched_tokens: int
    fixed_ms: float  # cost of a step regardless of its tokens
    per_token_ms: float  # cost of one more prefill token
    target_ms: float


@dataclass(frozen=True, slots=True)
class ProbeTimes:
    """The fastest wall time seen for a short and a long probe prefill (ms), and the long one's length."""

    short_ms: float
    long_ms: float
    long_n: int
    others: float | None = None  # the share of the machine's CPUs other processes used meanwhile (None: unknown)

    def best(self, other: ProbeTimes) -> ProbeTimes:
        """The fastest of both (``others``: the newer's)."""
        return ProbeTimes(min(self.short_ms, other.short_ms), min(self.long_ms, other.long_ms), self.long_n,
                          other.others)

    @property
    def contended(self) -> bool:
        return self.others is None or self.others >= BUSY_SHARE


def _cpu_busy_s() -> float | None:
    """CPU seconds every process has used (Linux's /proc/stat: user, nice, system, irq, softirq, steal), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _watch() -> Callable[[], float | None]:
    """Starts watching the machine; the function it returns tells what share of its CPUs processes other than this
    one used since (None where /proc/stat cannot be read)."""
    busy, own, wall = _cpu_busy_s(), sum(os.times()[:2]), time.monotonic()

    def others() -> float | None:
        now_busy = _cpu_busy_s()
        elapsed = (time.monotonic() - wall) * (os.cpu_count() or 1)
        if busy is None or now_busy is None or elapsed <= 0:
            return None
        return max(0.0, (now_busy - busy) - (sum(os.times()[:2]) - own)) / elapsed

    return others


def default_target_ms(device: str) -> float:
    return DEFAULT_TARGET_STEP_MS["cuda" if device.startswith("cuda") else "cpu"]


def _prefill_ms(engine: LLMEngine, n: int, tag: str) -> float:
    """Wall time of one step that prefills ``n`` prompt tokens and samples one token."""
    engine.add_request(f"\0sizing-{tag}", [(i * 7919) % engine.vocab_size for i in range(n)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=_SALT + tag)
    start = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - start) * 1000.0
    while engine.has_unfinished():  # reports the finish (and would run anything left, which nothing is)
        engine.step()
    return elapsed


def _probe(engine: LLMEngine, round_: int, repeats: int, stop: Callable[[], bool]) -> ProbeTimes | None:
    """Time the probes (short and long, ``repeats`` each, alternating) in one step each; None if ``stop`` said
    so between two of them. The engine's budget is restored and its counters and prefix cache are as before."""
    long_n = max(_SHORT + 1, min(_LONG, engine.max_model_len - 1))
    budget = engine.scheduler.config.max_num_batched_tokens
    engine.set_token_budget(max(long_n, budget))  # a probe in one step
    short, long = float("inf"), float("inf")
    others = _watch()
    try:
        for i in range(repeats):
            for n in (_SHORT, long_n):
                if stop():
                    return None
                with engine.uncounted():  # each probe: its blocks are the next one's, not a tenant's prefix
                    ms = _prefill_ms(engine, n, f"{'s' if n == _SHORT else 'l'}{round_}.{i}")
                short, long = (min(short, ms), long) if n == _SHORT else (short, min(long, ms))
    finally:
        engine.set_token_budget(budget)
    return ProbeTimes(short, long, long_n, others())


def fit(times: ProbeTimes, target_ms: float, max_num_seqs: int) -> StepSizing:
    """The budget from the probe times: the largest prefill chunk under the target, plus the decodes."""
    per_token = max((times.long_ms - times.short_ms) / (times.long_n - _SHORT), 1e-6)
    fixed = max(0.0, times.short_ms - per_token * _SHORT)
    chunk = max(MIN_PREFILL_CHUNK, int((target_ms - fixed) / per_token))
    return StepSizing(min(CEILING, max_num_seqs + chunk), fixed, per_token, target_ms)


def measure(engine: LLMEngine, target_ms: float, max_num_seqs: int) -> tuple[StepSizing, ProbeTimes]:
    """Start-up's probe (nothing else runs yet, so nothing stops it) and the budget it gives."""
    times = _probe(engine, 0, _START_REPEATS, lambda: False)
    if times is None:  # cannot happen: nothing stops it
        raise RuntimeError("start-up step sizing was interrupted")
    engine.reset_counters()  # nothing before this was traffic (a warm-up)
    return fit(times, target_ms, max_num_seqs), times


def apply(engine: LLMEngine, budget: int) -> None:
    """Give the engine's steps this token budget."""
    engine.set_token_budget(budget)


class Resizer:
    """Probes again while the engine is idle where start-up's probes were contended, until a round runs on a quiet
    machine (or ``RESIZE_MAX_ROUNDS``), and keeps the fastest times seen.

    Owned by the engine thread, which calls ``maybe_run`` when it has been idle; pure timing logic besides the
    probes themselves, so the schedule is testable with a fake clock."""

    def __init__(self, sizing: StepSizing, times: ProbeTimes, max_num_seqs: int,
                 clock: Callable[[], float] = time.monotonic,
                 jitter: Callable[[], float] = lambda: _ENTROPY.uniform(0.0, RESIZE_JITTER)) -> None:
        self.sizing, self.times, self.max_num_seqs, self.clock = sizing, times, max_num_seqs, clock
        self.jitter = jitter
        self._started = clock()
        self.rounds = 0  # rounds completed (an interrupted one is tried again at the next idle time)
        self.pending = times.contended  # a quiet start-up measured the machine: nothing to correct
        self._next = RESIZE_FIRST_S * (1.0 + jitter())  # seconds after start

    def due(self, idle_s: float) -> bool:
        return self.pending and idle_s >= RESIZE_IDLE_S and self.clock() - self._started >= self._next

    def maybe_run(self, engine: LLMEngine, idle_s: float, stop: Callable[[], bool]) -> StepSizing | None:
        """Probe if due; the new sizing when it gives a different budget (already applied), else None."""
        if not self.due(idle_s):
            return None
        times = _probe(engine, self.rounds + 1, _IDLE_REPEATS, stop)
        if times is None:
            return None
        self.rounds += 1
        self.times = self.times.best(times)
        self.pending = times.contended and self.rounds < RESIZE_MAX_ROUNDS
        self._next = self.clock() - self._started + RESIZE_FIRST_S * 2 ** self.rounds * (1.0 + self.jitter())
        sizing = fit(self.times, self.sizing.target_ms, self.max_num_seqs)
        if sizing.max_num_batched_tokens == self.sizing.max_num_batched_tokens:
            return None
        self.sizing = sizing
        apply(engine, sizing.max_num_batched_tokens)
        return sizing
