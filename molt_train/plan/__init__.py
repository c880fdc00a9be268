"""`molt-train --dry-run`: will this run fit, and where does everything go, before anything starts.

From the model's `config.json`, the flags and the cluster's shape alone (no
weights, no GPU, no Ray actor): the placement of every engine replica and
trainer rank (`layout.py`), the memory of every trainer and engine GPU and
of every host (`memory.py`, with the parameter counts of `shape.py`), and
the tokens per step. `check` fails with the flag to change when something
does not fit.

Host memory counts what the code keeps there: offloaded optimizer states,
the checkpoint that trainer rank 0 reads (every other rank builds its shard
on the meta device and receives its share), the whole model that a
tensor-parallel engine gathers before each reload, and with
`train.weight_sync object_store` the copy that travels through Ray's object
store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from molt_train.config import Config, ConfigError
from molt_train.plan.layout import Cluster, Layout, place
from molt_train.plan.memory import (
    DTYPE_BYTES,
    GB,
    EngineMemory,
    RewardMemory,
    TrainerMemory,
    engine_memory,
    reward_memory,
    trained_params,
    trainer_memory,
)
from molt_train.plan.shape import Shape, shape, text_config

# GPU memory by Ray's accelerator_type, for a live cluster whose --cluster.gpu_memory_gb is not given.
ACCELERATOR_GB = {"H100": 80, "H200": 141, "H800": 80, "A100": 80, "A100-80G": 80, "A100-40G": 40, "B200": 180,
                  "L40S": 48, "L4": 24, "A10G": 24, "GB200": 186}


@dataclass(frozen=True)
class Plan:
    config: Config
    shape: Shape
    cluster: Cluster
    layout: Layout
    trainer: TrainerMemory
    engine: EngineMemory
    host: list[dict[str, float]]  # per node: what lives in its memory
    reward: RewardMemory | None = None


def make_plan(config: Config, model: dict, cluster: Cluster, reward_model: dict | None = None) -> Plan:
    """`reward_model`: the reward model's config.json, with `--reward.model`."""
    model_shape = shape(model)
    layout = place(config, cluster)
    device_gb = cluster.gpu_gb if cluster.gpus else cluster.cpu_gb
    engine = engine_memory(model_shape, config, device_gb, gpu=cluster.gpus > 0)
    trainer = trainer_memory(model_shape, config, gpu=cluster.gpus > 0)
    reward = reward_memory(shape(reward_model), config, _stored_bytes(reward_model)) if reward_model else None
    return Plan(config, model_shape, cluster, layout, trainer, engine,
                host_memory(config, model, model_shape, layout, trainer, cluster), reward)


def _stored_bytes(model: dict) -> int:
    """Bytes per parameter as the checkpoint stores them (a vision-language model declares its dtype on its
    text model)."""
    text = text_config(model)
    return DTYPE_BYTES.get(text.get("torch_dtype") or text.get("dtype") or "float32") or 4


def host_memory(config: Config, model: dict, model_shape: Shape, layout: Layout, trainer: TrainerMemory,
                cluster: Cluster) -> list[dict[str, float]]:
    hosts = [dict() for _ in range(cluster.nodes)]
    for node, _ in layout.ranks:
        if trainer.host:
            hosts[node]["offloaded states"] = hosts[node].get("offloaded states", 0.0) + trainer.host
    load_bytes = (_stored_bytes(model) if config.actor.world_size > 1 else 4) * model_shape.params
    hosts[layout.ranks[0][0]]["checkpoint read by rank 0"] = load_bytes
    sync_bytes = trained_params(model_shape, config) * (DTYPE_BYTES[config.engine.dtype] or 4)
    if config.train.weight_sync == "object_store":
        hosts[layout.ranks[0][0]]["weights in Ray's object store"] = sync_bytes
    for node, _ in layout.engines:
        if config.engine.tensor_parallel_size > 1 or config.train.weight_sync == "object_store":
            hosts[node]["weights gathered by engines"] = hosts[node].get("weights gathered by engines", 0) + sync_bytes
    return hosts


