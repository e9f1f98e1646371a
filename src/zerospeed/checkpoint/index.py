"""The checkpoint format: directory layout, ``index.json``, and validated reading of both.

A checkpoint is a directory ``SAVE_DIR/<tag>/`` holding:

``rank00000.safetensors`` ... one file per data-parallel rank (per global rank for a pipeline engine
    with several stages, per rank of the world under tensor parallelism; standard safetensors). Rank r's file
    holds, for every bucket shard it wrote, one 1-D tensor per kind, ``b<i>.weight`` (model dtype),
    ``b<i>.master`` (fp32; absent when training in fp32, where the master is the weight) and
    ``b<i>.optim.<state>`` (``exp_avg``, ``exp_avg_sq``, ...), plus its RNG states (``rng.*``).
    Rank 0's file also holds unsharded module entries (buffers, frozen parameters) as ``x<j>.weight``
    and tensors of client_state as ``client.<n>``.
``index.json`` written last; its presence marks the checkpoint complete. It maps every entry of
    the module's ``state_dict`` to pieces: ``params[name].pieces`` is a list of
    ``[shard, key_offset, param_start, numel]`` and ``shards[shard]`` is ``{"file", "prefix",
    "kinds"}``: elements ``[param_start, param_start + numel)`` of the flattened parameter are
    ``[key_offset, key_offset + numel)`` of ``<prefix>.<kind>`` in ``file``, for every kind of that
    shard. It also records each file's size and each tensor's CRC-32, the tied-weight aliases,
    optimizer hyperparameters and scalar states, scheduler, loss scaler, step counters, every
    rank's RNG metadata, client_state (JSON), and the config the engine ran with.

``SAVE_DIR/latest`` names the newest complete tag (DeepSpeed's convention). Nothing is pickled.
"""

from __future__ import annotations

import json
import os
from typing import Any

from zerospeed.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from zerospeed.checkpoint.shards import SourcePiece

FORMAT = "zerospeed-checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


class CheckpointIndex:
    """A parsed, validated ``index.json`` and the directory it describes."""

    def __init__(self, directory: str, data: dict[str, Any]) -> None:
        self.directory = directory
        self.path = os.path.join(directory, INDEX_FILE)
        self.data = data
        self._validate()
        self.shards: list[dict[str, Any]] = data["shards"]
        self.params: dict[str, dict[str, Any]] = data["params"]
        self._sources: dict[str, list[SourcePiece]] = {}

    @classmethod
    def read(cls, directory: str) -> CheckpointIndex:
        path = os.path.join(directory, INDEX_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} is missing: {directory} is not a complete zerospeed checkpoint "
                                          "(an interrupted save never publishes a directory without it)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointCorruptError(f"cannot read {path}: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointCorruptError(f"{path} is not valid JSON ({e}): the file is truncated or was "
                                         "modified") from None
        return cls(directory, data)

    def _fail(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: {what}: the index is corrupted or not a zerospeed checkpoint")

    def _validate(self) -> None:
        d = self.data
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise self._fail(f"'format' is not {FORMAT!r}")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointCorruptError(f"{self.path}: format version {d.get('format_version')!r} is not supported "
                                         f"by this zerospeed (it reads version {FORMAT_VERSION})")
        for key, kind in (("files", dict), ("shards", list), ("params", dict), ("aliases", dict), ("rng", list),
                          ("engine", dict), ("world_size", int)):
            if not isinstance(d.get(key), kind):
                raise self._fail(f"'{key}' is missing or not a {kind.__name__}")
        files = d["files"]
        for name, rec in files.items():
            if os.path.basename(name) != name or name.startswith("."):
                raise self._fail(f"file name {name!r} is not a plain file name")
            if (not isinstance(rec, dict) or not isinstance(rec.get("bytes"), int)
                    or not isinstance(rec.get("crc32"), dict)):
                raise self._fail(f"record of file {name!r} is malformed")
        for i, sh in enumerate(d["shards"]):
            if not isinstance(sh, dict) or sh.get("file") not in files or not isinstance(sh.get("prefix"), str) \
                    or not isinstance(sh.get("kinds"), list):
                raise self._fail(f"shard {i} is malformed")
        num_shards = len(d["shards"])
        for name, p in d["params"].items():
            if not isinstance(p, dict) or not isinstance(p.get("shape"), list) or not isinstance(p.get("pieces"), list):
                raise self._fail(f"entry of {name!r} is malformed")
            for piece in p["pieces"]:
                if (not isinstance(piece, list) or len(piece) != 4
                        or not all(isinstance(x, int) and x >= 0 for x in piece) or piece[0] >= num_shards):
                    raise self._fail(f"a piece of {name!r} is malformed")

    # -- queries ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return int(self.data["world_size"])

    def numel(self, name: str) -> int:
        n = 1
        for d in self.params[name]["shape"]:
            n *= int(d)
        return n

    def sources(self, name: str) -> list[SourcePiece]:
        if name not in self._sources:
            self._sources[name] = [SourcePiece(*piece) for piece in self.params[name]["pieces"]]
        return self._sources[name]

    def has_kind(self, name: str, kind: str) -> bool:
        return all(kind in self.shards[sp.shard]["kinds"] for sp in self.sources(name))

    def key(self, shard: int, kind: str) -> tuple[str, str]:
        sh = self.shards[shard]
        if kind not in sh["kinds"]:
            raise CheckpointCorruptError(f"{self.path}: shard {shard} ({sh['file']}) has no {kind!r} tensor")
        return sh["file"], f"{sh['prefix']}.{kind}"

    def file_path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def file_bytes(self, name: str) -> int:
        return int(self.data["files"][name]["bytes"])

    def crc32(self, name: str, key: str) -> int | None:
        value = self.data["files"][name]["crc32"].get(key)
        return None if value is None else int(value)

    def state_dict_keys(self) -> list[str]:
        return list(self.data.get("state_dict_keys") or list(self.params) + list(self.data["aliases"]))

    def canonical(self, key: str) -> str:
        return self.data["aliases"].get(key, key)


def build_index(header: dict[str, Any], records: list[dict[str, Any]],
                param_info: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank records (rank order) into the index written by rank 0.

    ``records[r]`` = ``{"file": FileRecord json + name, "shards", "pieces", "scalars", "state_keys", "rng"}``;
    ``param_info`` = ``{name: {"shape", "dtype", "kind", ...}}`` for every saved entry.
    """
    files: dict[str, Any] = {}
    shards: list[dict[str, Any]] = []
    params = {name: dict(info, pieces=[]) for name, info in param_info.items()}
    scalars: dict[str, Any] = {}
    state_keys: set[str] = set()
    rng = []
    for rec in records:
        fname = rec["file"]["name"]
        files[fname] = {"bytes": rec["file"]["bytes"], "crc32": rec["file"]["crc32"]}
        base = len(shards)
        shards.extend(dict(sh, file=fname) for sh in rec["shards"])
        for name, pieces in rec["pieces"].items():
            params[name]["pieces"].extend([base + p[0], p[1], p[2], p[3]] for p in pieces)
        for name, sc in rec["scalars"].items():
            scalars.setdefault(name, sc)
        state_keys.update(rec["state_keys"])
        rng.append({"file": fname, "meta": rec["rng"]})
    for name, p in params.items():
        p["pieces"].sort(key=lambda x: x[2])
    out = dict(header)
    out.update(format=FORMAT, format_version=FORMAT_VERSION, files=files, shards=shards, params=params, rng=rng)
    if out.get("optimizer") is not None:
        out["optimizer"] = dict(out["optimizer"], state_keys=sorted(state_keys), scalars=scalars)
    return out
