"""Timing inputs, the shape trial's constant, the GPU gate, and concurrent verification (CPU)."""

from __future__ import annotations

import os
import random
import threading
import time
import types

import pytest
import torch

from _helpers import process_state
from _verify_sources import HONEST, RELU_REF, mutate
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.sizing import shape_constant
from dice_ray.tasks.task import Task
from dice_ray.verify.sandbox.runner import IDLE_GRACE_S, GpuGate
from dice_ray.verify.trials.timing import (MAX_CALLS_PER_WINDOW, OUTLAST_SLACK_MAX_MS, OUTLAST_SLACK_MS, InputSchedule, calls_per_window,
                                    outlast_limit_ms, spread_stats, time_calls, window_ms, window_sizes)
from dice_ray.verify.verifier import Verifier


def _make(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(256, generator=g), 3]


def test_schedule_gives_every_call_its_own_values():
    sched = InputSchedule(_make, base_seed=100, calls=10, pool_bytes=10 * 1024)  # 1 KiB a set: 10 slots
    assert sched.slots == 10
    ptrs = {sched(j)[0].data_ptr() for j in range(10)}
    assert len(ptrs) == 10 and sched.refills == 0
    for j in (0, 7, 3):
        assert torch.equal(sched(j)[0], _make(100 + j)[0]) and sched(j)[1] == 3


def test_small_pool_refills_in_place_with_fresh_values():
    sched = InputSchedule(_make, base_seed=0, calls=12, pool_bytes=2 * 1024 + 10)  # 2 slots
    assert sched.slots == 2
    seen = []
    for j in range(12):
        x = sched(j)[0]
        assert torch.equal(x, _make(j)[0])  # a reused slot never serves stale values
        seen.append((x.data_ptr(), float(x[0])))
    assert len({p for p, _ in seen}) == 2 and len({v for _, v in seen}) == 12
    assert sched.refills == 10
    assert torch.equal(sched(0)[0], _make(0)[0])  # any order


def test_window_ends_at_the_stream_unless_work_outlasts_it():
    """A window is timed to its stream-ordered end event when the synchronize after it returned as fast
    as after the reference's windows; work that ran on past the stream (a side stream) is timed to the
    synchronize."""
    gaps = [0.026, 0.027, 0.027, 0.028, 0.030, 0.041]  # ms: the reference's synchronize return + host wake-up
    limit = outlast_limit_ms(gaps)
    med = spread_stats(gaps)[0]
    assert med + OUTLAST_SLACK_MS <= limit < med + 0.010
    assert window_ms(0.350, 0.350 + 0.029, limit, med) == (0.350, False)  # host jitter is not timed
    ms, outlasted = window_ms(0.002, 0.002 + 0.035 + 0.027, limit, med)  # all work on a side stream
    assert outlasted and ms == pytest.approx(0.037, abs=1e-3)
    ms, outlasted = window_ms(0.300, 0.300 + 0.200, limit, med)
    assert outlasted and ms == pytest.approx(0.5 - med)
    assert window_ms(0.300, 0.300 + med + 0.0049, limit, med) == (0.300, False)
    wide = [0.02, 0.02, 0.06, 0.06]
    assert outlast_limit_ms(wide) > spread_stats(wide)[0] + OUTLAST_SLACK_MS  # a wide spread widens the slack
    assert outlast_limit_ms(wide) <= spread_stats(wide)[0] + OUTLAST_SLACK_MAX_MS  # up to a cap: hidden work stays small


def test_time_calls_rejects_bad_window_plans_before_touching_the_gpu():
    sched = InputSchedule(_make, base_seed=0, calls=4, pool_bytes=4 * 1024)
    flush = torch.empty(1)
    with pytest.raises(ValueError, match="warmup=3 of 3 windows"):
        time_calls(torch.relu, torch.relu, sched, {"reference": [1] * 3, "candidate": [1] * 3}, 3, flush, 0)
    with pytest.raises(ValueError, match="sizes in \\[1, schedule.slots=4\\]"):
        time_calls(torch.relu, torch.relu, sched, {"reference": [5, 1], "candidate": [1, 1]}, 0, flush, 0)


