"""Imported first by the recipes, before any library: they never reach the Hugging Face Hub.

The recipes read local checkpoints (`--model PATH`) and the data next to them. Offline mode makes that hold for
the libraries they import too: on a CPU with AVX512-bf16, bitsandbytes (which peft imports) otherwise looks an
optional CPU kernel up on the Hub as it is imported. `HF_HUB_OFFLINE=0` lets it. bitsandbytes is imported here
without the warnings it logs when that kernel is not to be had: the recipes use no bitsandbytes kernel.
"""

import os

# Set before huggingface_hub is imported (Lightning imports it), which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ds_plugin.env import import_bitsandbytes_quietly

import_bitsandbytes_quietly()
