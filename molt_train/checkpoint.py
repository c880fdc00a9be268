"""Checkpoints: `RUN_DIR/checkpoints/step_NNNNNN/` holds everything a resume needs.

    policy/          the policy in Hugging Face format with its tokenizer and processor (transformers and vLLM load it)
    adapter/         instead of policy/ under LoRA: the adapters in PEFT's format (adapter_config.json,
                     adapter_model.safetensors; PEFT and vLLM load them onto the run's model) and the tokenizer
    optimizer.pt     optimizer and scheduler state
    rng_rankN.pt     each trainer rank's random generator states (torch, CUDA, Python, NumPy)
    loop_state.json  step, policy version, data position, seed

Rollouts need no generator state: every episode's environment seed and
sampling seed derive from (seed, group index, sample index), so a resumed run
replays a group with the seeds it would have had.

A checkpoint is written under a temporary name and renamed when complete, so
a run killed mid-save (kill -9 included) resumes from the previous one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Copied from the model directory: the tokenizer, and a vision-language model's processor.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "processor_config.json", "preprocessor_config.json")


def latest(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / "loop_state.json").exists()) if root.exists() else []
    return done[-1] if done else None


async def save(trainer, run_dir: Path, model_dir: str, state: dict, keep: int) -> Path:
    root = run_dir / "checkpoints"
    final = root / f"step_{state['step']:06d}"
    partial = root / f".partial_{state['step']:06d}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    await trainer.save(str(partial))
    weights = policy_dir(partial)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, weights / name)
    (partial / "loop_state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for old in sorted(p for p in root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def policy_dir(checkpoint: Path) -> Path:
    """Where a checkpoint keeps its policy: `policy/`, or under LoRA `adapter/`."""
    return checkpoint / "adapter" if (checkpoint / "adapter").is_dir() else checkpoint / "policy"


def load_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "loop_state.json").read_text())
