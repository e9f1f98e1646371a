"""HuggingFace ``"auto"`` values in a DeepSpeed config: :mod:`zerospeed.config.hf_auto` (the parser's), under
the path the HF Trainer integration has always imported."""

from zerospeed.config.hf_auto import fill_auto, read_config

__all__ = ["fill_auto", "read_config"]
