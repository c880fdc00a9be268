"""The typed config tree of a run: defaults here, a YAML recipe, then CLI overrides.

Every field is a flag (`--engine.dtype bfloat16`); the docstring under a
field is its `--help` text. `validate` rejects unsupported combinations
before any work starts, naming the flag.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class EngineConfig:
    """Rollout engine."""

    name: Literal["vllm", "hf"] = "vllm"
    """Engine backend: vllm, or hf (the transformers fallback)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine weight dtype; the weight sync sends the trainer's floating-point weights cast to it (the same
    weights the engine would cast them to, in half the bytes for bf16)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + completion) the engine accepts, in tokens; default: the model's own
    context (max_position_embeddings). More than the model's context is refused."""
    data_parallel_size: int = 1
    """Engine replicas: rollout worker actors, each with its own engine (and loopback), sharing the prompt
    groups."""
    tensor_parallel_size: int = 1
    """Ranks of one engine (GPUs; processes on CPU), all on one node: vLLM slices every weight across them,
    and each weight sync reaches all of them."""
    expert_parallel: bool = False
    """MoE models: spread whole experts over the engine's tensor-parallel ranks (vLLM's
    enable_expert_parallel) instead of slicing every expert."""
    gpu_memory_utilization: float = 0.85
    """Fraction of each engine GPU that vLLM may fill (weights, activations, KV cache); on CPU the KV cache is
    sized to the run instead: twice its episodes in flight at their longest, at most 1 GiB, or
    VLLM_CPU_KVCACHE_SPACE GiB where set (`molt_train.plan.memory.cpu_kv_cache`)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (group samples, multi-turn episodes); blocks are salted
    with the policy version, so no request reuses KV computed by older weights."""
    enforce_eager: bool | None = None
    """Run the model eagerly instead of capturing CUDA graphs; default: eager on CPU, graphs on GPU."""
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache dtype (auto: the engine dtype); fp8 halves the cache and widens the engine-trainer logprob
    mismatch, which the importance weights then correct."""


@dataclass
class RolloutConfig:
    """Sampling during rollouts."""

    group_size: int = 8
    """Samples per prompt (n): one group, for group baselines."""
    groups_per_step: int = 16
    """Prompt groups per optimizer step."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 16
    """Most tokens sampled per turn."""
    max_total_tokens: int = 512
    """Token budget of a whole episode (prompt, turns and replies)."""
    episode_timeout: float = 300.0
    """Seconds an episode may take; past it the episode is dropped (counted as a failure) and the run goes on."""
    max_failed_steps: int = 3
    """Consecutive steps whose every episode failed before the run ends, naming the first failure (0: never)."""
    allow_remote_images: bool = False
    """--agent runs: let the loopback fetch http(s) image URLs (default: only inline data: URLs)."""
    partial_rollout: bool = True
    """Requests in flight continue under new weights after a sync; off, they finish on the old ones first."""


@dataclass
class TrainConfig:
    """The optimizer and the training step."""

    lr: float = 2e-3
    """Learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, in optimizer steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """After warmup: a constant learning rate, or a linear or cosine decay to min_lr_ratio * lr at the last step."""
    min_lr_ratio: float = 0.1
    """Where the decay ends, as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""
    micro_batch_tokens: int = 1024
    """Token budget of one packed micro-batch (gradient accumulation over micro-batches)."""
    share_prefix: bool = True
    """Train the samples of a prompt as one prefix tree: the prompt's forward and backward once for all of
    them, not once each (fsdp2 backend, text only; see `molt_train.packing`)."""
    updates_per_batch: int = 1
    """Optimizer steps per batch of rollouts (PPO epochs over mini-batches)."""
    async_queue_size: int = 16
    """Finished groups that may wait for the trainer; 0 = synchronous, strictly on-policy."""
    weight_sync: Literal["broadcast", "object_store"] = "broadcast"
    """How new weights reach the engines: broadcast in buckets on a collective channel (NCCL on GPU, gloo
    on CPU), or through Ray's object store (trainer rank 0 gathers the whole model first)."""
    routing_replay: bool = True
    """MoE policies: the actor's forwards use the experts the engine chose for each token (trajectory
    routes; positions without routes keep live routing). No effect on dense models."""
    sync_bucket_mb: int = 256
    """Bucket size of the broadcast weight sync, in MiB (a larger tensor travels alone)."""


