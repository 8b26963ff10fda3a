"""Benchmarks: programs that print JSON (``ds-plugin bench NAME``)."""