def test_spread_stats():
    med, spread = spread_stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert med == 3.0 and spread == pytest.approx((4.0 - 2.0) / 3.0)
    assert spread_stats([0.0, 0.0]) == (0.0, 0.0)


def test_calls_per_window_fills_the_window_within_its_limits():
    assert calls_per_window(0.04, 0.5, limit=100) == 13  # a 40 us kernel: 13 calls make 0.5 ms
    assert calls_per_window(0.5, 0.5, limit=100) == 1  # a slow side: its own window, not the fast side's count
    assert calls_per_window(2.0, 0.5, limit=100) == 1  # already longer than a window
    assert calls_per_window(0.001, 0.5, limit=100) == MAX_CALLS_PER_WINDOW
    assert calls_per_window(0.04, 0.5, limit=4) == 4  # few pool slots or large outputs
    assert calls_per_window(0.04, 0.0, limit=100) == 1  # windowing off
    assert calls_per_window(-0.01, 0.5, limit=100) == 1  # the probe saw no GPU time
    assert calls_per_window(float("nan"), 0.5, limit=100) == 1


def test_window_sizes_are_secret_and_bounded():
    assert window_sizes(1, 5, random.Random(0)) == [1] * 5
    sizes = window_sizes(8, 400, random.Random(1))
    assert len(sizes) == 400 and min(sizes) == 8 and max(sizes) == 15  # every size in [k, 2k-1] occurs
    assert window_sizes(8, 50, random.Random(2)) != window_sizes(8, 50, random.Random(3))


def test_shape_constant_picks_a_size_only_get_inputs_reads():
    src = (
        "import torch\nbatch_size = 16\ndim = 4096\nfeatures = 64\nscale = 2.0\n"
        "class Model(torch.nn.Module):\n    def __init__(self, f):\n        super().__init__()\n"
        "def get_inputs():\n    return [torch.randn(batch_size, features, dim)]\n"
        "def get_init_inputs():\n    return [features]\n"
    )
    assert shape_constant(src) == ("batch_size", 16)
    assert shape_constant(src.replace("def get_init_inputs():\n    return [features]",
                                      "def get_init_inputs():\n    return [features, batch_size]")) == ("dim", 4096)
    assert shape_constant(RELU_REF) is None  # literal shapes: nothing to double
    assert shape_constant("def get_inputs(:") is None


def test_gpu_gate_exclusive_excludes_shared():
    gate = GpuGate()
    events: list[str] = []
    gate.acquire("shared")

    def timer() -> None:
        gate.acquire("exclusive")
        events.append("exclusive")
        time.sleep(0.05)
        events.append("exclusive-done")
        gate.release("exclusive")

    t = threading.Thread(target=timer)
    t.start()
    time.sleep(0.05)
    assert events == []  # waits for the reader
    gate.release("shared")
    time.sleep(0.01)
    reader_done = threading.Event()

    def late_reader() -> None:
        gate.acquire("shared")
        events.append("shared")
        gate.release("shared")
        reader_done.set()

    threading.Thread(target=late_reader).start()
    t.join(5)
    assert reader_done.wait(5)
    assert events == ["exclusive", "exclusive-done", "shared"]


