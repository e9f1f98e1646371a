"""The example GPT (examples/gpt_model.py) for tests: puts examples/ on sys.path and re-exports it
(also in the ranks the harness starts, which inherit sys.path)."""

import os
import sys

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from gpt_model import GPT, Block, GPTConfig  # noqa: E402

__all__ = ["Block", "GPT", "GPTConfig"]
