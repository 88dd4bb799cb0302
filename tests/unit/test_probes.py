"""When an idle engine re-measures its step alone, and what that does to its figures
(consumers/inference/runners/probes.py; the runner's probes on a stand-in engine)."""

from __future__ import annotations

import asyncio
import math

import pytest

from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.engine_io import GenRequest
from consumers.inference.runners import probes
from consumers.inference.runners.probes import Pressure, ProbeClock, rescaled
from consumers.inference.runners.thread import PROFILE_PREFIX, EngineRunner
from tests.unit.test_runner import SteppingEngine
from tests.waiting import until


def test_an_idle_engine_probes_often_while_the_cpu_is_contended_and_rarely_when_quiet():
    clock = ProbeClock()
    assert clock.due(100.0, idle_since=-math.inf, pressure=0.0)  # nothing measured in this process yet
    clock.probed(100.0, 0.9)
    assert not clock.due(100.5, idle_since=50.0, pressure=0.9)  # just probed
    assert clock.due(100.0 + probes.EVERY_S, idle_since=50.0, pressure=0.9)  # contended: the hog may end
    assert not clock.due(100.0 + probes.EVERY_S, idle_since=101.5, pressure=0.9)  # a request a moment ago
    clock.probed(200.0, 0.02)
    assert not clock.due(210.0, idle_since=50.0, pressure=0.05)  # quiet and unchanged
    assert clock.due(210.0, idle_since=50.0, pressure=0.02 + probes.CHANGED)  # it changed
    assert clock.due(210.0, idle_since=50.0, pressure=None)  # unknown: as if contended
    assert clock.due(200.0 + probes.QUIET_EVERY_S, idle_since=50.0, pressure=0.02)
    clock.probed(300.0, 0.02, faster=True)  # faster than the figures: the machine is changing
    assert clock.due(300.0, idle_since=50.0, pressure=0.02)


def test_a_probe_rescales_the_figures_only_past_its_noise():
    assert rescaled(0.070, 2.172) == pytest.approx(0.070 / 2.172)  # the hog ended
    assert rescaled(2.0, 0.05) == pytest.approx(40.0)  # a hog began
    assert rescaled(0.055, 0.05) == 1.0 and rescaled(0.045, 0.05) == 1.0
    assert rescaled(0.05, None) == 1.0


def test_pressure_is_the_share_of_the_interval_some_task_waited_for_a_core(tmp_path):
    psi = tmp_path / "cpu.pressure"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1000000\nfull avg10=0.00 total=0\n")
    pressure = Pressure([str(tmp_path / "missing"), str(psi)])
    assert pressure.path == psi and pressure.read(10.0) is None  # no interval yet
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1400000\n")
    assert pressure.read(10.5) == pytest.approx(0.8)
    assert Pressure([str(tmp_path / "missing")]).read() is None


@pytest.fixture
def fast_probes(monkeypatch):
    monkeypatch.setattr(probes, "IDLE_S", 0.05)
    monkeypatch.setattr(probes, "EVERY_S", 0.1)
    monkeypatch.setattr(probes, "QUIET_EVERY_S", 0.1)


async def test_an_engine_profiled_beside_a_hog_follows_the_machine_once_it_ends(fast_probes):
    """The lockout of issue 49: a profile measured beside a CPU hog said every step was
    slow, and refused requests never ran to say otherwise. An idle engine's probes see the
    steps are fast again and every figure follows (alone, small and full batches); the
    probes stay out of the outputs and the metrics, and a request that comes during one
    is served (the probe gives way)."""
    delivered: list = []
    steps: list = []
    engine = SteppingEngine(slots=8, per_row=0.02)  # beside the hog
    runner = EngineRunner(
        engine, asyncio.get_running_loop(), delivered.extend, on_step=lambda s, _: steps.append(s), profile=True
    )  # type: ignore[arg-type]
    try:
        assert await asyncio.to_thread(runner.profiled.wait, 10)
        hogged = runner.load()
        assert hogged.alone_step_s == pytest.approx(0.02, rel=0.5)
        engine.per_row = 0.002  # the hog ends
        await until(lambda: (runner.load().alone_step_s or 1) < 0.006, timeout=10)
        quiet = runner.load()
        runner.add(GenRequest("real", [5, 6], SamplingParams(temperature=0, max_tokens=3)))
        await until(lambda: [o for o in delivered if o.finished], timeout=10)
    finally:
        runner.stop()
    assert hogged.full_step_s is not None and quiet.full_step_s is not None
    assert quiet.full_step_s == pytest.approx(hogged.full_step_s / 10, rel=0.5)
    assert quiet.measured_at > hogged.measured_at
    assert [o.completion_tokens for o in delivered] == [1, 2, 3]
    assert [s.batch for s in steps] == [0, 1, 1]  # the request's own steps only (its first one prefills)
    probed = [r for r in engine.seen if r.request_id.startswith(PROFILE_PREFIX + "1-")]
    assert len(probed) >= 2 and all(not r.cache for r in probed)


