"""`molt-merge`: a LoRA run's policy as full weights, the adapters merged into the run's model.

The result is a plain Hugging Face model directory with the tokenizer, for
whatever loads models without PEFT (`molt-train --model`, vLLM, transformers).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="molt-merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", help="a LoRA run directory (its latest checkpoint), a checkpoint, or an "
                                        "adapter directory in PEFT's format")
    parser.add_argument("--out", type=Path, required=True, help="the merged model's directory")
    parser.add_argument("--model", default=None, help="the model the adapters were trained on (default: the one "
                                                      "their adapter_config.json names)")
    args = parser.parse_args(argv)

    from molt_agents.hf_model import adapter_base
    from molt_train.checkpoint import TOKENIZER_FILES
    from molt_train.config import ConfigError
    from molt_train.eval_cli import policy_dir

    try:
        adapter = policy_dir(args.adapter)
        base = args.model or adapter_base(adapter)
    except (ConfigError, ValueError) as error:
        parser.exit(2, f"molt-merge: {error}\n")
    from peft import PeftModel

    from molt_agents.hf_model import load_model
    from molt_train.actor.fsdp import checkpoint_dtype

    merged = PeftModel.from_pretrained(load_model(base, checkpoint_dtype(base)), str(adapter)).merge_and_unload()
    merged.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        for source in (adapter / name, Path(base) / name):
            if source.exists():
                shutil.copy(source, args.out / name)
                break
    print(f"molt-merge: {adapter} merged into {base}: {args.out}")


if __name__ == "__main__":
    main()
