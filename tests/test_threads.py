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


def test_a_new_request_follows_load_that_arrived_between_requests():
    """A persistent session (a chat, a library caller): the load arrives after a request at two
    threads; the next request's first step reads the meter and runs at one thread, with no probe
    of two (a short request would pay for it); when the load is gone, the next one is back at two."""
    meter = FakeMeter(0.0)
    a = ThreadAdapter([2, 1], idle=meter)
    drive(a, IDLE, 50)
    assert a.current == 2
    meter.others = 1.0
    a.new_request()
    assert drive(a, BUSY, 8, start=50) == [1] * 8
    meter.others = 0.0
    a.new_request()
    assert drive(a, IDLE, 3, start=58)[0] == 2
    without = ThreadAdapter([2, 1], idle=FakeMeter(0.0))  # the same load, no new request: 2 threads first
    drive(without, IDLE, 50)
    without.idle.others = 1.0
    assert drive(without, BUSY, 1, start=50) == [2]


class PausedMeter(FakeMeter):
    """A meter whose window reached back over a long pause (others_cpus: None) and whose instant
    reading says what runs now."""

    def __init__(self, now: float):
        super().__init__(None)
        self.now = now

    def others_now(self):
        return self.now


def test_a_later_request_after_a_pause_reads_the_load_at_this_instant():
    """The windowed reading is stale after a pause between requests (other work came and went):
    a later request starts from what runs at this instant, both ways."""
    meter = PausedMeter(0.0)
    a = ThreadAdapter([2, 1], idle=meter)
    drive(a, IDLE, 50)
    meter.now = 1.0
    a.new_request()
    assert drive(a, BUSY, 4, start=50) == [1] * 4
    meter.now = 0.0
    a.new_request()
    assert drive(a, IDLE, 1, start=54) == [2]


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


# -- every path: prompt batches, the server's steps, bench ---------------------------------------------


@pytest.mark.parametrize("others, threads", [(1.0, 1), (0.5, 1), (0.3, 1), (0.2, 2), (0.0, 2), (None, 2)])
def test_long_prompt_batches_run_on_the_cores_other_processes_left(others, threads):
    meter = FakeMeter(others)
    a = ThreadAdapter([2, 1], idle=meter, small_batch=16)
    assert a.batch_threads(512) == threads and a.last_batch == threads
    assert meter.reads == 1  # read before the batch: no probe, no wait


def test_each_long_batch_reads_the_meter_again():
    meter = FakeMeter(1.0)
    a = ThreadAdapter([2, 1], idle=meter)
    assert a.run_batch(512, lambda n: n) == 1
    meter.others = 0.0  # the load went away
    assert a.run_batch(512, lambda n: n) == 2
    meter.others = 1.0
    assert a.run_batch(512, lambda n: n) == 1


class SharedMeter(FakeMeter):
    """A meter that answers only when its window is long enough (every other read here), and
    remembers its last answer, as IdleMeter does."""

    def __init__(self, others, n_cpu=2):
        super().__init__(others, n_cpu)
        self.last_others = None

    def others_cpus(self, min_seconds: float = 0.2, max_seconds: float | None = None):
        self.reads += 1
        if self.reads % 2 == 0:
            return None  # too soon after the previous reading
        self.last_others = self.others
        return self.others


def test_decoding_after_a_long_prompt_starts_from_the_prompts_reading():
    """The prompt's batch read the meter just before; the first decode step's reading comes too
    soon to tell, so it takes the meter's last value: the first token already runs at 1 thread."""
    a = ThreadAdapter([2, 1], idle=SharedMeter(1.0))
    assert a.batch_threads(512) == 1
    assert drive(a, BUSY, 8) == [1] * 8


def test_prompt_batches_pick_every_thread_on_an_idle_machine_and_tokens_need_no_probe():
    a = ThreadAdapter([2, 1], idle=SharedMeter(0.0))
    assert a.batch_threads(512) == 2
    used = drive(a, IDLE, 20)
    assert used[0] == 2 and a.current == 2


def _fake_clock_step(cost, clock, used):
    """A step that records its count and advances the fake clock by cost(n)."""
    def step(n):
        used.append(n)
        clock["t"] += cost(n)
        return n
    return step


