"""DeepSpeed 0.19.8's behaviours that a script switching to zerospeed relies on (issue #27, part A).

Each was read in DeepSpeed 0.19.8's source (the bench venv's site-packages/deepspeed) and is listed in the README's
migration table: ``gradient_clipping`` defaults to 1.0 (runtime/constants.py); WarmupLR / WarmupDecayLR refuse a
non-positive ``warmup_num_steps`` and clamp it to at least 2 (runtime/lr_schedules.py); ``initialize`` with no
optimizer builds an engine for forward and evaluation (runtime/engine.py); ``bf16.check_grad_overflow`` defaults to
true (runtime/precision_config.py); ``compile.passes`` takes z1, z3, autosp, autotp (compile/config.py);
DataStates is ``datastates_ckpt`` (datastates/config.py). Plus DeepSpeed's public names: the LR schedule constants,
``DeepSpeedConfigError``, the launcher's ``main(args=...)``, the tag-validation ``AssertionError``, and two bugs
(every exception pickles; ``save_checkpoint(save_dir=None)`` is a clear ValueError).
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from pathlib import Path

import pytest
import torch

import zerospeed
from deepspeed_behaviour_cases import no_optimizer_forward
from engine_cases import config, global_batch, make_model
from zerospeed.config import ConfigError, load_config
from zerospeed.testing import run_distributed

DS_CONFIGS = Path(__file__).parents[1].parent / "shared" / "ds_configs"
BERT_CONFIG = DS_CONFIGS / "compression__bert__config__ds_config_W1A8_Qgroup64_fp32.json"


# -- gradient_clipping ------------------------------------------------------------------------------------------
def _sgd_step_norm(**extra) -> tuple[float, float]:
    """(the global gradient norm before clipping, the norm of the update) of one SGD(lr=1) step, one process."""
    cfg = config(0, 1, **extra)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
    cfg.pop("gradient_clipping")
    cfg.update(extra)
    engine, *_ = zerospeed.initialize(model=make_model(), config=cfg)
    before = [p.detach().clone() for p in engine.module.parameters()]
    x, y = global_batch(0)
    engine.backward(engine(x, y * 20))  # large targets: a gradient norm well above 1
    engine.step()
    delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(engine.module.parameters(), before)])
    return engine.get_global_grad_norm(), delta.norm().item()


def test_gradient_clipping_defaults_to_one_as_deepspeed():
    assert load_config({"train_batch_size": 1}).gradient_clipping == 1.0
    assert load_config({"train_batch_size": 1, "gradient_clipping": 0}).gradient_clipping == 0.0
    norm, update = _sgd_step_norm()  # no gradient_clipping key
    assert norm > 2.0
    # SGD(lr=1): the update is the clipped gradient, whose norm is max_norm up to fp32 rounding of the ~120-element
    # norm and of the scale (relative error a few hundred ulps at most)
    assert update == pytest.approx(1.0, rel=1e-5)
    norm0, update0 = _sgd_step_norm(gradient_clipping=0.0)  # 0 switches clipping off
    assert update0 == pytest.approx(norm0, rel=1e-5) and norm0 == pytest.approx(norm, rel=1e-5)


# -- WarmupLR / WarmupDecayLR ---------------------------------------------------------------------------------
def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_warmup_num_steps_is_clamped_to_two_and_zero_refused_as_deepspeed():
    from zerospeed.runtime.lr_schedules import WarmupDecayLR, WarmupLR

    for steps in (1, 2):
        s = WarmupLR(_sgd(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=steps, warmup_type="linear")
        assert s.warmup_num_steps == 2
        lrs = []
        for _ in range(3):
            s.step()
            lrs.append(s.get_last_lr()[0])
        assert lrs == [0.0, 0.5, 1.0]  # linear over W = max(2, n) = 2 steps
    assert WarmupDecayLR(_sgd(), total_num_steps=10, warmup_num_steps=1).warmup_num_steps == 2
    for cls, kw in ((WarmupLR, {}), (WarmupDecayLR, {"total_num_steps": 10})):
        with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_num_steps: 0 must be >= 1"):
            cls(_sgd(), warmup_num_steps=0, **kw)  # DeepSpeed 0.19.8: ValueError, "must be a positive integer"


def test_total_num_steps_below_warmup_is_refused_where_deepspeed_warns():
    """A deliberate difference (the 'warmup_total_steps' row): the schedule would end before its warmup."""
    from zerospeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR

    for cls in (WarmupDecayLR, WarmupCosineLR):
        with pytest.raises(ConfigError, match=r"params\.total_num_steps: 3 is less than warmup_num_steps \(5\)"):
            cls(_sgd(), total_num_steps=3, warmup_num_steps=5)
        assert cls(_sgd(), total_num_steps=5, warmup_num_steps=5).total_num_steps == 5


def test_hf_auto_fills_warmup_steps_zero_as_one():
    """HF's ZeRO-3 template with WarmupLR and warmup_steps=0: transformers 5.24 fills max(1, ...) (DeepSpeed 0.19.8
    refuses 0), and so does zerospeed's HF "auto" filling; the schedule then warms up over 2 steps."""
    from transformers import TrainingArguments

    from zerospeed.config.hf_auto import fill_auto

    args = TrainingArguments(output_dir="/tmp/unused", warmup_steps=0, learning_rate=0.01, report_to=[])
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                         "warmup_num_steps": "auto"}}}
    filled = fill_auto(raw, args, max_steps=5, world_size=1)
    assert filled["scheduler"]["params"]["warmup_num_steps"] == 1
    assert load_config(filled).scheduler.params["warmup_num_steps"] == 1


