"""The restricted `.metadata` unpickler, independent of the interpreter running the tests.

Python 3.11.0-3.11.4 pickle an Enum member as `getattr(EnumClass, "NAME")`; 3.10, 3.11.5+ and later pickle the
class and the value. DCP's metadata holds Enum members, so a checkpoint written on either kind of interpreter
must load on every other, and the `getattr` that the first form needs must not become a way to reach anything
but those members. The pickles here are built explicitly in each form, whatever this interpreter writes.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import os
import pathlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata, TensorStorageMetadata

from ds_plugin.checkpoint import MARKER, CheckpointError, load_checkpoint, read_checkpoint_info, save_checkpoint


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))


class _EnumFormPickler(pickle.Pickler):
    """Writes every Enum member in one chosen form: "by_name" (3.11.0-3.11.4) or "by_value" (the others)."""

    def __init__(self, file: io.BytesIO, form: str) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.form = form
        self.enums_written = 0

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, enum.Enum):
            self.enums_written += 1
            return (getattr, (type(obj), obj.name)) if self.form == "by_name" else (type(obj), (obj.value,))
        return NotImplemented


def _forge(ck: Path, data: bytes) -> None:
    """Replace `.metadata` and rewrite the marker to match, as a forger (or a re-pickling test) would."""
    (ck / ".metadata").write_bytes(data)
    marker = json.loads((ck / MARKER).read_text())
    marker["metadata_sha256"] = hashlib.sha256(data).hexdigest()
    marker["files"][".metadata"] = len(data)
    (ck / MARKER).write_text(json.dumps(marker))


def _saved(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "ck", model_state=_mlp(seed=0).state_dict(), extra={"step": 7})


@pytest.mark.parametrize("form", ["by_name", "by_value"])
def test_metadata_in_either_enum_form_loads(tmp_path: Path, form: str) -> None:
    ck = _saved(tmp_path)
    _, metadata = read_checkpoint_info(ck)
    buf = io.BytesIO()
    pickler = _EnumFormPickler(buf, form)
    pickler.dump(metadata)
    assert pickler.enums_written > 0, "the metadata holds no Enum member: this test would prove nothing"
    data = buf.getvalue()
    assert (b"getattr" in data) == (form == "by_name")
    _forge(ck, data)

    _, reread = read_checkpoint_info(ck)
    assert isinstance(reread, Metadata)
    for key, meta in metadata.state_dict_metadata.items():
        got = reread.state_dict_metadata[key]
        assert type(got) is type(meta)
        if isinstance(meta, TensorStorageMetadata):
            assert got.size == meta.size and got.properties == meta.properties
    state = _mlp(seed=3).state_dict()
    assert load_checkpoint(ck, model_state=state) == {"step": 7}
    assert all(torch.equal(state[k], v) for k, v in _mlp(seed=0).state_dict().items())


# Hand-written pickle programs (protocol 0 opcodes), each ending in a call that would create a file named
# `pwned` in the working directory if it ever ran.
_GETATTR = b"cbuiltins\ngetattr\n"
_PAYLOADS = {
    # getattr on a module: os.system, and builtins.exec, each reached through getattr.
    "getattr_os_module": _GETATTR + b"(cimportlib\nimport_module\n(Vos\ntRVsystem\ntR(Vtouch pwned\ntR.",
    "getattr_builtins_module": _GETATTR
    + b"(cimportlib\nimport_module\n(Vbuiltins\ntRVexec\ntR(Vopen('pwned','w').close()\ntR.",
    # getattr on an allowed class for something that is not an Enum member.
    "getattr_path_write_text": _GETATTR + b"(cpathlib\nPath\nVwrite_text\ntR(cpathlib\nPath\n(Vpwned\ntRVx\ntR.",
    "getattr_enum_non_member": _GETATTR
    + b"(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nV__class__\ntR.",
    "getattr_function_globals": _GETATTR + b"(ctorch.serialization\n_get_layout\nV__globals__\ntR.",
    "getattr_non_string_name": _GETATTR + b"(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nI1\ntR.",
    # BUILD with slot state on an allowed class: would give the Enum a fake member `EVIL` = `Path`, for the whole
    # process, which the getattr stand-in would then hand out.
    "build_on_allowed_class": b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
    b"(N}(V_member_map_\n}(VEVIL\ncpathlib\nPath\nuutb.",
}


@pytest.mark.parametrize("name", sorted(_PAYLOADS))
def test_getattr_reaching_anything_but_an_allowed_enum_member_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    ck = _saved(tmp_path)
    _forge(ck, _PAYLOADS[name])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ck, model_state=_mlp(seed=0).state_dict())
    message = str(info.value)
    assert "\n" not in message and "refused" in message and "not allowed in DCP metadata" in message
    assert not (tmp_path / "pwned").exists()
    assert "EVIL" not in _MEM_FORMAT_ENCODING.__members__


def test_payloads_would_run_under_plain_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The payloads above are live: plain `pickle.loads` runs them, so the refusals are the guard's doing."""
    monkeypatch.chdir(tmp_path)
    for name in ("getattr_os_module", "getattr_builtins_module", "getattr_path_write_text"):
        pickle.loads(_PAYLOADS[name])
        assert (tmp_path / "pwned").exists(), name
        os.remove(tmp_path / "pwned")
    assert isinstance(pickle.loads(_PAYLOADS["getattr_function_globals"]), dict)
    assert pathlib.Path("pwned").exists() is False
    # The class-altering one runs in a child, so this process's Enum stays intact.
    code = (
        "import pickle, sys; from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as E; "
        "pickle.loads(sys.stdin.buffer.read()); print(E.__members__['EVIL'].__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=_PAYLOADS["build_on_allowed_class"], capture_output=True, check=True
    )
    assert done.stdout.decode().strip() == "Path"
