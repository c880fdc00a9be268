"""LoRA on CPU: the trainer's adapter step against plain PEFT and PyTorch, two ranks against one, the saved
adapter in PEFT, and `molt-train --actor.lora.rank` end to end with the vLLM engines serving the adapters.

The trainer runs as the real `PolicyRank` in spawned processes (a gloo group); the reference is written
here from PEFT's `get_peft_model` and the policy loss spelled out for this batch: at the first update of a
batch the PPO ratio is 1 (so no clip acts), each token's importance weight is exp(old - engine) capped at
2, and the KL term is k3 to the model with its adapters off. Two steps on the same batch: in the first the
adapters' B is zero, so the A matrices get no gradient and the KL none either; the second moves both.
The adapters are compared as one vector, |trainer - reference| / |reference|: AdamW's step is about lr x
the gradient's sign, so an element whose gradient is a sum that cancels to near zero (a few in a thousand)
turns the trainer's other summation order (packed rows) into a visible part of its step, while a real error
(a wrong loss term, a frozen matrix training, an adapter not updated) moves the whole vector.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from molt_train.actor.lora import file_key
from molt_train.actor.policy import PolicyRank
from molt_train.config import ActorConfig, AlgoConfig, Config, LoraConfig, TrainConfig
from molt_train.packing import TrainItem, deal, pack

LR, SEED, STEPS = 1e-3, 3, 2
LORA = LoraConfig(rank=8, alpha=16.0)


def _items(vocab: int) -> list[TrainItem]:
    """Four sequences, the second half of each trained, with made-up engine logprobs and advantages."""
    generator = np.random.default_rng(0)
    items = []
    for length, advantage in ((20, 1.0), (23, -0.5), (18, 0.5), (21, -1.0)):
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        items.append(TrainItem(token_ids=generator.integers(3, vocab, length).tolist(), mask=mask,
                               logprobs=[float(-6.5 - generator.random()) if m else None for m in mask],
                               ages=[0] * length, advantage=advantage))
    return items


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_steps(rank: int, world_size: int, model_dir: str, init_method: str, out_dir: str) -> None:
    policy = PolicyRank(model_dir, model_dir, rank, world_size, init_method,
                        Config(train=TrainConfig(lr=LR, lr_schedule="constant", grad_clip=1e9),
                               algo=AlgoConfig(kl_coef=0.1), actor=ActorConfig(world_size=world_size, lora=LORA),
                               steps=STEPS, seed=SEED))
    try:
        micro_batches = pack(_items(policy.model.config.vocab_size), token_budget=48)
        step_tokens = int(sum(mb.mask.sum() for mb in micro_batches))
        share = deal(micro_batches, world_size)[rank]
        losses = [policy.step(share, step_tokens).loss_sum for _ in range(STEPS)]
        weights = policy.full_weights(for_sync=True)
        policy.save(os.path.join(out_dir, "checkpoint"))
        torch.save({"losses": losses, "weights": weights, "trainable": sum(
            p.numel() for p in policy.model.parameters() if p.requires_grad)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        policy.close()


def _run_trainer(model_dir, out_dir, world_size: int) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out_dir.mkdir()
    mp.start_processes(_trainer_steps, args=(world_size, str(model_dir), f"tcp://127.0.0.1:{_port()}", str(out_dir)),
                       nprocs=world_size, start_method="spawn")
    ranks = [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    return {"losses": [sum(r["losses"][step] for r in ranks) for step in range(STEPS)],
            "weights": ranks[0]["weights"], "trainable": ranks[0]["trainable"], "checkpoint": out_dir / "checkpoint"}


def _token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """[T]: each token's logprob given the ones before it (0 for the first)."""
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]])


def _peft_model(model_dir):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from molt_agents.hf_model import load_model

    torch.manual_seed(SEED)
    return get_peft_model(load_model(model_dir, torch.float32), PeftLoraConfig(
        r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules="all-linear", bias="none",
        task_type="CAUSAL_LM"))


