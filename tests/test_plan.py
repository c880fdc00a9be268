"""`molt-train --dry-run`: parameter counts, placement, the memory model against measured peaks, the recipes.

The memory model is checked against the real trainer: `PolicyRank` steps on
the tiny dense, MoE and vision-language models (gloo ranks spawned here)
under the CPU allocator's own accounting (the profiler's memory events: every
byte allocated and freed, in order), and the highest total during a step of
two micro-batches per rank is compared with the estimate of the same flags.
The profiler records only the main thread's events, so a tensor whose last
reference a gloo thread drops reads as never freed; the step therefore starts
from the bytes of every tensor alive at its start, counted directly, and adds
the profiler's rise within the step.
"""

import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from molt_train.config import (
    ActorConfig,
    AlgoConfig,
    Config,
    EngineConfig,
    RolloutConfig,
    TrainConfig,
)
from molt_train.plan.memory import cpu_kv_cache, kv_bytes_per_token, sequences_in_flight, trainer_memory
from molt_train.plan.shape import _meta_counts, shape, sizes

ROOT = Path(__file__).resolve().parent.parent
MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]
RECIPES = sorted(path for path in (ROOT / "recipes").glob("*.yaml") if "\ncluster:" in path.read_text())
TOLERANCE = 0.15  # estimate vs measured peak, relative
MARKER = 7_777_777  # bytes of a tensor allocated and freed between the two steps: where the measured step starts


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _dry_run(*flags, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(MOLT_TRAIN + ["--dry-run", *flags], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


# ----------------------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("model", sorted((ROOT / "recipes" / "models").iterdir()), ids=lambda path: path.name)
def test_parameter_counts_equal_transformers_own_class_on_the_meta_device(model):
    counted, built = shape(_config(model)), _meta_counts(_config(model))
    assert counted.counted_by == "formula"
    for key, value in built.items():
        assert getattr(counted, key) == value, key


def test_the_tiny_models_are_counted_right(dense_dir, moe_dir):
    from molt_agents.tiny import tiny_model

    for model in (dense_dir, moe_dir, tiny_model("vlm")):
        counted, built = shape(_config(Path(model))), _meta_counts(_config(Path(model)))
        assert {key: getattr(counted, key) for key in built} == built


# ----------------------------------------------------------------------------- the recipes

PLAN_PAGES = ("docs/scaling.md", "docs/plans.md")  # every recipe's plan on plans.md, one of them in scaling.md


def _documented_plans() -> list[tuple[str, str]]:
    """(recipe, plan) for every `<!-- plan: recipes/X.yaml -->` block on the pages that show plans."""
    return [match for page in PLAN_PAGES
            for match in re.findall(r"<!-- plan: (\S+) -->\n```\n(.*?)```", (ROOT / page).read_text(), re.DOTALL)]


def test_every_recipe_fits_its_cluster_and_the_docs_show_its_plan():
    plans = _documented_plans()
    assert len(RECIPES) >= 5
    for recipe in RECIPES:
        name = str(recipe.relative_to(ROOT))
        start = time.monotonic()
        result = _dry_run("--config", name)
        print(f"{name}: {time.monotonic() - start:.2f} s")
        assert result.returncode == 0, result.stderr
        assert result.stdout.rstrip().endswith("the run fits")
        shown = [plan for shown_for, plan in plans if shown_for == name]
        assert shown, f"docs/plans.md shows no plan for {name} (a '<!-- plan: {name} -->' block)"
        for plan in shown:
            assert result.stdout == plan, f"the plan of {name} changed: update it in {' and '.join(PLAN_PAGES)}"


@pytest.mark.parametrize("flags,message", [
    (["--config", "recipes/qwen3-235b-a22b.yaml", "--actor.offload", "none"],
     "trainer rank needs 91.8 GB of 80 GB: set --actor.offload optimizer, or --actor.world_size >= 64"),
    (["--config", "recipes/deepseek-v3.yaml", "--cluster.gpu_memory_gb", "141"],
     "--engine.tensor_parallel_size 8: an engine GPU needs 170.0 GB for weights and workspace of 133.9 GB"),
    (["--config", "recipes/qwen3-30b-a3b.yaml", "--engine.tensor_parallel_size", "16"],
     "--engine.tensor_parallel_size 16: an engine's ranks share one node, and a node has 8 GPUs"),
    (["--config", "recipes/qwen3-30b-a3b.yaml", "--actor.world_size", "16", "--actor.expert_parallel", "16"],
     "--engine.data_parallel_size 2 x --engine.tensor_parallel_size 4 + --actor.world_size 16: the run places 24 "
     "GPUs and the cluster has 16"),
    (["--config", "recipes/qwen3-235b-a22b.yaml", "--cluster.cpu_memory_gb", "800"],
     "--cluster.cpu_memory_gb 800: node 2 needs 940.4 GB of host memory"),
    (["--config", "recipes/qwen3-4b.yaml", "--engine.gpu_memory_utilization", "0.14"],
     "--rollout.max_total_tokens 8192: the KV cache of an engine GPU holds 0.8 GB, less than one such sequence"),
])
def test_a_run_that_does_not_fit_fails_naming_the_flag_to_change(flags, message):
    result = _dry_run(*flags)
    assert result.returncode == 1
    assert result.stderr.startswith(f"molt-train --dry-run: {message}"), result.stderr


def test_dry_run_plans_the_reward_model_on_a_device_of_its_own():
    """`--reward.model`: its parameters counted as transformers builds the sequence classifier (a score head in
    place of the language-model head), a device of its own in the placement, and its GPU checked."""
    from transformers import AutoModelForSequenceClassification

    from molt_agents.tiny import tiny_model
    from molt_train.plan.memory import reward_memory

    reward_dir = tiny_model("reward")
    built = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(reward_dir).parameters())
    counted = reward_memory(shape(_config(reward_dir)), Config(), 4)
    assert counted.params == built and counted.weights == 4 * built
    tied = _config(ROOT / "recipes" / "models" / "qwen3-4b")
    assert tied["tie_word_embeddings"] and reward_memory(shape(tied), Config(), 2).params == shape(tied).params + 2560

    result = _dry_run("--reward.model", "tiny:reward", "--engine.data_parallel_size", "2")
    assert result.returncode == 0, result.stderr
    assert f"reward model, its own CPU (node 0, CPU 3): {built / 1e6:.2f}M parameters" in result.stdout
    recipe = ["--config", "recipes/qwen3-4b.yaml", "--reward.model", "recipes/models/qwen3-4b"]
    refused = _dry_run(*recipe)
    assert refused.returncode == 1 and "+ --reward.model: the run places 9 GPUs and the cluster has 8" in refused.stderr
    fits = _dry_run(*recipe, "--engine.data_parallel_size", "3")
    assert fits.returncode == 0, fits.stderr
    assert "reward model, its own GPU (node 0, GPU 7): 4.02B parameters" in fits.stdout
    too_big = _dry_run(*recipe, "--engine.data_parallel_size", "3", "--reward.batch_size", "512")
    assert too_big.returncode == 1 and too_big.stderr.startswith(
        "molt-train --dry-run: --reward.batch_size 512: the reward model's GPU needs"), too_big.stderr


def test_dry_run_counts_the_cpus_a_local_ray_gives_the_run():
    """A local Ray counts a CPU for every process it places, however few the machine has (`local_cpus`): the
    dry run plans with those, so a run that starts here is not refused by its own dry run."""
    result = _dry_run("--engine.data_parallel_size", "3")
    assert result.returncode == 0, result.stderr
    assert f"# cluster: 1 node(s) x {max(os.cpu_count(), 4)} CPUs" in result.stdout, result.stdout


def test_dry_run_reads_the_shape_of_a_live_ray_cluster(ray_address, dense_dir):
    result = _dry_run("--model", str(dense_dir), "--ray.address", ray_address)
    assert result.returncode == 0, result.stderr
    assert "# cluster: 1 node(s) x 4 CPUs" in result.stdout and f"(Ray cluster {ray_address})" in result.stdout


def test_the_paper_s_optimizer_offload_figure():
    """The AdamW moments that `--actor.offload optimizer` moves off each GPU, for Qwen3-4B in bf16 compute."""
    model = shape(_config(ROOT / "recipes" / "models" / "qwen3-4b"))
    savings = {}
    for world in (1, 2, 4, 8):
        actor = dict(world_size=world, param_dtype="bfloat16", activation_checkpointing="full")
        plain = trainer_memory(model, Config(actor=ActorConfig(**actor)))
        offloaded = trainer_memory(model, Config(actor=ActorConfig(**actor, offload="optimizer")))
        savings[world] = (plain.total - offloaded.total) / 1e9
        assert offloaded.host == pytest.approx(12 * model.params / world)  # moments and master weights
    print("Qwen3-4B optimizer offload saves per GPU:", {world: f"{gb:.1f} GB" for world, gb in savings.items()})
    assert savings[2] == pytest.approx(8 * 4.0225e9 / 2 / 1e9, rel=1e-3)


def test_a_cpu_engine_s_kv_cache_is_sized_to_the_run_s_episodes_in_flight(dense_dir, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model = sizes(_config(dense_dir))
    config = Config(engine=EngineConfig(max_model_len=4096))
    per_token = kv_bytes_per_token(model, config.engine)
    assert per_token == 2 * model.layers * model.kv_heads * model.head_dim * 4  # K and V, fp32
    # 16 groups of 8 a step plus the asynchronous look-ahead of 16 groups, up to 512 tokens each, twice over
    assert sequences_in_flight(config) == (16 + 16) * 8
    assert cpu_kv_cache(per_token, config) == 2 * 256 * 512 * per_token
    # shared by the engine replicas; an evaluation's plays come on top
    two = replace(config, engine=replace(config.engine, data_parallel_size=2),
                  eval=replace(config.eval, every=10, episodes=63, samples=2))
    assert sequences_in_flight(two) == 16 * 8 + 32 * 2
    # molt-sft runs no engine; its runtime counts as one
    assert sequences_in_flight(replace(config, engine=replace(config.engine, data_parallel_size=0))) == 256
    # never less than two sequences of max_model_len, never more than 1 GiB unless the user grants it
    assert cpu_kv_cache(per_token, replace(config, rollout=replace(config.rollout, groups_per_step=1, group_size=1),
                                           train=replace(config.train, async_queue_size=0))) == 2 * 4096 * per_token
    big = replace(config, rollout=replace(config.rollout, max_total_tokens=4096, group_size=64))
    assert cpu_kv_cache(per_token, big) == 2**30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_kv_cache(per_token, config) == 3 * 2**30


def test_a_model_whose_config_lacks_the_sizes_keeps_the_engine_s_default_kv_cache(tmp_path):
    from molt_train.runtime import _cpu_kv_cache

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64}))
    assert _cpu_kv_cache(Config(engine=EngineConfig(max_model_len=1024)), str(tmp_path)) is None


