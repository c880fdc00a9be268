"""TRL's side of the SFT benchmark: TRL's SFTTrainer on bench/sft.py's chat data, one JSON line per step.

Runs in bench/.venv-trl (bench/setup_trl.sh: TRL, no Molt):

    bench/.venv-trl/bin/python bench/trl_sft.py --model DIR --data chats.jsonl --seed 0 --steps 200 --out trl.jsonl

The run is molt-sft's (bench/sft.py), in TRL's names: each chat record becomes a prompt-completion pair of
texts, the prompt the chat template's rendering up to the assistant's turn and the completion the reply
and the end-of-turn token (the model's EOS), the tokens molt-sft trains; the loss on the completion only
(completion_only_loss). (TRL's conversational format would train the newline after the end-of-turn token
and an EOS it appends after that, tokens molt-sft leaves out.) BATCH examples per optimizer step without
accumulation, AdamW at a constant
LR without warmup or weight decay, gradient norm clipped at 1.0, fp32 on the CPU, no packing, no
gradient checkpointing. Each JSON line: step, loss (the step's mean over its completion tokens, as TRL
logs it), elapsed (seconds since train() was called).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

BATCH = 32
LR = 1e-3


class StepLog(TrainerCallback):
    def __init__(self, path: Path):
        self.out, self.started = path.open("w"), 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.out.write(json.dumps({"step": state.global_step, "loss": logs["loss"],
                                       "elapsed": time.perf_counter() - self.started}) + "\n")
            self.out.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.out.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, type=Path, help="chat JSON lines (bench/sft.py writes them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    chats = [json.loads(line)["messages"] for line in args.data.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": tokenizer.apply_chat_template(chat[:-1], tokenize=False,
                                                                      add_generation_prompt=True),
                               "completion": chat[-1]["content"] + tokenizer.eos_token} for chat in chats])
    config = SFTConfig(
        output_dir=str(args.out.parent), model_init_kwargs={"dtype": "float32"}, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, completion_only_loss=True, packing=False,
        gradient_checkpointing=False, use_cpu=True, bf16=False, logging_steps=1, report_to="none",
        save_strategy="no", seed=args.seed, data_seed=args.seed, dataloader_num_workers=0)
    trainer = SFTTrainer(model=args.model, args=config, train_dataset=data, callbacks=[StepLog(args.out)])
    trainer.train()


if __name__ == "__main__":
    main()