def test_server_steps_adapt_per_number_of_requests_on_a_busy_machine():
    from qllama.runtime.threads import StepThreads

    meter = SharedMeter(1.0)
    st = StepThreads([2, 1], idle=meter)
    clock = {"t": 0.0}
    now = lambda: clock["t"]  # noqa: E731
    used = []
    cost = lambda n: {2: 0.300, 1: 0.015}[n]  # noqa: E731
    st.run(2, 2 * 40, _fake_clock_step(cost, clock, used), now)  # two prompts of 40 tokens: the meter decides
    for _ in range(10):  # then both decode
        st.run(2, 2, _fake_clock_step(cost, clock, used), now)
    for _ in range(10):  # one finished; a third joins later
        st.run(1, 1, _fake_clock_step(cost, clock, used), now)
    st.run(3, 3, _fake_clock_step(cost, clock, used), now)
    # each new adapter starts from the shared meter: its first steps at 1 thread (a probe of 2 threads
    # comes only after the gap, 8 steps, and loses)
    assert used[:9] == [1] * 9 and used[11:19] == [1] * 8 and used[21] == 1
    assert set(st.adapters) == {1, 2, 3} and all(a.current == 1 for a in st.adapters.values())
    assert "2 seq: 1 (adaptive among 2, 1" in st.describe()


def test_server_steps_step_down_by_timing_when_the_meter_cannot_tell():
    from qllama.runtime.threads import StepThreads

    st = StepThreads([2, 1])  # no meter: timed probes only
    clock = {"t": 0.0}
    used = []
    for _ in range(30):
        st.run(4, 4, _fake_clock_step(lambda n: {2: 0.300, 1: 0.015}[n], clock, used), lambda: clock["t"])
    assert used[:2] == [2, 1] and st.adapter(4).current == 1 and used[2:12] == [1] * 10


def test_scheduler_asks_the_step_adapter_and_greedy_tokens_do_not_change():
    """The server's steps at counts that alternate 1, 2, 1, ... give the same greedy tokens as each
    request alone at a fixed count; each step's kernels run at the count it was given."""
    import qllama
    from qllama.server.engine import model_forward
    from qllama.server.scheduler import Job, Scheduler
    from qllama.server.schemas import GenParams

    from dataclasses import replace

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba's pool has a single thread")
    prompts = ["ROMEO:", "JULIET: O Romeo", "First Citizen:\nBefore we proceed"]
    ref_model = qllama.load("demo", n_ctx=128, n_threads=1)
    ref = [ref_model.complete(p, max_tokens=24, temperature=0) for p in prompts]

    llm = qllama.load("demo", n_ctx=128, n_threads=2)  # fixed: no adapter of its own ...
    forward, new_cache, _ = model_forward(llm)
    assert forward.threads is None

    class Alternate:  # ... but this one hands each step the other count
        def __init__(self):
            self.calls, self.seen = 0, []

        def run(self, n_seq, n_tok, step):
            self.calls += 1
            n = 1 + self.calls % 2
            out = step(n)
            self.seen.append((n, numba.get_num_threads()))
            return out

    forward.threads = Alternate()
    sched = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=3, chunk=8)
    events = [[] for _ in prompts]
    for p, ev in zip(prompts, events):
        greedy = GenParams(max_tokens=24, sampling=replace(GenParams().sampling, temperature=0.0))
        sched.submit(Job(llm.tokenize(p, add_bos=True), greedy, ev.append))
    while sched.step():
        pass
    got = ["".join(e.text for e in ev) for ev in events]
    assert got == ref
    seen = forward.threads.seen
    assert {n for n, _ in seen} == {1, 2} and all(n == live for n, live in seen)


def test_default_threads_give_the_server_a_step_adapter():
    import qllama
    from qllama.qtensor import physical_cores
    from qllama.runtime.threads import StepThreads
    from qllama.server.engine import model_forward

    forward, _, _ = model_forward(qllama.load("demo", n_ctx=64))
    if physical_cores() < 2:
        assert forward.threads is None
    else:
        assert isinstance(forward.threads, StepThreads) and isinstance(forward.threads.idle, IdleMeter)
    assert model_forward(qllama.load("demo", n_ctx=64, n_threads=1))[0].threads is None


