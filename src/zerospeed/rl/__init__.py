"""RL post-training on zerospeed's engines (issue #32): rollouts on the live training weights
(:mod:`zerospeed.rl.rollout`, ``engine.generate``) and weight sync to a separate generator
(:mod:`zerospeed.rl.sync`, ``engine.sync_weights``).

Layer: above ``runtime/`` and ``inference/`` (it uses both); nothing below imports it. The training engine reaches
it through the :class:`RLHooks` object the facade (``zerospeed.initialize``) attaches as ``engine.rl``, so
``runtime/`` never imports this package. Imports here are lazy: a training run that never generates does not load
the inference engine.
"""

from __future__ import annotations

from typing import Any


class RLHooks:
    """What ``engine.generate`` / ``engine.sync_weights`` delegate to (one per training engine)."""

    def __init__(self, train_engine: Any, config: Any) -> None:
        self._engine = train_engine
        self._config = config
        self._rollout: Any = None

    @property
    def enabled(self) -> bool:
        return bool(self._config.hybrid_engine.enabled)

    @property
    def rollout(self) -> Any:
        """The :class:`~zerospeed.rl.rollout.RolloutEngine` (built at the first call)."""
        if self._rollout is None:
            from zerospeed.rl.rollout import RolloutEngine

            fp = self._config.fast_paths
            self._rollout = RolloutEngine(self._engine, self._config.hybrid_engine, fp.cpu_kernels, fp.greedy_head)
        return self._rollout

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.rollout.generate(*args, **kwargs)

    def sync_weights(self, *args: Any, **kwargs: Any) -> Any:
        from zerospeed.rl.sync import sync_weights

        return sync_weights(self._engine, *args, **kwargs)


def attach(train_engine: Any, config: Any) -> RLHooks:
    """The facade's call after building a training engine."""
    hooks = RLHooks(train_engine, config)
    if hooks.enabled:  # bad hybrid_engine values fail at initialize, not at the first rollout
        hooks.rollout
    return hooks


__all__ = ["RLHooks", "attach"]