# ----------------------------------------------------------------------------- estimates vs measured peaks

def _micro_batches(vocab: int, budget: int, count: int, width: int, rows: bool):
    """The estimate's worst case, `count` micro-batches of `budget` tokens: every position trained, in rows
    of `width` (one sequence as long, then two of half its length in each other row, so that the attention
    masks cover every row); without `rows` one row each, as the packer gives AutoModel and image batches."""
    from molt_train.packing import TrainItem, pack

    generator, items = np.random.default_rng(0), []
    for _ in range(count):
        for length in [width] + [width // 2] * (2 * (budget // width - 1)):
            mask = [0] + [1] * (length - 1)
            items.append(TrainItem(token_ids=generator.integers(3, vocab, length).tolist(), mask=mask,
                                   logprobs=[-1.0 if m else None for m in mask], ages=[0] * length, advantage=1.0))
    return pack(items, budget, rows)


def _alive_bytes() -> int:
    """The bytes of the CPU storages that every tensor alive in this process holds, each storage once."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
            if tensor.device.type == "cpu" and not tensor.is_meta:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):  # fake and functional tensors have no storage; dead weak proxies
            continue
    return sum(storages.values())


def _measured_rank(rank, world, model_dir, actor, algo, train, port, out):
    """Two steps of a real PolicyRank under the profiler; the highest allocated total during the second."""
    from torch.profiler import ProfilerActivity, profile

    from molt_train.actor.policy import PolicyRank

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        policy = PolicyRank(model_dir, model_dir, rank, world, f"tcp://127.0.0.1:{port}",
                            Config(train=train, algo=algo, actor=actor, steps=2))
        vocab = policy.model.config.get_text_config().vocab_size
        one_row = actor.backend == "automodel" or hasattr(policy.model.config, "vision_config")
        batches = _micro_batches(vocab, train.micro_batch_tokens, 2 * actor.data_parallel, width=MAX_TOTAL_TOKENS,
                                 rows=not one_row)
        mine = batches[rank // (actor.tensor_parallel * actor.context_parallel)::actor.data_parallel]
        step_tokens = int(sum(mb.mask.sum() for mb in batches))
        policy.step(mine, step_tokens)  # the first step allocates the optimizer's states
        alive = _alive_bytes()
        marker = torch.empty(MARKER, dtype=torch.uint8)
        del marker
        policy.step(mine, step_tokens)
    events = sorted((event for event in profiler.profiler.kineto_results.events()
                     if event.name() == "[memory]" and event.device_type().name == "CPU"),
                    key=lambda event: event.start_ns())
    allocated, start, peak = 0, None, 0
    for event in events:
        allocated += event.nbytes()
        if event.nbytes() == -MARKER:
            start = allocated
        if start is not None:
            peak = max(peak, allocated)
    torch.save(alive + peak - start, f"{out}/rank{rank}.pt")
    policy.close()


def _measured_peak(model_dir, actor: ActorConfig, algo: AlgoConfig, train: TrainConfig, out: Path) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_measured_rank, args=(actor.world_size, str(model_dir), actor, algo, train, port, str(out)),
                       nprocs=actor.world_size, start_method="spawn")
    return max(torch.load(out / f"rank{rank}.pt") for rank in range(actor.world_size))


MAX_TOTAL_TOKENS = 512
SETTINGS = [
    ("dense", {}, 2048),
    ("dense", {"param_dtype": "bfloat16"}, 1024),
    ("dense", {"activation_checkpointing": "full"}, 2048),
    ("dense", {"param_dtype": "bfloat16", "activation_checkpointing": "full"}, 2048),
    ("dense", {"activation_checkpointing": "selective", "logprob_chunk_tokens": 256}, 2048),
    ("dense", {"world_size": 2}, 1024),
    ("dense", {"offload": "optimizer"}, 1024),
    ("dense", {"offload": "full", "world_size": 2}, 1024),
    ("moe", {}, 1024),
    ("moe", {"backend": "automodel", "world_size": 2, "expert_parallel": 2, "param_dtype": "bfloat16",
             "activation_checkpointing": "full"}, 1024),
    ("vlm", {}, 1024),
]


@pytest.mark.parametrize("kind,actor,tokens", SETTINGS, ids=lambda value: json.dumps(value).replace(" ", ""))
def test_the_trainer_estimate_matches_the_measured_peak(kind, actor, tokens, tmp_path):
    """On CPU host and device are one memory: the estimate's device and host parts together."""
    from molt_agents.tiny import tiny_model

    model_dir = tiny_model(kind)
    config = Config(actor=ActorConfig(**actor), algo=AlgoConfig(kl_coef=0.1),
                    train=TrainConfig(micro_batch_tokens=tokens),
                    rollout=RolloutConfig(max_total_tokens=MAX_TOTAL_TOKENS))
    estimate = trainer_memory(shape(_config(model_dir)), config)
    measured = _measured_peak(model_dir, config.actor, config.algo, config.train, tmp_path)
    estimated = estimate.total + estimate.host
    print(f"{kind} {actor} {tokens} tokens: estimated {estimated / 2**20:.2f} MiB, measured {measured / 2**20:.2f} "
          f"MiB ({estimated / measured - 1:+.1%}); activations {estimate.activations / 2**20:.2f} MiB")
    assert abs(estimated / measured - 1) <= TOLERANCE
