"""DeepSpeed 0.19.8 behaviours a switching script or library relies on, and what zerospeed does (issue 27).

The migration page's table (``docs/gen_pages.py``) is generated from :data:`BEHAVIOURS`, so the docs list what
this module says; each row names the DeepSpeed file it was read in and is tested in
``tests/test_deepspeed_behaviours.py`` (the HuggingFace rows in ``tests/test_as_deepspeed*.py`` and
``tests/test_ds_param_view.py``). Data only: nothing here changes behaviour.
"""

from __future__ import annotations

from typing import NamedTuple


class Behaviour(NamedTuple):
    key: str
    """A stable id (tests check that every behaviour of issue 27 has its row)."""
    behaviour: str
    deepspeed: str
    """What DeepSpeed 0.19.8 does (Markdown)."""
    zerospeed: str
    """What zerospeed does, and what it did before when that differed (Markdown)."""


BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour('gradient_clipping_default',
              '`gradient_clipping` absent',
              '1.0 (`runtime/constants.py`)',
              '1.0 (was 0: no clipping); `0` switches clipping off'),
    Behaviour('warmup_num_steps_clamp',
              '`WarmupLR` / `WarmupDecayLR` `warmup_num_steps`',
              '0 or less: `ValueError`; else `max(2, n)` (`runtime/lr_schedules.py`)',
              'same: 0 is a `ConfigError` (a `ValueError`) naming `scheduler.params.warmup_num_steps`, 1 warms up '
              'over 2 steps; HF `"auto"` is filled with `max(1, warmup_steps)` as transformers 5.24 fills it (was '
              'the raw 0)'),
    Behaviour('warmup_total_steps',
              '`WarmupDecayLR` / `WarmupCosineLR` with `total_num_steps < warmup_num_steps`',
              'a logged warning',
              'a `ConfigError` naming `scheduler.params.total_num_steps` (deliberate, unchanged: the schedule '
              'would end before its warmup)'),
    Behaviour('initialize_without_optimizer',
              '`initialize` with no optimizer (none passed, no `optimizer` section)',
              'an engine for forward/eval: optimizer `None` at stage 0, ZeRO-3 partitions the parameters, stages '
              '1-2 assert "requires an optimizer" (`runtime/engine.py`)',
              'an engine for forward/eval at every stage (ZeRO-3 partitioned; a `PipelineModule` still needs an '
              'optimizer), `None` in the optimizer slot, `engine.backward` / `engine.step` raise one line (was '
              '`ConfigError: no optimizer`); a `scheduler` with no optimizer is a `ConfigError` (DeepSpeed '
              'ignores it)'),
    Behaviour('bf16_check_grad_overflow',
              '`bf16.check_grad_overflow` default',
              '`true` (`runtime/precision_config.py`)',
              '`true` (was `false`); zerospeed skips a step with non-finite gradients in every precision whatever '
              'the flag'),
    Behaviour('compile_passes',
              '`compile.passes`',
              '`z1`, `z3`, `autosp`, `autotp` (`compile/config.py`)',
              "`z1` / `z3` accepted (DeepCompile runs the stage's ZeRO passes anyway), `autosp` / `autotp` a "
              "`ConfigError` naming them; other names are zerospeed's own graph passes, none named like "
              "DeepSpeed's (`register_compile_pass` refuses the four) (was: any name taken as a zerospeed pass)"),
    Behaviour('datastates_ckpt',
              'DataStates checkpointing',
              'key `datastates_ckpt`, on whenever present and not `false` (`datastates/config.py`)',
              '`datastates_ckpt` refused by name unless `false` / `null` (was the key `datastates`)'),
    Behaviour('bf16_grad_accum_fp32',
              'bf16 with `data_types.grad_accum_dtype: "fp32"`',
              'fp32 gradient accumulation at ZeRO 1-3, "unsupported mix" at stage 0 (`runtime/engine.py`)',
              "built at ZeRO 1-3 (was a `ConfigError`): stage 1 adds each backward's bf16 gradient into an fp32 "
              'buffer, stages 2 and 3 sum the reduced shards in fp32 (stage 3 reduces each micro-batch in bf16 '
              "first, as DeepSpeed's ZeRO-3 does); stage 0 a `ConfigError`, as DeepSpeed"),
    Behaviour('module_attribute_chains',
              '`deepspeed.runtime.utils.set_random_seed(...)` after `import deepspeed` alone',
              'works: the import loads the module tree',
              "works: every package loads its submodules on first attribute access (every path of DeepSpeed's "
              '420-module tree that zerospeed has: 39 today, tested each in an interpreter where it was not '
              "loaded yet; `module_inject.auto_tp` is zerospeed's `auto_tp()` function); `import zerospeed` 20.5 "
              "-> 21.0 ms (median of 21, `-X importtime`) (was `AttributeError: module 'zerospeed.runtime' has no "
              "attribute 'utils'`)"),
    Behaviour('set_random_seed',
              '`set_random_seed(seed)`',
              'any int; NumPy `seed % 2**32`, torch `seed % 2**63` (`runtime/utils.py`)',
              'same (was: negative refused)'),
    Behaviour('move_to_device',
              '`runtime.utils.move_to_device(item, device, criterion_func)`',
              'nested lists / tuples / dicts; selected tensors moved in place',
              'same; a non-tensor leaf is returned as it is (DeepSpeed: `AttributeError`) (was missing)'),
    Behaviour('lr_schedule_constants',
              'LR schedule constants (`WARMUP_LR`, `LR_RANGE_TEST`, `ONE_CYCLE`, `WARMUP_DECAY_LR`, '
              '`WARMUP_COSINE_LR`, `VALID_LR_SCHEDULES`, `WARMUP_NUM_STEPS`, ...)',
              '`runtime/lr_schedules.py`',
              'the same 32 names and values in `zerospeed.runtime.lr_schedules` (was missing)'),
    Behaviour('partition_parameters_path',
              '`deepspeed.runtime.zero.partition_parameters`',
              '`Init`, `GatheredParameters`, `ZeroParamStatus`, `zero_wrapper_for_fp_tensor_constructor`, '
              '`_orig_torch_*`, ...',
              "`zerospeed.runtime.zero[.partition_parameters]`: zerospeed.zero's objects under DeepSpeed's path, "
              "the constructor wrapper to DeepSpeed's semantics, torch's constructors (zerospeed never replaces "
              'them) (was missing)'),
    Behaviour('launcher_main_args',
              'launcher `runner.main` / `parse_args`',
              '`main(args=None)`',
              '`main(args=None)` (was `argv`)'),
    Behaviour('checkpoint_tag_assertion',
              'checkpoint tags that differ across ranks with `checkpoint.tag_validation: "Fail"`',
              '`AssertionError` (`_checkpoint_tag_validation`)',
              '`CheckpointTagMismatchError`, a `CheckpointSaveError` that is an `AssertionError` (was '
              '`CheckpointSaveError` only)'),
    Behaviour('deepspeed_config_error',
              '`deepspeed.DeepSpeedConfigError`',
              'the config error class',
              '`zerospeed.DeepSpeedConfigError` is `ConfigError` (one-message form accepted) (was missing)'),
    Behaviour('pickle_every_exception',
              'an exception raised in a worker process',
              "DeepSpeed's exceptions are plain `Exception` subclasses",
              'every exception class of the package round-trips through `pickle` with its fields (was: '
              "`ConfigError` could not be unpickled, so a worker's error hung the parent waiting for it)"),
    Behaviour('save_checkpoint_without_dir',
              '`save_checkpoint(save_dir=None)`',
              'fails inside the saver',
              '`ValueError: save_checkpoint: save_dir must be a directory path` before touching the saver (was a '
              '`TypeError` deep in the saver)'),
    Behaviour('engine_config_get',
              '`engine.config`',
              "the config the user passed (a dict, for HF's libraries), read with `.get` (transformers' "
              '`Trainer.save_model`: `engine.config.get("zero_optimization", {}).get("stage")`) '
              '(`runtime/engine.py`)',
              'the parsed `ZeroSpeedConfig`; its `.get(key, default)` returns a copy of the value the user gave '
              'for that top-level key, so such reads work (was `AttributeError`)'),
    Behaviour('dotted_top_level_keys',
              'a top-level key written as a dotted path (`"zero_optimization.reduce_bucket_size"`, as TRL\'s '
              '`prepare_deepspeed` writes for its reference model)',
              'never read: DeepSpeed reads only its own top-level names',
              'dropped with a `UserWarning` naming it (was `ConfigError: unknown key`); other unknown keys are '
              'still refused'),
    Behaviour('zero_init_auto',
              '`zero.Init(config_dict_or_path=...)` with HF `"auto"` values (transformers\' `from_pretrained` '
              'under `HfDeepSpeedConfig`)',
              '`"auto"` read as unset',
              "the same (was `ConfigError`); `from_pretrained` under ZeRO-3 loads each rank's shard only: peak "
              'anonymous memory per rank <= model / world + largest tensor + 32 MiB '
              '(`tests/test_as_deepspeed_sharded_load.py`)'),
    Behaviour('ds_param_attributes',
              '`ds_id`, `ds_numel`, `ds_shape`, `ds_status`, `ds_tensor` on ZeRO-3 parameters, `ZeroParamStatus`',
              'attributes set on each parameter',
              "read-only properties of a parameter subclass that look the values up in zerospeed's shard registry "
              "(no state on the parameter) (was missing: PEFT's counts were wrong, `merge_and_unload` failed)"),
    Behaviour('parameter_gathered_in_forward',
              'a parameter read in a forward that never calls its module, gathered with `GatheredParameters` '
              "(TRL's fused LM head reads `lm_head.weight`)",
              'registered as an external parameter only when `fwd_module=` is given '
              '(`runtime/zero/partition_parameters.py`)',
              'registered automatically as an external parameter of the model when gathered inside its forward '
              'with grad on, so backward gathers it again before its gradient arrives; gathered around the engine '
              'call instead (released before backward), the failing backward names it and '
              '`register_external_parameter` (was: backward failed with `The size of tensor a (0) must match ...`)'),
    Behaviour('deepspeed_package_name',
              '`import deepspeed` in Transformers, Accelerate, PEFT, TRL',
              'the real package',
              '`zerospeed-as-deepspeed COMMAND` or `import zerospeed.as_deepspeed`: `deepspeed.a.b` is '
              '`zerospeed.a.b`, never active unless asked, refused when a real DeepSpeed is importable (unless '
              '`--force`), a path or name zerospeed lacks refused naming it'),
    Behaviour('backward_return_value',
              '`engine.backward(loss)` return value',
              '`loss / gradient_accumulation_steps` (`scale_wrt_gas=True`), else `loss` (`runtime/engine.py`)',
              'the same (was `loss` in both cases)'),
    Behaviour('tensor_fragment_api',
              '`deepspeed.utils.safe_get_full_grad` / `_fp32_param` / `_optimizer_state`, their setters, the '
              'ZeRO-3 `safe_get_local_*` / `safe_set_local_*`',
              'read through state set on each parameter (`_hp_mapping`, `_z3_optimizer`); at ZeRO-0 without bf16 '
              'the fp32 parameter and optimizer state read as `None` (`utils/tensor_fragment.py`)',
              "read from the strategies' shards at every stage (a weak parameter -> strategy map, nothing on the "
              'parameter); at ZeRO-0 the values are returned too; `safe_get_full_grad` between micro-batches at '
              'stages 0-1, where nothing is reduced yet, raises one line (was missing)'),
    Behaviour('z3_leaf_modules',
              '`deepspeed.utils.set_z3_leaf_modules` (MoE blocks)',
              "sets `module._z3_leaf`; read when the hooks are installed (`utils/z3_leaf_module.py`)",
              "kept in zerospeed's ZeRO-3 registry (no attribute on the module), read when the engine is built; a "
              "leaf's subtree is gathered at once, no hooks below it, its gradients reduced in bucket order after "
              'backward; set after the engine exists it warns (was missing)'),
    Behaviour('trl_generation_hooks',
              "`engine.optimizer.parameter_offload` (TRL's `remove_hooks` / `add_hooks` around generation)",
              "the ZeRO-3 optimizer's `DeepSpeedZeRoOffload`",
              "a view over zerospeed's hooks on a subclass of the optimizer's own class (its state unchanged): "
              'removing its handle removes every module hook, `_register_deepspeed_module` re-installs them and '
              "the prefetch trace is recorded again (was: `GRPOTrainer` at ZeRO-3 failed in generation)"),
    Behaviour('engine_no_sync',
              "`engine.no_sync()` (Accelerate's `accumulate` enters it between syncs at ZeRO 0-1)",
              'backward inside skips the reduction; `step()` inside, nesting and stages 2-3 raise '
              '`AssertionError` (`runtime/engine.py`)',
              'the same, with the same messages (was: `NotImplementedError`, so `accelerate launch '
              '--use_deepspeed --zero_stage 1` with gradient accumulation failed)'),
    Behaviour('client_optimizer_wins',
              'an optimizer / lr scheduler passed to `initialize` as well as an `optimizer` / `scheduler` section',
              "the one passed is used, the section ignored (`runtime/engine.py` `_configure_optimizer` / "
              '`_configure_lr_scheduler`)',
              'the same, and the ignored section is named in a warning on rank 0 (was: a `ConfigError` asking to '
              'keep one)'),
    Behaviour('offload_param_below_stage_3',
              '`zero_optimization.offload_param` at stage 0-2 (Accelerate\'s `DeepSpeedPlugin` writes it whatever '
              'the stage)',
              'ignored: only the stage-3 optimizer reads it (`runtime/engine.py`, `runtime/zero/config.py`)',
              'ignored with a `UserWarning` naming it (was: a `ConfigError`, so three of Accelerate\'s own '
              '`tests/deepspeed` cases stopped at `deepspeed.initialize`)'),
    Behaviour('accumulation_boundary_override',
              '`engine.set_gradient_accumulation_boundary(b)` (DeepSpeed\'s own tests, Accelerate before every '
              'backward)',
              'sticky until set again, replaces the micro-step counter: while `False` backward only accumulates '
              '(no ZeRO-0/1 reduction) and `step()` only counts, at `True` the window is reduced and the optimizer '
              'steps; the loss is still divided by `gradient_accumulation_steps` (`runtime/engine.py`)',
              'the same at ZeRO 0-3 (`tests/test_compat_accumulation_boundary.py`); refused on the pipeline engine '
              '(its window is one `train_batch()`); `managed_gradient_accumulation: false` is not built (was: a '
              'value disagreeing with the counter refused)'),
)


def markdown_table() -> str:
    """The table as Markdown (one row per behaviour)."""
    rows = ["| Behaviour | DeepSpeed 0.19.8 | zerospeed (and what it did before) |", "|---|---|---|"]
    rows += [f"| {b.behaviour} | {b.deepspeed} | {b.zerospeed} |" for b in BEHAVIOURS]
    return "\n".join(rows)
