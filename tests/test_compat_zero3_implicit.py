"""ZeRO-3 and parameters read outside their own module's forward (issue 20, point 6).

``nn.MultiheadAttention`` passes ``out_proj.weight`` to a functional call without calling
``out_proj``; ``nn.TransformerEncoderLayer``'s no-grad fast path reads all its children's weights.
Both are detected: at world size 2, stage 3 matches a single process (losses and weights to 1e-5
relative, fp32; the eval loss through the fast path too). A module of the user's that does the same
gets an error naming the parameter and register_external_parameter. The model also applies an
in-place ReLU to a Linear's 3-D output (a view), whose own grad node then leaves the graph: the
backward re-gather must still happen (it hooks the view's base too).
"""

import pytest

from compat_cases import attn_reference, attn_zero3_run, unregistered_reader_error
from engine_cases import max_rel_err
from zerospeed.testing import run_distributed


@pytest.mark.timeout(120)
def test_multihead_attention_at_zero3_matches_one_process():
    ref = attn_reference()
    results = run_distributed(attn_zero3_run, 2)
    for r in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) < 1e-5
        assert abs(r["eval"] - ref["eval"]) / abs(ref["eval"]) < 1e-5
    assert set(results[0]["weights"]) == set(ref["weights"])
    assert max_rel_err(results[0]["weights"], ref["weights"]) < 1e-5


@pytest.mark.timeout(60)
def test_unregistered_submodule_parameter_is_named():
    message = run_distributed(unregistered_reader_error, 2)[0]
    assert "'proj.weight'" in message and "register_external_parameter" in message, message
    assert "UnregisteredReader" in message and "cause: RuntimeError" in message, message
