"""Every two-rank Lightning check that can share one launch (Lightning's launcher re-runs this script for rank 1).

Parts, in order: parity (all strategy names vs ddp), lora (peft + zeropp), qlora (peft on an NF4 base + zeropp),
fabric, plans (one config through initialize, the Trainer and Fabric), resume (needs `--killed`, the workdir of a
`resume.py --mode kill` run). An exception inside a Trainer makes Lightning kill the other rank, so the suite
stops at the first failing part and reports it; later parts are marked as not run.
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path
from typing import Any

import fabric_zero
import lora_zeropp
import parity
import plan_parity
import qlora_zeropp
import resume
from _tiny_lightning import run

PARTS = {
    "parity": parity.main,
    "lora": lora_zeropp.main,
    "qlora": qlora_zeropp.main,
    "fabric": fabric_zero.main,
    "plans": plan_parity.main,
    "resume": resume.resume,
}


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--killed", type=Path)


def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in args.parts.split(","):
        if any("error" in part for part in out.values()):
            out[name] = {"error": "not run: an earlier part failed"}
            continue
        try:
            out[name] = PARTS[name](args)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


if __name__ == "__main__":
    run(main, _args)
