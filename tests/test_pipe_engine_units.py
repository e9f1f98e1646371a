"""Pieces of the pipeline runtime that need no processes: the split backward (ZB-H1's
BACKWARD_INPUT / BACKWARD_WEIGHT) against the full backward, activation metadata encoding, and the
forward-only schedule used by eval_batch."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerospeed.pipe import ActionKind, execute
from zerospeed.pipe.p2p import ActivationMeta, TensorMeta, as_tensors
from zerospeed.pipe.runtime_backward import SplitBackward, full_backward


class Stage(nn.Module):
    """A stage whose graph shape is chosen by ``mode``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.a, self.b, self.mode = nn.Linear(6, 6), nn.Linear(6, 6), mode

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        if self.mode == "tied":  # a weight used twice on the input path
            h = h @ self.a.weight.T
        if self.mode == "raw_and_transformed":  # a weight used raw and through an op: recompute fallback
            h = h @ (self.a.weight * 2) + x @ self.a.weight
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "checkpointed":
            return checkpoint(self.body, x, use_reentrant=False)
        out = self.body(x)
        if self.mode == "two_outputs":  # a second output that does not depend on the input
            return out, self.b.bias * 3
        return out


def _run(mode: str, needs_input_grad: bool, split: bool):
    torch.manual_seed(0)
    stage = Stage(mode)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).requires_grad_(needs_input_grad)
    out = stage(x)
    outs = as_tensors(out)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2 + i)) for i, o in enumerate(outs)]
    params = list(stage.parameters())
    if split:
        sb = SplitBackward(outs, grads, [x], params)
        input_grads = sb.input_grads()
        assert all(p.grad is None for p in params), "the input half must not produce weight gradients"
        sb.weight_grads()
    else:
        input_grads = full_backward(outs, grads, [x])
    return input_grads, [p.grad for p in params], (sb.recompute if split else None)


@pytest.mark.parametrize("mode", ["plain", "tied", "raw_and_transformed", "checkpointed", "two_outputs"])
@pytest.mark.parametrize("needs_input_grad", [True, False], ids=["middle_stage", "first_stage"])
def test_split_backward_equals_full_backward(mode, needs_input_grad):
    ref_in, ref_w, _ = _run(mode, needs_input_grad, split=False)
    got_in, got_w, recompute = _run(mode, needs_input_grad, split=True)
    for a, b in zip(got_w, ref_w):
        assert torch.equal(a, b)
    if needs_input_grad:
        assert torch.equal(got_in[0], ref_in[0])
        assert recompute == (mode == "raw_and_transformed")  # exact frontier split everywhere else
    else:
        assert got_in == [None] and recompute  # first stage: all of the work is weight work


def test_split_backward_order_is_enforced():
    stage = Stage("plain")
    x = torch.randn(2, 6, requires_grad=True)
    sb = SplitBackward([stage(x)], [torch.ones(2, 6)], [x], list(stage.parameters()))
    with pytest.raises(RuntimeError, match="input_grads must run first"):
        sb.weight_grads()


def test_activation_meta_round_trip_and_grad_tensors():
    act = (torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64), torch.zeros(()))
    meta = ActivationMeta.of(act)
    assert ActivationMeta.decode(meta.encode()) == meta
    assert meta.grad_metas == (TensorMeta((2, 3), torch.bfloat16), TensorMeta((), torch.float32))
    single = ActivationMeta.of(torch.zeros(4, 8))
    assert not single.is_tuple and str(single) == "(4, 8) float32"
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        as_tensors([torch.zeros(1)])


@pytest.mark.parametrize("ranks,virtual", [(2, 1), (4, 1), (2, 2), (1, 3)])
def test_eval_forward_schedule_is_valid(ranks, virtual):
    from zerospeed.pipe.runtime_setup import forward_schedule

    class Layout:
        num_pp = ranks

    layout = Layout()
    layout.virtual = virtual
    full = {}
    for r in range(ranks):
        layout.pipe_rank = r
        full[r] = forward_schedule(layout, 4)
    kinds = {a.kind for actions in full.values() for a in actions}
    assert kinds <= {ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT}
    assert sum(a.kind is ActionKind.FORWARD for actions in full.values() for a in actions) == 4 * ranks * virtual
    execute(full, lambda action: 1.0, p2p="rendezvous")  # raises if blocking send/recv could deadlock
