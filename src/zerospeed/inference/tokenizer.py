"""The tokenizer of a model folder, local files only.

``tokenizer.json`` is read with the ``tokenizers`` library (fast, no transformers import); without
it, ``transformers.AutoTokenizer`` is tried with ``local_files_only=True`` (GPT-2 style
``vocab.json`` + ``merges.txt``). A folder with neither gives ``None``: the engine then serves token
ids only and refuses ``stop`` strings. ``tokenizer_config.json``'s ``chat_template`` is kept for the
server.
"""

from __future__ import annotations

import json
import os
from typing import Any


class Tokenizer:
    def __init__(self, backend: Any, kind: str, chat_template: str | None = None,
                 special: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.kind = kind  # "tokenizers" or "transformers"
        self.chat_template = chat_template
        self.special_tokens = special or {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.kind == "tokenizers":
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        if self.kind == "tokenizers":
            return self.backend.get_vocab_size(with_added_tokens=True)
        return len(self.backend)

    def token_to_id(self, token: str) -> int | None:
        if self.kind == "tokenizers":
            return self.backend.token_to_id(token)
        tid = self.backend.convert_tokens_to_ids(token)
        return tid if tid != self.backend.unk_token_id or token == self.backend.unk_token else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("the model folder's tokenizer_config.json has no chat_template")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        tmpl = env.from_string(self.chat_template)
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens, **kwargs})


def _token_str(v: Any) -> Any:
    return v.get("content") if isinstance(v, dict) else v


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    cfg: dict = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    special = {k: _token_str(cfg[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if cfg.get(k)}
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer as FastTokenizer

        return Tokenizer(FastTokenizer.from_file(path), "tokenizers", template, special)
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in ("vocab.json", "tokenizer.model", "vocab.txt")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return Tokenizer(tok, "transformers", template or getattr(tok, "chat_template", None), special)
    return None
