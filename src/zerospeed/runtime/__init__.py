"""Training runtime: the engine and what it drives each step (LR schedules, ...)."""