# ----------------------------------------------------------------------------- the cluster

def cluster_of(config: Config) -> Cluster:
    """The cluster's shape: --cluster.* where given, the rest from the live Ray cluster (--ray.address) or
    from this machine."""
    flags = config.cluster
    given = {key: value for key, value in vars(flags).items() if value is not None}
    if len(given) == 4:
        return Cluster(flags.nodes, flags.gpus_per_node, flags.gpu_memory_gb, flags.cpu_memory_gb,
                       cpus=(os.cpu_count() or 1) if flags.gpus_per_node == 0 else 0)
    found = _live_cluster(config.ray.address) if config.ray.address else _this_machine()
    if not config.ray.address:  # a local Ray counts its CPUs as the run starts it
        found["cpus"] = local_cpus(config)
    merged = {**found, **given}
    if merged["gpu_memory_gb"] is None:
        raise ConfigError("--cluster.gpu_memory_gb: the cluster's GPU type is unknown "
                          f"({found.get('accelerator') or 'not reported'}); give the memory of one GPU in GB")
    source = "flags" if not found else ("Ray cluster " + config.ray.address if config.ray.address else "this machine")
    return Cluster(merged["nodes"], merged["gpus_per_node"], merged["gpu_memory_gb"], merged["cpu_memory_gb"],
                   cpus=found.get("cpus", 0) if merged["gpus_per_node"] == 0 else 0, source=source)


def local_cpus(config: Config) -> int:
    """CPUs of a local Ray: --ray.num_cpus, or all, and at least one per process the run places."""
    processes = (config.engine.data_parallel_size * config.engine.tensor_parallel_size + config.actor.world_size
                 + bool(config.reward.model))
    return config.ray.num_cpus or max(os.cpu_count() or 1, processes)


def _this_machine() -> dict:
    import shutil
    import subprocess

    host_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    gpus, gpu_gb = 0, 0.0
    if shutil.which("nvidia-smi"):
        result = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True)
        sizes = [float(line) for line in result.stdout.split()] if result.returncode == 0 else []
        gpus, gpu_gb = len(sizes), (min(sizes) * 2**20 / GB if sizes else 0.0)
    return {"nodes": 1, "gpus_per_node": gpus, "gpu_memory_gb": gpu_gb if gpus else host_gb,
            "cpu_memory_gb": host_gb, "cpus": os.cpu_count() or 1}


def _live_cluster(address: str) -> dict:
    """The shape of a running Ray cluster (joined as a driver; nothing is scheduled on it)."""
    import ray

    ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [node for node in ray.nodes() if node["Alive"]]
    finally:
        ray.shutdown()
    gpus = [int(node["Resources"].get("GPU", 0)) for node in nodes]
    accelerators = {key.removeprefix("accelerator_type:") for node in nodes for key in node["Resources"]
                    if key.startswith("accelerator_type:")}
    accelerator = next(iter(accelerators), None)
    per_gpu = ACCELERATOR_GB.get(accelerator) if max(gpus, default=0) else None
    host = min(node["Resources"].get("memory", 0) for node in nodes) / GB
    return {"nodes": len(nodes), "gpus_per_node": min(gpus), "gpu_memory_gb": per_gpu if max(gpus) else host,
            "cpu_memory_gb": host, "cpus": int(min(node["Resources"].get("CPU", 1) for node in nodes)),
            "accelerator": accelerator}


# ----------------------------------------------------------------------------- does it fit

