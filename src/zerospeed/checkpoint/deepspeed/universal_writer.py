"""Writing a checkpoint (either layout) as a DeepSpeed *universal* checkpoint (``zerospeed-convert --to universal``).

A universal folder is what DeepSpeed's ``ds_to_universal`` makes and what DeepSpeed 0.19.8 resumes with
``"checkpoint": {"load_universal": true}`` at any data-parallel size. This writes the layout
``ds_to_universal`` gives for a ZeRO-3 source (the one DeepSpeed 0.19.8 converts without extra client
metadata), into ``DST/<tag>_universal`` with ``DST/latest_universal`` naming it:

* ``zero/<parameter>/fp32.pt`` and one file per Adam state (``exp_avg.pt``, ``exp_avg_sq.pt``): the full
  tensor, flattened, as DeepSpeed's ZeRO-3 merge saves it;
* ``zero/optimizer_state.pt``: rank 0's ZeRO-3 optimizer record with the optimizer's ``param_groups`` at its
  top level (the step DeepSpeed restores comes from its state);
* ``zero_pp_rank_R_mp_rank_00_model_states.pt`` for R < ``world_size``: the model states of a ZeRO-3 save at
  that size (counters, scheduler, client state, buffers, ``param_shapes``), as ``ds_to_universal`` copies them.

The tensors are those :func:`zerospeed.checkpoint.deepspeed.writer.write_deepspeed` writes at ZeRO 3 (it is
run first, into a scratch folder inside ``DST``), so the two conversions agree element for element. As every
zerospeed conversion, nothing is visible in ``DST`` until the folder is complete (written under a temporary
name and renamed; ``latest_universal`` replaced last).
"""

from __future__ import annotations

import os
import shutil

import torch

from zerospeed.checkpoint.deepspeed.universal import UNIVERSAL_DIR
from zerospeed.checkpoint.deepspeed.writer import _save, _zero3_rank, layout_of, write_deepspeed
from zerospeed.checkpoint.full_tensors import FullTensors
from zerospeed.checkpoint.publish import TMP_PREFIX, new_nonce, publish_dir, validate_tag, write_text_atomic

LATEST_UNIVERSAL = "latest_universal"


def write_universal(src: str, dst: str, world_size: int | None = None, precision: str | None = None,
                    src_tag: str | None = None, tag: str | None = None) -> str:
    """Write checkpoint ``src`` as DeepSpeed universal folder ``dst/<tag>_universal``; return its path.

    ``world_size``: the data-parallel size the copied model-state files record (default: the source's);
    ``tag`` defaults to ``global_step<N>``."""
    os.makedirs(dst, exist_ok=True)
    nonce = new_nonce()
    work = os.path.join(dst, f"{TMP_PREFIX}universal-{nonce}")
    try:
        ds_dir = write_deepspeed(src, os.path.join(work, "zero3"), world_size, 3, precision, src_tag, tag)
        out_tag = validate_tag(f"{os.path.basename(ds_dir)}_universal")
        tmp = os.path.join(work, "universal")
        zero_dir = os.path.join(tmp, UNIVERSAL_DIR)
        os.makedirs(zero_dir)
        model_files = sorted(n for n in os.listdir(ds_dir) if n.endswith("_model_states.pt"))
        for name in model_files:
            shutil.copy2(os.path.join(ds_dir, name), os.path.join(tmp, name))
        with FullTensors(src, src_tag) as ft:
            groups, _, param_groups, state_keys = layout_of(ft)
            common = _zero3_rank(ft, groups, param_groups, 0, len(model_files), state_keys)["optimizer_state_dict"]
            common["param_groups"] = common["optimizer_state_dict"]["param_groups"]
            _save(common, os.path.join(zero_dir, "optimizer_state.pt"))
            del common
            for name in (n for names in groups for n in names):
                folder = os.path.join(zero_dir, name)
                os.makedirs(folder)
                for state, kind in [("fp32", None)] + [(k, f"optim.{k}") for k in state_keys]:
                    t = ft.tensor(name, torch.float32, kind=kind).reshape(-1).contiguous()
                    _save(t, os.path.join(folder, f"{state}.pt"))
        final = publish_dir(tmp, dst, out_tag, nonce)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_text_atomic(os.path.join(dst, LATEST_UNIVERSAL), out_tag)
    return final