def test_spares_start_a_few_at_a_time_and_a_promoted_one_at_once():
    """Background start-ups hold one of the gate's start-up slots from their first gate access to their
    end, so at most `startup_slots` are under way; a spare promoted while it waits goes at once."""
    gate = GpuGate(startup_slots=2)
    under_way, most, lock = [0], [0], threading.Lock()
    promoted = threading.Event()
    release = threading.Event()

    def start_up(background) -> None:
        with gate.startup_slot(background):
            with lock:
                under_way[0] += 1
                most[0] = max(most[0], under_way[0])
            release.wait(5)
            with lock:
                under_way[0] -= 1

    spares = [threading.Thread(target=start_up, args=(lambda: True,)) for _ in range(4)]
    for t in spares:
        t.start()
    late = threading.Thread(target=start_up, args=(lambda: not promoted.is_set(),))
    late.start()
    time.sleep(0.2)
    assert under_way[0] == 2  # two slots taken, three wait
    promoted.set()
    gate.wake()
    time.sleep(0.2)
    assert under_way[0] == 3  # the promoted one went without a slot
    release.set()
    for t in [*spares, late]:
        t.join(5)
    assert most[0] == 3 and under_way[0] == 0 and gate._starting == 0


def test_a_start_up_part_keeps_a_timing_stage_out_but_lets_jobs_shared_parts_in():
    """While a timing stage waits for a worker's start-up part (a CUDA context: up to ~0.5 s), jobs'
    shared parts still start; when only jobs hold, a waiting timing stage keeps new ones out, and a
    start-up part waits for it like a job's part."""
    gate = GpuGate()
    gate.acquire("shared", startup=True)
    timed = threading.Event()

    def timer() -> None:
        gate.acquire("exclusive")
        timed.set()
        gate.release("exclusive")

    t = threading.Thread(target=timer)
    t.start()
    deadline = time.monotonic() + 5
    while not gate._writers_waiting and time.monotonic() < deadline:
        time.sleep(0.005)
    assert gate._writers_waiting == 1

    def try_shared(startup: bool) -> threading.Event:
        got = threading.Event()

        def take() -> None:
            gate.acquire("shared", startup=startup)
            got.set()
            gate.release("shared", startup)

        threading.Thread(target=take, daemon=True).start()
        return got

    assert try_shared(False).wait(2)  # a job's part starts beside the start-up part, the timer still waiting
    other_startup = try_shared(True)
    assert not other_startup.wait(0.2) and not timed.is_set()  # another start-up part waits for the timer
    gate.acquire("shared")  # a job's part that the timer now waits for too
    gate.release("shared", startup=True)  # the start-up part ends: jobs' parts no longer start
    job = try_shared(False)
    assert not job.wait(0.2) and not timed.is_set()
    gate.release("shared")
    t.join(5)
    assert timed.is_set() and job.wait(2) and other_startup.wait(2)
    assert gate._readers == gate._startup_readers == 0 and not gate._writer


def test_worker_start_up_self_test_takes_the_gate():
    """A starting worker's self-test announces its stages like a job: while another worker holds the
    GPU exclusively (timing), the start waits at its first shared stage, then completes."""
    from dice_ray.verify.sandbox.runner import WorkerProcess

    cfg = VerifyConfig(mode="compile_only", workers=1)
    settings = {**cfg.model_dump(), "mode": "compile_only", "device": None}
    gate = GpuGate()
    gate.acquire("exclusive")
    worker = WorkerProcess(settings, gate=gate)
    try:
        deadline = time.monotonic() + 120
        while gate._writer and worker._booting.is_alive() and time.monotonic() < deadline:
            if gate._readers == 0 and worker.boot_s is None and _waiting_for_shared(gate):
                break
            time.sleep(0.05)
        seen_waiting = time.monotonic()
        assert worker.boot_s is None and worker._booting.is_alive()  # held at the gate, not ready
        time.sleep(0.2)
        gate.release("exclusive")
        held = time.monotonic() - seen_waiting
        info = worker.wait_ready(120)
        # the boot reports its wait for the gate: at least the time this test saw it held there
        assert held <= info["boot_phases_s"]["gate_wait"] + 1e-3 <= info["boot_phases_s"]["self_test"] + 1e-3  # rounded to ms
        assert info["self_test"].startswith("ok") and gate._readers == 0 and not gate._writer
        # how long the start held the gate is measured (the self-test's shared parts), waiting excluded
        assert 0 < worker.boot_gate_part_s <= worker.boot_gate_s < time.monotonic() - worker.started
        assert info["gc_frozen"] > 100_000  # torch's objects frozen: the after-job collections skip them
        assert info["preload"] is None  # compile-only: no GPU kernels to load
    finally:
        worker.kill()


