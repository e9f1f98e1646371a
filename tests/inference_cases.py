"""Tiny random-weight HF models saved as model folders, and HF greedy references, for the
inference tests. Weights use a large ``initializer_range`` so greedy continuations are diverse
(default-initialised random models loop on a handful of tokens, which would make token parity a
weak check)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 320
INIT = 0.3


def hf_config(family: str, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, initializer_range=INIT, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, **common)
    elif family == "llama3":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, max_position_embeddings=256, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                             tie_word_embeddings=True, **common)
    elif family == "mistral":
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256, sliding_window=24, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, **common)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
        cfg.initializer_range = 0.6  # GPT-2's scaled init needs more spread to avoid loops
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=256, rotary_pct=0.5, **common)
    else:
        raise KeyError(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def make_model(family: str, seed: int = 0, **over):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family, **over), attn_implementation="eager")
    if family == "qwen2":  # HF initialises biases to zero; make the QKV bias matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.eval()


def save_model(model, path: str, dtype: torch.dtype = torch.float32, **kwargs) -> str:
    model.to(dtype).save_pretrained(path, **kwargs)
    model.to(torch.float32)
    return path


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


#: the engine's float32 logits agree with HF's to this fraction of the logits' scale (test_inference_engine,
#: test_inference_v1: measured <= 3e-6 at every ISA cap of make test-isa)
LOGIT_TOL = 2e-5


def hf_greedy_decided(model, prompt: list[int], max_new_tokens: int, tol: float = LOGIT_TOL) -> tuple[list[int], int]:
    """HF's greedy tokens, and how many of them every float32 path must pick too: those before the first position
    whose two largest logits are closer than ``2 * tol * max(1, max|logits|)``. A path whose logits are within
    ``tol`` of HF's picks HF's token wherever the gap is wider; at a narrower one another CPU's rounding may pick
    the runner-up (issue #25: compare what the arithmetic decides, not what one CPU gave), and every later token then
    follows another prefix."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    for i, logits in enumerate(out.logits):
        top = logits[0].float().topk(2).values
        if (top[0] - top[1]).item() <= 2 * tol * max(1.0, logits[0].abs().max().item()):
            return tokens, i
    return tokens, len(tokens)


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def build_tokenizer(path: str) -> None:
    """A small word-level tokenizer saved as tokenizer.json (built locally, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