def _reference_steps(model_dir) -> tuple[list[float], dict, object]:
    """The same two steps with PEFT and PyTorch alone, one sequence at a time."""
    model = _peft_model(model_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    items = _items(model.config.vocab_size)
    step_tokens = sum(sum(item.mask) for item in items)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for item in items:
            ids, mask = torch.tensor(item.token_ids), torch.tensor(item.mask, dtype=torch.float32)
            engine = torch.tensor([lp if lp is not None else 0.0 for lp in item.logprobs])
            logprobs = _token_logprobs(model, ids)
            with torch.no_grad(), model.disable_adapter():
                reference = _token_logprobs(model, ids)
            old = logprobs.detach()
            weights = torch.exp((old - engine) * mask).clamp(max=2.0)
            policy_loss = -item.advantage * torch.exp(logprobs - old) * weights
            k3 = torch.exp(reference - logprobs) - (reference - logprobs) - 1
            loss = ((policy_loss + 0.1 * k3) * mask).sum()
            (loss / step_tokens).backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    adapters = {file_key(k): v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return losses, adapters, model


@pytest.fixture(scope="module")
def one_rank(dense_dir, tmp_path_factory):
    return _run_trainer(dense_dir, tmp_path_factory.mktemp("lora") / "one_rank", world_size=1)


def _relative(a: dict, b: dict) -> float:
    """|a - b| / |b| over all the tensors of `b` as one vector."""
    assert a.keys() == b.keys() and a
    difference = sum(float(((a[k] - b[k]) ** 2).sum()) for k in b) ** 0.5
    return difference / sum(float((b[k] ** 2).sum()) for k in b) ** 0.5


def test_a_lora_step_equals_a_plain_peft_step(dense_dir, one_rank):
    losses, adapters, model = _reference_steps(dense_dir)
    assert one_rank["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert one_rank["trainable"] < sum(p.numel() for p in model.parameters()) / 10  # the adapters only train
    initial = {file_key(k): v for k, v in _peft_model(dense_dir).state_dict().items() if "lora_" in k}
    moved = {kind: max(float((adapters[k] - initial[k]).abs().max()) for k in adapters if kind in k)
             for kind in ("lora_A", "lora_B")}
    assert min(moved.values()) > 1e-4, f"the steps did not move both matrices ({moved}): a vacuous comparison"
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(one_rank["losses"], losses))
    worst = _relative(one_rank["weights"], adapters)
    print(f"LoRA step vs PEFT + PyTorch: losses {one_rank['losses']} vs {losses} (relative {loss_rel:.2e}); "
          f"adapters moved up to {moved}, differ by {worst:.2e} (relative); the steps moved them by "
          f"{_relative(adapters, initial):.2e}")
    assert loss_rel < 1e-6 and worst < 1e-6


def test_two_ranks_train_the_adapters_of_one(dense_dir, one_rank, tmp_path):
    two = _run_trainer(dense_dir, tmp_path / "two_ranks", world_size=2)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one_rank["losses"]))
    worst = _relative(two["weights"], one_rank["weights"])
    print(f"LoRA, two ranks vs one: losses {two['losses']} vs {one_rank['losses']} (relative {loss_rel:.2e}); "
          f"adapters differ by {worst:.2e} (relative)")
    assert loss_rel < 1e-6 and worst < 1e-6


def test_a_saved_adapter_loads_in_peft_and_gives_the_trainers_logprobs(dense_dir, one_rank):
    from peft import PeftModel

    from molt_agents.hf_model import load_model

    saved = one_rank["checkpoint"] / "adapter"
    assert json.loads((saved / "adapter_config.json").read_text())["r"] == LORA.rank
    assert not (one_rank["checkpoint"] / "policy").exists()
    loaded = PeftModel.from_pretrained(load_model(dense_dir, torch.float32), saved)
    _, _, trained = _reference_steps(dense_dir)
    ids = torch.tensor(_items(loaded.config.vocab_size)[1].token_ids)
    with torch.no_grad():
        ours, reference, base = (_token_logprobs(loaded, ids), _token_logprobs(trained, ids),
                                 _token_logprobs(load_model(dense_dir, torch.float32), ids))
    gap = float((ours - reference).abs().max())
    print(f"saved adapter in PEFT vs the trained model: logprobs differ by {gap:.2e} (the adapters moved them "
          f"by {float((reference - base).abs().max()):.2e})")
    assert gap < 1e-5 and float((reference - base).abs().max()) > 1e-4


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["o_proj", "down_proj"]])
def test_the_plan_counts_the_adapters_peft_makes(dense_dir, targets):
    from molt_agents.hf_model import load_model
    from molt_train.actor.lora import with_adapters
    from molt_train.plan.memory import lora_params
    from molt_train.plan.shape import shape

    model = with_adapters(load_model(dense_dir, torch.float32), LoraConfig(rank=8, target_modules=targets), SEED)
    made = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert made > 0 and lora_params(shape(json.loads((dense_dir / "config.json").read_text())), 8, targets) == made


@pytest.mark.parametrize("flags,named", [
    (["--engine.name", "hf"], "--actor.lora.rank"), (["--actor.backend", "automodel"], "--actor.lora.rank"),
    (["--actor.lora.dropout", "1.5"], "--actor.lora.dropout")])
def test_what_lora_cannot_run_with_is_refused_naming_the_flag(flags, named):
    from molt_train.cli import parse_config
    from molt_train.config import ConfigError, validate

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(parse_config(["--actor.lora.rank", "8", *flags])[0])
    validate(parse_config(["--actor.lora.rank", "8"])[0])


MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]


def _train(out, ray_address, *flags):
    args = MOLT_TRAIN + ["--out", str(out), "--ray.address", ray_address, "--log.tensorboard", "false",
                         "--rollout.groups_per_step", "4", "--rollout.group_size", "4", *flags]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("weight_sync", ["broadcast", "object_store"])
