"""Greedy structured output through the approximate (bf16 / int8) greedy LM heads (issue #31).

A guided greedy row used to need the full float32 logits (the mask was applied after them), so a
JSON-schema reply read the LM head in float32 while free greedy generation read its int8 or bf16
copy. Now the guided rows' token masks are computed before the forward and applied to the
approximate logits before the exact candidates are chosen (``CausalLM.greedy_tokens(hidden,
refuse)``): a refused token is never a candidate, and the token is the argmax of the masked float32
logits. These tests check exactly that, on random heads with adversarial masks and end to end
through the engine against the float32 head.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from serve_cases import build_model_dir
from zerospeed.inference.api import SamplingParams
from zerospeed.inference.constraints import Guides, grammar_for
from zerospeed.inference.build import build_engine
from zerospeed.inference.models import greedy_head, layers

pytestmark = pytest.mark.timeout(180)

INT8_HEAD = greedy_head.int8_matmul_available() and greedy_head.build_int8_head(
    torch.randn(64, 32, generator=torch.Generator().manual_seed(0))) is not None
HEADS = ["bf16"] + (["int8"] if INT8_HEAD else [])  # int8 needs an exact oneDNN int8 matmul (AMX or VNNI)


def _model(w: torch.Tensor, mode: str) -> layers.CausalLM:
    model = layers.CausalLM()
    model.lm_head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(w)
    model.greedy_head = mode
    return model


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``allowed [R, V]`` bool -> llguidance's int32 bitmask ``[R, ceil(V / 32)]`` (bit t % 32 of word t // 32)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)  # in [0, 2^32)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


@pytest.mark.parametrize("mode", HEADS)
def test_masked_greedy_head_is_the_argmax_of_the_masked_float32_logits(mode):
    g = torch.Generator().manual_seed(1)
    V, H = 3001, 48  # V not a multiple of 32: the last word of the mask is partial
    w = torch.randn(V, H, generator=g) * 0.05
    w[1000:1064] = w[800] + 2e-3 * torch.randn(64, H, generator=g)  # near-ties around the unmasked best
    h = torch.randn(12, H, generator=g)
    h[0:4] = w[800] * 100 + torch.randn(4, H, generator=g)  # rows whose best token sits in the cluster
    h[4] = 0  # every logit ties: more candidates than the pass takes, the float32 fallback (masked)
    exact = F.linear(h, w)
    allowed = torch.rand(12, V, generator=g) < 0.3
    allowed[0:4, 800] = False  # refuse the unmasked best and most of its near-ties
    allowed[0:4, 1000:1060] = False
    allowed[5] = False
    allowed[5, [17, 2999, 3000]] = True  # a row with three tokens allowed, one in the partial word
    allowed[6] = True  # an unconstrained guided row
    allowed[4, :7] = False  # the fallback row: the lowest ids refused, so its tied argmax moves to id 7
    allowed[4, 7] = True
    rows = list(range(12))
    bitmask = _bitmask(allowed)
    want = exact.masked_fill(~allowed, float("-inf")).max(dim=1).indices
    assert not torch.equal(want[:4], exact[:4].max(dim=1).indices)  # the masks change these rows' tokens
    model = _model(w, mode)

    def refuse(t):
        Guides.apply(t, rows, bitmask)

    got = model.greedy_tokens(h, refuse)
    assert got is not None
    assert torch.equal(got, want), (got, want)
    assert bool(allowed[torch.arange(12), got].all())
    assert int(got[4]) == 7 and int(got[5]) in (17, 2999, 3000)
    # the masks reach only the guided rows: rows outside `rows` keep their unmasked argmax
    some = [0, 5]

    def refuse_some(t):
        Guides.apply(t, some, bitmask[some])

    got = model.greedy_tokens(h, refuse_some)
    free = exact.max(dim=1).indices
    for r in range(12):
        assert int(got[r]) == (int(want[r]) if r in some else int(free[r])), r


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "size"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("structured_greedy") / "tiny-llama")


def _run(model_dir, head: str) -> list[list[int]]:
    engine = build_engine(str(model_dir), num_blocks=96, block_size=8, max_model_len=128, greedy_head=head)
    tok = engine.tokenizer
    grammars = [grammar_for("json_schema", SCHEMA), grammar_for("regex", r"[a-z]{3,9}( [a-z]{2,5}){2}"),
                grammar_for("choice", ["alpha", "beta gamma", "delta"]), grammar_for("json_object", None)]
    prompts = [tok.encode(f"request number {i} asks for something") for i in range(6)]
    params = [SamplingParams(max_new_tokens=48, temperature=0, guide=grammars[i % 4]) for i in range(5)]
    params.append(SamplingParams(max_new_tokens=12, temperature=0))  # a free greedy row in the same batches
    out = engine.generate(prompts, params)
    alone = engine.generate(prompts[:1], params[:1])  # one guided row alone (the one-row class)
    assert alone[0] == out[0]
    text = [tok.decode(t) for t in out]
    assert json.loads(text[0])["color"] in ("red", "green", "blue")
    assert text[2] in ("alpha", "beta gamma", "delta")
    return out


def test_engine_guided_greedy_tokens_equal_the_float32_head(model_dir):
    want = _run(model_dir, "float32")
    for head in HEADS:
        assert _run(model_dir, head) == want, head
