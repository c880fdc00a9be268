"""Print the GPU checks' report: one line per check, PASS / FAIL / SKIP, with its numbers.

Reads the JSON that tests/gpu/conftest.py writes (`MOLT_GPU_REPORT`). Without
CUDA, where every check skipped, it ends with the line "no CUDA: skipped".
Usage: python tests/gpu/report.py REPORT.json
"""

import json
import sys
from pathlib import Path


def _number(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(path: str) -> int:
    import torch

    report = Path(path)
    if not report.exists():
        print(f"gpu_check: no report at {report} (pytest did not get to the checks)")
        return 1
    results = json.loads(report.read_text())
    label = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}
    for nodeid, entry in results.items():
        name = nodeid.split("::", 1)[-1]
        numbers = ", ".join(f"{key}={_number(value)}" for key, value in entry["numbers"].items())
        detail = numbers if entry["outcome"] == "passed" else "; ".join(filter(None, [entry["reason"], numbers]))
        print(f"{label[entry['outcome']]}  {name}" + (f"  {detail}" if detail else ""))
    counts = {outcome: sum(e["outcome"] == outcome for e in results.values()) for outcome in label}
    print(f"gpu_check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if not torch.cuda.is_available() and not counts["failed"]:
        print(f"no CUDA: skipped ({len(results)} GPU checks; none of the GPU paths ran on this machine)")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