def check(plan: Plan) -> None:
    """A ConfigError naming the flags that would make the run fit, if it does not."""
    config, cluster = plan.config, plan.cluster
    device_gb = cluster.gpu_gb if cluster.gpus else cluster.cpu_gb
    if cluster.gpus and plan.trainer.total > device_gb * GB:
        fixes = _trainer_fixes(plan, device_gb)
        raise ConfigError(f"trainer rank needs {plan.trainer.total / GB:.1f} GB of {device_gb:g} GB"
                          + (f": set {', or '.join(fixes)}" if fixes else ""))
    engine = plan.engine
    if cluster.gpus and engine.weights + engine.workspace > engine.budget:
        raise ConfigError(f"--engine.tensor_parallel_size {config.engine.tensor_parallel_size}: an engine GPU needs "
                          f"{(engine.weights + engine.workspace) / GB:.1f} GB for weights and workspace of "
                          f"{engine.budget / GB:.1f} GB (--engine.gpu_memory_utilization "
                          f"{config.engine.gpu_memory_utilization} of {device_gb:g} GB): use more GPUs per engine or "
                          "GPUs with more memory")
    if cluster.gpus and engine.sequences < 1:
        raise ConfigError(f"--rollout.max_total_tokens {config.rollout.max_total_tokens}: the KV cache of an engine "
                          f"GPU holds {max(engine.kv_cache, 0) / GB:.1f} GB, less than one such sequence "
                          f"({engine.kv_per_token * config.rollout.max_total_tokens / GB:.1f} GB); raise "
                          "--engine.gpu_memory_utilization or --engine.tensor_parallel_size, or shorten episodes")
    if cluster.gpus and plan.reward and plan.reward.total > cluster.gpu_gb * GB:
        raise ConfigError(f"--reward.batch_size {config.reward.batch_size}: the reward model's GPU needs "
                          f"{plan.reward.total / GB:.1f} GB of {cluster.gpu_gb:g} GB (weights "
                          f"{plan.reward.weights / GB:.1f} GB): score fewer conversations at once, or use a smaller "
                          "reward model")
    for node, parts in enumerate(plan.host):
        used = sum(parts.values()) + (0 if cluster.gpus else _cpu_device_bytes(plan, node))
        if used > cluster.cpu_gb * GB:
            shown = ", ".join(f"{name} {value / GB:.1f} GB" for name, value in parts.items())
            raise ConfigError(f"--cluster.cpu_memory_gb {cluster.cpu_gb:g}: node {node} needs {used / GB:.1f} GB of "
                              f"host memory ({shown}); use nodes with more memory or "
                              "--actor.offload none, or spread the run over more nodes")


def _cpu_device_bytes(plan: Plan, node: int) -> float:
    """On a CPU cluster the trainer's and engines' memory is host memory too."""
    ranks = sum(1 for rank_node, _ in plan.layout.ranks if rank_node == node)
    engines = sum(1 for engine_node, _ in plan.layout.engines if engine_node == node)
    reward = plan.reward.total if plan.reward and plan.layout.reward[0] == node else 0.0
    return ranks * plan.trainer.total + engines * plan.engine.total + reward


def _trainer_fixes(plan: Plan, device_gb: float) -> list[str]:
    """Single flag changes after which a trainer rank fits, cheapest in speed first."""
    config, limit, fixes = plan.config, device_gb * GB, []
    actor = config.actor

    def fits(**changes) -> bool:
        trial = replace(config, actor=replace(actor, **changes))
        return trainer_memory(plan.shape, trial).total <= limit

    if actor.logprob_chunk_tokens == 0 and actor.tensor_parallel == 1 and fits(logprob_chunk_tokens=1024):
        fixes.append("--actor.logprob_chunk_tokens 1024")
    if actor.activation_checkpointing != "full" and fits(activation_checkpointing="full"):
        fixes.append("--actor.activation_checkpointing full")
    if actor.param_dtype == "float32" and fits(param_dtype="bfloat16"):
        fixes.append("--actor.param_dtype bfloat16")
    if actor.offload == "none" and fits(offload="optimizer"):
        fixes.append("--actor.offload optimizer")
    step = actor.tensor_parallel * actor.context_parallel
    for world in range(actor.world_size + 1, 16 * plan.cluster.nodes * plan.cluster.devices + 1):
        if world % step == 0 and world % actor.expert_parallel == 0 and fits(world_size=world):
            fixes.append(f"--actor.world_size >= {world}")
            break
    if not fixes and actor.offload != "full" and fits(offload="full"):
        fixes.append("--actor.offload full")
    return fixes[:3]


# ----------------------------------------------------------------------------- the report

