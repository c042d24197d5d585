"""Thread count for one-token decode steps, adapted online to how busy the machine is.

Why: every Numba parallel region (a `prange`) ends in a barrier that waits for all of its
threads. When another process holds a core, the second thread waits for a scheduler slice at
every region (a few hundred per token). With libgomp's default spin (some ms) the first thread
held its core meanwhile, and decoding fell to 0.05-0.1x of one thread; qllama's shorter spin
(`qllama.kernels.jit.GOMP_SPINCOUNT`) removed that collapse, so a fixed count now degrades only
by its share of the cores. Numba's OpenMP layer still cannot skip a thread that has not started,
so the default thread count adapts (measurements: docs/measurements.md).

`ThreadAdapter` is that choice, made from wall times: it decodes at its current count, and now
and then probes the other candidates for a few tokens, switching when one is clearly faster
(`margin`). It starts at the largest count (best on an idle machine). It probes early, again
soon when its own tokens slow down (load arrived), and otherwise at a growing interval while
probes keep losing, bounded so a losing probe costs at most `budget` of the decode time (a
probe of 2 threads under load can take 40 one-thread tokens). While it runs fewer threads than
it may, it also watches the machine's idle CPU time (`/proc/stat`): when at least half a core
sits idle, it probes the larger count without waiting for that bound, so it recovers within
a second or so of the load going away. At the largest count it reads the CPU time of other
processes instead: when its tokens have slowed by `slowdown` and others hold enough CPU that
fewer threads fit beside them, it steps down at once, without a probe. (A probe alone can lose by chance: the one remaining thread may share the busy core until the
scheduler moves it.) Greedy tokens do not depend on
the thread count (every kernel splits rows, never a sum), so switching changes speed only.

Prompt batches read the meter before each batch and run on the cores other processes left
free (`batch_threads`): a prompt's regions are longer than a decode step's, but with a core held
elsewhere a thread still waits a scheduler slice at each of them (measured: 2 threads evaluated a
prompt at 0.15x one thread beside a busy loop). A short batch (a chat turn's few new tokens,
`small_batch`) runs at the decode count, whose regions it resembles. The server's steps (several
requests per forward pass) use `StepThreads`: one adapter per number of requests in the step,
on one shared meter. An explicit thread count (`-t N`, `n_threads=N`) means no adapter: fixed N.

The decision logic (`choose`, `observe`) reads no clock (the idle meter is passed in), so tests
drive it with made-up step times and a fake meter; `ThreadAdapter.run` is the timed wrapper the session uses.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from typing import Callable, Sequence

__all__ = ["ThreadAdapter", "IdleMeter", "StepThreads", "adapter_for", "step_threads_for"]


class IdleMeter:
    """Idle CPUs of the whole machine, and CPUs busy with other processes, averaged between two
    readings of /proc/stat (Linux) and of this process's CPU time."""

    def __init__(self, path: str = "/proc/stat"):
        self.path = path
        self.n_cpu = os.cpu_count() or 1
        self._last = self._read()
        self._own = self._own_now()
        self.last_others: float | None = None  # the last `others_cpus` value (shared by its readers)

    def _read(self) -> tuple[int, int] | None:
        """(idle ticks, all ticks) summed over CPUs, or None where /proc/stat is unreadable."""
        try:
            with open(self.path) as f:
                fields = f.readline().split()
            ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
            return ticks[3] + (ticks[4] if len(ticks) > 4 else 0), sum(ticks)  # idle + iowait, total
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _own_now() -> tuple[float, float]:
        t = os.times()
        return t.user + t.system, time.monotonic()  # this process's CPU seconds (every thread), wall

    def others_now(self, samples: int = 4, gap: float = 0.001) -> float | None:
        """CPUs other processes want right now: the machine's runnable threads (`procs_running`)
        less this process's running ones, at most every CPU (None: unknown). No window, so it
        answers when `others_cpus` cannot yet (a meter just made, or a window that would reach back
        over a pause). While it sees others it looks again, up to `samples` times `gap` seconds
        apart, and keeps the fewest: a process that has just finished (its threads still spinning
        for a millisecond) does not count, a busy one does."""
        fewest = None
        for i in range(samples):
            if i:
                time.sleep(gap)
            try:
                with open(self.path) as f:
                    running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
                own = self._own_running()
            except (OSError, ValueError, IndexError, StopIteration):
                return fewest
            now = float(min(self.n_cpu, max(0, running - max(1, own))))
            fewest = now if fewest is None else min(fewest, now)
            if fewest < 0.5:
                break
        return fewest

    @staticmethod
    def _own_running() -> int:
        """This process's threads in state R (running or runnable), the caller included."""
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as f:
                    own += f.read().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                continue
        return own

    def idle_cpus(self) -> float | None:
        """CPUs idle on average since the previous reading (None: unknown, or too short to tell)."""
        now = self._read()
        last, self._last = self._last, now
        self._own = self._own_now()
        if now is None or last is None or now[1] <= last[1]:
            return None
        return self.n_cpu * (now[0] - last[0]) / (now[1] - last[1])

    def others_cpus(self, min_seconds: float = 0.2, max_seconds: float | None = None) -> float | None:
        """CPUs kept busy by other processes on average since the previous reading: the machine's
        busy time less this process's CPU time (None: unknown, or under min_seconds apart; or over
        max_seconds apart, when the window restarts now: it would average over a pause)."""
        now, (own, wall) = self._read(), self._own_now()
        last, (own0, wall0) = self._last, self._own
        if max_seconds is not None and wall - wall0 > max_seconds:
            self._last, self._own = now, (own, wall)
            return None
        if now is None or last is None or wall - wall0 < min_seconds or now[1] <= last[1]:
            return None
        self._last, self._own = now, (own, wall)
        busy = self.n_cpu * (1.0 - (now[0] - last[0]) / (now[1] - last[1]))
        self.last_others = max(0.0, busy - (own - own0) / (wall - wall0))
        return self.last_others


