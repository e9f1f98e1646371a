"""The package version: read by the facade (``zerospeed.__version__``) and written into checkpoint metadata."""

__version__ = "0.1.0"
