"""GPU checks: shared fixtures, and the report of what ran.

Every module here skips without CUDA (its own `pytestmark`, with the reason).
A test records its measured numbers with pytest's `record_property`; when
`MOLT_GPU_REPORT` names a file, the outcome and numbers of every test in this
folder are written there as JSON at the end of the session, and
`scripts/gpu_check.sh` prints them through `tests/gpu/report.py`.

This folder is a package (`__init__.py`) so that this conftest does not clash
with `tests/conftest.py`, whose fixtures (`vllm_engines`, `dense_dir`,
`moe_dir`) and helper `run` the tests here use.
"""

import json
import os
from dataclasses import fields, replace
from pathlib import Path

import torch

_results: dict[str, dict] = {}  # nodeid -> {"outcome", "reason", "numbers"}


# vLLM on a shared GPU: each engine takes 15% (four engines start one after another in a session, and a closed
# one may not give all of its memory back); the transformers references and the trainer use the rest.
# enforce_eager skips CUDA-graph capture and compilation (a minute per engine start), so the checks stay short.
GPU_ENGINE_ARGS = {"gpu_memory_utilization": 0.15, "enforce_eager": True}


def on_device(mb, device):
    """A packed micro-batch with every tensor on `device` (packing builds them on the CPU)."""
    moved = {f.name: getattr(mb, f.name).to(device) for f in fields(mb)
             if isinstance(getattr(mb, f.name), torch.Tensor)}
    return replace(mb, **moved)


def pytest_runtest_logreport(report):
    if "gpu/test_" not in report.nodeid:  # only this folder's checks go into the report
        return
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "reason": "", "numbers": {}})
    entry["numbers"].update(dict(report.user_properties))
    if report.skipped:
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        entry["reason"] = reason.removeprefix("Skipped: ")
    elif report.failed:
        entry["outcome"] = "failed"
        lines = (report.longreprtext or "").strip().splitlines()
        entry["reason"] = f"{report.when}: {lines[-1] if lines else 'failed'}"


def pytest_sessionfinish(session):
    path = os.environ.get("MOLT_GPU_REPORT")
    if path and _results:
        Path(path).write_text(json.dumps(_results, indent=1, default=float))
