"""Launcher for data-parallel vLLM on a Ray cluster, run as the head job's entrypoint."""

__version__ = "0.1.0"