@dataclass
class AlgoConfig:
    """The RL algorithm."""

    estimator: Literal["reinforce_pp", "reinforce_pp_baseline", "grpo", "dr_grpo", "rloo", "gspo"] = \
        "reinforce_pp_baseline"
    """Advantage estimator (the default: each reward less its group's mean, then whitened over the batch)."""
    clip_low: float = 0.2
    """PPO clip below 1 (GSPO: use about 3e-4)."""
    clip_high: float = 0.28
    """PPO clip above 1 (asymmetric clip-higher; GSPO: about 4e-4)."""
    dual_clip: float | None = None
    """Dual-clip bound for negative advantages (e.g. 3.0); off when null."""
    kl_coef: float = 0.1
    """Weight of the KL penalty to the frozen initial policy; 0 = no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_in_reward: bool = False
    """Apply the KL penalty as a per-token reward (REINFORCE++) instead of a loss term."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    max_staleness: int = 4
    """Samples from more than this many policy versions ago are handled by staleness_mode."""
    staleness_mode: Literal["drop", "mask"] = "drop"
    """drop the whole rollout, or mask only its stale tokens."""
    is_level: Literal["token", "seq", "geo"] = "token"
    """Importance-sampling ratio between trainer and engine logprobs: per token, sequence or geometric mean."""
    is_mode: Literal["mask", "clip", "truncate"] = "truncate"
    """mask: drop outside [is_low, is_high]; clip: clamp into it; truncate: cap at is_high."""
    is_low: float = 0.0
    """Lower edge of the importance-sampling band."""
    is_high: float = 2.0
    """Upper edge of the importance-sampling band."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal: they carry no advantage (for group-baseline estimators)."""
    max_extra_groups: int = 0
    """DAPO's dynamic sampling, with filter_zero_variance: per step, up to this many more groups are sampled
    in place of groups whose rewards are all equal, so that the step trains groups_per_step groups that
    carry advantage where it can."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (0: off): an episode that generates more than overlong_limit minus this
    many tokens loses reward linearly, up to overlong_penalty at overlong_limit and beyond."""
    overlong_limit: int = 0
    """The episode's generated tokens (all its turns) at which the overlong penalty is whole (DAPO: the
    maximum response length, e.g. --rollout.max_tokens for a single turn)."""
    overlong_penalty: float = 1.0
    """The overlong penalty at and beyond overlong_limit."""
    mask_truncated: bool = False
    """Episodes cut short (the last reply cut at max_tokens, or a turn or token budget hit) train no token;
    their rewards still count in their group's baseline (DAPO's overlong filtering)."""


