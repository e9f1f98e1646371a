"""Helpers for testing zerospeed (and code built on it) across several processes on one machine."""

from zerospeed.testing.distributed import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