def _pipes_reusing(numbers: set[int]) -> list[tuple[int, int]]:
    """Open pipes until every descriptor number in ``numbers`` (just closed) is one of theirs (the
    lowest free numbers go first, so lower ones freed elsewhere in the session are taken on the way)."""

    pipes: list[tuple[int, int]] = []
    while not numbers <= {fd for pipe in pipes for fd in pipe}:
        if len(pipes) >= 512:
            _close_pipes(pipes)
            raise AssertionError(f"descriptors {sorted(numbers)} were not free again")
        pipes.append(os.pipe())
    return pipes


def _close_pipes(pipes: list[tuple[int, int]]) -> None:

    for fd in (fd for pipe in pipes for fd in pipe):
        os.close(fd)


def test_close_kills_a_starting_worker_and_the_fork_server_at_once():
    """A Verifier closed while its worker still imports torch (``dice-ray verify`` on a candidate a static rule
    refused) kills it rather than asking it to exit: it reads no request before its start-up ends, and close()
    used to wait 5 s for it; so does a fork server's close().  A compile-only Verifier starts no fork server
    until it needs spares.  Their folders are removed."""
    import signal

    from dice_ray.verify.sandbox.zygote import Zygote

    v = Verifier(VerifyConfig(mode="compile_only", workers=1), RewardConfig())
    worker = v._idle.queue[0]
    assert v._zygote is None and not worker.ready  # seconds of imports ahead of the worker
    v.close()
    assert worker._killed and worker.proc.poll() is not None and not os.path.exists(worker.workdir)
    zygote = Zygote()
    zygote.close()  # still importing torch
    assert zygote.proc.returncode == -signal.SIGKILL and not os.path.exists(zygote.workdir)


def test_a_killed_worker_is_dead_at_once_and_reaped_by_close():
    """kill(wait=False) (a crashed worker: the verdict does not wait for its CUDA context's teardown)
    makes alive() False at once; close() waits for the exit and removes the worker's folder, and only its
    first call acts (a retired worker closed twice once closed pipes other workers had just opened)."""

    from dice_ray.verify.sandbox.runner import WorkerProcess

    cfg = VerifyConfig(mode="compile_only", workers=1)
    worker = WorkerProcess({**cfg.model_dump(), "mode": "compile_only", "device": None})
    try:
        worker.wait_ready(120)
        assert worker.alive()
        worker.kill(wait=False)
        assert not worker.alive()
        worker.close()
        assert worker.proc.poll() is not None and not os.path.exists(worker.workdir)
        # its pipe descriptor numbers are free again: a second close() must not close what reuses them
        pipes = _pipes_reusing({worker._w, worker._reader.fd})
        try:
            worker.close()
            for fd in (fd for pipe in pipes for fd in pipe):
                os.fstat(fd)  # EBADF if the second close() closed it
        finally:
            _close_pipes(pipes)
    finally:
        worker.kill()


