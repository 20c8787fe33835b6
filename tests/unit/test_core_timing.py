"""StepClock: the split of step time, driven by a scripted clock so every figure is exact."""

from __future__ import annotations

import pytest

from lightning_gpuopt.core.timing import StepClock


class ScriptedClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run_step(
    clock: StepClock, time: ScriptedClock, fetch: float, compute: float, other: float = 0.0, samples: int = 4
) -> None:
    time.advance(fetch)
    clock.add_fetch(fetch, cpu_seconds=fetch / 2)
    time.advance(other)
    clock.step_start()
    time.advance(compute)
    clock.step_end(samples)


def test_steps_split_into_wait_compute_and_other():
    time = ScriptedClock()
    clock = StepClock(warmup_steps=1, clock=time)
    clock.epoch_start()
    for _ in range(5):
        run_step(clock, time, fetch=0.030, compute=0.010, other=0.002)
    totals = clock.totals()
    assert totals.steps == 4  # step 0: warm-up and the epoch's first
    assert totals.wall_s == pytest.approx(4 * 0.042)
    assert totals.data_wait_s == pytest.approx(4 * 0.030)
    assert totals.compute_s == pytest.approx(4 * 0.010)
    assert totals.other_s == pytest.approx(4 * 0.002)
    assert totals.data_wait_fraction == pytest.approx(30 / 42)
    assert totals.loader_cpu_fraction == pytest.approx(0.5)
    assert totals.samples_per_second == pytest.approx(4 / 0.042)
    assert clock.worker_startup_s == [pytest.approx(0.032)]


def test_excluded_work_between_steps_is_totalled_apart():
    time = ScriptedClock()
    clock = StepClock(warmup_steps=0, clock=time)
    clock.epoch_start()
    run_step(clock, time, fetch=0.01, compute=0.01)
    run_step(clock, time, fetch=0.01, compute=0.01)
    time.advance(0.5)
    clock.add_excluded("validation", 0.5)
    start = None
    time.advance(0.01)
    clock.add_fetch(0.01)
    start = clock.step_start()
    time.advance(0.01)
    clock.step_end(4)
    assert start.measured and not start.clean_gap  # the GPU-idle gap before it holds validation
    assert clock.totals().steps == 2
    assert clock.totals().wall_s == pytest.approx(0.04)
    assert clock.excluded_s["validation"] == pytest.approx(0.5) == clock.totals().validation_s


def test_each_epoch_start_is_start_up_not_a_step():
    time = ScriptedClock()
    clock = StepClock(warmup_steps=0, clock=time)
    for _ in range(3):
        clock.epoch_start()
        time.advance(0.2)  # workers starting
        for _ in range(4):
            run_step(clock, time, fetch=0.001, compute=0.01)
        time.advance(1.0)  # epoch-end work never counts
    assert clock.totals().steps == 3 * 3
    assert clock.totals().wall_s == pytest.approx(9 * 0.011)
    assert clock.worker_startup_s == [pytest.approx(0.201)] * 3
    assert clock.epochs_seen == 3


def test_take_window_resets_only_the_window():
    time = ScriptedClock()
    clock = StepClock(warmup_steps=0, clock=time)
    clock.epoch_start()
    for _ in range(4):
        run_step(clock, time, fetch=0.01, compute=0.01)
    window = clock.take_window()
    assert window.steps == 3 and window.wall_s == pytest.approx(3 * 0.02)
    run_step(clock, time, fetch=0.01, compute=0.01)
    window = clock.take_window()
    assert window.steps == 1 and window.data_wait_s == pytest.approx(0.01) and clock.totals().steps == 4


def test_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="warmup_steps"):
        StepClock(warmup_steps=-1)


def test_forward_timed_in_some_steps_is_scaled_to_every_measured_step():
    time = ScriptedClock()
    clock = StepClock(warmup_steps=1, clock=time)
    clock.epoch_start()
    for step in range(9):
        time.advance(0.001)
        clock.add_fetch(0.001)
        clock.step_start()
        if step % 4 == 0 or step == 1:  # timed in steps 1, 4 and 8 (measured) and 0 (warm-up: not counted)
            clock.add_forward({0: 1.0, 1: 0.003, 4: 0.004}.get(step, 0.005))
        time.advance(0.010)
        clock.step_end(4)
    totals = clock.totals()
    assert totals.steps == 8 and totals.compute_s == pytest.approx(8 * 0.010)
    assert totals.forward_s == pytest.approx(8 * (0.003 + 0.004 + 0.005) / 3)  # the timed steps' mean, each step
    assert clock.take_window().forward_s == 0.0  # the windows logged carry no forward time


def test_noted_steps_settle_to_what_the_told_steps_give():
    """Two clocks on one scripted time: one told each step's fetch, start and end; one (the monitor's hot path)
    noting the fetch's start and end in most steps (after a timed one), told in the others but ending each step at the next
    fetch's start. A save between steps, a step ended by -1 and two epochs. The rest of a step (transfer, hooks)
    is the same in every step, so the noted steps' compute, estimated from the told steps' rest, is exact."""
    time = ScriptedClock()
    told, noted = StepClock(warmup_steps=1, clock=time), StepClock(warmup_steps=1, clock=time)
    for epoch in range(2):
        for clock in (told, noted):
            clock.epoch_start()
        for step in range(12):
            fetch, sampled = (
                (0.004 if step % 3 else 0.010),
                step % 4 == 0 or step == epoch + 1,
            )  # as the monitor: timed first
            noted.note_boundary()
            time.advance(fetch)
            for clock in (told, noted) if sampled else (told,):
                clock.add_fetch(fetch, cpu_seconds=fetch / 4)
            if not sampled:
                noted.note_fetched(step + epoch)
            time.advance(0.001)  # the transfer, the hooks before the step
            for clock in (told, noted) if sampled else (told,):
                clock.step_start()
            if epoch == 1 and step == 11:  # on_train_batch_start returned -1: no end
                break
            time.advance(0.020 + step / 1000)
            told.step_end(step + epoch)
            if sampled:
                noted.compute_end(step + epoch)
            time.advance(0.001)  # the logging after the step
            if step == 6:  # a save after the step
                for clock in (told, noted):
                    clock.add_excluded("checkpoint", 0.002)
                time.advance(0.002)
        else:
            noted.note_boundary()  # the epoch's end ends its last step
    assert noted.steps_seen < told.steps_seen  # lagging until settled
    n, t = noted.totals(), told.totals()
    figures = ("steps", "samples", "wall_s", "data_wait_s", "data_wait_cpu_s", "compute_s", "checkpoint_s")
    assert [getattr(n, name) for name in figures] == pytest.approx([getattr(t, name) for name in figures])
    assert noted.timeline().data_wait_s == pytest.approx(told.timeline().data_wait_s)  # each step's own fetch
    assert noted.steps_seen == told.steps_seen == 23 and noted.worker_startup_s == pytest.approx(told.worker_startup_s)
