"""Suite-wide pytest setup: the test-only sabotage switch, the `long` tier and the `release` set.

`long` tests are minutes-long end-to-end runs (the recipes, convergence runs, killed ranks). A bare run (the
README's `python -m pytest -q -n 2 --dist loadfile`) leaves them out so that the suite stays within 10 minutes on 2
cores; `python -m pytest -q -m long` runs them (CI runs both). Naming a file, directory or test on the command line
runs what it names, `long` or not. Under pytest-xdist (`-n N`) each worker takes its share of the cores' intra-op
threads.

`release` marks the tests of what can differ between torch and framework releases: FSDP2's extension points (custom
all-gathers, `fsdp_pre/post_all_gather`), DCP, the functional collectives, inductor's CPU code (the compiled
quantizer steps, whose bits it decides), the Triton interpreter, the Lightning, Accelerate and HF Trainer/trl
adapters, and checkpoints. CI's second stack (an older torch on a newer Python) runs only these: `python -m pytest
-q -m release`. The mark comes from where a test lives (`RELEASE_DIRS`, `RELEASE_FILES`, checkpoint file names), so
a new file there is covered without a decorator; a test elsewhere that leans on such an API says so with
`@pytest.mark.release`. A `long` test is never `release`: the second stack does not repeat the minutes-long runs.

`gpu` tests run with strict kernels (`DS_PLUGIN_STRICT_KERNELS=1`): a Triton kernel that fails to launch is an
error there, never a silent fallback to the torch reference that the test would then pass on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import _break
import pytest

_break.install()  # DS_PLUGIN_TEST_NOOP_STEP=1 makes every optimizer step a no-op (tests/_break.py)

# No test reaches the Hugging Face Hub: models are built from configs and data ships in the repository. Offline mode
# makes that hold for the libraries too: on a CPU with AVX512-bf16, importing bitsandbytes (0.50) otherwise looks a
# kernel up on the hub (its CPU backend's `get_kernel`). Set before anything imports huggingface_hub, which reads it
# once; ranks started by tests inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n N`: the workers share the cores instead of each taking them all
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

TESTS = Path(__file__).resolve().parent
# Folders under tests/ whose every test is `release`: the adapters, the Triton kernels, the checkpoints.
RELEASE_DIRS = ("strategies", "accelerate", "kernels", "checkpoint")
# Files elsewhere whose every test is `release` (FSDP2 hooks and custom collectives).
RELEASE_FILES = (
    "zero/test_zeropp_comm.py",  # qwZ/qgZ as FSDP2 custom collectives, against exact torch collectives
    "precision/test_fp8_all_gather.py",  # FP8 weights through fsdp_pre/post_all_gather, and their checkpoint
    "zero/test_engine_features.py",  # FSDP2 state dicts and optimizer state across stages
    "zero/test_gather_schedule.py",  # prefetch lists, kept blocks (post_forward_mesh_info), FSDP2's param groups
    "zero/test_gloo_comm.py",  # FSDP2 custom collectives on gloo, FSDP2's cast buffer
    "quant/comm/test_fused.py",  # the compiled quantizer steps, bit for bit: inductor's code generation differs
    "quant/frozen/test_fused_decode.py",  # the compiled frozen-weight decode, bit for bit, likewise
)
# Any test file whose name holds one of these is `release`, wherever it lives (checkpoint save/load over DCP).
RELEASE_NAME_WORDS = ("checkpoint", "resume")


def _is_release(path: Path) -> bool:
    try:
        rel = path.resolve().relative_to(TESTS)
    except ValueError:
        return False
    return (
        rel.parts[0] in RELEASE_DIRS
        or rel.as_posix() in RELEASE_FILES
        or any(word in rel.name for word in RELEASE_NAME_WORDS)
    )


@pytest.fixture(scope="session", autouse=True)
def _children_write_temp_files_here(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The processes tests start keep their temporary files under this session's pytest directory (pytest keeps
    the last three sessions' and removes older ones), not in the system's: torchrun's agent alone leaves a
    `torchelastic_*` directory behind at every launch. Inductor's compile cache stays where it was (it is found
    through the temporary directory), so the compiled code is still shared between runs."""
    import getpass
    import tempfile

    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("children"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _strict_kernels_in_the_gpu_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")  # ds_plugin.quant.STRICT_KERNELS_ENV, not imported here


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks added here must be seen by it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("long"):
            continue
        if _is_release(Path(str(item.path))):
            item.add_marker(pytest.mark.release)
    if config.getoption("markexpr") or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    deselected = [item for item in items if item.get_closest_marker("long")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("long")]