def test_lr_schedule_constants_are_deepspeeds():
    from zerospeed.runtime import lr_schedules as ls

    # deepspeed/runtime/lr_schedules.py (0.19.8): names and values
    expected = {"LR_SCHEDULE": "lr_schedule", "LR_RANGE_TEST": "LRRangeTest", "ONE_CYCLE": "OneCycle",
                "WARMUP_LR": "WarmupLR", "WARMUP_DECAY_LR": "WarmupDecayLR", "WARMUP_COSINE_LR": "WarmupCosineLR",
                "LR_RANGE_TEST_MIN_LR": "lr_range_test_min_lr", "LR_RANGE_TEST_STEP_RATE": "lr_range_test_step_rate",
                "LR_RANGE_TEST_STEP_SIZE": "lr_range_test_step_size",
                "LR_RANGE_TEST_STAIRCASE": "lr_range_test_staircase", "EDGE_VALUE": "edge_value",
                "MID_VALUE": "mid_value", "CYCLE_FIRST_STEP_SIZE": "cycle_first_step_size",
                "CYCLE_FIRST_STAIR_COUNT": "cycle_first_stair_count", "CYCLE_SECOND_STEP_SIZE": "cycle_second_step_size",
                "CYCLE_SECOND_STAIR_COUNT": "cycle_second_stair_count", "DECAY_STEP_SIZE": "decay_step_size",
                "CYCLE_MIN_LR": "cycle_min_lr", "CYCLE_MAX_LR": "cycle_max_lr", "DECAY_LR_RATE": "decay_lr_rate",
                "CYCLE_MIN_MOM": "cycle_min_mom", "CYCLE_MAX_MOM": "cycle_max_mom", "DECAY_MOM_RATE": "decay_mom_rate",
                "WARMUP_MIN_LR": "warmup_min_lr", "WARMUP_MAX_LR": "warmup_max_lr",
                "WARMUP_NUM_STEPS": "warmup_num_steps", "WARMUP_TYPE": "warmup_type", "WARMUP_LOG_RATE": "log",
                "WARMUP_LINEAR_RATE": "linear", "WARMUP_MIN_RATIO": "warmup_min_ratio",
                "COS_MIN_RATIO": "cos_min_ratio", "TOTAL_NUM_STEPS": "total_num_steps"}
    assert {k: getattr(ls, k) for k in expected} == expected
    assert ls.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    # a scheduler section written with the constants, as DeepSpeed's own tests write it, builds
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": ls.WARMUP_DECAY_LR, "params": {ls.WARMUP_MIN_LR: 0.0, ls.WARMUP_MAX_LR: 0.1,
                                                                 ls.WARMUP_NUM_STEPS: 4, ls.TOTAL_NUM_STEPS: 8,
                                                                 ls.WARMUP_TYPE: ls.WARMUP_LINEAR_RATE}}}
    _, _, _, sched = zerospeed.initialize(model=make_model(), config=cfg)
    assert isinstance(sched, ls.WarmupDecayLR) and sched.warmup_num_steps == 4