async def test_an_idle_engine_does_not_probe_while_another_engine_steps(fast_probes):
    """Beside an engine serving a load, an idle one's probe times that load, not the
    machine, and takes the busy engine's threads (cores.CoreShare): it waits until the
    other engine stops stepping, then probes as before."""
    engine = SteppingEngine(slots=8, per_row=0.002)
    busy = [True]
    runner = EngineRunner(
        engine, asyncio.get_running_loop(), lambda _: None, profile=True, neighbours_stepping=lambda: busy[0]
    )  # type: ignore[arg-type]
    try:
        assert await asyncio.to_thread(runner.profiled.wait, 10)
        profiled = len(engine.seen)
        await asyncio.sleep(1.0)  # probes due every 0.1 s (fast_probes): none while the other steps
        assert len(engine.seen) == profiled
        busy[0] = False
        await until(lambda: len(engine.seen) > profiled, timeout=10)  # it stopped: a probe runs
    finally:
        runner.stop()


async def test_a_probe_gives_way_to_a_request_and_its_steps_are_not_used(fast_probes, monkeypatch):
    monkeypatch.setattr(probes, "PROBE_STEPS", 50)
    monkeypatch.setattr(probes, "PROBE_MAX_STEPS", 50)
    delivered: list = []
    engine = SteppingEngine(slots=8, per_row=0.01)
    runner = EngineRunner(engine, asyncio.get_running_loop(), delivered.extend, profile=True)  # type: ignore[arg-type]
    try:
        assert await asyncio.to_thread(runner.profiled.wait, 10)
        profiled = len(engine.seen)
        await until(lambda: len(engine.seen) > profiled, timeout=10)  # a probe began
        alone = runner.load().alone_step_s
        engine.per_row = 0.1  # a probe's figure now would say 10x
        runner.add(GenRequest("real", [5, 6], SamplingParams(temperature=0, max_tokens=2)))
        await until(lambda: [o for o in delivered if o.finished], timeout=10)
        after = runner.load().alone_step_s
    finally:
        runner.stop()
    assert engine.seen[profiled].request_id in engine.cancelled  # the probe, cut
    assert [o.completion_tokens for o in delivered] == [1, 2]
    assert after == alone  # the cut probe measured nothing


async def test_a_profile_cut_short_beside_a_hog_still_reports_its_step_alone(monkeypatch):
    """Beside a hog the profile's lone request stepped 1-2 s a step: its batch is cut
    short like the full one (PROFILE_FULL_BUDGET_S), and the few steps it has are the step
    alone until probes add theirs (a missing step alone let the small-batch figure judge
    an idle fleet: 429 "estimated 145.9 s" for the README's request)."""
    from consumers.inference.runners import thread as runner_module

    monkeypatch.setattr(runner_module, "PROFILE_FULL_BUDGET_S", 0.2)
    engine = SteppingEngine(slots=8, per_row=0.06)  # 16 lone steps: ~1 s
    runner = EngineRunner(engine, asyncio.get_running_loop(), lambda _: None, profile=True)  # type: ignore[arg-type]
    try:
        assert await asyncio.to_thread(runner.profiled.wait, 10)
        load = runner.load()
    finally:
        runner.stop()
    assert runner_module.PROFILE_MIN_FULL_STEPS <= len(runner.figures.alone_idle) < runner_module.PROFILE_STEPS
    assert load.alone_step_s == pytest.approx(0.06, rel=0.5)
