"""Dynamic loss scaling: hysteresis, halving, the window, the floor (hand-traced sequences)."""

from types import SimpleNamespace

from zerospeed.runtime.loss_scaler import DynamicLossScaler, StaticLossScaler, build_loss_scaler


def test_halves_only_after_hysteresis_is_spent():
    s = DynamicLossScaler(initial_scale_power=4, scale_window=3, hysteresis=2)
    assert s.scale == 16.0
    s.update(True)  # first overflow spends hysteresis
    assert s.scale == 16.0
    s.update(True)  # second overflow halves
    assert s.scale == 8.0
    s.update(True)  # hysteresis stays spent until a window passes
    assert s.scale == 4.0


def test_grows_after_window_of_clean_steps_and_restores_hysteresis():
    s = DynamicLossScaler(initial_scale_power=4, scale_window=3, hysteresis=2)
    s.update(True)
    s.update(True)
    assert s.scale == 8.0
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)  # third clean step in a row
    assert s.scale == 16.0 and s.hysteresis_left == 2
    s.update(True)  # hysteresis restored: no halving
    assert s.scale == 16.0


def test_overflow_resets_window():
    s = DynamicLossScaler(initial_scale_power=2, scale_window=2, hysteresis=1)
    s.update(False)
    s.update(True)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0


def test_consecutive_hysteresis_restores_on_each_clean_step():
    s = DynamicLossScaler(initial_scale_power=4, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    s.update(True)
    s.update(False)
    s.update(True)
    assert s.scale == 16.0  # each overflow was forgiven
    s.update(True)
    assert s.scale == 8.0


def test_min_scale_floor():
    s = DynamicLossScaler(initial_scale_power=1, scale_window=10, hysteresis=1, min_scale=1.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 1.0


def test_state_round_trip():
    s = DynamicLossScaler(initial_scale_power=5, scale_window=4, hysteresis=3)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.hysteresis_left, t.clean_steps) == (32.0, 2, 1)


def test_builder_picks_static_or_dynamic():
    fp16 = SimpleNamespace(loss_scale=0, initial_scale_power=8, loss_scale_window=10, hysteresis=2,
                           consecutive_hysteresis=False, min_loss_scale=1.0)
    assert isinstance(build_loss_scaler("fp16", fp16), DynamicLossScaler)
    assert build_loss_scaler("fp16", fp16).scale == 256.0
    assert build_loss_scaler("fp16", SimpleNamespace(loss_scale=128.0)).scale == 128.0
    assert isinstance(build_loss_scaler("bf16", fp16), StaticLossScaler)
    assert build_loss_scaler("fp32", fp16).scale == 1.0
