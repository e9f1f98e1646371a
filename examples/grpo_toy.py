"""GRPO on a verifiable toy task, rolled out with engine.generate on live ZeRO-3 weights (issue #32).

The task: a prompt is ``<bos> a b c <sep>`` with ``a b c`` drawn from 8 symbols; the completion should copy
``a b c``. The reward is verifiable: the fraction of the 3 generated tokens equal to the prompt's symbols at the
same position (a random policy over the 16-token vocabulary scores about 1/16).

Each step, on every data-parallel rank (run it with 2 processes, ZeRO stage 3):

1. ``engine.generate(prompts, n=group, do_sample=True, seeds=...)`` samples ``group`` completions per prompt on
   zerospeed's inference engine over the current (sharded) weights: one gather of every ZeRO-3 bucket per step;
2. group-relative advantages: each completion's reward minus its group's mean, over the group's standard deviation
   (GRPO; no value model);
3. the policy-gradient loss ``-mean(advantage * log p(completion))`` (on-policy, one update per rollout, so the
   importance ratio is 1 and no clipping is needed) is backpropagated through the ZeRO-3 engine and stepped.

Run: ``torchrun --nproc_per_node 2 examples/grpo_toy.py --steps 40 --plot runs/grpo_toy.png``
(or ``zerospeed --num_gpus 2 examples/grpo_toy.py ...``). The plot shows the mean reward per step (top) and the
rollout tokens/s (bottom), as the demo's plot does for the loss.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import zerospeed
from zerospeed import comm

BOS, SEP, FIRST_SYMBOL, NUM_SYMBOLS, VOCAB, LENGTH = 1, 3, 4, 8, 16, 3


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Llama over the 16-token vocabulary (built from a config: nothing is downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=BOS,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def grpo_config(world: int, prompts: int, group: int, lr: float) -> dict:
    return {"train_batch_size": prompts * group * world, "train_micro_batch_size_per_gpu": prompts * group,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "gradient_clipping": 1.0, "steps_per_print": 0,
            "hybrid_engine": {"enabled": True, "max_out_tokens": 16, "max_num_seqs": prompts * group}}


def make_prompts(g: torch.Generator, n: int) -> list[list[int]]:
    symbols = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS, (n, LENGTH), generator=g)
    return [[BOS, *row, SEP] for row in symbols.tolist()]


def reward(prompt: list[int], completion: list[int]) -> float:
    target = prompt[1:1 + LENGTH]
    return sum(int(a == b) for a, b in zip(completion, target)) / LENGTH


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each reward against its group's mean, in units of the group's standard deviation."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def completion_logprobs(engine, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """Sum of log p(completion token) per sequence, through the training engine (gradients flow)."""
    seqs = torch.tensor([p + c for p, c in zip(prompts, completions)])
    logits = engine(input_ids=seqs).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    start = len(prompts[0]) - 1  # the logit at position t predicts token t + 1
    return logp[:, start:].sum(-1)


def train(steps: int = 40, prompts_per_rank: int = 8, group: int = 8, lr: float = 3e-3, seed: int = 0,
          log=print) -> dict:
    """Run GRPO for ``steps`` steps on the current process group; every rank returns the same history."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = tiny_policy(seed)
    engine, *_ = zerospeed.initialize(model=model, config=grpo_config(world, prompts_per_rank, group, lr))
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    history: dict[str, list[float]] = {"reward": [], "rollout_tokens_per_s": [], "step_s": []}
    for step in range(steps):
        start = time.perf_counter()
        prompts = make_prompts(g, prompts_per_rank)
        seeds = [int(s) for s in torch.randint(0, 2**31, (len(prompts),), generator=g)]
        t0 = time.perf_counter()
        completions = engine.generate(prompts, n=group, seeds=seeds, max_new_tokens=LENGTH, do_sample=True,
                                      temperature=1.0, ignore_eos=True)
        rollout_s = time.perf_counter() - t0
        expanded = [p for p in prompts for _ in range(group)]
        rewards = torch.tensor([reward(p, c) for p, c in zip(expanded, completions)])
        adv = group_advantages(rewards, group)
        loss = -(adv * completion_logprobs(engine, expanded, completions)).mean()
        engine.backward(loss)
        engine.step()
        stats = torch.tensor([rewards.mean().item(), len(completions) * LENGTH / rollout_s])
        comm.all_reduce(stats)
        stats /= world
        history["reward"].append(stats[0].item())
        history["rollout_tokens_per_s"].append(stats[1].item())
        history["step_s"].append(time.perf_counter() - start)
        if rank == 0 and log is not None:
            log(f"step {step + 1:3d}  mean reward {stats[0].item():.3f}  rollout {stats[1].item():.0f} tokens/s")
    return history


def plot(path: str, history: dict, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(history["reward"]) + 1))
    fig, (ax_r, ax_speed) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax_r.plot(steps, history["reward"], color="tab:blue", linewidth=1.2, label="mean reward (all ranks)")
    ax_r.axhline(1 / VOCAB, color="tab:gray", linestyle="--", linewidth=1.0, label="random policy (1/16)")
    ax_r.set_ylabel("reward (fraction of tokens copied)")
    ax_r.set_title(title, fontsize=10)
    ax_r.grid(alpha=0.3)
    ax_r.legend()
    ax_speed.plot(steps, history["rollout_tokens_per_s"], color="tab:green", linewidth=1.0)
    ax_speed.set_ylabel("rollout tokens / s")
    ax_speed.set_xlabel("GRPO step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.abspath(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join("runs", "grpo_toy.png"))
    p.add_argument("--local_rank", type=int, default=None, help="accepted for DeepSpeed launchers; unused")
    args = p.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    zerospeed.init_distributed()
    history = train(args.steps, args.prompts, args.group, args.lr, args.seed)
    if comm.get_rank() == 0:
        first, last = history["reward"][:5], history["reward"][-5:]
        print(f"mean reward: first 5 steps {sum(first) / len(first):.3f}, last 5 steps {sum(last) / len(last):.3f}")
        title = (f"GRPO copy task, ZeRO-3 on {comm.get_world_size()} ranks, {args.prompts} prompts x "
                 f"{args.group} samples per rank")
        print(f"plot: {plot(args.plot, history, title)}")


if __name__ == "__main__":
    main()