@dataclass
class RewardConfig:
    """A reward model that scores every finished training episode, beside the environment's reward."""

    model: str | None = None
    """A sequence-classification model directory (a one-output score head on a causal LM, as public reward
    models are), or tiny:reward; null: the environment's reward alone."""
    weight: float = 1.0
    """The episode's reward gains the reward model's score times this."""
    keep_env: bool = True
    """Keep the environment's reward in the sum (false: the reward model's score alone; the environment's
    reward is still reported, as env/env_reward)."""
    batch_size: int = 16
    """Conversations in one forward of the reward model."""


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, through PEFT): the trainer trains the adapters only and the model's own
    weights stay frozen (no optimizer state, no KL reference copy: the reference is the model with the
    adapters off); the vLLM engines serve the adapters, and a weight sync moves them alone."""

    rank: int = 0
    """Rank r of every adapter; 0 = train the full weights."""
    alpha: float = 16.0
    """Scale: the adapter's product is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' inputs while training."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """The linear layers that get adapters, by name (e.g. q_proj v_proj); all-linear: every linear layer of
    the decoder blocks (not the output head), as PEFT reads it."""


@dataclass
class ActorConfig:
    """The policy trainer group."""

    world_size: int = 1
    """FSDP2 ranks (gloo on CPU, NCCL on GPU)."""
    backend: Literal["fsdp2", "automodel"] = "fsdp2"
    """Sharding: torch fully_shard, or NeMo AutoModel's parallelizer."""
    tensor_parallel: int = 1
    """Ranks that split each weight matrix (AutoModel TP; --actor.backend automodel); they see the same data."""
    context_parallel: int = 1
    """Ranks that split each packed micro-batch along its tokens (AutoModel's block-diagonal CP; --actor.backend
    automodel): each attends to the keys and values of the whole row, sequence by sequence; for long
    sequences. Dense transformers models, text only."""
    expert_parallel: int = 1
    """Ranks over which a MoE model's experts are spread (AutoModel EP; --actor.backend automodel); it folds
    into the other ranks, so it divides world_size, and each rank keeps its own data."""
    freeze_moe_router: bool = False
    """MoE policies: keep the router weights fixed (not optimized, not sent to the engines)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the actor's forwards and backwards (FSDP2 mixed precision). bfloat16 keeps fp32
    master weights and optimizer states, reduces gradients in fp32 and takes the logprobs in fp32 from
    the bf16 logits; checkpoints stay fp32 (the engines get them in --engine.dtype)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """full: keep only each decoder block's inputs and recompute its activations in backward (less
    memory for long sequences, about one more forward of compute); selective: every other block (about
    half the saving for half the recompute; fsdp2 backend). Routing replay covers the recompute."""
    logprob_chunk_tokens: int = 0
    """Compute token logprobs and entropies this many positions at a time (the output head and the
    log-softmax per chunk, recomputed in backward), so a micro-batch's [tokens, vocab] logits never
    exist whole; for large vocabularies, e.g. 1024. 0: all positions at once."""
    colocate: bool = False
    """GPU only: trainer ranks and engines share the GPUs (engine replica i on rank i's GPU), the engines
    sleeping (vLLM sleep mode frees their weights and KV cache) while the trainer steps. Needs
    --train.async_queue_size 0, --train.weight_sync object_store, --engine.tensor_parallel_size 1 and
    --engine.data_parallel_size equal to --actor.world_size."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    offload: Literal["none", "optimizer", "full"] = "none"
    """optimizer: the sharded parameters and gradients stay on the device, AdamW's states and fp32 master
    weights live in host memory (ZeRO-Offload: gradient shards go to the host, AdamW steps on the CPU, the
    updated shards come back). full: the sharded parameters, gradients and AdamW states all live in host
    memory (FSDP2 CPUOffloadPolicy) and each block's parameters visit the device only for its compute."""

    @property
    def data_parallel(self) -> int:
        """Groups of ranks that train on different micro-batches: world_size / (tensor_parallel x context_parallel),
        as AutoModel's device mesh (dp, cp, tp) lays them out, tensor-parallel ranks innermost."""
        return self.world_size // (self.tensor_parallel * self.context_parallel)


@dataclass
class RayConfig:
    """The Ray runtime."""

    address: str | None = None
    """Join this Ray cluster (e.g. auto or ray://host:10001); default: a local Ray."""
    num_cpus: int | None = None
    """CPUs for a local Ray (default: all)."""


@dataclass
class ClusterConfig:
    """The cluster a --dry-run plans for (default: the live Ray cluster of --ray.address, else this machine)."""

    nodes: int | None = None
    """Nodes of the cluster."""
    gpus_per_node: int | None = None
    """GPUs per node (0: a CPU cluster, every process takes one CPU)."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU, in GB (1e9 bytes)."""
    cpu_memory_gb: float | None = None
    """Host memory of one node, in GB."""


@dataclass
class CkptConfig:
    """Checkpoints under RUN_DIR/checkpoints/."""

    every: int = 50
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep: int = 2
    """Checkpoints kept (oldest deleted)."""


@dataclass
class LogConfig:
    """Metrics and plots."""

    tensorboard: bool = True
    """Write TensorBoard events under RUN_DIR/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases: the metrics, the config and a table of sample episodes (needs the wandb package:
    pip install 'molt[wandb]', and a login or WANDB_MODE=offline)."""
    wandb_episodes: int = 4
    """Episodes of each step in the W&B episode table (prompt, reply, reward); 0 = no table."""
    plot_every: int = 0
    """Write the PNG plots every this many steps (0 = only at the end)."""
    verbose: bool = False
    """Show all output on the terminal (third-party warnings, every actor's log); default: RUN_DIR/molt.log."""
    rollouts: bool = False
    """Save every trained episode and every evaluation play to RUN_DIR/rollouts/ as trajectory records
    (gzipped JSON lines, molt-serve --trajectories' schema with the step: molt_train/saved_rollouts.py)."""
    rollouts_every: int = 100
    """Steps per file of saved rollouts."""
    rollouts_groups: int = 0
    """Save at most this many groups of each step (the first to finish), for long runs; 0 = all."""


@dataclass
class EvalConfig:
    """Evaluation on held-out episodes (environment seeds training never draws, molt_env.split), on the rollout
    engines between steps; logged as eval/* and never trained on."""

    every: int = 0
    """Evaluate after every this many steps and after the last one; 0 = not during training (see at_start)."""
    at_start: bool = False
    """Evaluate the initial policy before the first step (logged as step 0)."""
    episodes: int = 64
    """Held-out episodes per evaluation: evaluation seeds 0 .. N-1, the same at every evaluation and in molt-eval."""
    samples: int = 1
    """Samples per episode, the k of pass@k (pass@1 and pass@k by Chen et al.'s unbiased estimator)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation; 0 = greedy."""
    pass_threshold: float = 1.0
    """An episode passes (for pass@k) when its reward is at least this; a failed episode scores 0."""


@dataclass
class Config:
    """A Molt run."""

    env: str = "digit"
    """Environment: a short name, a Gymnasium id (molt/Name-v0), package.module:Class or path/file.py:Class."""
    agent: str | None = None
    """A ChatAgent class (package.module:Class or path/file.py:Class) that plays each episode through the
    loopback with the openai client; default: the env runner plays it."""
    model: str | None = None
    """Model directory (Hugging Face format); default: the built-in tiny chat model."""
    steps: int = 200
    """Optimizer steps to run."""
    out: str | None = None
    """Run directory (default: runs/<env>-<time>)."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint."""
    seed: int = 0
    """Random seed for data order, sampling and initialisation."""
    dry_run: bool = False
    """Print the plan (where every engine and trainer rank goes, memory per GPU and host, tokens per step) from
    the model's config.json and the cluster's shape (--cluster.*), start nothing, and fail naming the flag to
    change when the run does not fit. Also --dry-run."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


LORA_MAX_RANK = 512  # vLLM's largest max_lora_rank


class ConfigError(ValueError):
    pass


def need(ok: bool, flag: str, why: str) -> None:
    """A ConfigError naming `--flag` and why, unless `ok`."""
    if not ok:
        raise ConfigError(f"--{flag}: {why}")


def validate(config: Config) -> None:
    """Reject values and combinations that cannot run, naming the flag."""
    for flag, least in (("steps", 1), ("rollout.group_size", 1), ("rollout.groups_per_step", 1),
                        ("rollout.max_tokens", 1), ("rollout.max_failed_steps", 0), ("train.async_queue_size", 0),
                        ("train.warmup_steps", 0), ("train.sync_bucket_mb", 1), ("train.updates_per_batch", 1),
                        ("actor.world_size", 1), ("algo.max_staleness", 0), ("algo.max_extra_groups", 0),
                        ("ckpt.every", 0), ("log.rollouts_every", 1), ("log.rollouts_groups", 0),
                        ("log.wandb_episodes", 0), ("engine.data_parallel_size", 1),
                        ("engine.tensor_parallel_size", 1), ("eval.episodes", 1), ("reward.batch_size", 1)):
        need(functools.reduce(getattr, flag.split("."), config) >= least, flag, f"must be >= {least}")
    need(not config.log.wandb or importlib.util.find_spec("wandb") is not None, "log.wandb",
         "the wandb package is not installed here (pip install 'molt[wandb]')")
    if config.actor.colocate:
        _validate_colocate(config)
    need(config.engine.max_model_len is None or config.engine.max_model_len >= 1, "engine.max_model_len",
         "must be >= 1")
    need(0 < config.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(config.train.lr > 0, "train.lr", "must be > 0")
    need(0 <= config.train.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    need(config.actor.logprob_chunk_tokens >= 0, "actor.logprob_chunk_tokens", "must be >= 0 (0: no chunks)")
    need(config.actor.activation_checkpointing != "selective" or config.actor.backend == "fsdp2",
         "actor.activation_checkpointing", "selective needs --actor.backend fsdp2 (AutoModel checkpoints all blocks)")
    single_automodel_rank = config.actor.backend == "automodel" and config.actor.world_size == 1
    for flag, value, without_fsdp in (("param_dtype", config.actor.param_dtype, ("float32",)),
                                      ("offload", config.actor.offload, ("none", "optimizer"))):
        need(value in without_fsdp or not single_automodel_rank, f"actor.{flag}",
             f"{value} needs FSDP, which NeMo AutoModel does not apply to a single rank: use "
             "--actor.backend fsdp2 or --actor.world_size >= 2")
    _validate_actor_parallel(config.actor)
    _validate_lora(config)
    need(config.algo.is_low <= config.algo.is_high, "algo.is_low", "must be <= --algo.is_high")
    need(not config.algo.max_extra_groups or config.algo.filter_zero_variance, "algo.max_extra_groups",
         "replaces the groups --algo.filter_zero_variance drops: set it true")
    algo = config.algo
    need(algo.overlong_buffer >= 0, "algo.overlong_buffer", "must be >= 0 (0: no overlong penalty)")
    need(not algo.overlong_buffer or algo.overlong_limit >= algo.overlong_buffer, "algo.overlong_limit",
         f"must be >= --algo.overlong_buffer {algo.overlong_buffer}: the generated tokens of an episode at which "
         "the penalty is whole (DAPO: the maximum response length)")
    need(algo.overlong_penalty >= 0, "algo.overlong_penalty", "must be >= 0 (it is subtracted)")
    need(config.reward.model is not None or config.reward.keep_env, "reward.keep_env",
         "false leaves no reward: give --reward.model")
    evaluation = config.eval
    need(evaluation.every >= 0, "eval.every", "must be >= 0 (0: not during training)")
    need(evaluation.samples >= 1, "eval.samples", "must be >= 1 (the k of pass@k)")
    need(evaluation.temperature >= 0, "eval.temperature", "must be >= 0 (0: greedy)")
    need(evaluation.samples == 1 or evaluation.temperature > 0, "eval.samples",
         f"{evaluation.samples} greedy samples are all the same: set --eval.temperature above 0 for pass@k")
    engine = config.engine
    need(0 < engine.gpu_memory_utilization <= 1, "engine.gpu_memory_utilization", "must be in (0, 1]")
    if engine.name == "hf":
        for flag, value, plain in (("tensor_parallel_size", engine.tensor_parallel_size, 1),
                                   ("expert_parallel", engine.expert_parallel, False),
                                   ("kv_cache_dtype", engine.kv_cache_dtype, "auto")):
            need(value == plain, f"engine.{flag}", f"{value} needs --engine.name vllm (the hf engine is one process "
                 "with a plain cache)")
    need(not engine.expert_parallel or engine.tensor_parallel_size >= 2, "engine.expert_parallel",
         "spreads experts over the engine's ranks: needs --engine.tensor_parallel_size >= 2")
    need(not (config.rollout.group_size == 1 and config.algo.estimator in ("grpo", "dr_grpo", "rloo", "gspo",
                                                                          "reinforce_pp_baseline")),
         "algo.estimator", f"{config.algo.estimator} needs --rollout.group_size >= 2 for its group baseline")
    need(not (config.resume and config.out is None), "resume", "needs --out RUN_DIR of the run to continue")


def _validate_lora(config: Config) -> None:
    lora = config.actor.lora
    need(0 <= lora.rank <= LORA_MAX_RANK, "actor.lora.rank", f"must be in [0, {LORA_MAX_RANK}] (0: full weights; "
         f"{LORA_MAX_RANK} is the most vLLM serves)")
    if not lora.rank:
        return
    need(lora.alpha > 0, "actor.lora.alpha", "must be > 0")
    need(0 <= lora.dropout < 1, "actor.lora.dropout", "must be in [0, 1)")
    need(bool(lora.target_modules), "actor.lora.target_modules", "name at least one module, or all-linear")
    need(config.actor.backend == "fsdp2", "actor.lora.rank",
         "LoRA trains with --actor.backend fsdp2 (AutoModel's own PEFT path is not wired in)")
    need(config.engine.name == "vllm", "actor.lora.rank", "the engines serve the adapters with vLLM's LoRA: "
         "needs --engine.name vllm")


def _validate_actor_parallel(actor: ActorConfig) -> None:
    """The actor's model-parallel sizes against the backend and the world size, laid out as AutoModel's
    device mesh does: world_size = data-parallel x context_parallel x tensor_parallel, and the expert
    ranks fold into all of them (expert_parallel divides world_size)."""
    for flag in ("tensor_parallel", "context_parallel", "expert_parallel"):
        size = getattr(actor, flag)
        need(size >= 1, f"actor.{flag}", "must be >= 1")
        need(size == 1 or actor.backend == "automodel", f"actor.{flag}", f"{size} needs --actor.backend automodel")
    need(actor.world_size % (actor.tensor_parallel * actor.context_parallel) == 0, "actor.tensor_parallel",
         f"{actor.tensor_parallel} x --actor.context_parallel {actor.context_parallel} does not divide "
         f"--actor.world_size {actor.world_size}")
    need(actor.world_size % actor.expert_parallel == 0, "actor.expert_parallel",
         f"{actor.expert_parallel} does not divide --actor.world_size {actor.world_size}")
    need(actor.tensor_parallel == 1 or actor.logprob_chunk_tokens == 0, "actor.logprob_chunk_tokens",
         "the chunked output head does not take a tensor-parallel (vocabulary-sharded) one: use 0 with "
         "--actor.tensor_parallel > 1")


def _validate_colocate(config: Config) -> None:
    """Colocated engines sleep while the trainer steps: nothing may generate then, and the weights cannot
    travel on NCCL between two processes of one GPU (NCCL refuses a duplicate GPU)."""
    flag = "actor.colocate"
    need(config.engine.name == "vllm", flag, "needs --engine.name vllm (its sleep mode frees the GPU)")
    need(config.train.async_queue_size == 0, flag, "engines sleep while the trainer steps: needs "
         "--train.async_queue_size 0")
    need(config.train.weight_sync == "object_store", flag, "NCCL cannot broadcast between two processes on "
         "one GPU: needs --train.weight_sync object_store")
    need(config.engine.tensor_parallel_size == 1, flag, "places one engine rank per trainer GPU: needs "
         "--engine.tensor_parallel_size 1")
    need(config.engine.data_parallel_size == config.actor.world_size, flag,
         f"one engine per trainer GPU: needs --engine.data_parallel_size {config.actor.world_size} "
         "(= --actor.world_size)")
