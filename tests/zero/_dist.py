"""The tests' multi-process runner is the package's own (`ds_plugin.launch.run_ranks`), shared with benchmarks."""

from ds_plugin.launch import run_ranks

__all__ = ["run_ranks"]