class ThreadAdapter:
    """Picks the thread count of each decode step among `candidates` from measured step times.

    candidates: thread counts to choose from; the largest is the start and the prefill count.
    margin: a probed count must be this much faster (fraction) than the current one to switch.
    probe_tokens: steps a probe runs (fewer if its first step is already clearly slower).
    first_gap / max_gap: steps between probes: first_gap after a start or a switch, doubling
        after each losing probe up to max_gap.
    budget: a losing probe's extra time is at most this fraction of the time between probes.
    slowdown: when the current count's recent median exceeds its median at the last decision by
        this factor, the next probe comes at once (load arrived; only while fewer threads are left
        to try: at the fewest, more threads would not help against more load).
    window: steps of the current count whose median is its estimate.
    small_batch: prompt batches up to this many tokens run at the decode count (`batch_threads`);
        longer ones at the count that fits beside other processes, a CPU being free while they
        hold less than `batch_slack` of it.
    recent_seconds: a later request's first step (`new_request`) reads the meter over at most
        this many seconds, else the processes running at that instant.
    idle: an `IdleMeter` (or anything with `idle_cpus() -> float | None`), read at most every
        `idle_every` seconds of decoding while below the largest count, and, if it also has
        `others_cpus` and `n_cpu`, as often at the largest count; None: not used.
    """

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        margin: float = 0.08,
        probe_tokens: int = 3,
        first_gap: int = 8,
        max_gap: int = 256,
        budget: float = 0.05,
        slowdown: float = 1.5,
        window: int = 5,
        idle=None,
        idle_every: float = 0.25,
        idle_cpus: float = 0.5,
        small_batch: int = 16,
        batch_slack: float = 0.25,
        recent_seconds: float = 1.0,
    ):
        cands = sorted({int(c) for c in candidates}, reverse=True)
        if not cands or cands[-1] < 1:
            raise ValueError(f"thread candidates must be positive integers, got {list(candidates)!r}")
        self.candidates = cands
        self.max_threads = cands[0]
        self.margin, self.probe_tokens, self.budget, self.slowdown = margin, probe_tokens, budget, slowdown
        self.first_gap, self.max_gap = first_gap, max_gap
        self.current = self.max_threads
        self.switches = 0  # how often the current count changed (for reports and tests)
        self.probes = 0  # probes started
        self._recent: deque[float] = deque(maxlen=window)  # step seconds at the current count
        self._reference = 0.0  # the current count's median when it was last chosen or confirmed
        self._gap = first_gap  # steps at the current count before the next probe
        self._since = 0  # steps at the current count since the last probe (or switch)
        self._time_since = 0.0  # their seconds
        self._cooldown_s = 0.0  # the last losing probe's extra seconds / budget: wait at least this long
        self._next_alt = 0  # round robin over the other candidates
        self._probe: int | None = None  # the count being probed, if a probe runs
        self._probe_times: list[float] = []
        self.idle, self.idle_every, self.idle_threshold = idle, idle_every, idle_cpus
        self.small_batch, self.batch_slack = small_batch, batch_slack
        self.last_batch = self.max_threads  # the count of the last long batch (for reports)
        self.long_batches = 0  # long batches run (their counts came from the meter)
        self._idle_clock = 0.0  # decode seconds since the idle meter was last read
        self._started = False  # the first probe comes after one step (the load is unknown at start)
        self._checked_start = False  # whether the first step looked at the meter
        self._idle_probe = False  # the running probe was started by the idle meter
        self._low_start = False  # started below the largest count by the meter, no switch since
        self._idle_misses = 0  # idle-started probes lost since the last switch
        self._best = 0.0  # the current count's fastest median since it was chosen
        self._later = False  # a request after the first (`new_request`)
        self.recent_seconds = recent_seconds

    # -- the decision (pure: no clock, no Numba) ---------------------------------------------

    def choose(self) -> int:
        """The thread count for the next step."""
        self._check_start()
        if self._probe is None and len(self.candidates) > 1 and self._due():
            others = [c for c in self.candidates if c != self.current]
            self._probe = others[self._next_alt % len(others)]
            self._next_alt += 1
            self._probe_times = []
            self.probes += 1
        return self._probe if self._probe is not None else self.current

    def observe(self, n_threads: int, seconds: float) -> None:
        """Record that the step chosen last (`n_threads`) took `seconds` of wall time."""
        if self._probe is not None and n_threads == self._probe:
            self._probe_times.append(seconds)
            est = self.estimate()
            lost = est > 0 and seconds > est * (1.0 + 3 * self.margin)  # clearly slower: no need for more steps
            if lost or len(self._probe_times) >= self.probe_tokens:
                self._decide()
            return
        if n_threads != self.current:  # a step run outside our choice: not ours to learn from
            return
        self._recent.append(seconds)
        self._since += 1
        self._time_since += seconds
        self._idle_clock += seconds
        if len(self._recent) == self._recent.maxlen:
            est = self.estimate()
            self._reference = self._reference or est
            self._best = min(self._best, est) if self._best else est
            if self.current == self.max_threads and self._idle_clock >= self.idle_every:
                self._idle_clock = 0.0
                self._step_down_if_loaded(est)

    def estimate(self) -> float:
        """Median step seconds at the current count (0 before the first step)."""
        return statistics.median(self._recent) if self._recent else 0.0

    def _due(self) -> bool:
        if not self._recent:
            return False
        if not self._started:  # one step at the start count, then compare at once
            self._started = True
            return True
        est = self.estimate()
        slowed = self._reference and len(self._recent) == self._recent.maxlen and est > self._reference * self.slowdown
        if slowed and self.current > self.candidates[-1]:  # load arrived: fewer threads may help, probe soon
            return self._time_since >= self._cooldown_s * 0.25  # (still bounded by the last losing probe)
        # idle CPU seen: probe before the cooldown ends, but each such probe that loses (the meter
        # misled) doubles the share of the cooldown the next one waits: 1/8, 1/4, 1/2, all of it
        wait = self._cooldown_s * min(1.0, 0.125 * 2 ** self._idle_misses)
        if self._since < self._gap:
            # started low by the meter: no timed probe before max_gap steps (a probe of more
            # threads beside a busy core can cost as much as ten steps, and a short request would
            # pay for it), only an idle-CPU one, after first_gap steps
            if self._low_start and self._since >= self.first_gap and self._time_since >= wait and self._spare_cpu():
                self._idle_probe = True
                return True
            return False
        if self._time_since >= self._cooldown_s:
            return True
        if self.current < self.max_threads and self._time_since >= wait and self._spare_cpu():
            self._idle_probe = True
            return True
        return False

    def _check_start(self) -> None:
        """Once per request, before its first step or short prompt batch: the start count from
        the meter (at the first request of a session only fewer threads than the largest count)."""
        if not self._checked_start:
            self._checked_start = True
            fit = self._start_fit()
            if fit is None or fit == self.current:
                return
            self._probe, self._probe_times, self._idle_probe = None, [], False  # (a later request's: dropped)
            if fit > self.current:  # a later request on a machine that has room again
                self._switch(fit, [])
                return
            if self._recent:  # a later request: this count's times say nothing of the new one
                self._switch(fit, [])
            self.current = fit  # others hold CPUs: start with fewer threads, probe more when CPU is idle
            self._started = True
            self._gap, self._low_start = self.max_gap, True

    def new_request(self) -> None:
        """A new request (a prompt, a chat turn) begins: its first step reads the meter again, so a
        load that arrived or left between requests is followed from its first token, not after a
        probe or a slowdown within it (a short request would pay for either)."""
        self._checked_start = False
        self._later = True

    def _start_fit(self) -> int | None:
        """The largest count that fits beside the CPUs other processes kept busy since the meter's
        last reading (model load, warm-up, prompt), or None: unknown. For a later request, over at
        most the last `recent_seconds`, else at this instant: a window reaching back over the pause
        between requests would count load that has since gone (or miss load that just came)."""
        if self._later and hasattr(self.idle, "others_now"):
            busy = self.idle.others_cpus(max_seconds=self.recent_seconds)
            if busy is None:  # the pause was longer (or too short to tell): this instant
                busy = self.idle.others_now()
        else:
            busy = self._others()
        return None if busy is None else self._fit(int(self.idle.n_cpu - busy + 0.5))

    def _spare_cpu(self) -> bool:
        """Whether the machine had idle CPU since the last reading (read at most every idle_every s)."""
        if self.idle is None or self._idle_clock < self.idle_every:
            return False
        self._idle_clock = 0.0
        idle = self.idle.idle_cpus()
        return idle is not None and idle >= self.idle_threshold

    def _step_down_if_loaded(self, est: float) -> None:
        """At the largest count, every `idle_every` seconds: if this count's tokens are `slowdown`
        times slower than its best and other processes held CPUs since the last reading, switch
        to the largest count that fits beside them."""
        others = getattr(self.idle, "others_cpus", None)
        if others is None or self._probe is not None:
            return
        busy = others(max_seconds=4 * self.idle_every)  # a longer window spans a pause between requests
        if busy is None or est <= self._best * self.slowdown:
            return
        room = max(1, int(self.idle.n_cpu - busy + 0.5))
        fits = [c for c in self.candidates if c <= room]
        if fits and fits[0] < self.current:
            self._switch(fits[0], [])

    def _switch(self, n: int, times: list[float]) -> None:
        """Make n the current count; `times` are its steps measured so far (a probe's)."""
        self.current = n
        self.switches += 1
        self._low_start = False
        self._since, self._time_since = 0, 0.0
        self._idle_misses = 0
        if self.idle is not None:  # the idle window starts now
            self.idle.idle_cpus()
            self._idle_clock = 0.0
        self._recent.clear()
        self._recent.extend(times)
        self._reference = self._best = 0.0
        self._gap = self.first_gap
        self._cooldown_s = 0.0

    def _decide(self) -> None:
        probe, times = self._probe, self._probe_times
        self._probe, self._probe_times = None, []
        by_idle, self._idle_probe = self._idle_probe, False
        est = self.estimate()
        p = statistics.median(times)
        self._since, self._time_since = 0, 0.0
        if est and p < est * (1.0 - self.margin):  # the probed count wins: switch
            self._switch(probe, times)
        else:  # it lost: wait longer before the next probe, so that losing probes stay cheap
            self._gap = min(self.max_gap, self._gap * 2)
            self._idle_misses = self._idle_misses + 1 if by_idle else self._idle_misses
            extra = sum(times) - est * len(times)
            self._cooldown_s = max(0.0, extra) / self.budget
            self._reference = est

    def batch_threads(self, n_tok: int) -> int:
        """Threads for a batch of n_tok tokens (a prompt): up to `small_batch` tokens its parallel
        regions are short, like a decode step's, so it takes the decode count; a longer batch reads
        the meter before it runs and takes the largest count that fits beside the CPUs other
        processes held (`batch_slack`: a CPU counts as free while others use less than that much
        of it), every thread when the meter cannot tell. Reading the meter costs two small file
        reads, no wait: a short request pays nothing for it."""
        if n_tok <= self.small_batch:
            self._check_start()
            return self.current
        self.long_batches += 1
        others = self._others(min_seconds=0.05)
        if others is None:
            self.last_batch = self.max_threads
        else:
            self.last_batch = self._fit(self.idle.n_cpu - others + self.batch_slack)
        return self.last_batch

    def _others(self, min_seconds: float = 0.2) -> float | None:
        """CPUs other processes held since the meter's last reading; when that was too recent, the
        meter's previous value (`last_others`, shared by every adapter on one meter), or before it
        has one, the processes running at this instant (`others_now`); None: unknown."""
        others = getattr(self.idle, "others_cpus", None)
        if others is None:
            return None
        busy = others(min_seconds=min_seconds)
        if busy is None:
            busy = getattr(self.idle, "last_others", None)
        if busy is None and hasattr(self.idle, "others_now"):  # a meter just made: the instant's count
            busy = self.idle.others_now()
        return busy

    def _fit(self, room: float) -> int:
        """The largest candidate count not above room (at least the fewest)."""
        fits = [c for c in self.candidates if c <= max(1.0, room)]
        return fits[0] if fits else self.candidates[-1]

    def run_batch(self, n_tok: int, step: Callable[[int], object]):
        """step(n) for a batch (not timed: its cost is not a decode step's), n = `batch_threads(n_tok)`."""
        return step(self.batch_threads(n_tok))

    def describe(self) -> str:
        """One line for timings, e.g. "1 (adaptive among 2, 1; 3 probes, 1 switch)"."""
        among = ", ".join(str(c) for c in self.candidates)
        pr = "probe" if self.probes == 1 else "probes"
        sw = "switch" if self.switches == 1 else "switches"
        batches = f"; prompt batches at {self.last_batch}" if self.long_batches else ""
        return f"{self.current} (adaptive among {among}; {self.probes} {pr}, {self.switches} {sw}{batches})"

    # -- the timed wrapper -----------------------------------------------------------------

    def run(self, step: Callable[[int], object], clock: Callable[[], float] = time.perf_counter):
        """step(n) for one decode step at the chosen count n, timed; returns its result."""
        n = self.choose()
        t0 = clock()
        out = step(n)
        self.observe(n, clock() - t0)
        return out