def test_gpu_gate_background_waits_for_an_idle_verifier_unless_promoted():
    """A background acquisition (a spare's start-up) waits while any verify call is in progress, shared or
    exclusive; it goes IDLE_GRACE_S after the last call ended, or when it is promoted; a background holder yielding between
    parts steps aside for a call that began meanwhile."""
    gate = GpuGate()
    got: list[str] = []
    promoted = threading.Event()

    def spare(name: str, mode: str, flag: threading.Event | None = None) -> None:
        gate.acquire(mode, background=lambda: not (flag and flag.is_set()))
        got.append(name)
        gate.release(mode)

    with gate.job():
        threads = [threading.Thread(target=spare, args=("shared", "shared")),
                   threading.Thread(target=spare, args=("exclusive", "exclusive")),
                   threading.Thread(target=spare, args=("promoted", "shared", promoted))]
        for t in threads:
            t.start()
        time.sleep(0.1)
        assert got == []  # a call is in progress: all wait
        gate.acquire("shared")  # a job's own stage is not held up by them
        gate.release("shared")
        promoted.set()
        gate.wake()
        threads[2].join(5)
        assert got == ["promoted"]
    ended = time.monotonic()
    for t in threads:
        t.join(5)
    assert sorted(got) == ["exclusive", "promoted", "shared"]
    assert time.monotonic() - ended >= IDLE_GRACE_S  # not in the gap between two calls of a loop

    gate.acquire("shared", background=lambda: True)  # idle: granted at once
    stepped_aside = threading.Event()

    def part_boundary() -> None:
        gate.yield_shared(background=lambda: True)  # a call began: wait for it to end
        stepped_aside.set()

    with gate.job():
        t = threading.Thread(target=part_boundary)
        t.start()
        time.sleep(0.1)
        assert not stepped_aside.is_set() and gate._readers == 0  # gave its access back meanwhile
    t.join(5)
    assert stepped_aside.is_set() and gate._readers == 1
    gate.release("shared")


