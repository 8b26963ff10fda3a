"""Comms logger: calls and bytes per collective, per process group, per step (DeepSpeed's `comms_logger`).

FSDP2 issues its collectives through `torch.distributed` module functions looked up at call time
(`dist.all_gather_into_tensor` on torch 2.11, `dist.all_gather_single` on 2.13, `dist.reduce_scatter_*`,
`dist.all_reduce` for HSDP), and DTensor redistribution goes through functional collectives looked up as
`funcol.<name>`. While a `CommsLogger` is active those module attributes are replaced by thin wrappers
that record the call and hand back whatever the original returns (async `Work` handles included).

Covered: every tensor collective and point-to-point function of `torch.distributed` (and its
`distributed_c10d` module), and the functional collectives DTensor uses (all-gather, reduce-scatter,
all-reduce, all-to-all, broadcast). Not covered: code that bound a function before the logger started
(`from torch.distributed import all_reduce`), direct `ProcessGroup` method calls, and traced
`torch.compile` graphs. Object collectives are counted as the tensor collectives they are built from.

Byte convention. `bytes` is what this rank puts on the wire under a ring algorithm, i.e. the message
size times nccl-tests' bus-bandwidth factor, so the same number means the same traffic for every op
(n = group size):

    all_gather*          (n-1) x input bytes        (= output x (n-1)/n)
    reduce_scatter*      (n-1) x output bytes       (= input x (n-1)/n)
    all_reduce           2(n-1)/n x tensor bytes
    all_to_all*          input bytes minus the chunk this rank keeps
    broadcast, reduce    tensor bytes
    send / recv          tensor bytes / 0;  gather / scatter: the non-root's send / the root's sends
    barrier              0

`in_bytes` / `out_bytes` are the raw sizes of the local input / output tensors, for benchmarks that
prefer DeepSpeed's message-size view. Op names are the ones on the left (2.13's `all_gather_single` and
`reduce_scatter_single` count as `all_gather_into_tensor` / `reduce_scatter_tensor`); `prof_ops` uses them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from ds_plugin.config import CommsLoggerConfig

__all__ = ["CommsLogger", "comms_logger_from_config", "get_comms_logger", "record_collective", "unrecorded"]

logger = logging.getLogger(__name__)

Sizes = tuple[int, int, int]  # (in_bytes, out_bytes, wire_bytes)
SizeFn = Callable[[dict[str, Any], int, int], Sizes]


def _nb(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _nbl(ts: Sequence[Any] | None) -> int:
    return sum(_nb(t) for t in ts or ())


def _gather(inp: int, out: int, n: int) -> Sizes:
    return inp, out, (n - 1) * inp


def _scatter_reduce(inp: int, out: int, n: int) -> Sizes:
    return inp, out, (n - 1) * out


def _all_reduce(b: int, n: int) -> Sizes:
    return b, b, 2 * (n - 1) * b // n


def _a2a_single(inp: torch.Tensor, out: int, splits: Sequence[int] | None, n: int, r: int) -> Sizes:
    b = _nb(inp)
    if splits:
        own = splits[r] * (b // max(inp.shape[0], 1)) if inp.dim() else 0
    else:
        own = b // n
    return b, out, b - own


def _is_root(a: dict[str, Any], r: int, group_key: str, global_key: str) -> bool:
    if a.get(group_key) is not None:
        return a[group_key] == r
    return a.get(global_key) == dist.get_rank()


# torch.distributed functions: name -> (canonical op name, f(bound arguments, group size, rank in group)).
# fmt: off
_C10D: dict[str, tuple[str, SizeFn]] = {
    "all_gather_into_tensor": ("all_gather_into_tensor",
                               lambda a, n, r: _gather(_nb(a["input_tensor"]), _nb(a["output_tensor"]), n)),
    "all_gather": ("all_gather", lambda a, n, r: _gather(_nb(a["tensor"]), _nbl(a["tensor_list"]), n)),
    "all_gather_coalesced": ("all_gather_coalesced", lambda a, n, r: _gather(
        _nbl(a["input_tensor_list"]), sum(_nbl(x) for x in a["output_tensor_lists"]), n)),
    "reduce_scatter_tensor": ("reduce_scatter_tensor",
                              lambda a, n, r: _scatter_reduce(_nb(a["input"]), _nb(a["output"]), n)),
    "reduce_scatter": ("reduce_scatter", lambda a, n, r: _scatter_reduce(_nbl(a["input_list"]), _nb(a["output"]), n)),
    "all_reduce": ("all_reduce", lambda a, n, r: _all_reduce(_nb(a["tensor"]), n)),
    "all_reduce_coalesced": ("all_reduce_coalesced", lambda a, n, r: _all_reduce(_nbl(a["tensors"]), n)),
    "all_to_all_single": ("all_to_all_single", lambda a, n, r: _a2a_single(
        a["input"], _nb(a["output"]), a.get("input_split_sizes"), n, r)),
    "all_to_all": ("all_to_all", lambda a, n, r: (
        _nbl(a["input_tensor_list"]), _nbl(a["output_tensor_list"]),
        _nbl(a["input_tensor_list"]) - _nb(a["input_tensor_list"][r]))),
    "broadcast": ("broadcast", lambda a, n, r: (_nb(a["tensor"]),) * 3),
    "reduce": ("reduce", lambda a, n, r: (_nb(a["tensor"]),) * 3),
    "gather": ("gather", lambda a, n, r: (
        _nb(a["tensor"]), _nbl(a.get("gather_list")), 0 if _is_root(a, r, "group_dst", "dst") else _nb(a["tensor"]))),
    "scatter": ("scatter", lambda a, n, r: (
        _nbl(a.get("scatter_list")), _nb(a["tensor"]),
        _nbl(a.get("scatter_list")) - _nb(a["tensor"]) if _is_root(a, r, "group_src", "src") else 0)),
    "send": ("send", lambda a, n, r: (_nb(a["tensor"]), 0, _nb(a["tensor"]))),
    "recv": ("recv", lambda a, n, r: (0, _nb(a["tensor"]), 0)),
    "barrier": ("barrier", lambda a, n, r: (0, 0, 0)),
}
# fmt: on
# Aliases across torch versions: 2.13 renamed the flat-tensor collectives and made the old names call the
# new ones, which the re-entrancy guard below turns into a single record.
_C10D["all_gather_single"] = _C10D["_all_gather_base"] = _C10D["all_gather_into_tensor"]
_C10D["reduce_scatter_single"] = _C10D["_reduce_scatter_base"] = _C10D["reduce_scatter_tensor"]
_C10D["isend"], _C10D["irecv"] = _C10D["send"], _C10D["recv"]

# Functional collectives (DTensor): they return the result instead of filling an output tensor.
# fmt: off
_FUNCOL: dict[str, tuple[str, SizeFn]] = {
    "all_gather_tensor": ("all_gather_into_tensor", lambda a, n, r: _gather(_nb(a["self"]), n * _nb(a["self"]), n)),
    "reduce_scatter_tensor": ("reduce_scatter_tensor",
                              lambda a, n, r: _scatter_reduce(_nb(a["self"]), _nb(a["self"]) // n, n)),
    "all_reduce": ("all_reduce", lambda a, n, r: _all_reduce(_nb(a["self"]), n)),
    "all_to_all_single": ("all_to_all_single", lambda a, n, r: _a2a_single(
        a["self"], _nb(a["self"]), a.get("input_split_sizes"), n, r)),
    "broadcast": ("broadcast", lambda a, n, r: (_nb(a["self"]),) * 3),
}
# fmt: on
_FUNCOL["all_gather_single"] = _FUNCOL["all_gather_tensor"]
_FUNCOL["reduce_scatter_single"] = _FUNCOL["reduce_scatter_tensor"]

_tls = threading.local()  # per-thread nesting depth: only the outermost wrapped call is recorded
_install_lock = threading.Lock()
_active: tuple[CommsLogger, ...] = ()
_saved: list[tuple[Any, str, Any, Any]] = []  # (module, attribute, original, wrapper)
_global: CommsLogger | None = None


# Frames skipped when `debug` names the caller: the collective API itself, so FSDP2's or the user's call site shows.
_API_MODULES = (
    __name__,
    "torch.distributed.distributed_c10d",
    "torch.distributed.c10d_logger",
    funcol.__name__,
    "ds_plugin.zero.gloo_comm",  # its rings are recorded as the collectives they implement
)


def _caller() -> str:
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "") in _API_MODULES:
        f = f.f_back
    return "?" if f is None else f"{f.f_globals.get('__name__', '?')}.{f.f_code.co_name}"


def _make_wrapper(orig: Callable[..., Any], spec: tuple[str, SizeFn], functional: bool) -> Callable[..., Any]:
    op, size_fn = spec
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        loggers = _active
        if not loggers or getattr(_tls, "depth", 0):
            return orig(*args, **kwargs)
        _tls.depth = 1
        try:
            try:
                record = _measure(sig, args, kwargs, size_fn, functional)
            except Exception:  # a logger must never break training: skip the record, make the call
                logger.debug("comms logger could not size %s", op, exc_info=True)
                record = None
            result = orig(*args, **kwargs)
        finally:
            _tls.depth = 0
        if record is not None:
            caller = _caller() if any(lg.config.debug for lg in loggers) else ""
            for lg in loggers:
                lg._record(op, *record, caller)
        return result

    wrapper._ds_comms_wrapper = True  # type: ignore[attr-defined]
    return wrapper


def _measure(
    sig: inspect.Signature, args: tuple, kwargs: dict, size_fn: SizeFn, functional: bool
) -> tuple[tuple[int, ...], Sizes] | None:
    a = sig.bind_partial(*args, **kwargs).arguments
    if functional:  # funcol takes a group, a group name, ranks or a mesh: let it resolve them
        ranks = tuple(funcol._expand_group(a["group"], a.get("tag", ""))[1])
    else:
        group = a.get("group")
        ranks = tuple(dist.get_process_group_ranks(c10d._get_default_group() if group is None else group))
    me = dist.get_rank()
    if me not in ranks:  # c10d returns at once for a rank outside the group: nothing is sent
        return None
    return ranks, size_fn(a, len(ranks), ranks.index(me))


def record_collective(op: str, group: Any, in_bytes: int, out_bytes: int) -> None:
    """Record one call of `op` (`all_gather_into_tensor` or `reduce_scatter_tensor`) that was built from other calls,
    such as a ring of sends and receives, which then run under `unrecorded`: its bytes by this module's convention."""
    if not _active:
        return
    ranks = tuple(dist.get_process_group_ranks(group))
    size_fn = _gather if op == "all_gather_into_tensor" else _scatter_reduce
    sizes = size_fn(in_bytes, out_bytes, len(ranks))
    caller = _caller() if any(lg.config.debug for lg in _active) else ""
    for lg in _active:
        lg._record(op, ranks, sizes, caller)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Calls made inside are not recorded (they make up a collective recorded with `record_collective`)."""
    depth = getattr(_tls, "depth", 0)
    _tls.depth = depth + 1
    try:
        yield
    finally:
        _tls.depth = depth


def _install() -> None:
    """Replace the collective functions on the torch modules (once, however many loggers are active)."""
    wrappers: dict[int, Callable[..., Any]] = {}
    for module, table, functional in ((dist, _C10D, False), (c10d, _C10D, False), (funcol, _FUNCOL, True)):
        for name, spec in table.items():
            orig = getattr(module, name, None)
            if orig is None or getattr(orig, "_ds_comms_wrapper", False):
                continue
            # One wrapper per function object, so `dist.isend is c10d.isend` still holds (P2POp checks it).
            if id(orig) not in wrappers:
                wrappers[id(orig)] = _make_wrapper(orig, spec, functional)
            wrapper = wrappers[id(orig)]
            setattr(module, name, wrapper)
            _saved.append((module, name, orig, wrapper))


def _uninstall() -> None:
    while _saved:
        module, name, orig, wrapper = _saved.pop()
        if getattr(module, name, None) is wrapper:  # leave alone whatever someone patched over us
            setattr(module, name, orig)


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(b) < 1024:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return f"{b:.2f} GiB"


Stat = dict[str, int]
_Key = tuple[str, str, tuple[int, ...]]  # (region path, op, global ranks of the group)


def _add(bucket: dict[Any, list[int]], key: Any, sizes: Sizes) -> None:
    s = bucket.setdefault(key, [0, 0, 0, 0])
    s[0] += 1
    s[1] += sizes[2]
    s[2] += sizes[0]
    s[3] += sizes[1]


class CommsLogger:
    """Records calls and bytes of every collective while active.

    Usage: ``with CommsLogger(cfg) as log: ...; log.step()`` per training step, ``with log.region("forward")``
    to tag a stretch of code, then ``log.summary()`` / ``log.table()``. Regions are process-wide (not
    per-thread) so collectives that autograd issues from its worker threads carry the region the training
    loop opened.

    Args:
        config: the `comms_logger` config section (`enabled` is not consulted: constructing one means on).
        group_labels: human names for process groups, keyed by group or by its global ranks.
        max_steps: keep per-step detail for this many most recent steps (totals always cover every step).
    """

    def __init__(
        self,
        config: CommsLoggerConfig | None = None,
        *,
        group_labels: Mapping[Any, str] | None = None,
        max_steps: int | None = 1000,
    ) -> None:
        self.config = config or CommsLoggerConfig(enabled=True)
        self.max_steps = max_steps
        self._lock = threading.Lock()
        self._labels: dict[tuple[int, ...], str] = {}
        self._regions: list[str] = []
        self._step = 0
        self._steps: dict[int, dict[_Key, list[int]]] = {}  # step -> key -> [calls, wire, in, out]
        self._totals: dict[_Key, list[int]] = {}
        self._running = False
        for group, label in (group_labels or {}).items():
            self.label_group(group, label)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> CommsLogger:
        """Begin recording (installs the wrappers if no other logger has)."""
        global _active
        with _install_lock:
            if not self._running:
                if not _active:
                    _install()
                _active = (*_active, self)
                self._running = True
        return self

    def stop(self) -> None:
        """Stop recording; the wrappers are removed when the last active logger stops."""
        global _active, _global
        with _install_lock:
            if self._running:
                _active = tuple(lg for lg in _active if lg is not self)
                self._running = False
                if not _active:
                    _uninstall()
            if _global is self:
                _global = None

    def __enter__(self) -> CommsLogger:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- labelling and tagging ---------------------------------------------------------------------------
    def label_group(self, group: Any, label: str) -> None:
        """Name a process group in the summary.

        Args:
            group: a `ProcessGroup`, or the sequence of global ranks it spans.
            label: the name to report (two groups given one label are summed under it).
        """
        ranks = tuple(group) if isinstance(group, (list, tuple)) else tuple(dist.get_process_group_ranks(group))
        self._labels[ranks] = label

    def label_mesh(self, mesh: Any) -> None:
        """Name each dimension's group of a `DeviceMesh` after the dimension ("dp_shard", "dp_replicate", ...).

        Args:
            mesh: the device mesh; unnamed dimensions are labelled `mesh_dim{i}`.
        """
        names = mesh.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(mesh.ndim))
        for i, name in enumerate(names):
            self.label_group(mesh.get_group(i), name)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Tag the collectives issued inside the block; nested regions join with "/" ("backward/layer0").

        Args:
            name: the region name.
        """
        with self._lock:
            self._regions.append(name)
        try:
            yield
        finally:
            with self._lock:
                # Remove this block's own entry (the last one of that name), even if regions closed out of order.
                del self._regions[len(self._regions) - 1 - self._regions[::-1].index(name)]

    def step(self) -> dict[tuple[str, str], Stat]:
        """Close the current step; returns its totals per (op, group label)."""
        with self._lock:
            closed = self._step
            self._step += 1
            items = list(self._steps.get(closed, {}).items())
            if self.max_steps is not None:
                for old in [s for s in self._steps if s <= closed - self.max_steps]:
                    del self._steps[old]
        return self._aggregate(items, None)

    def reset(self) -> None:
        """Forget everything recorded and restart at step 0."""
        with self._lock:
            self._steps.clear()
            self._totals.clear()
            self._step = 0

    # -- recording ---------------------------------------------------------------------------------------
    def _record(self, op: str, ranks: tuple[int, ...], sizes: Sizes, caller: str) -> None:
        cfg = self.config
        if not cfg.prof_all and op not in cfg.prof_ops:
            return
        if cfg.debug and caller:
            op = f"{op} | {caller}"
        with self._lock:
            key = ("/".join(self._regions), op, ranks)
            _add(self._steps.setdefault(self._step, {}), key, sizes)
            _add(self._totals, key, sizes)
        if cfg.verbose:
            logger.info(
                "rank %d comm op=%s group=%s wire=%d in=%d out=%d",
                dist.get_rank(), op, self._label(ranks), sizes[2], sizes[0], sizes[1],
            )  # fmt: skip

    def _label(self, ranks: tuple[int, ...]) -> str:
        if ranks in self._labels:
            return self._labels[ranks]
        if dist.is_initialized() and ranks == tuple(range(dist.get_world_size())):
            return "world"
        return "ranks[" + ",".join(map(str, ranks)) + "]"

    # -- reporting ---------------------------------------------------------------------------------------
    def _aggregate(self, items: list[tuple[_Key, list[int]]], region: str | None) -> dict[tuple[str, str], Stat]:
        out: dict[tuple[str, str], Stat] = {}
        for (reg, op, ranks), (calls, wire, inb, outb) in sorted(items):
            if region is not None and reg != region and not reg.startswith(region + "/"):
                continue
            e = out.setdefault((op, self._label(ranks)), {"calls": 0, "bytes": 0, "in_bytes": 0, "out_bytes": 0})
            e["calls"] += calls
            e["bytes"] += wire
            e["in_bytes"] += inb
            e["out_bytes"] += outb
        return out

    def groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Each group label seen, with the global ranks of the group(s) behind it."""
        with self._lock:
            seen = sorted({k[2] for k in self._totals})
        out: dict[str, list[tuple[int, ...]]] = {}
        for ranks in seen:
            out.setdefault(self._label(ranks), []).append(ranks)
        return out

    def regions(self) -> list[str]:
        """The region paths seen so far ("" = outside any region)."""
        with self._lock:
            return sorted({k[0] for k in self._totals})

    def summary(self, region: str | None = None) -> dict[int | str, dict[tuple[str, str], Stat]]:
        """Totals as plain data: ``{step: {(op, group_label): {"calls", "bytes", "in_bytes", "out_bytes"}}}``.

        Every retained closed step has an entry (empty if nothing was sent), the open step appears once it
        has records, and key "total" sums all steps ever recorded.

        Args:
            region: only collectives issued inside this region (or a region nested in it).
        """
        with self._lock:
            first = 0 if self.max_steps is None else max(0, self._step - self.max_steps)
            steps = {s: list(self._steps.get(s, {}).items()) for s in range(first, self._step)}
            if self._step in self._steps:
                steps[self._step] = list(self._steps[self._step].items())
            totals = list(self._totals.items())
        out: dict[int | str, dict[tuple[str, str], Stat]] = {s: self._aggregate(v, region) for s, v in steps.items()}
        out["total"] = self._aggregate(totals, region)
        return out

    def table(self, region: str | None = None, per_step: bool = False) -> str:
        """A printable table of the totals (or of every retained step with `per_step`).

        Args:
            region: as in `summary`.
            per_step: one block of rows per step instead of the totals.
        """
        summ = self.summary(region)
        keys: list[int | str] = [k for k in summ if k != "total"] if per_step else ["total"]
        head = f"{'step':>5}  {'op':<28} {'group':<16} {'calls':>7} {'bytes (wire)':>14} {'in':>12} {'out':>12}"
        lines = [head, "-" * len(head)]
        for step in keys:
            for (op, label), e in sorted(summ[step].items()):
                lines.append(
                    f"{step!s:>5}  {op:<28} {label:<16} {e['calls']:>7} {fmt_bytes(e['bytes']):>14} "
                    f"{fmt_bytes(e['in_bytes']):>12} {fmt_bytes(e['out_bytes']):>12}"
                )
        return "\n".join(lines)

    def log_summary(self, region: str | None = None) -> None:
        """Log the totals table at INFO on rank 0 (DeepSpeed's `log_all`).

        Args:
            region: as in `summary`.
        """
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("communication summary%s\n%s", f" ({region})" if region else "", self.table(region))


def get_comms_logger() -> CommsLogger | None:
    """The logger installed by `comms_logger_from_config`, if any."""
    return _global


def comms_logger_from_config(cfg: Any) -> CommsLogger | None:
    """Start the process-wide logger when the config enables it; None when it does not.

    Calling it again while that logger is running returns the same logger.

    Args:
        cfg: a `TrainingConfig` (its `comms_logger` section is used) or a `CommsLoggerConfig`.
    """
    global _global
    section = cfg if isinstance(cfg, CommsLoggerConfig) else cfg.comms_logger
    if not section.enabled:
        return None
    if _global is None or not _global._running:
        _global = CommsLogger(section).start()
    return _global