# -- initialize with no optimizer -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_no_optimizer_builds_an_engine_for_forward(stage):
    for rank, out in enumerate(run_distributed(no_optimizer_forward, 2, stage)):
        assert out["optimizer"] is None and out["scheduler"] is None
        assert out["got"] == out["want"], rank  # the same module and inputs: the same loss
        total = sum(p.numel() for p in make_model().parameters())
        assert out["held"] == (0 if stage == 3 else total)  # stage 3 partitions the parameters (placeholders)
        for error, call in zip(out["errors"], ("engine.backward", "engine.step")):
            assert error is not None and error.startswith(call) and "without an optimizer" in error


def test_no_optimizer_with_a_scheduler_is_refused():
    cfg = config(0, 1)
    del cfg["optimizer"]
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    with pytest.raises(ConfigError, match=r"scheduler: .*needs an optimizer"):
        zerospeed.initialize(model=make_model(), config=cfg)


@pytest.mark.skipif(not BERT_CONFIG.exists(), reason=f"DeepSpeedExamples configs are not at {DS_CONFIGS}")
def test_deepspeed_examples_bert_compression_config_without_optimizer():
    """DeepSpeedExamples' BERT compression config has no optimizer section (the example passes one); with neither,
    initialize builds the evaluation engine, and with the example's optimizer it trains."""
    from compression_cases import tiny_bert
    from zerospeed.compression import init_compression

    model = init_compression(tiny_bert(num_layers=2), str(BERT_CONFIG))
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    engine, optimizer, _, _ = zerospeed.initialize(model=model, config=str(BERT_CONFIG))
    assert optimizer is None
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids).logits, want)
    model = init_compression(tiny_bert(num_layers=2), str(BERT_CONFIG))
    engine, optimizer, _, _ = zerospeed.initialize(model=model, config=str(BERT_CONFIG),
                                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss = engine(input_ids=ids, labels=torch.zeros(32, dtype=torch.long)).loss
    engine.backward(loss)
    engine.step()
    assert isinstance(optimizer, torch.optim.AdamW) and engine.global_steps == 1


# -- config keys ----------------------------------------------------------------------------------------------
def test_bf16_check_grad_overflow_defaults_to_true():
    assert load_config({"train_batch_size": 1, "bf16": {"enabled": True}}).bf16.check_grad_overflow is True


def test_compile_passes_take_deepspeeds_values():
    from zerospeed.compile.passes import PassRegistry
    from zerospeed.config.compile import DEEPSPEED_PASS_NAMES

    def passes(names, deepcompile=True):
        return load_config({"train_batch_size": 1, "compile": {"deepcompile": deepcompile, "passes": names}}).compile.passes

    assert passes(["z1"]) is None and passes(["z3"], deepcompile=False) is None  # the stage's ZeRO passes run anyway
    assert passes(["z3", "prefetch"]) == ["prefetch"]
    for name, what in (("autosp", "AutoSP"), ("autotp", "AutoTP")):
        with pytest.raises(ConfigError, match=rf"compile\.passes: '{name}' is DeepSpeed's {what}"):
            passes([name])
    assert set(DEEPSPEED_PASS_NAMES) == {"z1", "z3", "autosp", "autotp"}
    registry = PassRegistry()
    assert not set(registry.known()) & set(DEEPSPEED_PASS_NAMES)  # zerospeed's own passes never collide
    with pytest.raises(ValueError, match="'z3' is one of DeepSpeed's compile.passes values"):
        registry.register("z3", lambda gm, profile: gm)


def test_datastates_key_is_datastates_ckpt():
    with pytest.raises(ConfigError, match=r"datastates_ckpt: not supported by zerospeed yet \(DataStates"):
        load_config({"train_batch_size": 1, "datastates_ckpt": {"enabled": False}})  # DeepSpeed: on when present
    assert load_config({"train_batch_size": 1, "datastates_ckpt": False}).train_batch_size == 1
    with pytest.raises(ConfigError, match=r"datastates: unknown key"):
        load_config({"train_batch_size": 1, "datastates": {"enabled": True}})


def test_engine_config_reads_as_the_dict_the_user_gave():
    # DeepSpeed's engine.config is the user's dict; transformers' Trainer.save_model reads the stage with .get
    given = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}
    cfg = load_config(given)
    assert cfg.get("zero_optimization", {}).get("stage") == 3 and cfg.get("zero_optimization") == given[
        "zero_optimization"]
    assert cfg.get("bf16") is None and cfg.get("bf16", {}) == {}  # not given: the default, as a dict's get
    cfg.get("zero_optimization")["stage"] = 0  # a copy: the config stays as parsed
    assert cfg.get("zero_optimization")["stage"] == 3 and cfg.zero_optimization.stage == 3


