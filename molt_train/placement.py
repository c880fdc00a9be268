"""Where the run's processes go on the Ray cluster: placement groups, reserved before any actor starts.

Every process of the run takes one device: a GPU when the cluster has GPUs, else one CPU (a logical
one: a local Ray that Molt starts counts at least one CPU per process it places).

- An engine replica is a placement group of one bundle with its `tensor_parallel_size` devices: the
  engine's actor and the vLLM worker processes it spawns for its ranks share one node.
- The trainer is one placement group of `world_size` one-device bundles, packed onto as few nodes as
  hold them (PACK). Rank r takes the r-th bundle in node order, so the ranks of one node are
  consecutive (a tensor-parallel group, which takes consecutive ranks, stays inside a node), and the
  rendezvous of the trainer's process group is on rank 0's node.
- `actor.colocate` (GPU only): engine replica i shares trainer rank i's GPU, half a GPU each in Ray's
  accounting; the engines sleep (vLLM frees their weights and KV cache) while the trainer steps.
- The reward model (`--reward.model`) is a placement group of one one-device bundle.
- Threads on CPU: a process computes with as many threads as it has CPUs (Ray's default), except in
  a synchronous run (`--train.async_queue_size 0`) on a local Ray without GPUs, where the engines and
  the trainer take turns, never computing at once: there each takes an equal share of all the
  machine's CPUs for its turn (`turn_threads`), as a single-process trainer would.
- Every process gets the `MOLT_*` environment variables of the `molt-train` that placed it (a judge's
  endpoint, for example), also on a cluster started before the run.

A reservation the cluster cannot hold is refused before anything starts, with what it needs and what
the cluster has; one that is not placed within the timeout (enough devices, but not on one node) says
so and names the flags.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from molt_train.config import Config, ConfigError

PLACEMENT_TIMEOUT = 300.0  # seconds for the cluster to reserve the bundles (autoscalers may add nodes)


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: its scheduling strategy and what it asks of the bundle."""

    strategy: PlacementGroupSchedulingStrategy
    num_cpus: float
    num_gpus: float
    threads: int | None = None  # the process's compute threads, where not its CPUs (`turn_threads`)

    def options(self) -> dict:
        options = dict(scheduling_strategy=self.strategy, num_cpus=self.num_cpus, num_gpus=self.num_gpus)
        env = {name: value for name, value in os.environ.items() if name.startswith("MOLT_")}
        if self.threads is not None:  # read by torch (and vLLM's CPU worker) as the process starts
            env["OMP_NUM_THREADS"] = str(self.threads)
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options


