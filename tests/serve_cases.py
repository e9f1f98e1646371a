"""Shared pieces of the ``zerospeed serve`` tests: a tiny model folder (random-init HF Llama, a BPE
tokenizer trained here with the ``tokenizers`` library, a chat template in tokenizer_config.json),
the server started in a subprocess on a free loopback port, and a small deterministic engine that
implements the engine contract (``zerospeed.inference.api``) for the fault-injection test.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from zerospeed.inference.api import EngineStats, RequestError, RequestOutput, SamplingParams

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TEXT = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. To be or not to be, that is the question. All that glitters is not gold. The early bird catches
the worm. Knowledge is power. Time flies like an arrow; fruit flies like a banana. Où est la gare?
Das ist gut. 東京は大きい都市です。 Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Serving models over
HTTP with continuous batching, paged attention and streaming responses to many clients at once."""

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_tokenizer(folder: Path, vocab_size: int = 300):
    """A byte-level BPE trained on TEXT; BOS added by the post-processor; saved with
    tokenizer_config.json (chat template, special tokens) and special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 128, "chat_template": CHAT_TEMPLATE,
        "add_bos_token": True,
    }, indent=1))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return tok


def build_model_dir(folder: Path, max_position_embeddings: int = 128) -> Path:
    """Tokenizer files plus a random-init 2-layer Llama (fp32 safetensors) in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position_embeddings,
                      bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
                      initializer_range=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# -- the server in a subprocess ----------------------------------------------------------------------


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("ZEROSPEED_API_KEY", None)
    return env


class ServerProcess:
    """``python -m zerospeed.launcher.runner serve ...`` (or another command line) on a free port;
    ``url`` once it printed its listening line; ``stop()`` sends SIGTERM and returns the status."""

    LISTEN = re.compile(r"listening on (http://\S+)")

    def __init__(self, argv: list[str], start_timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=subprocess_env(), cwd=str(REPO))
        self.lines: list[str] = []
        self.url: str | None = None
        got = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = self.LISTEN.search(line)
                if m and self.url is None:
                    self.url = m.group(1)
                    got.set()
            got.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not got.wait(start_timeout) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit status, once the process ended and all its output was read."""
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(10)
        return status

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def serve_argv(model_dir: Path, *flags: str) -> list[str]:
    """The ``zerospeed serve`` command line (through the launcher's entry point), any free port."""
    return [sys.executable, "-m", "zerospeed.launcher.runner", "serve", str(model_dir),
            "--port", "0", *flags]


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in Prometheus text."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if m is None:
        raise KeyError(f"{name} not in /metrics:\n{text}")
    return float(m.group(1))


# -- a deterministic engine implementing the contract ------------------------------------------------


class FakeEngine:
    """The engine contract without a model: token ``t+1`` is a hash of the sequence so far, with a
    block allocator, FIFO admission under ``max_num_seqs``/blocks, and ``fail_on`` (a substring of
    a request id) whose presence in a step makes that step raise, for the fault-injection test."""

    def __init__(self, model_dir: Path, num_blocks: int = 64, block_size: int = 4,
                 max_num_seqs: int = 4, max_model_len: int = 96, step_delay: float = 0.002,
                 fail_on: str | None = None) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.eos_token_ids = [self.tokenizer.token_to_id("</s>")]
        self.max_model_len = max_model_len
        self.model_name = Path(model_dir).name
        self._vocab = self.tokenizer.get_vocab_size()
        self._num_blocks, self._block_size, self._max_num_seqs = num_blocks, block_size, max_num_seqs
        self._free = num_blocks
        self._step_delay, self._fail_on = step_delay, fail_on
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._seqs: dict[str, dict] = {}
        self._generated = self._prompt_tokens = 0

    def _blocks(self, n: int) -> int:
        return -(-n // self._block_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise RequestError("request_id", f"duplicate id {request_id!r}")
        if not prompt_token_ids:
            raise RequestError("prompt_token_ids", "empty prompt")
        if len(prompt_token_ids) + params.max_new_tokens > self.max_model_len:
            raise RequestError("max_new_tokens", "does not fit the context")
        self._seqs[request_id] = {"ids": list(prompt_token_ids), "n_prompt": len(prompt_token_ids),
                                  "params": params, "blocks": 0, "gen": 0}
        self._waiting.append(request_id)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self._free += seq["blocks"]
        if request_id in self._running:
            self._running.remove(request_id)
        else:
            self._waiting.remove(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_waiting=len(self._waiting),
                           num_blocks_total=self._num_blocks, num_blocks_free=self._free,
                           block_size=self._block_size, num_generated_tokens=self._generated,
                           num_prompt_tokens=self._prompt_tokens)

    def _next(self, seq: dict) -> int:
        p: SamplingParams = seq["params"]
        h = (sum(seq["ids"][-3:]) * 31 + len(seq["ids"])) % 997
        if p.do_sample:
            h = random.Random(hash((p.seed, len(seq["ids"])))).randrange(997)
        return 6 + h % (self._vocab - 6)  # never a special token

    def step(self) -> list[RequestOutput]:
        time.sleep(self._step_delay)
        while self._waiting and len(self._running) < self._max_num_seqs:
            seq = self._seqs[self._waiting[0]]
            need = self._blocks(len(seq["ids"]) + seq["params"].max_new_tokens)  # reserved upfront
            if need > self._free:
                break
            self._free -= need
            seq["blocks"] = need
            self._prompt_tokens += seq["n_prompt"]
            self._running.append(self._waiting.popleft())
        if self._fail_on and any(self._fail_on in r for r in self._running):
            raise RuntimeError("injected fault")
        outs = []
        for rid in list(self._running):
            seq = self._seqs[rid]
            tok = self._next(seq)
            seq["ids"].append(tok)
            seq["gen"] += 1
            self._generated += 1
            p: SamplingParams = seq["params"]
            done = seq["gen"] >= p.max_new_tokens or tok in p.stop_token_ids
            out = RequestOutput(rid, [tok], num_prompt_tokens=seq["n_prompt"],
                                num_generated_tokens=seq["gen"],
                                new_logprobs=[-0.5] if p.logprobs is not None else None)
            if done:
                out.finished, out.finish_reason = True, "length"
                self.abort(rid)
            outs.append(out)
        return outs
