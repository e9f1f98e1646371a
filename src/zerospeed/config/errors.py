"""The one error type for bad configuration.

Every configuration problem surfaces as a :class:`ConfigError` whose message is a single line
``zerospeed config: <key.path>: <problem>`` so a user sees which key to fix without reading a
traceback from inside the library.

``DeepSpeedConfigError`` (DeepSpeed's name, ``deepspeed.runtime.config.DeepSpeedConfigError``) is the same class, so
a script's ``except deepspeed.DeepSpeedConfigError`` catches zerospeed's configuration errors; like DeepSpeed's it can
be raised with one message (``ConfigError("bad batch")``: no key path). It pickles (``__reduce__``), so an error
raised in a worker process reaches the parent.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key that zerospeed cannot accept.

    Attributes:
        key_path: dotted path of the offending key (``"zero_optimization.stage"``), or ``""`` for
            the config as a whole.
        problem: what is wrong and, where it helps, what is allowed.
    """

    def __init__(self, key_path: str, problem: str | None = None) -> None:
        if problem is None:  # DeepSpeedConfigError("message"): DeepSpeed's one-argument form
            key_path, problem = "", key_path
        self.key_path = key_path
        self.problem = problem
        where = f"{key_path}: " if key_path else ""
        super().__init__(f"zerospeed config: {where}{problem}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.key_path, self.problem)


DeepSpeedConfigError = ConfigError
