"""One request's state inside the engine: its tokens, how many of them have K/V in the cache, the
blocks holding them, and what sampling and stopping need."""

from __future__ import annotations

import enum

import torch

from zerospeed.inference.api import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """``tokens`` is prompt + generated so far; ``num_computed`` of them have K/V in ``blocks``
    (``num_computed <= len(tokens)``; the last token's K/V is computed in the forward that samples
    the next one). ``block_hashes[i]`` is the prefix hash of full block ``i`` once sealed."""

    __slots__ = ("request_id", "tokens", "prompt_len", "params", "arrival", "num_computed", "blocks",
                 "block_hashes", "status", "generator", "num_preemptions", "finish_reason", "stop_reason",
                 "stop_set", "num_emitted", "pending_logprobs", "pending_top",
                 "prompt_lps", "prompt_tops", "prompt_sent", "forks", "matcher")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: int,
                 generator: torch.Generator | None, stop_set: frozenset[int]) -> None:
        self.request_id = request_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.params = params
        self.arrival = arrival
        self.num_computed = 0
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self.status = Status.WAITING
        self.generator = generator
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stop_set = stop_set  # token ids that end generation (stop_token_ids, EOS unless ignore_eos)
        self.num_emitted = 0  # generated tokens already handed out in a RequestOutput
        # params.prompt_logprobs: the prompt tokens' logprobs so far (position 0 has none), filled
        # chunk by chunk by the forwards that compute the prompt; sent once, when complete
        self.prompt_lps: list[float | None] = [None]
        self.prompt_tops: list[dict[int, float] | None] = [None]
        self.prompt_sent = False
        # sequences forked from this one's prompt (engine add_request(fork_of=)), waiting until its
        # prompt K/V is computed; they then share its prompt blocks
        self.forks: list[Sequence] = []
        self.matcher = None  # params.guide's grammar state (constraints.Guides.matcher)

    @property
    def needs_prompt_logits(self) -> bool:
        """True while the prompt's logprobs are asked for and not all computed: its prompt
        positions must run through the LM head (and not come from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_lps) < self.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_remaining(self) -> int:
        """Known tokens whose K/V is not computed yet (1 while decoding)."""
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
