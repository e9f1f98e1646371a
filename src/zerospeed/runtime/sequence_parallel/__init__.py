"""DeepSpeed's ``deepspeed.runtime.sequence_parallel``: ALST for HuggingFace models (:mod:`.ulysses_sp`)."""
