"""``zerospeed serve --tensor-parallel N``: N ranks started through the launcher, rank 0 serves HTTP.

Not available yet: the engine's tensor-parallel mode (``build_engine(..., tensor_parallel=N)``
with ``run_worker_loop``/``shutdown``) has not landed, so N > 1 is a clear error.
"""

from __future__ import annotations

import argparse
import sys


def main(args: argparse.Namespace, argv: list[str]) -> int:
    print("zerospeed serve: error: --tensor-parallel: only 1 is supported until the inference "
          f"engine's tensor-parallel mode lands (got {args.tensor_parallel})", file=sys.stderr,
          flush=True)
    return 2
