"""Mixture-of-experts support: ``zerospeed.moe.utils`` (DeepSpeed's helper names) and the registry
of expert parameters (:mod:`zerospeed.moe.registry`). The MoE layer itself is built elsewhere."""
