"""Checkpoints: sharded, atomic, resharding DCP directories that never run code, and the engine's save and load.

- `io.py`: `save_checkpoint` / `load_checkpoint` of any state dicts (atomic directory moves in `_atomic_dir.py`),
  `load_full_state_dict` for export.
- `guard.py`: what is verified before anything is unpickled (`read_checkpoint_info`; the restricted unpickler of
  DCP's `.metadata` is `_safe_pickle.py`).
- `engine_state.py`: the one save and load of a `ZeroEngine` (weights, optimizer, counters, a framework's state),
  used by the engine API, Lightning, Fabric and Accelerate, with its rule for what a load restores.
- `layout.py`: DeepSpeed's `save_dir/<tag>` + `save_dir/latest` layout of `ZeroEngine.save_checkpoint` /
  `load_checkpoint`, and `latest_checkpoint`.
- `metadata.py`: what `ds-plugin export` needs to know about the model (`model_metadata`).
"""

from ds_plugin.checkpoint.engine_state import LoadedCheckpoint, load_engine_checkpoint, save_engine_checkpoint
from ds_plugin.checkpoint.guard import MARKER, CheckpointError, read_checkpoint_info
from ds_plugin.checkpoint.io import load_checkpoint, load_full_state_dict, remove_checkpoint, save_checkpoint
from ds_plugin.checkpoint.layout import LATEST, latest_checkpoint
from ds_plugin.checkpoint.metadata import model_metadata

__all__ = [
    "LATEST",
    "MARKER",
    "CheckpointError",
    "LoadedCheckpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_engine_checkpoint",
    "load_full_state_dict",
    "model_metadata",
    "read_checkpoint_info",
    "remove_checkpoint",
    "save_checkpoint",
    "save_engine_checkpoint",
]