def test_bench_at_default_threads_adapts_and_an_explicit_count_stays(tmp_path):
    from qllama.bench.runner import format_table, run_bench
    from qllama.qtensor import physical_cores
    from tools.make_model import ModelSpec, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, ModelSpec(n_head=4, n_head_kv=2, weight_type="q8_0", seed=5, n_ctx=128))
    doc = run_bench(path, n_prompt=32, n_gen=8, reps=1)
    if physical_cores() >= 2:
        assert all("adaptive among" in r["adaptive"] for r in doc["results"])
        assert "auto (" in format_table(doc)
    fixed = run_bench(path, n_prompt=32, n_gen=8, threads=[1], reps=1)
    assert all("adaptive" not in r and r["threads"] == 1 for r in fixed["results"])


def test_idle_meter_others_now_counts_running_threads_of_other_processes(tmp_path, monkeypatch):
    stat, m, clock = _meter_on_fake_stat(tmp_path, monkeypatch)
    stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\nprocs_running 3\nprocs_blocked 0\n")
    monkeypatch.setattr(IdleMeter, "_own_running", staticmethod(lambda: 2))
    assert m.others_now() == 1.0  # 3 runnable, 2 of them ours
    stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\nprocs_running 9\n")
    assert m.others_now() == 2.0  # at most every CPU
    monkeypatch.setattr(IdleMeter, "_own_running", staticmethod(lambda: 0))
    stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\nprocs_running 1\n")
    assert m.others_now() == 0.0  # the reader itself is running
    stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\n")
    assert m.others_now() is None


def test_idle_meter_others_now_ignores_a_process_that_is_just_finishing(tmp_path, monkeypatch):
    """Another process runnable at the first look but gone a millisecond later (its threads' last
    spin) does not count; one that stays runnable at every look does."""
    import qllama.runtime.threads as threads_module

    stat, m, clock = _meter_on_fake_stat(tmp_path, monkeypatch)
    monkeypatch.setattr(IdleMeter, "_own_running", staticmethod(lambda: 1))
    stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\nprocs_running 2\n")
    looks = []
    monkeypatch.setattr(threads_module.time, "sleep", lambda s: looks.append(s))
    assert m.others_now() == 1.0 and len(looks) == 3  # stays: 4 looks, 1 ms apart
    looks.clear()
    monkeypatch.setattr(threads_module.time, "sleep",
                        lambda s: stat.write_text("cpu  100 0 0 100 0 0 0 0 0 0\nprocs_running 1\n"))
    assert m.others_now() == 0.0  # gone at the second look


def test_a_meter_just_made_falls_back_to_the_running_count():
    class Fresh(SharedMeter):
        def others_cpus(self, min_seconds=0.2, max_seconds=None):
            self.reads += 1
            return None  # no window yet

        def others_now(self):
            return self.others

    a = ThreadAdapter([2, 1], idle=Fresh(1.0))
    assert a.batch_threads(512) == 1
    assert ThreadAdapter([2, 1], idle=Fresh(0.0)).batch_threads(512) == 2


def test_a_low_start_pays_no_timed_probe_until_cpu_is_idle():
    """Started at 1 thread by the meter: no probe of 2 threads (which would cost ~20 steps here)
    while no CPU sits idle, however short or long the request; an idle CPU brings one soon."""
    meter = FakeMeter(1.0)
    a = ThreadAdapter([2, 1], idle=meter)
    used = drive(a, BUSY, 200)
    assert used == [1] * 200 and a.probes == 0
    meter.others, meter.value = 0.0, 2.0  # the load went away: two idle CPUs
    used = drive(a, IDLE, 40, start=200)
    assert a.current == 2 and a.switches == 1 and used.index(2) < 25


def test_a_low_start_still_probes_after_max_gap_without_a_meter_reading_idle():
    meter = FakeMeter(1.0)  # idle_cpus stays 0: only the gap rule can bring a probe
    a = ThreadAdapter([2, 1], idle=meter, max_gap=64)
    used = drive(a, IDLE, 100)  # 2 threads would be faster after all
    assert used[:64] == [1] * 64 and a.current == 2
