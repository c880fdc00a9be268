"""GPU checks: shared fixtures, and the report of what ran.

Every module here skips without CUDA (its own `pytestmark`, with the reason),
and a check that needs what this Python lacks (vLLM, Ray: the lent GPU machine
has neither, and no network to install them) skips saying so (`needs`).
`MOLT_GPU_CHECK_FORCE=1` runs the checks without CUDA all the same: the dry run
of `scripts/gpu_check.sh`'s GPU branch on a machine without a GPU, where each
check gets through its imports and CPU-side preparation and fails at its first
CUDA call.
A test records its measured numbers with pytest's `record_property`; when
`MOLT_GPU_REPORT` names a file, the outcome and numbers of every test in this
folder are written there as JSON at the end of the session, and
`scripts/gpu_check.sh` prints them through `tests/gpu/report.py`.

This folder is a package (`__init__.py`) so that this conftest does not clash
with `tests/conftest.py`, whose fixtures (`vllm_engines`, `dense_dir`,
`moe_dir`) and helper `run` the tests here use.
"""

import importlib.util
import json
import os
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

# Whether the checks run: CUDA is there, or MOLT_GPU_CHECK_FORCE=1 (a dry run without it).
CUDA = torch.cuda.is_available() or os.environ.get("MOLT_GPU_CHECK_FORCE") == "1"

_results: dict[str, dict] = {}  # nodeid -> {"outcome", "reason", "numbers"}


# vLLM on a shared GPU: each engine takes 15% (four engines start one after another in a session, and a closed
# one may not give all of its memory back); the transformers references and the trainer use the rest.
# enforce_eager skips CUDA-graph capture and compilation (a minute per engine start), so the checks stay short.
GPU_ENGINE_ARGS = {"gpu_memory_utilization": 0.15, "enforce_eager": True}


def needs(*modules: str):
    """Skip unless every one of `modules` is installed in this Python."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"cannot run in this Python: no {' and no '.join(missing)} "
                                                    "(the lent GPU machine has neither vLLM nor Ray, and no network "
                                                    "to install them)")


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
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception's own message, where pytest has it
        lines = crash.message.splitlines() if crash else (report.longreprtext or "").strip().splitlines()[-1:]
        entry["reason"] = f"{report.when}: {lines[0] if lines else 'failed'}"


def pytest_sessionfinish(session):
    path = os.environ.get("MOLT_GPU_REPORT")
    if path and _results:
        Path(path).write_text(json.dumps(_results, indent=1, default=float))