def test_a_spare_closed_while_it_waits_for_idle_time_leaves_reused_pipes_alone():
    """close() on a spare still held at the gate (a verify call in progress) ends its start-up thread
    before closing its pipes: let in later, that thread used to read and write descriptor numbers other
    pipes had reused by then (EBADF in start-up threads at a verifier's shutdown on the H200)."""
    import select

    from dice_ray.verify.sandbox.runner import WorkerProcess

    cfg = VerifyConfig(mode="compile_only", workers=1, start_timeout_s=120.0)
    gate = GpuGate()
    with gate.job():
        spare = WorkerProcess({**cfg.model_dump(), "mode": "compile_only", "device": None}, gate=gate, background=True)
        try:
            deadline = time.monotonic() + 120
            while not _waiting_for_shared(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _waiting_for_shared(gate) and spare._booting.is_alive()  # held: the call is in progress
            spare.close()
            assert not spare._booting.is_alive() and not gate._readers and not gate._writer
            pipes = _pipes_reusing({spare._w, spare._reader.fd})
        except BaseException:
            spare.kill()
            raise
    try:
        time.sleep(0.5)  # the call ended: a thread still waiting for idle time would go on now
        assert select.select([r for r, _ in pipes], [], [], 0)[0] == []  # nothing wrote into a reusing pipe
        for fd in (fd for pipe in pipes for fd in pipe):
            os.fstat(fd)
    finally:
        _close_pipes(pipes)


def test_gpu_gate_idle_turn_waits_for_idle_time_and_holds_back_spares_start_ups():
    """idle_turn() (the Verifier killing suspended workers) enters IDLE_GRACE_S after the last verify call
    ended, and a background acquisition (a spare's start-up) waits for it to end."""
    gate = GpuGate()
    entered, leave = threading.Event(), threading.Event()

    def reaper() -> None:
        with gate.idle_turn():
            entered.set()
            leave.wait(10)

    got: list[str] = []

    def spare() -> None:
        gate.acquire("shared", background=lambda: True)
        got.append("spare")
        gate.release("shared")

    with gate.job():
        t = threading.Thread(target=reaper)
        t.start()
        time.sleep(0.1)
        assert not entered.is_set()  # a call is in progress
    ended = time.monotonic()
    assert entered.wait(5) and time.monotonic() - ended >= IDLE_GRACE_S
    s = threading.Thread(target=spare)
    s.start()
    time.sleep(IDLE_GRACE_S + 0.3)
    assert got == []  # the turn counts as a call: the start-up waits
    leave.set()
    t.join(5)
    s.join(5)
    assert got == ["spare"] and gate._jobs == 0


def test_crashed_workers_stay_stopped_until_the_verifiers_idle_time_within_their_room():
    """A worker suspended after a sticky CUDA error (WorkerProcess.suspend: SIGSTOP) is kept for the Verifier's
    idle time, where it is killed (its exit, a CUDA context torn down, stalls other workers' allocations):
    at most one for each spare and half a spare's room (SPARE_ROOM_MIB) each on average; the rest are refused
    (killed at once by the caller), and so is one whose memory is unknown, or any without the static rules."""
    from dice_ray.verify.sandbox.runner import WorkerProcess
    from dice_ray.verify.verifier import SPARE_ROOM_MIB

    cfg = VerifyConfig(mode="compile_only", workers=1, spare_workers=2)
    settings = {**cfg.model_dump(), "mode": "compile_only", "device": None}
    with Verifier(cfg, RewardConfig()) as v:
        v._gate = GpuGate()  # the idle time it waits for is the GPU gate's
        workers = [WorkerProcess(settings) for _ in range(5)]
        try:
            for w in workers:
                w.wait_ready(120)
            for w, mib in zip(workers, (10.0, float(SPARE_ROOM_MIB), 20.0, 1.0, None)):
                w.suspend()
                w.reserved_mib = mib
            assert all(not w.alive() and process_state(w.pid, "T") == "T" for w in workers)
            with v._gate.job():
                with v._lock:
                    kept = [v._suspend_for_idle(w) for w in workers]
                # the second: over the memory room; the fourth: over spare_workers; the last: memory unknown
                assert kept == [True, False, True, False, False]
                time.sleep(IDLE_GRACE_S + 0.3)
                assert [process_state(w.pid) for w in (workers[0], workers[2])] == ["T", "T"]  # a call is in progress
                assert v.stats()["suspended"] == 2 and v.stats()["suspended_mib"] == 30.0
            deadline = time.monotonic() + 30
            while v.stats()["reaped_idle"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert v.stats()["reaped_idle"] == 2 and v.stats()["suspended"] == 0
            assert workers[0].proc.poll() is not None and workers[2].proc.poll() is not None
            assert not os.path.exists(workers[0].workdir)
            v.verify_cfg = v.verify_cfg.model_copy(update={"static_rules": False})  # frames can be forged then
            with v._lock:
                assert not v._suspend_for_idle(workers[3])
        finally:
            for w in workers:
                w.close()
    assert all(w.proc.poll() is not None for w in workers)


def test_spare_worker_starts_in_the_verifiers_idle_time():
    """A background worker (a spare) holds at its first gated stage while a verify call is in progress and
    becomes ready once none is; a promoted one starts during the call."""
    from dice_ray.verify.sandbox.runner import WorkerProcess

    cfg = VerifyConfig(mode="compile_only", workers=1, start_timeout_s=60.0)
    settings = {**cfg.model_dump(), "mode": "compile_only", "device": None}
    gate = GpuGate()
    with gate.job():
        idle_one = WorkerProcess(settings, gate=gate, background=True)
        needed = WorkerProcess(settings, gate=gate, background=True)
        try:
            needed.promote()
            info = needed.wait_ready(120)
            assert info["self_test"].startswith("ok") and not needed.background
            assert not idle_one.ready and idle_one._booting.is_alive()  # held: the call is still in progress
        except BaseException:
            idle_one.kill()
            needed.kill()
            raise
    try:
        assert idle_one.wait_ready(120)["self_test"].startswith("ok") and idle_one.background
    finally:
        idle_one.kill()
        needed.kill()


def _waiting_for_shared(gate: GpuGate) -> bool:
    """True once some thread blocks in ``gate.acquire("shared")`` (it waits on the condition)."""
    return bool(getattr(gate._cond, "_waiters", None))


def test_concurrent_workers_give_the_serial_verdicts():
    """Two sandbox workers verifying a mixed batch at once give each candidate the verdict it gets alone."""
    task = Task("test/relu", "relu", 1, RELU_REF)
    batch = [
        (task, HONEST, "ok"),
        (task, mutate("y[i] = x[i]", "y[i] = = x[i]"), "compile_error"),
        (task, mutate("import torch\n", "import torch\nimport os\nos.getpid()\n"), "cheat"),
        (task, mutate("        super().__init__()\n", "        super().__init__()\n        raise ValueError('x')\n"), "crash"),
    ] * 2
    cfg = VerifyConfig(mode="compile_only", workers=2, compile_timeout_s=10.0, run_timeout_s=5.0)
    with Verifier(cfg, RewardConfig()) as v:
        assert v.workers == 2 and len(v.worker_pids) == 2
        verdicts = v.verify_many([(t, src, f"c{i}") for i, (t, src, _) in enumerate(batch)])
    assert [x.candidate_id for x in verdicts] == [f"c{i}" for i in range(len(batch))]
    assert [x.verdict for x in verdicts] == [want for _, _, want in batch], [(x.verdict, x.reason[:400]) for x in verdicts]



def test_gpu_gate_yield_lets_a_waiting_timer_go_and_accounts_held_time(monkeypatch):
    """A shared holder yielding between the parts of its stage lets a waiting exclusive holder go
    first, then gets shared access back; held_seconds splits the time into exclusive/draining/shared/idle.
    The gate reads a made-up clock, moved by hand: its accounting is checked exactly, whatever the machine's speed."""
    from dice_ray.verify.sandbox import runner

    clock = [100.0]
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    made = clock[0]
    gate = GpuGate()
    clock[0] += 0.02  # idle
    gate.acquire("shared")
    clock[0] += 0.01  # shared, nobody waiting
    order: list[str] = []

    def timer() -> None:
        gate.acquire("exclusive")
        order.append("exclusive")
        clock[0] += 0.05  # exclusive
        gate.release("exclusive")

    t = threading.Thread(target=timer)
    t.start()
    while not gate._writers_waiting:
        time.sleep(0.001)
    clock[0] += 0.03  # the timer waits: the shared holder is draining
    gate.yield_shared()  # returns once the timer is done and shared access is back
    order.append("shared again")
    clock[0] += 0.02  # shared again
    gate.release("shared")
    t.join(5)
    assert order == ["exclusive", "shared again"]
    held = gate.held_seconds()
    assert held == pytest.approx({"idle": 0.02, "shared": 0.01 + 0.02, "draining": 0.03, "exclusive": 0.05})
    assert sum(held.values()) == pytest.approx(clock[0] - made)  # the four parts add up to the gate's age
    gate.acquire("shared")
    gate.yield_shared()  # nobody waiting: a no-op
    gate.release("shared")


@pytest.mark.gpu
def test_a_slow_host_is_not_timed_the_hold_waits_for_it():
    """A forward whose host side is slow (a 0.3 ms pause a call, as when other workers' compiles take the CPU)
    is timed by its GPU work alone: the hold keeps the GPU off the window's calls until the host has queued
    them all, so no window is host-bound and the time per call is the reference's (the same kernel)."""
    import time as _time

    x = torch.randn(1 << 22, device="cuda")

    def slow_host(a):
        _time.sleep(3e-4)
        return torch.relu(a)

    sched = InputSchedule(lambda seed: [x], 0, 8 * 12, 1 << 30)
    sizes = {"reference": [8] * 12, "candidate": [8] * 12}
    flush = torch.empty(1 << 24, device="cuda")
    t = time_calls(torch.relu, slow_host, sched, sizes, 2, flush, 0)
    assert t.host_bound == {"reference": 0, "candidate": 0}
    ref, cand = spread_stats(t.per_call["reference"])[0], spread_stats(t.per_call["candidate"])[0]
    assert cand == pytest.approx(ref, rel=0.1), (ref, cand, t.per_call["candidate"])  # not ~0.3 ms a call


@pytest.mark.gpu
def test_a_forward_that_waits_on_the_hold_times_it_out_and_its_windows_are_left_out():
    """A forward that synchronizes waits for the hold before it, which waits for the host: the hold's
    timeout (~20 ms) ends it, the windows are found host-bound (the GPU reached their start before the
    host had queued them) and left out; nothing hangs."""
    from dice_ray.verify.trials.gpu_spin import HOLD_TIMEOUT_CYCLES

    x = torch.randn(1 << 20, device="cuda")

    def syncing(a):
        torch.cuda.synchronize()
        return torch.relu(a)

    sched = InputSchedule(lambda seed: [x], 0, 4, 1 << 30)
    sizes = {"reference": [1] * 4, "candidate": [1] * 4}
    flush = torch.empty(1 << 24, device="cuda")
    t = time_calls(torch.relu, syncing, sched, sizes, 1, flush, 0)
    assert t.host_bound == {"reference": 0, "candidate": 3}  # each timed window's hold ended by its timeout
    assert len(t.per_call["candidate"]) == 3  # all windows host-bound: kept, since none is clean
    assert HOLD_TIMEOUT_CYCLES / 1e9 <= 0.05  # a hold that times out ends within 50 ms at >= 1 GHz: not a hang


@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_the_spin_kernel_compiles_for_full_occupancy(arch):
    """The spin's blocks are sized to fill every thread slot: 256 threads, registers capped for 8 blocks an SM."""
    from dice_ray.verify.candidate.nvrtc import compile_cuda
    from dice_ray.verify.trials.gpu_spin import _SOURCE, BLOCK

    ptx = compile_cuda(_SOURCE, arch=arch).ptx
    assert f".maxntid {BLOCK}, 1, 1" in ptx and ".minnctapersm 8" in ptx


@pytest.mark.gpu
def test_the_spin_keeps_side_stream_work_out_until_the_window_starts():
    """Kernels queued on another stream while the spin runs cannot run beside it (it holds every SM's
    thread slots), so they finish after the window's start event: inside the window, timed.
    ``torch.cuda._sleep`` (one thread) let them run before the start."""
    from dice_ray.verify.trials.gpu_spin import BLOCK, for_device

    spin = for_device(0)
    slots = torch.cuda.get_device_properties(0).max_threads_per_multi_processor
    assert spin.blocks_per_sm * BLOCK >= slots
    x = torch.randn(1 << 24, device="cuda")
    side = torch.cuda.Stream()
    start, side_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    spin(4_000_000)  # ~2 ms
    start.record()
    with torch.cuda.stream(side):
        for _ in range(4):
            x.mul_(1.0001)  # ~30 us each, queued while the spin runs
        side_done.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(side_done) > 0.05, "side-stream work ran before the window's start"


@pytest.mark.gpu
def test_the_spin_zeroes_the_flush_buffer_and_lasts_at_least_the_flush():
    """The L2 flush is the spin's own blocks zeroing the buffer (16-byte stores, a tail under 16 bytes
    left): every aligned word is zero after it, and a zero-cycle spin still takes the flush's time."""
    from dice_ray.verify.trials.gpu_spin import for_device

    spin = for_device(0)
    flush = torch.ones((1 << 24) + 3, dtype=torch.int32, device="cuda")  # 64 MiB + 12 bytes
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    spin(0, flush=flush)
    end.record()
    torch.cuda.synchronize()
    assert int(flush[: 1 << 24].count_nonzero()) == 0 and flush[1 << 24:].tolist() == [1, 1, 1]
    flush.fill_(1)
    copy = torch.empty_like(flush)
    torch.cuda.synchronize()
    c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    c0.record()
    copy.zero_()
    c1.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) >= 0.5 * c0.elapsed_time(c1)  # writing 64 MiB takes the GPU its time
    with pytest.raises(ValueError, match="16-byte aligned"):
        spin(0, flush=flush[1:])
    with pytest.raises(ValueError, match="contiguous"):
        spin(0, flush=flush[::2])
