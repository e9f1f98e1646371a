"""A deterministic byte-level text dataset, generated in-repo (no download).

The corpus comes from a small stochastic grammar (sentences like ``the old robot sees a red
fox near the river.``) drawn with ``random.Random(seed)``: same seed, same bytes, in every
process and on every machine, so data-parallel ranks agree on the data without communicating
and parity tests can compare a sharded run to a single-process one. The text has structure at
several scales (spelling, word order, punctuation), so a model's loss drops from ln(256) ~ 5.5
nats towards ~1 within a few hundred steps.

:class:`SyntheticTextDataset` yields ``(x, y)`` LongTensor pairs of length ``seq_len`` taken from
consecutive, non-overlapping windows of the corpus, ``y`` being ``x`` shifted left by one byte
(the next-byte targets). Sample ``i`` is always the same window.
"""

from __future__ import annotations

import os
import random

import torch
from torch.utils.data import Dataset

_DETERMINERS = ["the", "a", "every", "one", "that"]
_ADJECTIVES = ["old", "red", "quick", "small", "bright", "quiet", "lazy", "brave", "green", "cold"]
_NOUNS = ["fox", "dog", "robot", "river", "bird", "child", "city", "tree", "ship", "cat",
          "teacher", "garden"]
_VERBS = ["sees", "follows", "finds", "likes", "watches", "builds", "paints", "carries",
          "remembers", "visits"]
_PREPOSITIONS = ["near", "under", "behind", "with", "beside", "above"]
_ADVERBS = ["slowly", "quietly", "again", "today", "often"]


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    parts = [_noun_phrase(rng), rng.choice(_VERBS), _noun_phrase(rng)]
    if rng.random() < 0.4:
        parts += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
    if rng.random() < 0.3:
        parts.append(rng.choice(_ADVERBS))
    text = " ".join(parts)
    return text[0].upper() + text[1:] + "."


def make_corpus(num_bytes: int, seed: int = 0) -> bytes:
    """At least ``num_bytes`` of ASCII text (truncated to exactly that), deterministic in ``seed``.

    Sentences are separated by a space, paragraphs (3-6 sentences) by a newline.
    """
    rng = random.Random(seed)
    pieces: list[str] = []
    size = 0
    while size < num_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 6))) + "\n"
        pieces.append(paragraph)
        size += len(paragraph)
    return "".join(pieces).encode("ascii")[:num_bytes]


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a LongTensor of token ids in ``[0, 256)``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """Inverse of :func:`encode` (invalid byte sequences are replaced)."""
    return bytes(int(i) for i in ids.flatten().tolist()).decode("utf-8", errors="replace")


class SyntheticTextDataset(Dataset):
    """``num_samples`` next-byte prediction pairs of length ``seq_len`` from :func:`make_corpus`.

    Sample ``i`` is ``x = corpus[i*seq_len : (i+1)*seq_len]``, ``y = corpus[i*seq_len+1 :
    (i+1)*seq_len+1]``; both LongTensors of shape ``(seq_len,)``. Different seeds give different
    text from the same grammar, e.g. ``seed=1`` for a held-out set.
    """

    vocab_size = 256

    def __init__(self, seq_len: int = 64, num_samples: int = 4096, seed: int = 0) -> None:
        if seq_len < 1 or num_samples < 1:
            raise ValueError(f"seq_len and num_samples must be positive, got {seq_len}, {num_samples}")
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.seed = seed
        corpus = make_corpus(num_samples * seq_len + 1, seed)
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        start = (index % self.num_samples) * self.seq_len
        window = self.data[start : start + self.seq_len + 1]
        return window[:-1].clone(), window[1:].clone()


# -- real text: the Python standard library's own source ----------------------------------------
def stdlib_source_files() -> list[str]:
    """The top-level ``*.py`` files of this interpreter's standard library, sorted by name: real
    text every machine with Python already has, identical in every process."""
    import glob
    import sysconfig

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library at {sysconfig.get_paths()['stdlib']}")
    return files


def stdlib_corpus(max_bytes: int = 2_000_000, held_out_fraction: float = 0.05) -> tuple[bytes, bytes]:
    """(train bytes, held-out bytes) from the standard library's source, split by file.

    Files are read in name order until ``max_bytes``; the last files (about ``held_out_fraction``
    of the bytes) are held out, so held-out text comes from modules the model never trained on.
    """
    chunks: list[bytes] = []
    size = 0
    for path in stdlib_source_files():
        with open(path, "rb") as f:
            text = f.read()
        chunks.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    held_out_bytes = int(size * held_out_fraction)
    train, held, acc = [], [], 0
    for text in reversed(chunks):
        (held if acc < held_out_bytes else train).append(text)
        acc += len(text)
    return b"".join(reversed(train)), b"".join(reversed(held))


class ByteTextDataset(Dataset):
    """Next-byte pairs ``(x, y)`` of length ``seq_len`` from consecutive non-overlapping windows of
    ``data`` (bytes), like :class:`SyntheticTextDataset` but over any text."""

    vocab_size = 256

    def __init__(self, data: bytes, seq_len: int) -> None:
        if seq_len < 1 or len(data) < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} bytes, got {len(data)}")
        self.seq_len = seq_len
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.num_samples = (len(data) - 1) // seq_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        start = (index % self.num_samples) * self.seq_len
        window = self.data[start : start + self.seq_len + 1]
        return window[:-1].clone(), window[1:].clone()
