"""Benchmarks: programs that print JSON (and draw a PNG), run from the repository checkout.

Each runs as ``python -m benchmarks.NAME`` from the repository root, the eight with a ``main(argv)`` also as
``ds-plugin bench NAME`` (``ds_plugin/cli.py``). Not part of the installed package: they need network namespaces,
DeepSpeed, bitsandbytes or a GPU, and they write under ``benchmarks/results/``. Their tests are in
``benchmarks/tests/`` (``python -m pytest -q benchmarks/tests``), outside the main test tier.
"""

import os

# Nothing here reaches the Hugging Face Hub (models are built from configs or written here, data ships in the
# repository). Offline mode makes that hold for the libraries too: on a CPU with AVX512-bf16, importing bitsandbytes
# (0.50) otherwise looks a kernel up on the hub. Ranks inherit it; set `HF_HUB_OFFLINE=0` to let them reach it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
