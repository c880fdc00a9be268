"""`molt-sft` as a user runs it: a subprocess on molt-train's trainer (real Ray, FSDP2 over gloo), checked
against a plain transformers step, and on chat data from a run to a resumed run."""

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from environments.digit import Digit
from molt_env.split import eval_seed
from molt_env.trajectory import Trajectory

LR = 1e-4


def _molt_sft(out, ray_address, *flags, timeout=600):
    result = subprocess.run([sys.executable, "-m", "molt_train.sft", "--out", str(out), "--ray.address", ray_address,
                             "--log.tensorboard", "false", *flags], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _records(vocab: int) -> list[dict]:
    """Three trajectory records of random tokens, each with trained spans of its own."""
    rng = random.Random(0)
    records = []
    for index, (length, spans) in enumerate([(24, [(10, 16)]), (37, [(5, 9), (20, 30)]), (15, [(14, 15)])]):
        mask = [int(any(a <= t < b for a, b in spans)) for t in range(length)]
        records.append(Trajectory(token_ids=[rng.randrange(vocab) for _ in range(length)],
                                  logprobs=[-1.0 if m else None for m in mask], mask=mask,
                                  versions=[0 if m else -1 for m in mask], reward=1.0, rollout_id=str(index),
                                  group_id="0").to_dict() | {"step": 1, "split": "train"})
    return records


@pytest.mark.parametrize("backend", ["fsdp2", "automodel"])
def test_an_sft_step_on_trajectory_records_equals_a_plain_transformers_step(backend, tmp_path, ray_address, dense_dir):
    records = _records(AutoModelForCausalLM.from_pretrained(dense_dir).config.vocab_size)
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "sft"
    _molt_sft(out, ray_address, "--model", str(dense_dir), "--data.path", str(data), "--data.batch_size", "3",
              "--data.eval_fraction", "0", "--steps", "1", "--train.lr", str(LR), "--train.lr_schedule", "constant",
              "--train.grad_clip", "1e9", "--train.micro_batch_tokens", "40", "--actor.backend", backend)
    (row,) = _metrics(out)

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    total, trained = 0.0, sum(sum(record["mask"]) for record in records)
    for record in records:  # the trained tokens' log-likelihood, each given the tokens before it
        ids = torch.tensor([record["token_ids"]])
        logprobs = model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        total = total - (logprobs * torch.tensor(record["mask"][1:], dtype=torch.float32)).sum()
    loss = total / trained
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    optimizer.step()
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_000001" / "policy", dtype=torch.float32)
    differences = [float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                              saved.state_dict().values())]
    print(f"{backend}: loss {row['sft/loss']:.6f} vs {loss.item():.6f}; grad norm {row['grad_norm']:.6f} vs {float(norm):.6f}; "
          f"weights max |diff| {max(differences):.2e} (the step moved them by up to {LR})")
    assert row["tokens/trained"] == trained == 21  # exactly the tokens the records mark
    assert row["sft/loss"] == pytest.approx(float(loss), abs=1e-6)
    assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert max(differences) <= 1e-6


def test_molt_sft_learns_chat_replies_and_a_resumed_run_continues(tmp_path, ray_address):
    """Chat conversations on the tiny chat model, which answers a random digit: here the assistant always
    answers 4. SFT lowers the held-out loss, and `--resume` continues from the checkpoint step by step."""
    rng = random.Random(1)
    data = tmp_path / "chats.jsonl"
    with data.open("w") as out:
        for _ in range(60):
            out.write(json.dumps({"messages": [{"role": "user", "content": f"Repeat the digit {rng.randrange(10)}."},
                                               {"role": "assistant", "content": "4"}]}) + "\n")
    out = tmp_path / "chat"
    flags = ["--data.path", str(data), "--data.batch_size", "16", "--data.eval_fraction", "0.2",
             "--data.eval_every", "2", "--train.lr", "3e-3", "--ckpt.every", "4", "--epochs", "3",
             "--env", "digit", "--eval.every", "3", "--eval.episodes", "10", "--eval.at_start", "true"]
    _molt_sft(out, ray_address, *flags, "--steps", "6")
    whole = _metrics(out)[1:]  # after step 0's evaluation
    shutil.rmtree(out / "checkpoints" / "step_000006")  # as if stopped after step 5: resume from step 4
    _molt_sft(out, ray_address, *flags, "--steps", "6", "--resume")
    evals = {row["step"]: row for row in _metrics(out) if "eval/reward" in row}
    resumed = _metrics(out)[1:]
    losses = [row["sft/eval_loss"] for row in whole if "sft/eval_loss" in row]
    print("held-out loss", [round(loss, 3) for loss in losses], "training loss",
          [round(row["sft/loss"], 3) for row in whole])
    assert [row["step"] for row in resumed] == [1, 2, 3, 4, 5, 6]
    # the first step's loss is the untrained model's (about ln 10 on the digit, 0 on the end of the turn: about
    # 1.15 a token); the held-out loss falls to under a fifth of it
    assert whole[0]["sft/loss"] > 0.7 and losses[-1] < whole[0]["sft/loss"] / 5
    assert losses == sorted(losses, reverse=True)
    for a, b in zip(whole[4:], resumed[4:]):  # from the step-4 checkpoint, the same batches and weights
        assert b["sft/loss"] == pytest.approx(a["sft/loss"], abs=1e-5)
    assert (out / "checkpoints" / "step_000006" / "policy" / "config.json").exists()
    # the held-out episodes, played by the engine with the weights of the step (greedy): once it answers 4
    # to everything, it is right on exactly the episodes that ask for 4
    asked = [Digit().reset(seed=eval_seed(i))[1]["digit"] for i in range(10)]
    print("eval/reward", {step: row["eval/reward"] for step, row in evals.items()}, "asked", asked)
    assert sorted(evals) == [0, 3, 6] and [evals[s]["eval/version"] for s in (0, 3, 6)] == [0, 1, 2]
    assert evals[6]["eval/reward"] == asked.count("4") / 10


def test_molt_sft_trains_lora_adapters(tmp_path, ray_address):
    """`--actor.lora.rank`: the adapters train (the loss falls) and the checkpoint holds them in PEFT's
    format, as molt-train's LoRA checkpoints do."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say something {i}."},
                                                     {"role": "assistant", "content": "4"}]}) + "\n"
                            for i in range(32)))
    out = tmp_path / "lora"
    _molt_sft(out, ray_address, "--data.path", str(data), "--data.batch_size", "16", "--data.eval_fraction", "0",
              "--steps", "6", "--train.lr", "1e-2", "--actor.lora.rank", "8")
    losses = [row["sft/loss"] for row in _metrics(out)]
    print("LoRA training loss", [round(loss, 3) for loss in losses])
    assert losses[-1] < losses[0] / 2
    adapter = out / "checkpoints" / "step_000006" / "adapter"
    assert (adapter / "adapter_config.json").exists() and not (adapter.parent / "policy").exists()