def test_dotted_top_level_keys_are_ignored_as_deepspeed_ignores_them():
    # TRL's prepare_deepspeed passes {"zero_optimization.reduce_bucket_size": ...} for its reference model
    given = {"train_batch_size": 2, "zero_optimization": {"stage": 3},
             "zero_optimization.reduce_bucket_size": 7, "zero_optimization.stage3_param_persistence_threshold": 9}
    with pytest.warns(UserWarning, match=r"'zero_optimization.reduce_bucket_size', "
                                         r"'zero_optimization.stage3_param_persistence_threshold' ignored"):
        cfg = load_config(given)
    plain = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}})
    assert cfg.zero_optimization == plain.zero_optimization
    with pytest.raises(ConfigError, match=r"zero_optimisation.stage: unknown key"):
        load_config({"train_batch_size": 2, "zero_optimisation.stage": 3})  # not a section's path: still refused



def test_offload_param_below_stage_3_is_ignored_with_a_warning_as_deepspeed():
    """Accelerate's DeepSpeedPlugin(zero_stage=2, offload_param_device="cpu") writes offload_param at stage 2 (its own
    tests/deepspeed do); DeepSpeed 0.19.8 reads the section at stage 3 only. zerospeed refused it; now it warns once
    naming it and trains exactly as without it."""
    import warnings

    weights = []
    for offload in (False, True):
        cfg = config(2, 1)
        if offload:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, *_ = zerospeed.initialize(model=make_model(), config=cfg)
        named = [w for w in caught if "zero_optimization.offload_param is ignored at zero_optimization.stage 2"
                 in str(w.message)]
        assert len(named) == int(offload)
        x, y = global_batch(0)
        engine.backward(engine(x, y))
        engine.step()
        weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_managed_gradient_accumulation_false_is_refused_naming_the_way_to_do_it():
    """DeepSpeed 0.19.8's key: ``true`` (its default) is zerospeed's behaviour, accepted; ``false`` is not built and
    said so (it read as an unknown key, 'did you mean gradient_accumulation_steps')."""
    for value in (True, None):
        assert load_config({"train_batch_size": 2, "managed_gradient_accumulation": value}).train_batch_size == 2
    with pytest.raises(ConfigError, match=r"managed_gradient_accumulation: not supported by zerospeed yet \(false: "
                                          r"every step\(\) ends a window; .*set_gradient_accumulation_boundary"):
        load_config({"train_batch_size": 2, "managed_gradient_accumulation": False})

# -- names ----------------------------------------------------------------------------------------------------
def test_deepspeed_config_error_is_config_error():
    assert zerospeed.DeepSpeedConfigError is ConfigError
    with pytest.raises(zerospeed.DeepSpeedConfigError, match="train_batch_size"):
        load_config({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2})
    assert str(zerospeed.DeepSpeedConfigError("bad")) == "zerospeed config: bad"  # DeepSpeed's one-message form


