"""The decode thread adapter (qllama/threads.py): its choices under made-up step times (no wall
clock anywhere), and that generation with it gives the same greedy tokens as fixed threads."""

from __future__ import annotations

import numba
import pytest

from qllama.runtime.threads import IdleMeter, ThreadAdapter, adapter_for


class FakeIdle:
    """An idle meter that reports whatever the test sets."""

    def __init__(self, value: float | None = 0.0):
        self.value, self.reads = value, 0

    def idle_cpus(self):
        self.reads += 1
        return self.value


def drive(adapter: ThreadAdapter, cost, steps: int, start: int = 0, idle: FakeIdle | None = None, idle_at=None):
    """Run `steps` decode steps; cost(n_threads, step) gives each step's seconds. Returns the
    thread count of every step."""
    used = []
    for i in range(start, start + steps):
        if idle is not None and idle_at is not None:
            idle.value = idle_at(i)
        n = adapter.choose()
        adapter.observe(n, cost(n, i))
        used.append(n)
    return used


IDLE = lambda n, i: {2: 0.010, 1: 0.013}[n]  # noqa: E731  two threads win by 23%
BUSY = lambda n, i: {2: 0.300, 1: 0.015}[n]  # noqa: E731  a second thread waits for a slice at every region
SLIGHT = lambda n, i: {2: 0.0100, 1: 0.0104}[n]  # noqa: E731  within the margin


def test_stays_at_max_threads_when_they_are_faster():
    a = ThreadAdapter([2, 1])
    used = drive(a, IDLE, 2000)
    assert a.current == 2 and a.switches == 0
    assert used[0] == 2
    assert used.count(1) == a.probes  # 30% slower is clearly slower (> 3 x margin): each probe stops after 1 step
    assert 3 <= a.probes <= 15  # probes keep coming, ever further apart
    starts = [i for i, n in enumerate(used) if n == 1 and used[i - 1] == 2]  # where each probe began
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 256  # ever further apart, up to max_gap


def test_switches_to_one_thread_when_it_is_faster_and_stays():
    a = ThreadAdapter([2, 1], idle=FakeIdle(0.0))
    used = drive(a, BUSY, 3000)
    assert used[:2] == [2, 1]  # one step at the start count, then an immediate probe
    assert a.current == 1 and a.switches == 1
    # later probes of 2 threads cost at most `budget` of the time at 1 thread
    probe_time = sum(0.300 for n in used[2:] if n == 2)
    assert 0 < probe_time <= 0.05 * 0.015 * used[2:].count(1) + 0.300


def test_no_switch_within_the_margin():
    a = ThreadAdapter([2, 1], margin=0.08)
    used = drive(a, SLIGHT, 1000)
    assert a.current == 2 and a.switches == 0 and a.probes >= 3
    assert used.count(1) == 3 * a.probes  # 4% slower is not clearly slower: each probe runs its 3 steps


def test_switch_back_when_two_threads_recover_by_periodic_probe():
    a = ThreadAdapter([2, 1])  # no idle meter: only the periodic (budgeted) probes
    drive(a, BUSY, 500)
    assert a.current == 1
    used = drive(a, IDLE, 3000, start=500)
    assert a.current == 2 and a.switches == 2
    assert used.index(2) < 2000  # within the budgeted wait (300 ms lost / 5% = 6 s of 13 ms steps ~ 460)


def test_idle_cpu_triggers_an_early_probe():
    idle = FakeIdle(0.0)
    a = ThreadAdapter([2, 1], idle=idle)
    drive(a, BUSY, 500, idle=idle, idle_at=lambda i: 0.0)
    assert a.current == 1
    cost = lambda n, i: (BUSY if i < 600 else IDLE)(n, i)  # noqa: E731  the load goes away at step 600
    used = drive(a, cost, 200, start=500, idle=idle, idle_at=lambda i: 0.0 if i < 600 else 1.0)
    first_two = 500 + used.index(2, 100)
    assert a.current == 2
    assert first_two - 600 <= 40  # 0.25 s of 13 ms steps between idle readings, plus the probe gap