def render(plan: Plan, model_path: str) -> str:
    config, s, cluster, layout = plan.config, plan.shape, plan.cluster, plan.layout
    actor, engine = config.actor, config.engine
    kind = "GPU" if cluster.gpus else "CPU"
    experts = f" ({_count_of(s.expert_params)} in {s.experts} experts x {s.moe_layers} layers)" if s.experts else ""
    lines = [f"# plan: {s.model_type}, {_count_of(s.params)} parameters{experts}, from {model_path}",
             f"# cluster: {cluster.nodes} node(s) x " + (f"{cluster.gpus} GPUs of {cluster.gpu_gb:.4g} GB"
                                                        if cluster.gpus else f"{cluster.cpus} CPUs")
             + f", {cluster.cpu_gb:.4g} GB host memory each ({cluster.source})", "placement"]
    ep = " EP" if engine.expert_parallel else ""
    shared = " (shared with the trainer)" if layout.colocated else ""
    lines += _grouped([(node, f"TP {engine.tensor_parallel_size}{ep}, {kind}s {_span(devices)}{shared}")
                       for node, devices in layout.engines], "engine")
    mesh = (f"TP {actor.tensor_parallel} CP {actor.context_parallel} EP {actor.expert_parallel} "
            f"DP {actor.data_parallel}")
    per_node: dict[int, list[int]] = {}
    for node, device in layout.ranks:
        per_node.setdefault(node, []).append(device)
    rows, first = [], 0
    for node, devices in per_node.items():
        rows.append((node, f"{len(devices)} per node, {kind}s {_span(devices)}", first, first + len(devices)))
        first += len(devices)
    lines += [f"  trainer ranks {_span(list(range(rows[start][2], rows[end][3]))):<9} "
              f"{mesh}  {_nodes(rows[start][0], rows[end][0])}  {rows[start][1]}"
              for start, end in _runs([row[1] for row in rows], [row[0] for row in rows])]
    t = plan.trainer
    compute = "bf16" if actor.param_dtype == "bfloat16" else "fp32"
    if actor.lora.rank:
        lines.append(f"LoRA rank {actor.lora.rank} on {' '.join(actor.lora.target_modules)}: "
                     f"{_count_of(trained_params(plan.shape, config))} adapter parameters train, the model's are frozen")
    lines += [f"trainer, per {kind} ({actor.backend}, {compute} compute, checkpointing "
              f"{actor.activation_checkpointing}, offload {actor.offload}, logprob chunks "
              f"{actor.logprob_chunk_tokens or 'off'})",
              _row(f"parameters (fp32, 1/{actor.world_size} each)", t.params),
              _row("gradients (fp32)", t.grads),
              _row("optimizer (AdamW moments, fp32)", t.optimizer),
              _row("reference model (LoRA: adapters off)" if actor.lora.rank else f"reference model (kl_coef {config.algo.kl_coef:g})",
                   t.reference),
              _row(f"gathered by FSDP ({compute}: root + 2 blocks)", t.gathered),
              _row(f"activations ({t.micro_batch_tokens} tokens{' / CP' if actor.context_parallel > 1 else ''})",
                   t.activations)]
    if t.process:
        lines.append(_row("process (Python, torch, Ray's worker)", t.process))
    device_gb = cluster.gpu_gb if cluster.gpus else cluster.cpu_gb
    lines.append(_row("total", t.total) + f" of {device_gb:.4g} GB" + _verdict(t.total, device_gb * GB))
    e = plan.engine
    lines += [f"engine, per {kind} ({engine.name} {engine.dtype}, TP {engine.tensor_parallel_size}{ep}, "
              f"{engine.data_parallel_size} replica(s))",
              _row(f"weights (1/{engine.tensor_parallel_size})", e.weights),
              _row("workspace (assumed)", e.workspace),
              _row(f"KV cache ({e.kv_per_token / 1e3:.1f} kB/token)", max(e.kv_cache, 0.0))
              + f"  {e.sequences} sequences of {config.rollout.max_total_tokens} tokens at once"]
    if e.process:
        lines += [_row("process (Python, torch, vLLM, Ray's worker)", e.process),
                  _row(f"GEMM packing of the vocabulary ({'tied: one' if plan.shape.tied else 'two'})", e.packed),
                  _row("weight update (received, repacked)", e.update)]
    lines.append(_row("total", e.total) + (f" of {e.budget / GB:.1f} GB (gpu_memory_utilization "
                                           f"{engine.gpu_memory_utilization} of {device_gb:.4g} GB)"
                                           + _verdict(e.weights + e.workspace, e.budget) if cluster.gpus
                                           else " (KV cache: the episodes in flight, or VLLM_CPU_KVCACHE_SPACE GiB)"))
    if plan.reward:
        r, (node, device) = plan.reward, layout.reward
        lines += [f"reward model, its own {kind} (node {node}, {kind} {device}): {_count_of(r.params)} parameters",
                  _row("weights", r.weights),
                  _row(f"forward ({config.reward.batch_size} x {config.rollout.max_total_tokens} tokens, estimate)",
                       r.forward),
                  _row("total", r.total) + (f" of {device_gb:.4g} GB" + _verdict(r.total, device_gb * GB)
                                            if cluster.gpus else " (host memory)")]
    lines.append("host memory, per node")
    described = [(f"{sum(parts.values()) / GB:8.1f} GB of {cluster.cpu_gb:.4g} GB  ("
                  + (", ".join(f"{name} {value / GB:.1f} GB" for name, value in parts.items()) or "-") + ")")
                 for parts in plan.host]
    lines += [f"  {_nodes(start, end):<12} {described[start]}"
              for start, end in _runs(described, list(range(cluster.nodes)))]
    rollout = config.rollout
    episodes = rollout.group_size * rollout.groups_per_step
    trained = episodes * rollout.max_total_tokens
    lines += ["per step",
              f"  {episodes} episodes ({rollout.groups_per_step} groups x {rollout.group_size}), up to "
              f"{rollout.max_tokens} sampled tokens per turn and {rollout.max_total_tokens} tokens per episode",
              f"  up to {trained:,} tokens trained, {-(-trained // config.train.micro_batch_tokens):,} micro-batches "
              f"of {config.train.micro_batch_tokens} tokens over {actor.data_parallel} data-parallel replica(s)",
              f"  a weight sync sends {_size(trained_params(plan.shape, config) * (DTYPE_BYTES[engine.dtype] or 4))}"
              f" GB ({'the LoRA adapters' if actor.lora.rank else 'every weight'}, {engine.dtype})"]
    return "\n".join(lines)


