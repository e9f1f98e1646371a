"""The model folder's chat template, rendered with jinja2 as HF tokenizers render it.

Decisions:

* The template comes from ``tokenizer_config.json`` (``chat_template``: a string, or a list of
  ``{"name", "template"}`` from which ``default`` is taken), else from ``chat_template.jinja``
  (where transformers >= 4.43 saves it). A folder with neither has no chat endpoint: requests get
  a 400 naming ``messages``, the completions endpoint still works.
* The environment follows the conventions templates on the Hub are written for: a sandboxed,
  immutable jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the loop-controls extension,
  a ``tojson`` filter that keeps non-ASCII characters, ``raise_exception`` for templates that
  validate roles, and ``bos_token``/``eos_token`` and ``add_generation_prompt`` in the context.
* A template error (including ``raise_exception``) is the client's fault (bad roles or order) and
  becomes a 400 naming ``messages``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerospeed.inference.serving.protocol import ApiError, bad_request


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """``render(messages) -> str`` with the folder's template and special tokens."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, indent: int | None = None, **_: Any) -> str:
            return json.dumps(x, ensure_ascii=False, indent=indent)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: invalid jinja2 template (line {e.lineno}): "
                             f"{e.message}") from e
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # templates that spell out the BOS token must not get a second one from the tokenizer
        self.adds_bos = bool(bos_token) and "bos_token" in source

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate | None:
        """The folder's template, or None when it has none."""
        if model_dir is None:
            return None
        folder = Path(model_dir)
        cfg: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: invalid JSON ({e})") from e
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not source and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if not source:
            return None
        special: dict[str, Any] = {}
        special_path = folder / "special_tokens_map.json"
        if special_path.is_file():
            try:
                special = json.loads(special_path.read_text())
            except json.JSONDecodeError:
                special = {}
        bos = _token_text(cfg.get("bos_token")) or _token_text(special.get("bos_token"))
        eos = _token_text(cfg.get("eos_token")) or _token_text(special.get("eos_token"))
        return cls(source, bos, eos)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: OpenAI's tool list, given to the template as ``tools`` (None: not defined)."""
        import jinja2

        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", **extra)
        except jinja2.exceptions.TemplateError as e:
            raise bad_request("messages", f"the chat template refused them: {e}") from e


def tokenizer_info(model_dir: str | Path | None, template: ChatTemplate | None,
                   max_model_len: int) -> dict[str, Any]:
    """``GET /tokenizer_info`` (vLLM's name; lm-eval's remote tokenizer reads it): the folder's
    tokenizer_config.json fields a client needs, special tokens as plain strings."""
    cfg: dict[str, Any] = {}
    if model_dir is not None and (Path(model_dir) / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        except json.JSONDecodeError:
            cfg = {}
    info: dict[str, Any] = {"tokenizer_class": cfg.get("tokenizer_class"),
                            "model_max_length": max_model_len}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[key] = _token_text(cfg.get(key))
    if template is not None:
        info["bos_token"] = info["bos_token"] or template.bos_token
        info["eos_token"] = info["eos_token"] or template.eos_token
    for key in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
        if key in cfg:
            info[key] = cfg[key]
    info["chat_template"] = template.source if template is not None else None
    return info


def require(template: ChatTemplate | None) -> ChatTemplate:
    if template is None:
        raise ApiError(400, "messages: this model has no chat template (no chat_template in "
                       "tokenizer_config.json); use /v1/completions", param="messages")
    return template
