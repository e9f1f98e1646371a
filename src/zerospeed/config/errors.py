"""The one error type for bad configuration.

Every configuration problem surfaces as a :class:`ConfigError` whose message is a single line
``zerospeed config: <key.path>: <problem>`` so a user sees which key to fix without reading a
traceback from inside the library.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key that zerospeed cannot accept.

    Attributes:
        key_path: dotted path of the offending key (``"zero_optimization.stage"``), or ``""`` for
            the config as a whole.
        problem: what is wrong and, where it helps, what is allowed.
    """

    def __init__(self, key_path: str, problem: str) -> None:
        self.key_path = key_path
        self.problem = problem
        where = f"{key_path}: " if key_path else ""
        super().__init__(f"zerospeed config: {where}{problem}")
