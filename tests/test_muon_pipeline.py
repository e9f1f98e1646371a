"""Muon in the pipeline engine (issue #30): 2 stages (and 2 stages x 2 data-parallel replicas at ZeRO-1)
equal the single-process loop with the same optimizer, 1e-5 relative on losses and weights (the suite's
fp32 tolerance: micro-batch gradients are summed in another order). The tied ``embed`` layer goes to
Muon's Adam by its name, the hidden Linear(8, 8) weights to Muon."""

import pytest
import torch

from pipe_cases import CLIP, STEPS, Reference, config, micro_batches, mse, pipeline_run
from zerospeed.ops.optimizers import build_optimizer
from zerospeed.testing import run_distributed

PARAMS = {"lr": 0.02, "momentum": 0.9, "adam_lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8}
TOL = 1e-5


def _reference(gas, num_dp):
    model = Reference()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer("Muon", PARAMS, model.parameters(), names=names)
    assert {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]} \
        >= {"tied_modules.embed.weight"}
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        pieces = [mb for d in range(num_dp) for mb in micro_batches(step, d, num_dp, gas)]
        for x, y in pieces:
            loss = mse(model(x), y) / len(pieces)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, zero", [(2, 0), (4, 1)])
def test_pipeline_muon_matches_single_process(world, zero):
    cfg = config("1f1b", 2, zero=zero)
    cfg["optimizer"] = {"type": "Muon", "params": PARAMS}
    ref_losses, ref_weights = _reference(2, world // 2)
    for r in run_distributed(pipeline_run, world, cfg, 2, timeout=200):
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) < TOL
        for name, w in r["weights"].items():
            if name in ref_weights:
                assert ((w - ref_weights[name]).abs().max() / ref_weights[name].abs().max()).item() < TOL, name
