"""Runtime services around training that are not the ZeRO algorithm: dead-rank handling and the collective
timeout (`faults.py`), the comms logger (`comms_logger.py`), glibc host-memory reuse on CPU (`host_memory.py`), and
whether the CPU computes bf16 natively (`cpu_bf16.py`)."""

from ds_plugin.runtime.comms_logger import CommsLogger, comms_logger_from_config, get_comms_logger
from ds_plugin.runtime.faults import DEFAULT_TIMEOUT, RankFailureError, default_timeout, init_distributed
from ds_plugin.runtime.host_memory import host_memory_reuse_state, reuse_freed_host_memory

__all__ = [
    "DEFAULT_TIMEOUT",
    "CommsLogger",
    "RankFailureError",
    "comms_logger_from_config",
    "default_timeout",
    "get_comms_logger",
    "host_memory_reuse_state",
    "init_distributed",
    "reuse_freed_host_memory",
]
