"""Train a small model on random data with ZeRO stage 2: zerospeed --num_procs 2 quickstart.py --deepspeed_config ds.json"""

import argparse

import torch
from torch import nn

import zerospeed


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def main() -> None:
    parser = zerospeed.add_config_arguments(argparse.ArgumentParser())  # adds --deepspeed_config
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Regressor()
    dataset = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    engine, _, loader, _ = zerospeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    for x, y in loader:  # each rank reads its own share of the data
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    if engine.global_rank == 0:
        print(f"{engine.global_steps} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
