"""zero.Init keeps the model's own initialisation: HF ``post_init`` / ``_init_weights`` (GPT-2, Llama),
a parent ``__init__`` that initialises its children after creating them, and a ``reset_parameters``
pass. Same seed with and without zero.Init (2 ranks): every parameter equal bit for bit (so their
statistics too: GPT-2's embedding std 0.02, its residual projections 0.02/sqrt(2 n_layer)), and the
first stage-3 loss equal to 1e-6 relative.

``resize_token_embeddings`` on a Llama built under zero.Init (the documented path: resize the
zero.Init model with ``zerospeed.integrations.transformers.resize_token_embeddings`` - HF's resize
around gathered embedding / LM-head parameters, re-partitioned with the new shape - then build the
engine), against the same model built and resized without zero.Init (same seeds): every parameter
equal, the new shapes, and two ZeRO-3 training steps whose losses match a stage-0 run of the plain
model to 1e-5 relative. A shape change under an engine is refused, saying to resize before
``zerospeed.initialize``. Both run in one launch of 2 ranks (starting ranks is the slow part).
"""

import math

import pytest
import torch

from hf_cases import VOCAB, zero_init_and_resize_body
from zerospeed.testing import run_distributed

KINDS = ["gpt2", "llama", "parent_inits", "reset_pass"]
NEW_VOCAB = VOCAB + 5  # not a multiple of the world size: the new layout pads


@pytest.fixture(scope="module")
def launch():
    return run_distributed(zero_init_and_resize_body, 2, KINDS, NEW_VOCAB, timeout=170)


@pytest.mark.timeout(180)
def test_zero_init_model_initialises_as_without_it(launch):
    results = [r["init"] for r in launch]
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


@pytest.mark.timeout(180)
def test_resize_token_embeddings_of_a_zero_init_llama(launch):
    for r in (rank["resize"] for rank in launch):
        assert r["vocab"] == NEW_VOCAB and r["partitioned"]
        assert all(r["equal"].values()), {k: v for k, v in r["equal"].items() if not v}
        assert r["shapes"] == {"model.embed_tokens.weight": (NEW_VOCAB, 32), "lm_head.weight": (NEW_VOCAB, 32)}
        zero3, plain = r["losses"]["zero3"], r["losses"]["plain"]
        assert max(abs(a - b) / b for a, b in zip(zero3, plain)) < 1e-5, (zero3, plain)
        assert "before zerospeed.initialize" in r["engine_error"]
        assert "changed shape under a zerospeed engine" in r["gathered_error"]
        assert "lm_head.weight" in r["gathered_error"]
