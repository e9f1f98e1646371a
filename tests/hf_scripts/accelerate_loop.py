"""A plain Accelerate training loop, unchanged whether it runs under DDP or `accelerate launch --use_deepspeed`.

argv: OUT_JSON [GRADIENT_ACCUMULATION_STEPS]. Writes (main process) the loss of every micro-batch averaged over
ranks, and the final weights. Data: 8 micro-batches x 2 ranks x 4 samples of a fixed random regression problem, in
windows of GRADIENT_ACCUMULATION_STEPS (default 1) under ``accelerator.accumulate``; AdamW lr 1e-2; fp32; gradients
clipped to norm 1.0 at each sync (by the loop under DDP, by the config's gradient_clipping under DeepSpeed, where
Accelerate calls ``engine.set_gradient_accumulation_boundary(sync_gradients)`` before every backward).
"""

import json
import sys

import torch
import zerospeed.comm.lifecycle  # noqa: F401 - its exit handler keeps torch 2.13's gloo exit abort off the plain
# reference runs too (they never import zerospeed otherwise; see settle_gloo_workers)
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, MICRO, WORLD = 8, 4, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def main():
    out_path = sys.argv[1]
    accumulation = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(1)
    # CPU only: Accelerate 1.15 picks a process-group backend only for accelerators (or --cpu, which excludes
    # --use_deepspeed); without one it counts a world of 1 under DeepSpeed. Naming gloo is what a CPU user does.
    accelerator = Accelerator(gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * MICRO * WORLD, 16, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    model.train()
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # under DeepSpeed the config's gradient_clipping does it
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "engine": type(model).__name__, "world": accelerator.num_processes,
                       "distributed_type": str(accelerator.distributed_type),
                       "clipping": model.gradient_clipping() if hasattr(model, "gradient_clipping") else None,
                       "weights": {k: v.float().reshape(-1).tolist() for k, v in state.items()}}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