def test_the_engines_serve_the_trainers_adapters_token_exact(tmp_path, ray_address, weight_sync):
    """Synchronous, so every step's tokens were sampled by the adapters the trainer holds: after each sync the
    engine's logprobs equal the trainer's. Only the adapters travel; the full-weight run beside it sends the
    whole model."""
    rows = _train(tmp_path / "lora", ray_address, "--steps", "4", "--train.async_queue_size", "0",
                  "--train.weight_sync", weight_sync, "--actor.lora.rank", "8", "--train.lr", "1e-2")
    full = _train(tmp_path / "full", ray_address, "--steps", "1", "--train.async_queue_size", "0",
                  "--train.weight_sync", weight_sync)
    gaps = [r["mismatch/max_abs"] for r in rows if r["tokens/trained"]]
    print(f"LoRA ({weight_sync}): mismatch/max_abs per step {gaps}; a sync moves {rows[-1]['sync/bytes']} bytes "
          f"against {full[-1]['sync/bytes']} for the full weights; KL to the model per step "
          f"{[r['kl'] for r in rows]}")
    assert len(gaps) >= 3 and max(gaps) < 1e-5
    # the adapters moved the policy: an engine serving the model alone would differ by about sqrt(2 kl) a token,
    # a thousand times the gaps above
    assert rows[-1]["kl"] > 1e-4
    assert 0 < rows[-1]["sync/bytes"] < full[-1]["sync/bytes"] / 10
    checkpoint = tmp_path / "lora" / "checkpoints" / "step_000004"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").exists()
    assert (checkpoint / "adapter" / "tokenizer.json").exists() and not (checkpoint / "policy").exists()


def _serve_one_reply(adapter, trajectories) -> dict:
    """`molt-serve --lora adapter`: one chat reply through the stock client; the trajectory it captured."""
    import httpx
    import openai
    from conftest import molt_serve

    with molt_serve("--lora", str(adapter), "--api-key", "k", "--trajectories", str(trajectories),
                    "--max-model-len", "512") as (lines, base):
        assert any(line.startswith("molt-serve: model") and f"with the LoRA adapter {adapter}" in line
                   for line in lines), lines
        client = openai.OpenAI(base_url=base.replace("<session>", "s"), api_key="k", max_retries=0)
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say 7."}], max_tokens=8,
                                       seed=0)
        httpx.post(base.replace("<session>/v1", "s/finish"), json={"reward": 0.0}, headers={"Authorization": "Bearer k"})
    (record,) = [json.loads(line) for line in trajectories.read_text().splitlines()]
    return record


def test_a_lora_checkpoint_is_served_merged_and_evaluated(tmp_path, ray_address):
    """The adapters a run saved: `molt-serve --lora` samples with them (its logprobs are PEFT's on the run's
    model, not the model's own), `molt-merge` writes full weights that give the same logprobs, and
    `molt-eval` scores the run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from molt_agents.hf_model import adapter_base, load_model

    out = tmp_path / "run"
    _train(out, ray_address, "--steps", "3", "--train.async_queue_size", "0", "--actor.lora.rank", "8",
           "--train.lr", "1e-2")
    adapter = out / "checkpoints" / "step_000003" / "adapter"
    record = _serve_one_reply(adapter, tmp_path / "served.jsonl")
    ids = torch.tensor(record["token_ids"])
    sampled = torch.tensor(record["mask"], dtype=torch.bool)
    served = torch.tensor([lp if lp is not None else 0.0 for lp in record["logprobs"]])
    base = adapter_base(adapter)
    with torch.no_grad():
        peft = _token_logprobs(PeftModel.from_pretrained(load_model(base, torch.float32), adapter), ids)
        plain = _token_logprobs(load_model(base, torch.float32), ids)
        subprocess.run([sys.executable, "-m", "molt_train.merge", str(out), "--out", str(tmp_path / "merged")],
                       check=True, capture_output=True, timeout=300)
        merged = _token_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids)
    gaps = {name: float((served - values)[sampled].abs().max()) for name, values in
            (("PEFT", peft), ("the model alone", plain))}
    print(f"molt-serve --lora: {int(sampled.sum())} sampled tokens, logprobs vs {gaps}; merged vs PEFT "
          f"{float((merged - peft).abs().max()):.2e}")
    assert sampled.sum() > 0 and gaps["PEFT"] < 1e-4 and gaps["the model alone"] > 1e-2
    assert float((merged - peft).abs().max()) < 1e-5 and (tmp_path / "merged" / "tokenizer.json").exists()
    result = subprocess.run([sys.executable, "-m", "molt_train.eval_cli", "--model", str(out), "--eval.episodes", "8"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "molt-eval: digit, 8 episodes" in result.stdout, result.stderr[-3000:]
    refused = subprocess.run([sys.executable, "-m", "molt_train.eval_cli", "--model", str(out), "--engine.name", "hf"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "holds LoRA adapters" in refused.stderr, refused.stderr[-2000:]