def bundles(config: Config, gpus: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """The engine replicas' bundles (one each), the trainer's (one per rank) and the reward model's (one, or
    none without `--reward.model`)."""
    engine, actor = config.engine, config.actor
    per_device = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
    reward = [per_device] if config.reward.model else []
    if actor.colocate:
        return [], [{"GPU": 1, "CPU": 1}] * actor.world_size, reward
    per_engine = ({"GPU": engine.tensor_parallel_size, "CPU": 1} if gpus
                  else {"CPU": engine.tensor_parallel_size})
    return [per_engine] * engine.data_parallel_size, [per_device] * actor.world_size, reward


def check_fits(config: Config, reservation: list[dict], cluster: dict) -> None:
    """Refuse a reservation (all the run's bundles) larger than the cluster's totals, naming the flags that
    size it."""
    for resource in ("GPU", "CPU"):
        need = sum(bundle.get(resource, 0) for bundle in reservation)
        have = cluster.get(resource, 0)
        if need > have:
            e = config.engine
            raise ConfigError(
                f"--engine.data_parallel_size {e.data_parallel_size} x --engine.tensor_parallel_size "
                f"{e.tensor_parallel_size} + --actor.world_size {config.actor.world_size}"
                f"{' + --reward.model' if config.reward.model else ''}: the run places "
                f"{need:g} {resource}s and the Ray cluster has {have:g}")


def turn_threads(config: Config, cpus: int, gpus: bool) -> tuple[int | None, int | None]:
    """Compute threads of an engine process and of a trainer rank when they take turns on the `cpus` of one
    machine (a synchronous run on a local Ray without GPUs): the engines' processes share all of them while
    they generate, then the trainer's ranks while they train. None, None otherwise (a process computes on
    its own CPUs: in an asynchronous run both compute at once, and a joined cluster's other CPUs are not
    the run's to take)."""
    if gpus or config.ray.address or config.train.async_queue_size:
        return None, None
    engine_processes = config.engine.data_parallel_size * config.engine.tensor_parallel_size
    return max(1, cpus // max(engine_processes, 1)), max(1, cpus // config.actor.world_size)


def node_order(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices sorted so that bundles on one node are consecutive, nodes in order of first use."""
    first = {node: number for number, node in enumerate(dict.fromkeys(bundle_nodes))}
    return sorted(range(len(bundle_nodes)), key=lambda index: (first[bundle_nodes[index]], index))


class Placement:
    """The run's placement groups and the slot of every engine replica and trainer rank."""

    @classmethod
    async def reserve(cls, config: Config, timeout: float = PLACEMENT_TIMEOUT) -> Placement:
        cluster = ray.cluster_resources()
        gpus = cluster.get("GPU", 0) > 0
        if config.actor.colocate and not gpus:
            raise ConfigError("--actor.colocate: trainer and engines share GPUs, and this Ray cluster has none "
                              "(on CPU they already share the cores)")
        engines, trainer, reward = bundles(config, gpus)
        check_fits(config, engines + trainer + reward, cluster)
        self = cls()
        self.engine_groups = [placement_group([bundle], strategy="STRICT_PACK") for bundle in engines]
        self.trainer_group = placement_group(trainer, strategy="PACK")
        self.reward_group = placement_group(reward) if reward else None
        self.groups = [*self.engine_groups, self.trainer_group, *([self.reward_group] if reward else [])]
        try:
            await asyncio.wait_for(asyncio.gather(*(group.ready() for group in self.groups)), timeout)
        except asyncio.TimeoutError:
            self.remove()
            raise ConfigError(f"placement: the Ray cluster did not hold the run's bundles within {timeout:g} s "
                              f"(engines: {len(engines)} x {engines[:1]}, each on one node; trainer: "
                              f"{len(trainer)} x {trainer[:1]}); check --engine.tensor_parallel_size against the "
                              "devices per node, and `ray status`") from None
        table = ray.util.placement_group_table(self.trainer_group)["bundles_to_node_id"]
        self.rank_bundles = node_order([table[index] for index in range(len(trainer))])
        self.gpus, self.colocate = gpus, config.actor.colocate
        self.engine_threads, self.trainer_threads = turn_threads(config, int(cluster.get("CPU", 1)), gpus)
        return self

    def engine(self, replica: int) -> Slot:
        if self.colocate:  # on trainer rank `replica`'s GPU
            return Slot(PlacementGroupSchedulingStrategy(self.trainer_group, self.rank_bundles[replica]), 0.5, 0.5)
        group = self.engine_groups[replica]
        bundle = group.bundle_specs[0]
        return Slot(PlacementGroupSchedulingStrategy(group, 0), bundle["CPU"], bundle.get("GPU", 0),
                    self.engine_threads)

    def trainer_rank(self, rank: int) -> Slot:
        strategy = PlacementGroupSchedulingStrategy(self.trainer_group, self.rank_bundles[rank])
        if self.colocate:
            return Slot(strategy, 0.5, 0.5)
        return Slot(strategy, 1, 1 if self.gpus else 0, self.trainer_threads)

    def reward_model(self) -> Slot:
        bundle = self.reward_group.bundle_specs[0]
        return Slot(PlacementGroupSchedulingStrategy(self.reward_group, 0), bundle["CPU"], bundle.get("GPU", 0))

    def nodes(self) -> dict[str, list[str]]:
        """Node ids of the engine replicas and the trainer ranks (rank order), for the start-up report."""
        table = ray.util.placement_group_table
        trainer = table(self.trainer_group)["bundles_to_node_id"]
        return {"engines": [table(group)["bundles_to_node_id"][0] for group in self.engine_groups],
                "trainer": [trainer[index] for index in self.rank_bundles]}

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