def test_idle_meter_is_not_read_at_max_threads():
    idle = FakeIdle(1.0)
    a = ThreadAdapter([2, 1], idle=idle)
    drive(a, IDLE, 500)
    assert idle.reads == 0  # only consulted while running fewer threads than allowed


def test_slowdown_at_current_count_triggers_a_probe():
    a = ThreadAdapter([2, 1], max_gap=256)
    drive(a, IDLE, 1500)  # probes far apart by now
    cost = lambda n, i: BUSY(n, i) if i >= 1500 else IDLE(n, i)  # noqa: E731  load arrives at 1500
    used = drive(a, cost, 40, start=1500)
    assert a.current == 1
    assert used.index(1) <= 10  # within a window of slow steps, not after the long gap


def test_probe_outside_choice_is_ignored_and_foreign_counts_do_not_count():
    a = ThreadAdapter([2, 1])
    n = a.choose()
    a.observe(n, 0.01)
    a.observe(7, 5.0)  # a step at a count the adapter did not choose: ignored
    assert a.estimate() == pytest.approx(0.01)


def test_three_candidates_round_robin():
    a = ThreadAdapter([4, 2, 1])
    cost = lambda n, i: {4: 0.030, 2: 0.010, 1: 0.020}[n]  # noqa: E731
    drive(a, cost, 400)
    assert a.current == 2


def test_run_times_the_step_at_the_count_it_chose():
    a = ThreadAdapter([2, 1])
    ticks = iter([0.0, 0.010, 1.0, 1.300, 2.0, 2.015, 3.0, 3.015])  # a fake clock: two reads per step
    used = []

    def step(n):
        used.append(n)
        return "x"

    out = [a.run(step, clock=lambda: next(ticks)) for _ in range(2)]
    assert out == ["x", "x"]
    assert used == [2, 1]  # step 1 at 2 threads; step 2 probes 1 thread
    assert a.current == 2  # 1 thread took 0.3 s vs 0.01 s: lost at once


def test_adapter_for_and_bad_candidates():
    assert adapter_for(1) is None
    assert adapter_for(2).candidates == [2, 1]
    assert adapter_for(8).candidates == [8, 4, 1]
    with pytest.raises(ValueError):
        ThreadAdapter([0])


def test_idle_meter_reads_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3\n")
    m = IdleMeter(str(stat))
    stat.write_text("cpu  200 0 200 1400 0 0 0 0 0 0\ncpu0 1 2 3\n")  # 600 idle ticks of 800
    import os

    assert m.idle_cpus() == pytest.approx((os.cpu_count() or 1) * 0.75)
    assert m.idle_cpus() is None  # no ticks since: unknown
    assert IdleMeter(str(tmp_path / "missing")).idle_cpus() is None


# -- end to end: the same greedy tokens whatever the thread count ------------------------------------------


