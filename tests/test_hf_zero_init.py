"""zero.Init keeps the model's own initialisation: HF ``post_init`` / ``_init_weights`` (GPT-2, Llama),
a parent ``__init__`` that initialises its children after creating them, and a ``reset_parameters``
pass. Same seed with and without zero.Init (2 ranks): every parameter equal bit for bit (so their
statistics too: GPT-2's embedding std 0.02, its residual projections 0.02/sqrt(2 n_layer)), and the
first stage-3 loss equal to 1e-6 relative.
"""

import math

import pytest
import torch

from hf_cases import zero_init_body
from zerospeed.testing import run_distributed

KINDS = ["gpt2", "llama", "parent_inits", "reset_pass"]


@pytest.mark.timeout(150)
def test_zero_init_model_initialises_as_without_it():
    results = run_distributed(zero_init_body, 2, KINDS, timeout=140)
    for kind in KINDS:
        for r in results:
            rec = r[kind]
            assert rec["partitioned"], kind
            for name, (built, plain) in rec["params"].items():
                assert built.shape == plain.shape and torch.equal(built, plain), (kind, name)
                assert abs(built.std().item() - plain.std().item()) == 0.0 if built.numel() > 1 else True
            assert abs(rec["loss_init"] - rec["loss_plain"]) <= 1e-6 * abs(rec["loss_plain"]), kind
    gpt2 = results[0]["gpt2"]["params"]
    assert abs(gpt2["transformer.wte.weight"][0].std().item() - 0.02) < 0.004  # HF init, not N(0, 1)
    assert abs(gpt2["transformer.h.0.attn.c_proj.weight"][0].std().item() - 0.02 / math.sqrt(4)) < 0.002
    assert results[0]["gpt2"]["loss_plain"] < 6.0  # ~ln(96) = 4.56, not the 80+ of N(0, 1) embeddings
    llama = results[0]["llama"]["params"]
    assert torch.all(llama["model.embed_tokens.weight"][0][0] == 0)  # padding row zeroed by _init_weights
    parent = results[0]["parent_inits"]["params"]
    assert torch.all(parent["lin.bias"][0] == 0) and abs(parent["lin.weight"][0].std().item() - 0.5) < 0.15