def adapter_for(n_threads: int) -> ThreadAdapter | None:
    """The adapter for a default thread count of `n_threads` (the physical cores): choices
    n_threads and 1 (and half of n_threads on larger machines); None when there is nothing to
    choose from (one thread)."""
    if n_threads <= 1:
        return None
    return ThreadAdapter({n_threads, max(1, n_threads // 2), 1}, idle=IdleMeter())


class StepThreads:
    """Thread counts of the server's steps (`qllama.server.scheduler`): a step runs one segment per
    busy request, and its time depends on how many there are, so each number of segments (up to
    `max_group`; more count as that many) has its own `ThreadAdapter`, all on one meter (so a new
    adapter starts from the load the others saw). A step whose segments are all one token is a
    decode step (timed, `ThreadAdapter.run`); a step with prompt tokens is a batch
    (`ThreadAdapter.run_batch`: the meter decides when it is long)."""

    def __init__(self, candidates: Sequence[int], idle=None, max_group: int = 8, **kw):
        self.candidates, self.idle, self.max_group, self.kw = list(candidates), idle, max_group, kw
        self.adapters: dict[int, ThreadAdapter] = {}

    def adapter(self, n_seq: int) -> ThreadAdapter:
        k = max(1, min(n_seq, self.max_group))
        a = self.adapters.get(k)
        if a is None:
            a = self.adapters[k] = ThreadAdapter(self.candidates, idle=self.idle, **self.kw)
        return a

    def run(self, n_seq: int, n_tok: int, step: Callable[[int], object], clock: Callable[[], float] = time.perf_counter):
        """step(n) for a step of n_seq segments holding n_tok tokens in all, at the chosen count n."""
        a = self.adapter(n_seq)
        if n_tok == n_seq:  # one token each: a decode step
            return a.run(step, clock)
        return a.run_batch(n_tok, step)

    def describe(self) -> str:
        """e.g. "1 seq: 1 (adaptive among 2, 1; ...); 4 seq: 1 (...)"."""
        return "; ".join(f"{k} seq: {a.describe()}" for k, a in sorted(self.adapters.items()))


def step_threads_for(n_threads: int) -> StepThreads | None:
    """The server's step adapter for a default thread count of `n_threads` (as `adapter_for`)."""
    if n_threads <= 1:
        return None
    return StepThreads(sorted({n_threads, max(1, n_threads // 2), 1}), idle=IdleMeter())