def test_launcher_main_takes_args_keyword(capsys, tmp_path):
    from zerospeed.launcher import runner

    assert list(inspect.signature(runner.main).parameters) == ["args"]
    script = tmp_path / "train.py"
    script.write_text("")
    assert runner.main(args=["--dry_run", "--num_gpus", "2", str(script), "--lr", "1"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"--nproc_per_node 2 {script} --lr 1")
    assert runner.parse_args(args=[str(script)]).user_script == str(script)


def test_tag_mismatch_error_is_an_assertion_error():
    from zerospeed.checkpoint.errors import CheckpointSaveError, CheckpointTagMismatchError

    assert issubclass(CheckpointTagMismatchError, AssertionError)
    assert issubclass(CheckpointTagMismatchError, CheckpointSaveError)


def test_save_checkpoint_without_a_directory_is_a_value_error():
    engine, *_ = zerospeed.initialize(model=make_model(), config=config(0, 1))
    for bad in (None, "", 3):
        with pytest.raises(ValueError, match=r"save_checkpoint: save_dir must be a directory path"):
            engine.save_checkpoint(bad)


def test_move_to_device_as_deepspeed():
    from zerospeed.runtime.utils import move_to_device

    a, b = torch.ones(2), torch.zeros(3)
    moved = move_to_device({"x": [a, (b, 7)], "n": None}, "cpu", criterion_func=lambda t: t is a)
    assert moved["x"][0] is a  # selected: moved in place, same object
    assert torch.equal(moved["x"][1][0], b) and moved["x"][1][1] == 7 and moved["n"] is None
    assert isinstance(moved["x"][1], tuple)
    meta = move_to_device([torch.ones(2)], "meta")
    assert meta[0].device.type == "meta"


# -- every exception of the package pickles ----------------------------------------------------------------------
_SAMPLES = {"str": "x", "int": 3, "int | None": 3, "str | None": "p", "dict[str, str] | None": {"k": "v"},
            "str | os.PathLike[str]": "/p", "Action | None": None}


#: modules whose import does something (run a CLI, switch the DeepSpeed alias on): not imported by the walk
_ACTS_ON_IMPORT = ("__main__", "zerospeed.as_deepspeed")


def _exception_classes() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(zerospeed.__path__, "zerospeed."):
        if info.name.endswith("__main__") or info.name.startswith(_ACTS_ON_IMPORT[1:]):
            continue
        module = importlib.import_module(info.name)
        found += [obj for obj in vars(module).values()
                  if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__]
    return found


def _instance(cls: type) -> BaseException:
    args, kwargs = [], {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            args.append("message")
        elif p.kind is not p.VAR_KEYWORD:
            value = _SAMPLES.get(str(p.annotation), "x")
            if p.kind is p.KEYWORD_ONLY or p.default is not p.empty:
                kwargs[p.name] = value
            else:
                args.append(value)
    return cls(*args, **kwargs)


def test_every_exception_class_round_trips_through_pickle():
    classes = _exception_classes()
    assert len(classes) >= 30 and ConfigError in classes
    broken = []
    for cls in classes:
        error = _instance(cls)
        try:
            back = pickle.loads(pickle.dumps(error))
            same = type(back) is cls and str(back) == str(error) and back.args == error.args and \
                {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(error).items()}
        except Exception as e:  # noqa: BLE001 - reported below
            same, back = False, e
        if not same:
            broken.append(f"{cls.__module__}.{cls.__name__}: {back!r}")
    assert not broken, broken


# -- bf16 with fp32 gradient accumulation ---------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_with_fp32_gradient_accumulation(stage):
    from deepspeed_behaviour_cases import bf16_fp32_accumulation

    numel = sum(p.numel() for p in make_model().parameters())
    for out in run_distributed(bf16_fp32_accumulation, 2, stage, 4):
        # stages 1 and 2 sum each rank's bf16 micro-batch gradients in fp32 and reduce in fp32: a few fp32 roundings
        # per element (<= 8 terms), so the norm agrees to ~1e-6; stage 3 reduces each micro-batch in bf16 (as
        # DeepSpeed's ZeRO-3 does) before the fp32 sum: one bf16 rounding (2**-8 relative) per micro-batch
        rel = 1e-5 if stage < 3 else 4 * 2.0 ** -8
        assert out["norm"] == pytest.approx(out["want"], rel=rel)
        # the accumulated gradients are fp32: 4 bytes per element of the rank's share (all of it at stage 1's
        # persistent buffer, its shard plus padding at stages 2 and 3)
        share = numel if stage == 1 else numel / 2
        assert out["grad_bytes"] >= 4 * share


def test_bf16_with_fp32_accumulation_needs_zero():
    cfg = config(0, 1, precision="bf16", data_types={"grad_accum_dtype": "fp32"})
    with pytest.raises(ConfigError, match=r"data_types\.grad_accum_dtype: 'fp32' with bf16 needs ZeRO stage 1, 2 or 3"):
        zerospeed.initialize(model=make_model(), config=cfg)


def test_pipeline_without_optimizer_is_refused():
    """The forward-only engine is built for a plain module; a PipelineModule without an optimizer is refused (its
    train_batch would otherwise run no update)."""
    from zerospeed.pipe import PipelineModule

    model = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], num_stages=1,
                           loss_fn=torch.nn.MSELoss())
    with pytest.raises(ConfigError, match=r"optimizer: no optimizer: the pipeline engine trains"):
        zerospeed.initialize(model=model, config={"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2})


# -- the migration table ---------------------------------------------------------------------------------------
#: every behaviour issue 27 lists (its "What to build" and "public module paths" lists and the two bugs)
ISSUE_27_BEHAVIOURS = (
    "gradient_clipping_default", "warmup_num_steps_clamp", "initialize_without_optimizer", "bf16_check_grad_overflow",
    "compile_passes", "datastates_ckpt", "lr_schedule_constants", "ds_param_attributes", "partition_parameters_path",
    "launcher_main_args", "checkpoint_tag_assertion", "deepspeed_config_error", "bf16_grad_accum_fp32",
    "module_attribute_chains", "set_random_seed", "pickle_every_exception", "save_checkpoint_without_dir",
    "zero_init_auto", "parameter_gathered_in_forward", "deepspeed_package_name", "engine_config_get",
    "dotted_top_level_keys")


def test_migration_table_lists_every_behaviour_of_issue_27():
    import importlib.util

    from zerospeed.deepspeed_alias.behaviours import BEHAVIOURS

    keys = [b.key for b in BEHAVIOURS]
    assert len(keys) == len(set(keys))
    assert not set(ISSUE_27_BEHAVIOURS) - set(keys)
    spec = importlib.util.spec_from_file_location("gen_pages", Path(__file__).parents[1] / "docs" / "gen_pages.py")
    gen_pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_pages)
    page = gen_pages.migration_tables()
    for b in BEHAVIOURS:  # the migration page shows every row as the module has it
        assert f"| {b.behaviour} | {b.deepspeed} | {b.zerospeed} |" in page, b.key


def test_git_version_info_as_deepspeeds():
    # DeepSpeed's test harness (tests/unit/util.py) and ds_report read it; zerospeed compiles none of its ops
    from zerospeed import git_version_info as g

    assert g.version == zerospeed.__version__ and g.git_hash == "unknown"
    assert set(g.torch_info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    assert g.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert g.installed_ops and not any(g.installed_ops.values())
    assert g.accelerator_name == ("cuda" if torch.cuda.is_available() else "cpu")


# -- engine.backward's return value -----------------------------------------------------------------------------
def test_backward_returns_the_loss_divided_by_the_accumulation_steps():
    """DeepSpeed 0.19.8's engine.backward returns ``loss / gradient_accumulation_steps`` (``scale_wrt_gas=True``) or the
    loss itself (DeepSpeed's tests/unit/runtime/test_multi_output_model.py checks it); zerospeed returned the loss."""
    engine, *_ = zerospeed.initialize(model=make_model(), config=config(0, 4))
    x, y = global_batch(0)
    loss = engine(x, y)
    assert torch.equal(engine.backward(loss, retain_graph=True), loss / 4)  # division by 4: exact
    assert engine.backward(loss, scale_wrt_gas=False) is loss
