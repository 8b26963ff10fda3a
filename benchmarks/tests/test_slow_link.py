"""`ds-plugin bench slow-link`: the parts that need no root, the skip path, and (opt-in) the real shaped-link run.

The real run builds network namespaces and a tc-shaped veth pair, so it needs root and minutes; it runs only
with DS_PLUGIN_RUN_SLOW_BENCH=1. Everything else here is fast and runs anywhere.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import _slow_link_net as slow_link_net
from benchmarks import slow_link
from benchmarks._slow_link_timeline import Sampler, draw, trace, utilization
from benchmarks._slow_link_worker import (
    CONFIGS,
    MlpStack,
    deepspeed_config,
    floors,
    model_params,
    rate_bytes_per_s,
    summarize,
)
from ds_plugin.cli import main as cli_main

RUN_SLOW = os.environ.get("DS_PLUGIN_RUN_SLOW_BENCH") == "1"
_REPO = Path(slow_link.__file__).resolve().parents[1]


def test_parse_args_defaults_and_configs():
    args = slow_link.parse_args([])
    ours, theirs = ["zero3", "zeropp", "hpz"], ["deepspeed_zero3", "deepspeed_hpz", "deepspeed_zeropp"]
    assert (args.rate, args.configs, args.json) == ("1gbit", ours + theirs, False)
    args = slow_link.parse_args(["--json", "--configs", "zeropp, zero3", "--hidden", "64", "--delay-ms", "0.5"])
    assert (args.configs, args.hidden, args.delay_ms, args.json) == (["zeropp", "zero3"], 64, 0.5, True)
    assert slow_link.parse_args(["--timeline", "--png", "t.png"]).png == "t.png"
    for bad in (["--configs", "zero4"], ["--steps", "0"], ["--timeout", "0"], ["--warmup", "-1"], ["--png", "t.png"]):
        with pytest.raises(SystemExit) as exc:
            slow_link.parse_args(bad)
        assert exc.value.code == 2


def test_the_dtype_is_the_fast_one_unless_chosen_and_reaches_every_rank(monkeypatch, capsys):
    from ds_plugin.runtime import cpu_bf16

    for units, picked in ((False, "fp32"), (True, "bf16")):
        monkeypatch.setattr(cpu_bf16, "cpu_bf16_units", lambda units=units: (units, "the CPU's flags"))
        args = slow_link.parse_args([])
        assert args.dtype == picked and "the CPU's flags" in args.dtype_reason
        assert f"bench slow-link: training in {picked} (" in capsys.readouterr().err
        assert slow_link._worker_cmd(args, "zeropp", Path("o.json"))[-2:] == ["--dtype", picked]
    args = slow_link.parse_args(["--dtype", "bf16"])  # chosen: taken as given, even on a CPU without bf16 units
    assert (args.dtype, args.dtype_reason) == ("bf16", "chosen with --dtype") and capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        slow_link.parse_args(["--dtype", "fp16"])


def test_png_without_matplotlib_is_refused_before_any_run(monkeypatch, capsys):
    real = slow_link.importlib.util.find_spec
    monkeypatch.setattr(slow_link.importlib.util, "find_spec", lambda n: None if n == "matplotlib" else real(n))
    with pytest.raises(SystemExit) as exc:
        slow_link.parse_args(["--timeline", "--png", "t.png"])
    assert exc.value.code == 2 and "--png needs matplotlib: pip install" in capsys.readouterr().err


def test_model_params_matches_the_model():
    assert model_params(32, 3) == sum(p.numel() for p in MlpStack(32, 3).parameters()) == 3 * 2 * 32 * 128


def test_link_commands_shape_both_ends():
    link = slow_link.Link(tag=9999999)
    assert all(len(name) <= 15 for name in link.veths)  # Linux IFNAMSIZ - 1
    cmds = [" ".join(c) for c in slow_link.link_commands(link)]
    ns0, ns1 = link.namespaces
    assert cmds[:2] == [f"ip netns add {ns0}", f"ip netns add {ns1}"]
    tbf = [c for c in cmds if " tbf " in c]
    assert len(tbf) == 2 and all("rate 1gbit burst 256kb latency 100ms" in c for c in tbf)
    assert {c.split()[2] for c in tbf} == {ns0, ns1}
    assert any("10.77.0.1/24" in c for c in cmds) and any("10.77.0.2/24" in c for c in cmds)
    assert not any("netem" in c for c in cmds)
    delayed = [" ".join(c) for c in slow_link.link_commands(slow_link.Link(delay_ms=0.5, tag=1))]
    assert sum("netem delay 0.5ms" in c for c in delayed) == 2
    assert sum("parent 1:1" in c and "tbf" in c for c in delayed) == 2


def test_stale_namespaces_only_of_dead_runs():
    listing = "dspsl-123-0 (id: 0)\ndspsl-123-1 (id: 1)\ndspsl-456-0\nother-7-0\ndspsl-x-0\ndspsl-9-2\n"
    assert slow_link.stale_namespaces(listing, alive=lambda pid: pid == 456) == ["dspsl-123-0", "dspsl-123-1"]
    assert slow_link.stale_namespaces(listing, alive=lambda pid: True) == []
    # The default liveness check: this process is alive.
    assert slow_link.stale_namespaces(f"dspsl-{os.getpid()}-0") == []


def test_summarize_takes_the_slowest_rank_per_step():
    walls = {"forward": [[0.1, 0.2, 0.3], [0.5, 0.4, 0.6]], "backward": [[0.6, 2.5, 1.4], [0.7, 1.3, 1.6]]}
    walls["step"] = [[0.3] * 3] * 2
    cpus = {"forward": [0.1, 0.2], "backward": [0.3, 0.1], "step": [0.1, 0.1]}  # per rank, the same every step
    raw = {
        "config": "zero3",
        "step_times_by_rank": [[1.0, 3.0, 2.0], [1.5, 2.0, 2.5]],
        "cpu_times_by_rank": [[0.5, 0.5, 0.5], [0.2, 0.4, 0.3]],
        "cross_node_tx_bytes_by_node": [3_000_000, 6_000_000],
        # Per rank, per step: (wall, CPU) of the forward, the backward and step().
        "phases_by_rank": [
            [[(walls[p][rank][step], cpus[p][rank]) for p in ("forward", "backward", "step")] for step in range(3)]
            for rank in range(2)
        ],
        "losses": [1.0],
        "timed_window_monotonic": [100.0, 107.5],
    }
    out = summarize(raw)
    assert out["step_s"] == 2.5 and out["step_s_min"] == 1.5 and out["step_s_max"] == 3.0
    assert out["window_s_per_step"] == 2.5  # 7.5 s over 3 steps, the untimed barriers included
    assert out["cross_node_mb_per_step_by_node"] == [1.0, 2.0]
    assert out["cpu_s_per_step_by_rank"] == [0.5, 0.3]
    # Medians over the steps, per rank and phase; the raw lists are not reported.
    assert out["phase_s_by_rank"] == {"forward": [0.2, 0.5], "backward": [1.4, 1.3], "step": [0.3, 0.3]}
    assert out["phase_cpu_s_by_rank"] == {"forward": [0.1, 0.2], "backward": [0.3, 0.1], "step": [0.1, 0.1]}
    assert "phases_by_rank" not in out and "step_times_by_rank" not in out
    assert summarize({"error": "x"}) == {"error": "x"}


def test_utilization_sorts_each_interval_by_what_was_busy():
    # 2 cores, a 100 B/s link, one step in the window (0, 3.75) whose intervals last 1, 2, 0.5 and 0.25 s, one
    # class each. Samples outside the window (t = -1 and 5) would add time if they counted.
    samples = [
        (-1.0, 0, 0, 0),
        (0.0, 10_000_000_000, 1_000, 2_000),
        (1.0, 12_000_000_000, 1_010, 2_000),  # cores 2 s of 2 (busy), link 10 B/s (idle): cores alone
        (3.0, 12_500_000_000, 1_010, 2_160),  # cores 0.125, node 1 sends 80 B/s: link alone
        (3.5, 13_300_000_000, 1_040, 2_160),  # cores 0.8, node 0 sends 60 B/s: both
        (3.75, 13_350_000_000, 1_040, 2_160),  # cores 0.1, nothing sent: neither
        (5.0, 99_000_000_000, 9_000, 9_000),
    ]
    out = utilization(samples, (0.0, 3.75), steps=1, cores=2, link_bytes_per_s=100.0)
    assert out["cpu_only_s"] == 1.0 and out["link_only_s"] == 2.0 and out["both_s"] == 0.5
    assert out["neither_s"] == 0.25 and out["intervals"] == 4 and out["interval_ms"] == 937.5
    assert out["link_rate_share"] == pytest.approx((0.1 * 1 + 0.8 * 2 + 0.6 * 0.5) / 3.75, abs=1e-3)
    assert out["cores_share"] == pytest.approx((1.0 * 1 + 0.125 * 2 + 0.8 * 0.5 + 0.1 * 0.25) / 3.75, abs=1e-3)
    # Per step: the same window holding two steps halves every class.
    assert utilization(samples, (0.0, 3.75), 2, 2, 100.0)["link_only_s"] == 1.0
    # A thread that ended takes its CPU time with it: the interval counts as idle cores, never negative time.
    dropped = [(0.0, 5_000, 0, 0), (1.0, 1_000, 0, 90)]
    assert utilization(dropped, (0.0, 1.0), 1, 2, 100.0)["link_only_s"] == 1.0
    # Too few samples in the window, or a counter that could not be read (-1): no verdict.
    assert utilization(samples[:2], (0.0, 4.0), 2, 2, 100.0) is None
    assert utilization([(0.0, 0, -1, 0), (1.0, 0, -1, 0)], (0.0, 1.0), 1, 2, 100.0) is None


def test_trace_keeps_the_start_of_the_window_and_draw_charts_it(tmp_path):
    # Intervals of 1 s: cores 100% then 25%, link 10% then 80%; kept: the first 2.5 s of the window (0, 10).
    samples = [(-1.0, 0, 0, 0), (0.0, 0, 0, 0), (1.0, 2_000_000_000, 10, 0), (2.0, 2_500_000_000, 10, 80)]
    samples += [(3.0, 9_000_000_000, 500, 500)]  # past the 2.5 s kept
    points = trace(samples, (0.0, 10.0), 2.5, cores=2, link_bytes_per_s=100.0)
    assert points == [[0.5, 1.0, 0.1], [1.5, 0.25, 0.8]]
    entry = {"step_s": 1.0, "utilization": {"link_only_s": 0.5, "cpu_only_s": 0.5, "both_s": 0.0, "trace": points}}
    png = tmp_path / "timeline.png"
    assert draw({"zeropp": entry, "failed": {"error": "x"}}, str(png), "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not draw({"failed": {"error": "x"}}, str(tmp_path / "none.png"), "title")
    assert not (tmp_path / "none.png").exists()


def test_sampler_reads_this_process():
    # This process stands in for a rank (its CPU time grows while it hashes, the GIL released so the sampler's
    # thread runs) and for a node (the loopback counter).
    sampler = Sampler([os.getpid()], [os.getpid()], ["lo"])
    deadline, data = time.monotonic() + 0.2, bytes(4 << 20)
    while time.monotonic() < deadline:
        hashlib.sha256(data).digest()
    samples = sampler.stop()
    assert len(samples) >= 5 and all(a[0] < b[0] for a, b in itertools.pairwise(samples))
    assert samples[-1][1] > samples[0][1] > 0 and samples[0][2] >= 0


def test_rate_and_floors():
    assert rate_bytes_per_s("1gbit") == 125e6 and rate_bytes_per_s("100mbit") == 12.5e6
    assert rate_bytes_per_s("1.5Gbit") == 187.5e6 and rate_bytes_per_s("10mbps") is None
    entry = {"cross_node_mb_per_step_by_node": [250.0, 125.0], "cpu_s_per_step_by_rank": [0.5, 0.5, 0.5, 0.5]}
    out = floors(entry, "1gbit")
    cores = min(os.cpu_count() or 1, 4)
    assert out == {"link_floor_s": 2.0, "cpu_floor_s": round(2.0 / cores, 3), "bound_by": "link"}
    entry["cpu_s_per_step_by_rank"] = [10.0] * 4
    assert floors(entry, "1gbit")["bound_by"] == "cpu"
    assert floors(entry, "10mbps")["link_floor_s"] is None


def test_deepspeed_configs_match_ours():
    base = {"stage": 3}
    assert deepspeed_config("deepspeed_zero3", 2, 8)["zero_optimization"] == base
    assert deepspeed_config("deepspeed_hpz", 2, 8)["zero_optimization"] == {**base, "zero_hpz_partition_size": 2}
    zpp = deepspeed_config("deepspeed_zeropp", 2, 8)
    assert zpp["zero_optimization"] == {
        **base,
        "zero_hpz_partition_size": 2,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
    }
    assert zpp["bf16"] == {"enabled": True} and zpp["train_micro_batch_size_per_gpu"] == 8
    assert deepspeed_config("deepspeed_zero3", 2, 8, "fp32")["bf16"] == {"enabled": False}


def test_compare_picks_the_fastest_zero3_whoever_runs_it():
    configs = {
        "zero3": {"step_s": 3.0},
        "hpz": {"step_s": 2.8},
        "zeropp": {"step_s": 0.75},
        "deepspeed_zero3": {"step_s": 3.2},
        "deepspeed_hpz": {"step_s": 2.4},
        "deepspeed_zeropp": {"error": "exit codes [1, None, None, None]", "reason": "ValueError: no CPU op"},
    }
    out = slow_link.compare(configs)
    assert out["fastest_zero3"] == {"config": "deepspeed_hpz", "step_s": 2.4}
    assert out["zeropp_speedup_over_fastest_zero3"] == pytest.approx(3.2)
    assert out["ours_zero3_vs_deepspeed_zero3"] == pytest.approx(3.0 / 3.2)
    assert out["target_zeropp_over_fastest_zero3"] == 3.0
    assert out["targets"] == {"zero3_at_most_deepspeed_zero3": True, "zeropp_3x_fastest_zero3": True}
    # ZeRO++ never counts as a ZeRO-3, however fast; a slower ZeRO++ and a slower ZeRO-3 miss both bars.
    configs.update(deepspeed_zeropp={"step_s": 0.1}, zeropp={"step_s": 1.0}, zero3={"step_s": 3.5})
    out = slow_link.compare(configs)
    assert out["fastest_zero3"]["config"] == "deepspeed_hpz"
    assert out["targets"] == {"zero3_at_most_deepspeed_zero3": False, "zeropp_3x_fastest_zero3": False}
    # Ours may be the fastest; a tie with DeepSpeed's ZeRO-3 meets the bar.
    out = slow_link.compare({"zero3": {"step_s": 2.0}, "deepspeed_zero3": {"step_s": 2.0}, "zeropp": {"step_s": 0.5}})
    assert out["fastest_zero3"] == {"config": "zero3", "step_s": 2.0}
    assert out["ours_zero3_vs_deepspeed_zero3"] == 1.0 and out["zeropp_speedup_over_fastest_zero3"] == 4.0
    assert out["targets"] == {"zero3_at_most_deepspeed_zero3": True, "zeropp_3x_fastest_zero3": True}


def test_compare_without_the_times_it_needs():
    out = slow_link.compare({"zero3": {"error": "x"}, "deepspeed_zero3": {"skipped": "no deepspeed"}})
    assert out["fastest_zero3"] is None and out["zeropp_speedup_over_fastest_zero3"] is None
    assert out["ours_zero3_vs_deepspeed_zero3"] is None
    assert out["targets"] == {"zero3_at_most_deepspeed_zero3": None, "zeropp_3x_fastest_zero3": None}
    out = slow_link.compare({"hpz": {"step_s": 2.0}})  # no ZeRO++: a fastest ZeRO-3 but no speedup
    assert out["fastest_zero3"] == {"config": "hpz", "step_s": 2.0}
    assert out["targets"]["zeropp_3x_fastest_zero3"] is None


def test_error_reason_is_the_last_exception_line():
    log = (
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "x.py", line 3, in <module>\n'
        "[rank0]: RuntimeError: first\n"
        "During handling of the above exception, another exception occurred:\n"
        "[rank0]: ValueError: This op had not been implemented on CPU backend.\n"
        "[rank0]:[W1130 gloo] some warning afterwards\n"
    )
    assert slow_link.error_reason(log) == "ValueError: This op had not been implemented on CPU backend."
    assert slow_link.error_reason("torch.distributed.DistBackendError: Connection closed by peer") == (
        "torch.distributed.DistBackendError: Connection closed by peer"
    )
    assert slow_link.error_reason("killed\n") is None and slow_link.error_reason("") is None


def _fake_raw(config: str, step: float) -> dict:
    return {
        "config": config,
        "step_times_by_rank": [[step] * 2 for _ in range(4)],
        "cpu_times_by_rank": [[0.1] * 2 for _ in range(4)],
        "cross_node_tx_bytes_by_node": [2_000_000, 2_000_000],
        "losses": [1.0, 0.9, 0.8],
    }


def _fake_link_run(monkeypatch, run_config):
    monkeypatch.setattr(slow_link, "build_link", lambda link: None)
    monkeypatch.setattr(slow_link, "qdisc_drops", lambda link: [0, 0])
    monkeypatch.setattr(slow_link, "_deepspeed_importable", lambda: True)
    monkeypatch.setattr(slow_link, "run_config", run_config)


def test_a_failing_deepspeed_config_records_its_reason_and_the_rest_run(monkeypatch, capsys):
    steps = {"zero3": 2.0, "zeropp": 0.5, "hpz": 1.9, "deepspeed_zero3": 2.5, "deepspeed_hpz": 2.2}
    ran: list[str] = []

    def run_config(args, link, config, workdir, port):
        ran.append(config)
        if config == "deepspeed_zeropp":
            return {"config": config, "error": "exit codes [1, 1, 1, 1]", "reason": "ValueError: no CPU op"}
        return _fake_raw(config, steps[config])

    _fake_link_run(monkeypatch, run_config)
    assert slow_link.main(["--json", "--configs", ",".join(reversed(CONFIGS))]) == 0  # DeepSpeed's failure: exit 0
    report = json.loads(capsys.readouterr().out)
    assert ran == list(reversed(CONFIGS))
    assert report["configs"]["deepspeed_zeropp"]["reason"] == "ValueError: no CPU op"
    assert "step_s" not in report["configs"]["deepspeed_zeropp"]
    assert report["zero3_step_s"] == 2.0 and report["speedup"] == 4.0 and report["meets_target"] is True
    assert report["fastest_zero3"] == {"config": "hpz", "step_s": 1.9}
    assert report["zeropp_speedup_over_fastest_zero3"] == pytest.approx(3.8)
    assert report["ours_zero3_vs_deepspeed_zero3"] == pytest.approx(0.8)
    assert report["targets"] == {"zero3_at_most_deepspeed_zero3": True, "zeropp_3x_fastest_zero3": True}
    # Text mode names the reason and the targets; a failure of one of ours still fails the run.
    steps["zero3"] = None

    def ours_fail(args, link, config, workdir, port):
        if steps.get(config) is None:
            return {"config": config, "error": "exit codes [1]", "reason": "RuntimeError: boom"}
        return _fake_raw(config, steps[config])

    monkeypatch.setattr(slow_link, "run_config", ours_fail)
    assert slow_link.main([]) == 1
    text = capsys.readouterr().out
    assert "ValueError" not in text and "RuntimeError: boom" in text and "zero3_at_most_deepspeed_zero3 None" in text


def test_run_config_takes_the_reason_from_the_failing_rank(monkeypatch, tmp_path):
    real_popen = subprocess.Popen
    crash = "import sys; print('[rank1]: Traceback (most recent call last):'); sys.exit('[rank1]: ValueError: no op')"

    def popen(cmd, env, **kwargs):  # drop `ip netns exec NS`; rank 1 fails, the others wait in a "collective"
        code = crash if env["RANK"] == "1" else "import time; time.sleep(60)"
        return real_popen([sys.executable, "-c", code], env=env, **kwargs)

    monkeypatch.setattr(slow_link.subprocess, "Popen", popen)
    args = slow_link.parse_args(["--timeout", "50"])
    start = time.monotonic()
    out = slow_link.run_config(args, slow_link.Link(tag=1), "deepspeed_zeropp", tmp_path, 0)
    assert time.monotonic() - start < 40  # it did not wait for the timeout
    assert out["config"] == "deepspeed_zeropp" and out["log_tail_rank"] == 1
    assert out["reason"] == "ValueError: no op" and out["error"].startswith("exit codes")
    assert slow_link._RESOURCES.procs == []


def _skipped(capsys) -> str:
    report = json.loads(capsys.readouterr().out)
    assert list(report) == ["skipped"]
    return report["skipped"]


def test_skips_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(slow_link_net.os, "geteuid", lambda: 1000)
    before = signal.getsignal(signal.SIGTERM)
    assert slow_link.main(["--json"]) == 0
    assert "root" in _skipped(capsys)
    assert signal.getsignal(signal.SIGTERM) is before
    # Through the CLI too, and in text mode.
    assert cli_main(["bench", "slow-link", "--json"]) == 0
    assert "root" in _skipped(capsys)
    assert slow_link.main([]) == 0
    assert "skipped" in capsys.readouterr().out


def test_skips_and_cleans_up_when_ip_fails(monkeypatch, capsys):
    calls: list[list[str]] = []

    def fake_run(cmd, check=True):
        calls.append(cmd)
        if cmd[:3] == ["ip", "netns", "add"] and cmd[3].endswith("-1"):
            raise subprocess.CalledProcessError(1, cmd, "", "mount --make-shared /run/netns failed: Permission denied")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(slow_link_net.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slow_link_net.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(slow_link_net, "run_cmd", fake_run)
    assert slow_link.main(["--json"]) == 0
    reason = _skipped(capsys)
    assert "Permission denied" in reason and "ip netns add" in reason
    link = slow_link.Link()
    # Both namespaces the run tried to create are deleted again; nothing is left to undo.
    deleted = [c[3] for c in calls if c[:3] == ["ip", "netns", "delete"]]
    assert sorted(deleted) == sorted(link.namespaces)
    assert slow_link._RESOURCES.namespaces == [] and slow_link._RESOURCES.procs == []


def test_skips_without_iproute2(monkeypatch, capsys):
    monkeypatch.setattr(slow_link_net.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slow_link_net.shutil, "which", lambda tool: None)
    assert slow_link.main(["--json"]) == 0
    assert "iproute2" in _skipped(capsys)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # four processes (~20 s on two busy cores); no root needed, so it runs by default
@pytest.mark.timeout(300)
def test_worker_on_loopback(tmp_path):
    """The worker itself, 4 ranks on loopback (no namespaces, no root): ZeRO++ runs its quantized collectives."""
    out = tmp_path / "zeropp.json"
    port = str(_free_port())
    procs = []
    for rank in range(4):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(_REPO),
        }
        cmd = [sys.executable, "-m", "benchmarks._slow_link_worker", "--config", "zeropp", "--hidden", "32",
               "--layers", "2", "--batch", "4", "--steps", "2", "--warmup", "1", "--out", str(out),
               "--dtype", "fp32"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), logs
    result = json.loads(out.read_text())
    assert result["config"] == "zeropp" and result["hpz_partition_size"] == 2 and result["dtype"] == "fp32"
    assert result["collectives"] == {"all_gather": "QuantizedAllGather", "reduce_scatter": "QuantizedReduceScatter"}
    assert result["zeropp_stats_rank0"]["quantized_all_gathers"] > 0
    assert len(result["step_times_by_rank"]) == 4 and all(len(t) == 2 for t in result["step_times_by_rank"])
    # Each timed step of each rank split into forward, backward and step(), as (wall, CPU) pairs within its step.
    for steps, totals in zip(result["phases_by_rank"], result["step_times_by_rank"], strict=True):
        assert len(steps) == 2
        for phases, total in zip(steps, totals, strict=True):
            assert len(phases) == 3 and all(wall > 0 and cpu >= 0 for wall, cpu in phases)
            assert sum(wall for wall, _ in phases) <= total
    assert len(result["losses"]) == 3 and all(v > 0 for v in result["losses"])


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith(slow_link_net.NS_PREFIX)}


_needs_real_run = pytest.mark.skipif(
    not RUN_SLOW or os.geteuid() != 0, reason="real shaped-link run: set DS_PLUGIN_RUN_SLOW_BENCH=1 and run as root"
)
_SMALL = ["--hidden", "512", "--layers", "2", "--steps", "2", "--warmup", "1", "--configs", "zero3,zeropp"]


@pytest.mark.slow
@_needs_real_run
@pytest.mark.timeout(900)
def test_real_run_on_shaped_link(tmp_path):
    before = _namespaces()
    cmd = [sys.executable, "-m", "ds_plugin.cli", "bench", "slow-link", "--json", "--timeline", *_SMALL]
    cmd += ["--timeout", "300", "--png", str(tmp_path / "charts" / "timeline.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=800, cwd=_REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for key in ("zero3_step_s", "zeropp_step_s", "speedup", "link", "ranks", "nodes", "model_params", "torch"):
        assert key in report, key
    assert report["ranks"] == 4 and report["nodes"] == 2 and report["dtype"] in ("bf16", "fp32")
    assert report["speedup"] == pytest.approx(report["zero3_step_s"] / report["zeropp_step_s"])
    z3, zpp = report["configs"]["zero3"], report["configs"]["zeropp"]
    assert z3["dtype"] == zpp["dtype"] == report["dtype"]
    # Each node sends ~1.5x the model (in the compute dtype) across the link per ZeRO-3 step (every block is gathered
    # once and kept to its backward, then its gradients are reduce-scattered); ZeRO++ well under a third of that.
    model_mb = (2 if report["dtype"] == "bf16" else 4) * report["model_params"] / 1e6
    assert 1.25 * model_mb < z3["cross_node_mb_per_step_by_node"][0] < 1.75 * model_mb
    assert zpp["cross_node_mb_per_step_by_node"][0] < 0.3 * z3["cross_node_mb_per_step_by_node"][0]
    # --timeline: the four classes cover the timed window, whose steps the step times describe.
    for entry in (z3, zpp):
        u = entry["utilization"]
        covered = u["link_only_s"] + u["cpu_only_s"] + u["both_s"] + u["neither_s"]
        assert entry["step_s_min"] * 0.9 < covered < entry["step_s_max"] * 1.5, (covered, entry["step_s_all"])
        assert entry["utilization"]["trace"] and entry["utilization"]["trace"][-1][0] <= 2.5 * entry["step_s_max"]
    assert z3["utilization"]["link_rate_share"] > 0.3  # ZeRO-3 is link-bound here
    assert (tmp_path / "charts" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert _namespaces() == before  # the run removed its namespaces


@pytest.mark.slow
@_needs_real_run
@pytest.mark.timeout(300)
def test_sigterm_removes_namespaces_and_children():
    before = _namespaces()
    cmd = [sys.executable, "-m", "ds_plugin.cli", "bench", "slow-link", "--json", *_SMALL, "--timeout", "200"]
    proc = subprocess.Popen(cmd, cwd=_REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        mine = {f"{slow_link_net.NS_PREFIX}-{proc.pid}-0", f"{slow_link_net.NS_PREFIX}-{proc.pid}-1"}
        deadline = time.monotonic() + 120
        while not mine <= _namespaces() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mine <= _namespaces(), "the run never built its link"
        time.sleep(3)  # let the ranks start
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert _namespaces() == before
    workers = subprocess.run(["pgrep", "-f", f"ds_plugin_slow_link_{proc.pid}_"], capture_output=True, text=True)
    assert workers.stdout == ""
