"""A training script written the DeepSpeed way, for the suite (issue 20): the only zerospeed-specific
line is the import. It touches every DeepSpeed name zerospeed promises and writes what it saw to
``--out/rank<R>.json``. Not a copy of any DeepSpeed example."""

import argparse
import json
import os

import torch
from torch import nn

import zerospeed as deepspeed
import zerospeed.comm as dist
from zerospeed.accelerator import get_accelerator
from zerospeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from zerospeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerospeed.runtime.utils import see_memory_usage, set_random_seed
from zerospeed.utils import RepeatingLoader, log_dist, logger


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # reads out_proj.weight directly
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.embed(x))
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(dim=1))


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, 6, generator=g)
        return x, 1.0 + 0.5 * x.mean(dim=0).narrow(0, 0, 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    acc = get_accelerator()
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    acc.set_device(local_rank)
    set_random_seed(1234)
    acc.manual_seed_all(1234)

    model = Net()
    groups = split_params_into_different_moe_groups_for_optimizer({"name": "dense", "params": list(model.parameters())})
    optimizer = FusedAdam(groups, lr=5e-2, weight_decay=0.0)
    engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                        training_data=Data())
    log_dist(f"stage {engine.zero_optimization_stage()} on {engine.world_size} ranks", ranks=[0])
    batches = RepeatingLoader(loader)
    losses = []
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        x, y = x.to(engine.device), y.to(engine.device)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        loss.backward()  # the PyTorch way; the engine scales for accumulation
        engine.step()
        losses.append(loss.item())
    mean = torch.tensor([sum(losses[-2:]) / 2])
    dist.all_reduce(mean)
    gathered = torch.zeros(engine.world_size)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(engine.global_rank)]))
    dist.barrier()
    see_memory_usage("end of training", force=True)
    logger.info("done")
    cpu_adam = DeepSpeedCPUAdam([nn.Parameter(torch.zeros(2))], lr=0.1)
    report = {
        "rank": engine.global_rank, "local_rank": engine.local_rank, "world_size": engine.world_size,
        "device": str(engine.device), "stage": engine.zero_optimization_stage(), "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(), "grad_norm": engine.get_global_grad_norm(), "losses": losses,
        "final_mean": mean.item() / engine.world_size, "ranks": gathered.tolist(),
        "moe_params": sum(is_moe_param(p) for p in model.parameters()), "accelerator": acc.device_name(),
        "cpu_adam": type(cpu_adam).__name__, "global_steps": engine.global_steps,
    }
    with open(os.path.join(args.out, f"rank{engine.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
