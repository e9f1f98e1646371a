"""Integrations with other libraries (HuggingFace transformers: :mod:`zerospeed.integrations.transformers`)."""
