"""Where each engine replica and trainer rank lands on a cluster of a given shape, as `placement.py` reserves it.

The same bundles as the live placement (`placement.bundles`), placed the way
Ray places them: the engine replicas' groups first, each on the first node
with `tensor_parallel_size` free devices (STRICT_PACK: one node), then the
trainer's ranks packed onto the nodes with the most free devices (PACK),
rank r on the r-th bundle in node order. With `actor.colocate` engine
replica i shares trainer rank i's device.
"""

from __future__ import annotations

from dataclasses import dataclass

from molt_train.config import Config, ConfigError


@dataclass(frozen=True)
class Cluster:
    """The cluster's shape: identical nodes, each with `gpus` devices of `gpu_gb` and `cpu_gb` of host memory."""

    nodes: int
    gpus: int  # per node; 0 for a CPU cluster (then every process takes one CPU slot)
    gpu_gb: float
    cpu_gb: float
    cpus: int = 0  # per node, on a CPU cluster
    source: str = "flags"

    @property
    def devices(self) -> int:
        return self.gpus or self.cpus


@dataclass(frozen=True)
class Layout:
    """Per engine replica its node and devices; per trainer rank its node and device; the reward model's node
    and device (`--reward.model`)."""

    engines: list[tuple[int, list[int]]]
    ranks: list[tuple[int, int]]
    colocated: bool
    reward: tuple[int, int] | None = None


def place(config: Config, cluster: Cluster) -> Layout:
    engine, actor = config.engine, config.actor
    free = [list(range(cluster.devices)) for _ in range(cluster.nodes)]
    need = (actor.world_size + (0 if actor.colocate else engine.data_parallel_size * engine.tensor_parallel_size)
            + bool(config.reward.model))
    have = cluster.nodes * cluster.devices
    kind = "GPUs" if cluster.gpus else "CPUs"
    if not actor.colocate and engine.tensor_parallel_size > cluster.devices:
        raise ConfigError(f"--engine.tensor_parallel_size {engine.tensor_parallel_size}: an engine's ranks share "
                          f"one node, and a node has {cluster.devices} {kind}")
    if need > have:
        raise ConfigError(f"--engine.data_parallel_size {engine.data_parallel_size} x --engine.tensor_parallel_size "
                          f"{engine.tensor_parallel_size} + --actor.world_size {actor.world_size}"
                          f"{' + --reward.model' if config.reward.model else ''}: the run places "
                          f"{need} {kind} and the cluster has {have} ({cluster.nodes} node(s) x {cluster.devices}); "
                          "set --cluster.nodes or shrink the run")
    engines = []
    if not actor.colocate:
        for replica in range(engine.data_parallel_size):
            node = next((n for n in range(cluster.nodes) if len(free[n]) >= engine.tensor_parallel_size), None)
            if node is None:
                raise ConfigError(f"--engine.data_parallel_size {engine.data_parallel_size}: engine replica {replica} "
                                  f"finds no node with {engine.tensor_parallel_size} free {kind} (each replica's "
                                  "ranks share one node)")
            engines.append((node, free[node][:engine.tensor_parallel_size]))
            del free[node][:engine.tensor_parallel_size]
    ranks = []
    for node in sorted(range(cluster.nodes), key=lambda n: -len(free[n])):
        while free[node] and len(ranks) < actor.world_size:
            ranks.append((node, free[node].pop(0)))
    ranks.sort()
    if actor.colocate:
        engines = [(node, [device]) for node, device in ranks[:engine.data_parallel_size]]
    reward = next(((node, free[node][0]) for node in range(cluster.nodes) if free[node]), None) \
        if config.reward.model else None
    return Layout(engines, ranks, actor.colocate, reward)