def _grouped(items: list[tuple[int, str]], what: str) -> list[str]:
    """One line per run of consecutive replicas on consecutive nodes with the same description."""
    return [f"  {what}s {_span(list(range(start, end + 1))):<9} {_nodes(items[start][0], items[end][0])}  "
            f"{items[start][1]}" if end > start else f"  {what} {start:<10} node {items[start][0]}  {items[start][1]}"
            for start, end in _runs([text for _, text in items], [node for node, _ in items])]


def _runs(descriptions: list[str], nodes: list[int]) -> list[tuple[int, int]]:
    """(first, last) indices of runs of equal descriptions whose nodes follow one another (or repeat)."""
    runs, start = [], 0
    for index in range(1, len(descriptions) + 1):
        if (index == len(descriptions) or descriptions[index] != descriptions[start]
                or nodes[index] - nodes[index - 1] not in (0, 1)):
            runs.append((start, index - 1))
            start = index
    return runs


def _nodes(first: int, last: int) -> str:
    return f"node {first}" if first == last else f"nodes {first}-{last}"


def _count_of(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"


def _size(nbytes: float) -> str:
    """GB to three significant digits, whole GB from 1000 on."""
    return f"{nbytes / GB:.3g}" if nbytes < 1000 * GB else f"{nbytes / GB:,.0f}"


def _row(name: str, value: float) -> str:
    return f"  {name:<44} {value / GB:8.2f} GB"


def _verdict(used: float, limit: float) -> str:
    return "  fits" if used <= limit else "  DOES NOT FIT"


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"
