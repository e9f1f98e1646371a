"""``add_config_arguments(parser)``: DeepSpeed's command-line flags for a training script.

Adds an argument group with ``--deepspeed`` (a flag for the script's own use; zerospeed does not
read it), ``--deepspeed_config PATH``, and the deprecated aliases DeepSpeed still accepts,
``--deepscale`` and ``--deepscale_config``. :func:`config_path_from_args` is what ``initialize(args=...)``
uses: ``deepspeed_config``, else ``deepscale_config`` (with a deprecation warning, as DeepSpeed
logs one); both set is an error naming the two flags.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger("zerospeed")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_config_arguments: expected an argparse.ArgumentParser, got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zerospeed)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed/zerospeed (a flag for the script; zerospeed itself does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated alias of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated alias of --deepspeed_config")
    return parser


def config_path_from_args(args: Any) -> Any:
    """The config named on the command line (``args.deepspeed_config`` or the deprecated
    ``args.deepscale_config``), or None."""
    primary = getattr(args, "deepspeed_config", None)
    legacy = getattr(args, "deepscale_config", None)
    if primary is not None and legacy is not None:
        raise ValueError("initialize(args=...): both --deepspeed_config and the deprecated --deepscale_config are "
                         "set; keep --deepspeed_config")
    if legacy is not None:
        logger.warning("zerospeed: --deepscale_config is deprecated, use --deepspeed_config")
        return legacy
    return primary
