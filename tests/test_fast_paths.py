"""The fast-path chooser (zerospeed.ops.fast_paths): fed fake timings, it picks the faster candidate,
caches the choice per shape class, honours forced settings, and names bad switches. Nothing here
times anything real."""

from __future__ import annotations

import logging

import pytest

from zerospeed.ops.fast_paths import (
    ENV_VAR,
    Candidate,
    FastPathChooser,
    FastPathError,
    env_settings,
    resolve_setting,
    size_class,
    validate_setting,
)


class FakeClock:
    """``measure`` for the chooser: each candidate 'takes' a scripted time; counts the calls."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times = times
        self.calls: dict[str, int] = {}

    def __call__(self, name, fn):
        self.calls[name] = self.calls.get(name, 0) + 1
        fn()
        t = self.times[name]
        if isinstance(t, Exception):
            raise t
        return t


def cands(*names, unavailable=()):
    return {n: Candidate(None, "no int8 units") if n in unavailable else Candidate(lambda: None) for n in names}


def test_picks_the_faster_candidate_and_caches_it_per_shape_class():
    clock = FakeClock({"float32": 2e-3, "bf16": 1e-3, "int8": 40e-3})
    ch = FastPathChooser(measure=clock, repeats=3, budget_s=1.0)
    assert ch.choose("greedy_head", (8, 4096), cands("float32", "bf16", "int8")) == "bf16"
    first = dict(clock.calls)
    assert first == {"float32": 4, "bf16": 4, "int8": 4}  # one warm-up + 3 timed runs each
    # cached: the same shape class measures nothing again
    assert ch.choose("greedy_head", (8, 4096), cands("float32", "bf16", "int8")) == "bf16"
    assert clock.calls == first
    # another shape class is measured on its own
    clock.times["int8"] = 0.5e-3
    assert ch.choose("greedy_head", (16, 4096), cands("float32", "bf16", "int8")) == "int8"
    rep = ch.report()
    assert [c.chosen for c in rep] == ["bf16", "int8"]
    assert rep[0].timings_ms == pytest.approx({"float32": 2.0, "bf16": 1.0, "int8": 40.0})


def test_the_reference_keeps_the_job_within_the_noise_margin():
    clock = FakeClock({"off": 1.00e-3, "on": 0.97e-3})
    assert FastPathChooser(measure=clock).choose("cpu_kernels", "x", cands("off", "on")) == "off"
    clock = FakeClock({"off": 1.00e-3, "on": 0.80e-3})
    assert FastPathChooser(measure=clock).choose("cpu_kernels", "x", cands("off", "on")) == "on"


def test_budget_caps_the_runs_of_a_slow_candidate():
    clock = FakeClock({"float32": 1e-3, "int8": 0.2})
    ch = FastPathChooser(measure=clock, repeats=5, budget_s=0.05)
    assert ch.choose("greedy_head", 1, cands("float32", "int8")) == "float32"
    assert clock.calls["int8"] == 2  # warm-up, then one timed run: past the budget after that
    assert clock.calls["float32"] == 6


def test_forced_setting_is_used_without_measuring():
    clock = FakeClock({"float32": 1e-3, "int8": 9.0})
    ch = FastPathChooser(measure=clock)
    choice = ch.choice("greedy_head", 1, cands("float32", "int8"), setting="int8", source="greedy_head")
    assert choice.chosen == "int8" and "forced" in choice.reason
    assert clock.calls == {}


def test_forced_candidate_that_cannot_run_is_an_error_naming_the_switch():
    ch = FastPathChooser(measure=FakeClock({"float32": 1e-3}))
    with pytest.raises(FastPathError, match=r"inference\.greedy_head: 'int8' cannot run on this machine: no int8"):
        ch.choose("greedy_head", 1, cands("float32", "int8", unavailable=("int8",)), setting="int8",
                  source="inference.greedy_head")
    with pytest.raises(FastPathError, match=r"greedy_head: 'bf16' does not apply here"):
        ch.choose("greedy_head", 1, cands("float32", "int8"), setting="bf16")


def test_unavailable_and_failing_candidates_are_excluded_and_reported(caplog):
    clock = FakeClock({"float32": 3e-3, "bf16": RuntimeError("oneDNN says no"), "int8": 1e-3})
    ch = FastPathChooser(measure=clock)
    with caplog.at_level(logging.INFO, logger="zerospeed.fast_paths"):
        choice = ch.choice("greedy_head", 2, cands("float32", "bf16", "int8", unavailable=("int8",)))
    assert choice.chosen == "float32"
    assert "oneDNN says no" in choice.excluded["bf16"] and choice.excluded["int8"] == "no int8 units"
    assert "greedy_head[2]: float32" in caplog.text  # reported once, when made
    # only one candidate left: no measuring at all
    clock2 = FakeClock({})
    assert FastPathChooser(measure=clock2).choose("greedy_head", 2, cands("float32", "int8",
                                                                            unavailable=("int8",))) == "float32"
    assert clock2.calls == {}


def test_every_candidate_failing_falls_back_to_the_reference():
    err = RuntimeError("broken")
    ch = FastPathChooser(measure=FakeClock({"off": err, "on": err}))
    choice = ch.choice("cpu_kernels", 0, cands("off", "on"))
    assert choice.chosen == "off" and "reference" in choice.reason


def test_bad_settings_name_the_key_and_the_allowed_values(monkeypatch):
    with pytest.raises(FastPathError, match=r"greedy_head: 'fp8' is not one of auto, float32, bf16, int8"):
        validate_setting("greedy_head", "fp8")
    with pytest.raises(FastPathError, match=r"serve --cpu-kernels: 'yes' is not one of auto, off, on"):
        resolve_setting("cpu_kernels", "yes", source="serve --cpu-kernels")
    with pytest.raises(FastPathError, match="unknown fast path 'warp'"):
        validate_setting("warp", "auto")
    with pytest.raises(FastPathError, match=f"{ENV_VAR}: 'greedy_head' is not of the form"):
        env_settings({ENV_VAR: "greedy_head"})
    with pytest.raises(FastPathError, match=f"{ENV_VAR}: cpu_kernels: 'maybe' is not one of"):
        env_settings({ENV_VAR: "cpu_kernels=maybe"})


def test_environment_sets_only_what_the_config_leaves_at_auto():
    env = {ENV_VAR: " greedy_head=float32 , cpu_kernels=off"}
    assert env_settings(env) == {"greedy_head": "float32", "cpu_kernels": "off"}
    assert resolve_setting("greedy_head", "auto", environ=env) == "float32"
    assert resolve_setting("greedy_head", "int8", environ=env) == "int8"
    assert resolve_setting("cpu_kernels", "auto", environ={}) == "auto"


def test_size_class():
    assert [size_class(n) for n in (0, 1, 2, 3, 8, 9, 1000)] == [1, 1, 2, 4, 8, 16, 1024]