def test_greedy_generation_is_identical_with_adaptation(monkeypatch):
    """A default-threads model (adaptive) forced to switch counts every few steps decodes the
    same greedy tokens as one fixed at 1 thread (kernels split rows, never a sum)."""
    import qllama

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba's pool has a single thread")
    fixed = qllama.load("demo", n_ctx=128, n_threads=1)
    ref = fixed.complete("ROMEO:", max_tokens=60, temperature=0)
    ref_ids = list(fixed.session.tokens)

    model = qllama.load("demo", n_ctx=128, n_threads=None)
    a = model.session.threads
    if a is None:
        pytest.skip("one physical core: nothing to adapt")
    assert isinstance(a.idle, IdleMeter)
    a.idle = None  # the machine's real idle time would make the switching pattern vary
    # a cost that flips which count is faster every 10 steps, so the adapter keeps switching
    step = {"i": 0}
    seen = []

    def fake_observe(orig=a.observe):
        def observe(n, seconds):
            step["i"] += 1
            seen.append((n, numba.get_num_threads()))
            fast = 1 if (step["i"] // 10) % 2 else a.max_threads
            orig(n, 0.01 if n == fast else 0.05)
        return observe

    monkeypatch.setattr(a, "observe", fake_observe())
    out = model.complete("ROMEO:", max_tokens=60, temperature=0)
    assert out == ref
    assert list(model.session.tokens) == ref_ids
    assert a.switches >= 2 and {n for n, _ in seen} == {1, a.max_threads}
    assert all(n == live for n, live in seen)  # the kernels ran at the chosen count (each round sets its own)
    t = model.last_timings
    assert t.decode_threads == a.describe() and f"decode threads   = {a.current} (adaptive" in t.report()


def test_explicit_threads_do_not_adapt():
    import qllama

    m = qllama.load("demo", n_ctx=64, n_threads=2)
    assert m.session.threads is None
    m.complete("ROMEO:", max_tokens=3, temperature=0)
    assert m.last_timings.decode_threads == "" and "decode threads" not in m.last_timings.report()
    assert qllama.load("demo", n_ctx=64, n_threads=1).session.threads is None


def test_short_prompt_batches_follow_the_decode_count_long_ones_use_every_thread():
    a = ThreadAdapter([2, 1], small_batch=16)
    drive(a, BUSY, 50)
    assert a.current == 1
    assert a.batch_threads(1) == a.batch_threads(16) == 1 and a.batch_threads(17) == 2
    assert a.run_batch(8, lambda n: ("short", n)) == ("short", 1)  # the decode count
    assert a.run_batch(512, lambda n: ("long", n)) == ("long", 2)  # every thread
    probes = a.probes
    a.run_batch(8, lambda n: None)
    assert a.probes == probes and a.estimate() == pytest.approx(0.015)  # batches teach the adapter nothing


def test_slowdown_at_the_fewest_threads_does_not_probe_more():
    a = ThreadAdapter([2, 1])
    drive(a, BUSY, 300)
    assert a.current == 1
    probes = a.probes
    heavier = lambda n, i: {2: 0.300, 1: 0.045}[n]  # noqa: E731  1 thread slows 3x: more load, 2 threads no help
    used = drive(a, heavier, 30, start=300)
    assert used == [1] * 30 and a.probes == probes


class FakeMeter(FakeIdle):
    """A meter that also reports the CPUs other processes kept busy."""

    def __init__(self, others: float | None, n_cpu: int = 2):
        super().__init__(0.0)
        self.others, self.n_cpu = others, n_cpu

    def others_cpus(self, min_seconds: float = 0.2, max_seconds: float | None = None):
        self.reads += 1
        return self.others


@pytest.mark.parametrize("others, start", [(1.0, 1), (0.6, 1), (0.3, 2), (None, 2)])
def test_first_step_starts_low_when_other_processes_hold_a_cpu(others, start):
    a = ThreadAdapter([2, 1], idle=FakeMeter(others))
    used = drive(a, BUSY if start == 1 else IDLE, 12)
    assert used[0] == start
    if start == 1:  # no immediate probe of 2 threads: the first comes after the gap
        assert used[:8] == [1] * 8 and a.switches == 0
    else:
        assert used[1] == 1  # the usual immediate comparison


def _meter_on_fake_stat(tmp_path, monkeypatch):
    """(stat file, IdleMeter reading it, the clock dict its own CPU and wall time come from): 2 CPUs,
    first reading 100 busy + 100 idle ticks at CPU 0 s, wall 0 s."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\n")
    m = IdleMeter(str(stat))
    m.n_cpu = 2
    clock = {"cpu": 0.0, "wall": 0.0}
    monkeypatch.setattr(IdleMeter, "_own_now", staticmethod(lambda: (clock["cpu"], clock["wall"])))
    m._own = (0.0, 0.0)
    return stat, m, clock


def test_idle_meter_others_excludes_own_cpu(tmp_path, monkeypatch):
    stat, m, clock = _meter_on_fake_stat(tmp_path, monkeypatch)
    stat.write_text("cpu  250 0 0 150 0 0 0 0 0 0\n")  # 150 busy of 200 ticks: 1.5 CPUs busy
    clock.update(cpu=0.5, wall=1.0)  # of which this process used 0.5 CPU
    assert m.others_cpus() == pytest.approx(1.0)
    clock.update(wall=1.1)
    assert m.others_cpus() is None  # under min_seconds since the last reading


def test_a_short_first_prompt_already_starts_low():
    a = ThreadAdapter([2, 1], idle=FakeMeter(1.0), small_batch=16)
    assert a.batch_threads(512) == 2  # a long prompt keeps every thread, and does not consult the meter
    assert a.batch_threads(5) == 1  # a short one: others hold a CPU, so 1 thread, and decoding starts there
    assert drive(a, BUSY, 3) == [1, 1, 1]


def test_idle_meter_that_misleads_costs_ever_less():
    idle = FakeIdle(1.0)  # claims a free CPU, but 2 threads stay slow
    a = ThreadAdapter([2, 1], idle=idle)
    used = drive(a, BUSY, 4000, idle=idle, idle_at=lambda i: 1.0)
    assert a.current == 1
    starts = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 4 and gaps[:4] == sorted(gaps[:4]) and gaps[3] > gaps[0]  # ever further apart
    probe_time = 0.300 * used.count(2)
    assert probe_time <= 0.10 * 0.015 * used.count(1) + 2 * 0.300  # converges to the budget (5%), here < 10%


def test_load_at_max_threads_steps_down_by_the_meter_when_probes_lose():
    """The load arrives while 2 threads run; a probe of 1 thread loses (its thread shares the busy
    core at first), but the meter sees another process holding a CPU: 1 thread all the same."""
    meter = FakeMeter(0.0)
    a = ThreadAdapter([2, 1], idle=meter, max_gap=256)
    drive(a, IDLE, 1500)
    assert a.current == 2 and a.switches == 0
    meter.others = 1.0  # from here, another process holds a CPU
    shared = lambda n, i: 0.400 if n == 1 and i < 1505 else BUSY(n, i)  # noqa: E731  1 thread: slower than 2 at first
    current = []
    for i in range(1500, 1700):
        drive(a, shared, 1, start=i)
        current.append(a.current)
    assert a.current == 1 and a.switches == 1
    assert current.index(1) < 30  # within a few readings (the probe that lost would wait out its gap)


def test_meter_alone_does_not_step_down_without_a_slowdown():
    meter = FakeMeter(1.0)  # claims others hold a CPU, but 2 threads stay as fast as ever
    a = ThreadAdapter([2, 1], idle=meter)
    meter.others = 0.0  # (the start reading sees none)
    drive(a, IDLE, 50)
    meter.others = 1.0
    drive(a, IDLE, 1000, start=50)
    assert a.current == 2 and a.switches == 0 and meter.reads > 10


def test_idle_meter_others_restarts_after_a_pause(tmp_path, monkeypatch):
    stat, m, clock = _meter_on_fake_stat(tmp_path, monkeypatch)
    stat.write_text("cpu  300 0 0 100 0 0 0 0 0 0\n")  # all busy for 5 s while this process slept
    clock.update(wall=5.0)
    assert m.others_cpus(max_seconds=1.0) is None  # a pause: the window restarts
    stat.write_text("cpu  350 0 0 150 0 0 0 0 0 0\n")  # then half busy, all of it this process's
    clock.update(cpu=0.5, wall=5.5)
    assert m.others_cpus(max_seconds=1.0) == pytest.approx(0.0)
