"""``resize_token_embeddings`` on a Llama built under zero.Init (2 ranks, ZeRO-3).

The documented path: resize the zero.Init model (``zerospeed.integrations.transformers.
resize_token_embeddings``: HF's resize around gathered embedding / LM-head parameters, re-partitioned
with the new shape), then build the engine. Checked against the same model built and resized without
zero.Init (same seeds): every parameter equal, new shapes, and two training steps whose losses match
a stage-0 run of the plain model to 1e-5 relative. A shape change under an engine is refused with
an error that says to resize before ``zerospeed.initialize``.
"""

import pytest

from hf_cases import VOCAB, resize_body
from zerospeed.testing import run_distributed

NEW_VOCAB = VOCAB + 5  # not a multiple of the world size: the new layout pads


@pytest.mark.timeout(120)
def test_resize_token_embeddings_of_a_zero_init_llama():
    for r in run_distributed(resize_body, 2, NEW_VOCAB, timeout=110):
        assert r["vocab"] == NEW_VOCAB and r["partitioned"]
        assert all(r["equal"].values()), {k: v for k, v in r["equal"].items() if not v}
        assert r["shapes"] == {"model.embed_tokens.weight": (NEW_VOCAB, 32), "lm_head.weight": (NEW_VOCAB, 32)}
        zero3, plain = r["losses"]["zero3"], r["losses"]["plain"]
        assert max(abs(a - b) / b for a, b in zip(zero3, plain)) < 1e-5, (zero3, plain)
        assert "before zerospeed.initialize" in r["engine_error"]
        assert "changed shape under a zerospeed engine" in r["gathered_error"]
        assert "lm_head.weight" in r["gathered_error"]
