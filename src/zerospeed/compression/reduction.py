"""Layer reduction: the student keeps ``keep_number_layer`` of the teacher's layers.

``module_name_prefix`` names the layer list (an ``nn.ModuleList`` / ``nn.Sequential``, e.g.
``bert.encoder.layer`` or the demo GPT's ``blocks``).  With a teacher, the student's list must already
have ``keep_number_layer`` layers and layer ``i`` is loaded from the teacher's ``teacher_layer[i]``;
the ``other_module_name`` modules (embeddings, pooler, head) are loaded from the teacher too.  Without a
teacher, the model is its own teacher: its layer list is cut down, in place, to ``teacher_layer``.
A HF-style ``model.config`` layer count (``num_hidden_layers``, ``n_layer``, ``num_layers``) is updated
so a cleaned model saves a consistent config.
"""

from __future__ import annotations

from torch import nn

from zerospeed.config import ConfigError
from zerospeed.config.compression import LayerReduction

KEY = "compression_training.layer_reduction"
LAYER_COUNT_ATTRS = ("num_hidden_layers", "n_layer", "num_layers")


def _layer_list(model: nn.Module, prefix: str, what: str) -> nn.Module:
    try:
        layers = model.get_submodule(prefix)
    except AttributeError:
        raise ConfigError(f"{KEY}.module_name_prefix", f"{prefix!r} is not a module of the {what}") from None
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(f"{KEY}.module_name_prefix",
                          f"{prefix!r} is a {type(layers).__name__}, not a ModuleList/Sequential of layers")
    return layers


def reduce_layers(model: nn.Module, cfg: LayerReduction, teacher: nn.Module | None) -> None:
    keep = cfg.keep_number_layer
    source = _layer_list(teacher if teacher is not None else model, cfg.module_name_prefix,
                         "teacher" if teacher is not None else "model")
    if keep > len(source):
        raise ConfigError(f"{KEY}.keep_number_layer", f"{keep} is larger than the {len(source)} layers of "
                                                      f"{cfg.module_name_prefix!r}")
    bad = [i for i in cfg.teacher_layer if i >= len(source)]
    if bad:
        raise ConfigError(f"{KEY}.teacher_layer", f"{bad} are not layers of {cfg.module_name_prefix!r} "
                                                  f"(it has {len(source)})")
    if teacher is None:
        kept = type(source)(*[source[i] for i in cfg.teacher_layer]) if isinstance(source, nn.Sequential) \
            else nn.ModuleList([source[i] for i in cfg.teacher_layer])
        parent_name, _, child = cfg.module_name_prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, kept)
        old = len(source)
    else:
        student = _layer_list(model, cfg.module_name_prefix, "model")
        if len(student) != keep:
            raise ConfigError(f"{KEY}.keep_number_layer", f"{keep} differs from the student's {len(student)} "
                                                          f"layers in {cfg.module_name_prefix!r}")
        for i, t in enumerate(cfg.teacher_layer):
            student[i].load_state_dict(source[t].state_dict())
        for name in cfg.other_module_name:
            try:
                model.get_submodule(name).load_state_dict(teacher.get_submodule(name).state_dict())
            except AttributeError:
                raise ConfigError(f"{KEY}.other_module_name", f"{name!r} is not a module of both the "
                                                              "student and the teacher") from None
        return
    hf_config = getattr(model, "config", None)
    for attr in LAYER_COUNT_ATTRS:
        if hf_config is not None and getattr(hf_config, attr, None) == old:
            try:
                setattr(hf_config, attr, keep)
            except Exception:  # frozen dataclass configs (the demo GPT) keep their original count
                pass
