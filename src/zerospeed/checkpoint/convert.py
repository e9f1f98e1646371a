"""``zerospeed-convert``: checkpoints between zerospeed, DeepSpeed, HuggingFace and PyTorch DCP (issue #26).

::

    zerospeed-convert --to deepspeed SRC DST [--world-size N] [--zero-stage 0|1|2|3] [--precision fp32|bf16]
    zerospeed-convert --to universal SRC DST [--world-size N] [--precision fp32|bf16]
    zerospeed-convert --to hf        SRC DST [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
    zerospeed-convert --to dcp       SRC DST
    zerospeed-convert --from deepspeed SRC DST
    zerospeed-convert --from dcp       SRC DST

SRC of ``--to`` is a zerospeed checkpoint or a DeepSpeed folder (the folder holding ``latest``, or a tag
folder; ``--tag`` picks another tag). ``--to deepspeed`` writes a folder DeepSpeed 0.19.8 resumes
from at the given data-parallel size and stage (defaults: the source's); ``--to universal`` a DeepSpeed
universal checkpoint (``DST/<tag>_universal`` and ``DST/latest_universal``, as ``ds_to_universal`` writes
it) that DeepSpeed resumes with ``checkpoint.load_universal`` at any size; ``--from deepspeed`` writes a
zerospeed checkpoint once (the engine also loads DeepSpeed folders as they are). Every output is
written under a temporary name and renamed. Errors are one line on stderr, exit status 1 (2: usage).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from zerospeed.checkpoint.errors import CheckpointError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerospeed-convert", description=__doc__.split("\n\n")[0])
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["deepspeed", "universal", "hf", "dcp"],
                     help="format to write (SRC: any checkpoint)")
    way.add_argument("--from", dest="from_", choices=["deepspeed", "dcp"], help="format to read into a zerospeed "
                     "checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tag", default=None, help="tag of SRC to read (default: its 'latest')")
    p.add_argument("--out-tag", default=None, help="tag to write (default: global_step<N>)")
    p.add_argument("--world-size", type=int, default=None, help="--to deepspeed / universal: data-parallel size to "
                   "lay out for")
    p.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3], help="--to deepspeed: ZeRO stage")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="--to deepspeed / universal: training "
                   "dtype")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="--to hf / dcp: tensor dtype")
    p.add_argument("--max-shard-size", default="5GB", help="--to hf: largest output file (HF index when split)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.to == "deepspeed":
            from zerospeed.checkpoint.deepspeed.writer import write_deepspeed

            out = write_deepspeed(args.src, args.dst, args.world_size, args.zero_stage, args.precision, args.tag,
                                  args.out_tag)
        elif args.to == "universal":
            from zerospeed.checkpoint.deepspeed.universal_writer import write_universal

            if args.zero_stage is not None:
                raise ValueError("--zero-stage does not apply to --to universal: DeepSpeed chooses the stage when it "
                                 "loads a universal checkpoint")
            out = write_universal(args.src, args.dst, args.world_size, args.precision, args.tag, args.out_tag)
        elif args.to == "hf":
            from zerospeed.checkpoint.export import write_state_dict_files

            out = ", ".join(write_state_dict_files(args.src, args.dst, args.dtype, args.max_shard_size, True,
                                                   args.tag))
        elif args.to == "dcp":
            from zerospeed.checkpoint.dcp import write_dcp

            out = write_dcp(args.src, args.dst, args.tag, args.dtype)
        elif args.from_ == "deepspeed":
            from zerospeed.checkpoint.export import write_zerospeed
            from zerospeed.checkpoint.full_tensors import FullTensors

            with FullTensors(args.src, args.tag) as ft:
                if ft.deepspeed is None:
                    raise CheckpointError(f"{ft.directory} is not a DeepSpeed folder (it has an index.json)")
            out = write_zerospeed(args.src, args.dst, args.tag, args.out_tag)
        else:
            from zerospeed.checkpoint.dcp import dcp_to_zerospeed

            out = dcp_to_zerospeed(args.src, args.dst, args.out_tag or "global_step0")
    except (CheckpointError, ValueError, OSError) as e:
        print(f"zerospeed-convert: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
