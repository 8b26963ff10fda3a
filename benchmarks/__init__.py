"""Benchmarks: programs that print JSON (and draw a PNG), run from the repository checkout.

Each runs as ``python -m benchmarks.NAME`` from the repository root, the eight with a ``main(argv)`` also as
``ds-plugin bench NAME`` (``ds_plugin/cli.py``). Not part of the installed package: they need network namespaces,
DeepSpeed, bitsandbytes or a GPU, and they write under ``benchmarks/results/``. Their tests are in
``benchmarks/tests/`` (``python -m pytest -q benchmarks/tests``), outside the main test tier.
"""
