"""One rank of the policy trainer: a sharded model and its optimizer.

The model is the transformers class, or with the AutoModel backend NeMo
AutoModel's own class for the MoE architectures it implements; either way
its weights leave (for the engines, for checkpoints) as Hugging Face tensors.

Every rank of the group runs the same calls on its own share of the
micro-batches. `step` recomputes the logprobs without gradients (the proximal
policy's, and the reference model's: the run's initial model, anchor of the
KL penalty), measures them against the engine's, then `train`s (one or more
optimizer steps, gradient accumulation over micro-batches, token-level loss
normalisation over the whole step, gradient clipping). It returns the rank's
`StepStats`, which declare how the group combines them. Every rank takes part
in gathering full tensors for the weight sync and checkpoints; rank 0 sends
them to the engines (in the engines' dtype) and writes the files. With
several ranks only rank 0 reads the checkpoint at start; the others receive
their shards from it (`_load`, `_shard`).
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy
import torch

from molt_agents.hf_model import as_model_input, load_model
from molt_train.actor import automodel, fsdp, lora
from molt_train.actor.routing_replay import RoutingReplay, freeze_routers, moe_routers
from molt_train.algorithms.losses import entropy_from_logits, nll
from molt_train.algorithms.objective import Objective, objective
from molt_train.algorithms.off_policy import mismatch
from molt_train.config import ActorConfig, Config
from molt_train.packing import MicroBatch
from molt_train.weight_sync import Channel, plan_buckets, sync_dtype, sync_metas, tensor_meta


class Prepared(NamedTuple):
    """A micro-batch's token logprobs under the weights before the step, and under the reference model
    (None without a KL term)."""

    old: torch.Tensor
    ref: torch.Tensor | None


def _reduced(how: str, default=0):
    return field(default=default, metadata={"reduce": how})


@dataclass
class StepStats:
    """What one rank measured in one step, mostly as sums over its tokens (the loop turns them into
    per-token values). Each field declares how `reduce` combines the ranks': `sum`, `max`, or `same`
    (every rank holds the same value). None means not measured (no such token, or the term is off)."""

    tokens: int = _reduced("sum")  # trainable tokens
    loss_sum: float = _reduced("sum", 0.0)
    clipped_tokens: float = _reduced("sum", 0.0)  # tokens whose ratio the PPO / GSPO clip cut
    kept_tokens: int = _reduced("sum")  # tokens the importance-sampling correction kept
    entropy_sum: float | None = _reduced("sum", None)  # measured only with an entropy bonus
    kl_sum: float | None = _reduced("sum", None)  # KL to the reference model; only with one
    # Clipping computes the global norm on every rank. Mean over the batch's optimizer steps.
    grad_norm: float = _reduced("same", 0.0)
    # Trainer vs engine on tokens sampled by the weights the trainer holds: a gap here is the engine's.
    mismatch_tokens: int = _reduced("sum")
    mismatch_kl_sum: float = _reduced("sum", 0.0)
    mismatch_max_abs: float | None = _reduced("max", None)
    # Trainer vs engine on tokens sampled by older weights: how far the policy moved since.
    offpolicy_tokens: int = _reduced("sum")
    offpolicy_kl_sum: float = _reduced("sum", 0.0)
    routing_hits: int = _reduced("sum")  # MoE: tokens x layers where the trainer's top-k equals the engine's
    routing_compared: int = _reduced("sum")
    # Seconds of the rank's step (the slowest rank's): the separate old-logprob forwards (0 when the training
    # forward gives them), forwards and backwards, gradient clipping and optimizer steps, and the whole call.
    seconds_logprobs: float = _reduced("max", 0.0)
    seconds_forward_backward: float = _reduced("max", 0.0)
    seconds_optimizer: float = _reduced("max", 0.0)
    seconds_step: float = _reduced("max", 0.0)
    seconds_pack: float = _reduced("max", 0.0)  # packing the micro-batches, on the driver (the trainer group's)

    @classmethod
    def reduce(cls, ranks: list[StepStats]) -> StepStats:
        """The group's statistics from its ranks'; a rank's None (nothing measured) is left out."""
        values = {}
        for f in fields(cls):
            measured = [getattr(stats, f.name) for stats in ranks if getattr(stats, f.name) is not None]
            how = f.metadata["reduce"]
            if not measured:
                values[f.name] = None
            elif how == "sum":
                values[f.name] = sum(measured)
            elif how == "max":
                values[f.name] = max(measured)
            elif how == "same":
                if any(not math.isclose(value, measured[0], rel_tol=1e-6) for value in measured):
                    raise ValueError(f"{f.name} differs between the trainer ranks: {measured}")
                values[f.name] = measured[0]
            else:
                raise ValueError(f"{f.name}: unknown reduction {how!r}")
        return cls(**values)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """The learning rate's multiplier at optimizer step `step` (from 0): linear warmup, then constant,
    or a linear or cosine decay that reaches `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(total_steps - warmup_steps, 1))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def token_logprobs(model, mb: MicroBatch, with_entropy: bool = False, chunk_tokens: int = 0,
                   shard: automodel.SequenceShard | None = None, vocab_parallel: bool = False):
    """Logprob of every trained token given the ones before it in its sequence ([N]; 0 where `mb.mask` is 0
    and at sequence starts), and with `with_entropy` the entropy of each of those predictions; in fp32
    whatever the model computes in.

    The model's output head returns these per-token values instead of logits, for the positions that
    predict a trained token only (a prompt's, an environment turn's and the padding's never reach the
    head), and with `chunk_tokens` that many positions at a time, recomputing each chunk in backward
    (`actor.logprob_chunk_tokens`): the [N, vocab] logits never exist whole. A micro-batch with prefix
    trees (`mb.branch`) attends through their mask (`tree_mask`), each token predicted from its
    `mb.predecessor`. With a context-parallel `shard` (run inside its `attend`), the model sees this rank's
    piece of the row, the head maps all its positions, and the values of every rank's piece are gathered
    whole. A head that cannot be replaced (sharded on the vocabulary: `vocab_parallel`; soft-capped logits)
    returns the logits of every position."""
    softcapped = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    per_token = chunk_tokens > 0 or not (vocab_parallel or softcapped)
    predecessor = mb.predecessor if mb.predecessor is not None else _predecessors(mb.position_ids)
    tokens = torch.nonzero((mb.mask > 0) & (predecessor >= 0))[:, 0]  # the trained tokens
    if shard:  # this rank's piece of the row: every position, predicting the token after it
        input_ids, position_ids, targets = shard.input_ids, shard.position_ids, shard.targets
        sources = slice(len(targets))
    else:  # the positions that predict the trained tokens, and what they predict
        input_ids, position_ids = mb.input_ids, mb.position_ids
        sources, targets = predecessor[tokens], mb.input_ids[tokens]
    head = _per_token_head(model, targets, sources, chunk_tokens, with_entropy) if per_token else nullcontext()
    with head:
        if automodel.is_native(model):
            out = automodel.native_logits(model, input_ids, position_ids)
        else:
            images = {name: as_model_input(tensor, model) for name, tensor in (mb.images or {}).items()}
            rows = 1 if images or shard else mb.rows  # the packed grid, else one row
            masks = {} if mb.branch is None else {"attention_mask": tree_mask(
                mb.position_ids.view(rows, -1), mb.branch.view(rows, -1), model)}
            out = model(input_ids=input_ids.view(rows, -1), position_ids=position_ids.view(rows, -1),
                        use_cache=False, **masks, **images).logits
    out = _full_tensor(out)  # tensor parallel: the logits come sharded on the vocabulary
    columns = out[0] if per_token else _per_token(out.flatten(0, -2)[sources], targets, with_entropy)
    if shard:  # every rank's piece, whole: position p predicts token p + 1
        columns = automodel.gather_sequence(columns, shard)[tokens - 1]
    values = columns.new_zeros(len(mb.input_ids), columns.shape[1]).index_copy(0, tokens, columns)
    return values[:, 0], values[:, 1] if with_entropy else None


def _predecessors(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's predecessor in packed sequences whose positions restart at 0: the token before, -1 at a start."""
    index = torch.arange(len(position_ids)) - 1
    return torch.where(position_ids == 0, -1, index)


def tree_mask(position_ids: torch.Tensor, branch: torch.Tensor, model) -> torch.Tensor:
    """[rows, 1, W, W] attention mask of packed rows with prefix trees (`position_ids`, `branch` [rows, W]):
    a token sees the tokens before it in its block (from a position 0 to the next) that are on its branch
    or on none (0). Boolean for SDPA; 0 / the dtype's minimum for eager attention."""
    block = torch.cumsum(position_ids == 0, -1)
    width = position_ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    seen = ((block[:, :, None] == block[:, None, :]) & causal
            & ((branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])))[:, None]
    if model.config._attn_implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    return seen


def _per_token(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> torch.Tensor:
    """[positions, 1 or 2]: the target's fp32 logprob at each position of `logits` [positions, vocab], and
    the entropy."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[:, None])
    return torch.cat([logprobs, entropy_from_logits(logits)[:, None]], -1) if with_entropy else logprobs


@contextmanager
def _per_token_head(model, targets: torch.Tensor, selected: torch.Tensor | slice, chunk_tokens: int,
                    with_entropy: bool):
    """Within the model's own forward (so FSDP has gathered the head's weight), its output head maps the
    hidden states [rows, positions, hidden] of the `selected` positions (`targets` [selected]: what each
    predicts) to `_per_token` values [1, selected, 1 or 2], all at once or `chunk_tokens` at a time."""
    from torch.utils.checkpoint import checkpoint

    if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
        raise ValueError(f"--actor.logprob_chunk_tokens: {type(model).__name__} soft-caps its logits after the "
                         "output head, which the chunked head does not; use 0")
    head = model.get_output_embeddings()

    def chunk(hidden, chunk_targets):
        return _per_token(torch.nn.functional.linear(hidden, head.weight, head.bias), chunk_targets, with_entropy)

    def forward(hidden):  # a new tensor, not a view: FSDP hooks its backward on the root's output
        hidden = hidden.flatten(0, -2)[selected]  # the rows of the packed grid, end to end
        if not chunk_tokens:
            return torch.cat([chunk(hidden, targets)[None]], dim=1)
        return torch.cat([checkpoint(chunk, hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens],
                                     use_reentrant=False)[None]
                          for start in range(0, len(hidden), chunk_tokens)], dim=1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


class PolicyRank:
    def __init__(self, model_dir: str, start_dir: str, rank: int, world_size: int, init_method: str,
                 config: Config, sft: bool = False):
        """Rank `rank` of `world_size` (meeting at `init_method`) of the run `config` (its `train`, `algo`,
        `actor`, `steps`, `seed` and `engine.dtype`). The policy starts from the weights in `start_dir` (the
        run's model, or a checkpoint's policy when resuming); the reference model of the KL penalty is always
        the run's model in `model_dir`. The weight sync sends floating-point weights in the engines' dtype.
        `sft`: the loss is the trained tokens' negative log-likelihood (`molt-sft`), not `algo`'s objective."""
        began = time.perf_counter()
        train, algo, actor = config.train, config.algo, config.actor
        torch.manual_seed(config.seed)
        self.rank, self.world_size, self.data_parallel = rank, world_size, actor.data_parallel
        self.engine_dtype = getattr(torch, config.engine.dtype)
        self.context_parallel = actor.context_parallel
        self.vocab_parallel = actor.tensor_parallel > 1  # the output head is sharded on the vocabulary
        self.train_config, self.algo, self.sft = train, algo, sft
        self.chunk_tokens = actor.logprob_chunk_tokens
        self.device = fsdp.init_process_group(rank, world_size, init_method)
        # LoRA: the model's weights are the run's model's; a resumed run's adapters are in `start_dir`.
        self.lora, self.seed = (actor.lora if actor.lora.rank else None), config.seed
        self.adapters = start_dir if self.lora and start_dir != model_dir else None
        base_dir = model_dir if self.lora else start_dir
        model = self._adapt(self._load(base_dir, actor.backend))
        if actor.freeze_moe_router:
            freeze_routers(model)
        # Routers of a MoE policy are hooked: to replay the engine's experts, and to measure agreement.
        self.routing = RoutingReplay(model, train.routing_replay) if moe_routers(model) else None
        origin = "NeMo AutoModel's own" if automodel.is_native(model) else "transformers'"
        name = f"{type(model.get_base_model()).__name__} with rank-{self.lora.rank} LoRA adapters" if self.lora \
            else type(model).__name__
        self.description = f"{origin} {name} on {world_size} {actor.backend} rank(s)"
        self.frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        self.stochastic = stochastic(model)
        self.mesh = (automodel.device_mesh(actor.tensor_parallel, actor.context_parallel, actor.expert_parallel)
                     if actor.backend == "automodel" else None)
        self.model = self._shard(model, base_dir, actor)
        self.reference = None  # under LoRA the reference is the model with its adapters off
        if algo.kl_coef > 0 and not self.lora:  # forwards only: nothing to recompute
            self.reference = self._shard(self._load(model_dir, actor.backend), model_dir,
                                         replace(actor, activation_checkpointing="none"))
            self.reference.requires_grad_(False)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # torch picks the per-tensor loop for FSDP2's DTensor parameters; the fused step is one kernel per
        # tensor and holds no temporaries (the multi-tensor one holds a copy of the second moments: +2.2 GiB on a
        # 0.6B model, and 8x slower on CPU: bench/real_size.py)
        if actor.offload == "optimizer":
            # Imported here: it imports torch.distributed.tensor (0.5 s), which the driver, importing this module
            # for the class, need not wait for.
            from molt_train.actor.host_adamw import HostAdamW

            self.optimizer = HostAdamW(trainable, lr=train.lr, weight_decay=train.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(trainable, lr=train.lr, weight_decay=train.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(
            lr_factor, warmup_steps=train.warmup_steps, total_steps=config.steps * train.updates_per_batch,
            schedule=train.lr_schedule, min_ratio=train.min_lr_ratio))
        self._init_seconds = time.perf_counter() - began

    def describe(self) -> str:
        """Which model class trains, and how it is sharded."""
        return self.description

    def init_seconds(self) -> float:
        """How long this rank's constructor took (the models' load and sharding): `time/startup/trainer_init`."""
        return self._init_seconds

    @contextmanager
    def _passes(self, mb: MicroBatch, shard: automodel.SequenceShard | None, measure: bool = False):
        """The context of this micro-batch's forwards and backwards (checkpointed blocks recompute their
        forward there): replay (and measure) the engine's expert routes; attend across the
        context-parallel ranks of `shard`."""
        with (self.routing.use(mb.routes, measure) if self.routing is not None else nullcontext()), \
                (shard.attend() if shard else nullcontext()):
            yield

    def _split(self, mb: MicroBatch) -> automodel.SequenceShard | None:
        """With context parallel, this rank's piece of the micro-batch's packed row; else None."""
        if self.context_parallel == 1:
            return None
        if mb.images:
            raise ValueError("--actor.context_parallel: does not split image inputs over its ranks; use 1")
        return automodel.split_sequence(self.mesh.device_mesh["cp"], mb.input_ids, mb.position_ids)

    def _load(self, model_dir, backend):
        """The transformers model; with the AutoModel backend, AutoModel's own class for MoE models it has; in
        fp32, the master weights. With several ranks no rank reads the weights here: the model is built with
        its parameters on the meta device, and `_shard` gives it rank 0's."""
        native = backend == "automodel" and automodel.native_class(model_dir) is not None
        if self.world_size == 1:
            return automodel.load_native(model_dir, torch.float32) if native else load_model(model_dir, torch.float32)
        build = automodel.build_native if native else fsdp.build_model
        with fsdp.parameters_on_meta():
            return build(model_dir, torch.float32)

    def _adapt(self, model):
        """Under LoRA, `model` with the run's adapters (a resumed run's from its checkpoint; with several ranks
        only rank 0's unsharded copy reads them, see `_checkpoint_state`); else `model`."""
        if not self.lora:
            return model
        model = lora.with_adapters(model, self.lora, self.seed)
        if self.adapters and self.world_size == 1:
            lora.load_adapters(model, self.adapters)
        return model

    def _shard(self, model, model_dir, actor: ActorConfig):
        """Shard with the actor's backend, in its compute dtype, checkpointing and offload. A model built on the
        meta device (several ranks) then takes the weights in `model_dir`: rank 0 alone reads them, in the dtype
        the checkpoint stores, and every rank receives its shards from it."""
        dtype, offload = getattr(torch, actor.param_dtype), actor.offload == "full"
        checkpoint_every = {"none": 0, "full": 1, "selective": 2}[actor.activation_checkpointing]
        if actor.backend == "automodel":  # selective is refused there by `validate`
            model = automodel.shard_model(model, self.mesh, param_dtype=dtype,
                                          activation_checkpointing=checkpoint_every == 1, offload=offload)
        else:
            model = fsdp.shard_model(model, param_dtype=dtype, checkpoint_every=checkpoint_every, offload=offload)
        if self.world_size > 1:
            state = self._checkpoint_state(model, model_dir) if self.rank == 0 else {}
            fsdp.fill_from_rank0(model, state, torch.device("cpu") if offload else self.device)
        return model

    def _checkpoint_state(self, model, model_dir) -> dict[str, torch.Tensor]:
        """The full state dict of `model` from the checkpoint in `model_dir`, in the dtype the checkpoint stores
        (under LoRA, with the run's adapters)."""
        dtype = fsdp.checkpoint_dtype(model_dir)
        if automodel.is_native(model):
            return automodel.native_state(model, model_dir, dtype)
        unsharded = load_model(model_dir, dtype)
        if self.lora:  # (no reference model is sharded under LoRA)
            unsharded = lora.with_adapters(unsharded, self.lora, self.seed)
            if self.adapters:
                lora.load_adapters(unsharded, self.adapters)
        return unsharded.state_dict()

    # ------------------------------------------------------------------

    def step(self, micro_batches: list[MicroBatch], step_tokens: int, updates: int = 1) -> StepStats:
        """One batch: the logprobs of the weights before the step, measured against the engine's; train.

        With one update and a deterministic forward (no dropout, no router noise) those logprobs are the
        training forward's own, detached: no separate forward computes them."""
        started = time.perf_counter()
        prepared = self.logprobs(micro_batches) if updates > 1 or self.stochastic else None
        recomputed = time.perf_counter() - started
        stats, old = self.train(micro_batches, prepared, step_tokens, updates)
        self.trained_old = [o[mb.mask.to(o.device).bool()].float().cpu() for o, mb in zip(old, micro_batches)]
        trainer = torch.cat(old)
        engine = torch.cat([mb.engine_logprobs for mb in micro_batches])
        trained = torch.cat([mb.mask for mb in micro_batches]).bool()
        fresh = trained & (torch.cat([mb.ages for mb in micro_batches]) == 0)
        stale = trained & ~fresh
        mismatch_kl_sum, mismatch_max_abs = mismatch(trainer, engine, fresh)
        offpolicy_kl_sum, _ = mismatch(trainer, engine, stale)
        hits, compared = self.routing.take_agreement() if self.routing is not None else (0, 0)
        return replace(stats, mismatch_tokens=int(fresh.sum()), mismatch_kl_sum=mismatch_kl_sum,
                       mismatch_max_abs=mismatch_max_abs, offpolicy_tokens=int(stale.sum()),
                       offpolicy_kl_sum=offpolicy_kl_sum, routing_hits=hits, routing_compared=compared,
                       seconds_logprobs=recomputed, seconds_step=time.perf_counter() - started)

    def trained_logprobs(self) -> list[torch.Tensor]:
        """The last step's logprobs under the weights before it, of each micro-batch's trained tokens in order."""
        return self.trained_old

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[Prepared]:
        """Per micro-batch: the current policy's and the reference's token logprobs."""
        self.model.eval()
        out = []
        for mb in micro_batches:
            shard = self._split(mb)
            with self._passes(mb, shard, measure=True):
                current, _ = token_logprobs(self.model, mb, chunk_tokens=self.chunk_tokens, shard=shard,
                                            vocab_parallel=self.vocab_parallel)
            out.append(Prepared(current, self._reference_logprobs(mb, shard)))
        return out

    @torch.no_grad()
    def nll(self, micro_batches: list[MicroBatch]) -> tuple[float, int]:
        """The trained tokens' negative log-likelihood under the current weights, summed, and their count
        (a held-out loss)."""
        prepared = self.logprobs(micro_batches)
        return (sum(float(nll(p.old, mb.mask)) for p, mb in zip(prepared, micro_batches)),
                sum(int(mb.mask.sum()) for mb in micro_batches))

    @torch.no_grad()
    def _reference_logprobs(self, mb: MicroBatch, shard: automodel.SequenceShard | None) -> torch.Tensor | None:
        if self.algo.kl_coef <= 0:
            return None
        reference = self.model if self.lora else self.reference
        with self.model.disable_adapter() if self.lora else nullcontext(), shard.attend() if shard else nullcontext():
            return token_logprobs(reference, mb, chunk_tokens=self.chunk_tokens, shard=shard,
                                  vocab_parallel=self.vocab_parallel)[0]

    def train(self, micro_batches: list[MicroBatch], prepared: list[Prepared] | None, step_tokens: int,
              updates: int = 1) -> tuple[StepStats, list[torch.Tensor]]:
        """`updates` optimizer steps over the micro-batches (split evenly), from the `prepared` logprobs, or
        (one update) the training forward's own; the statistics, and the old logprobs of each micro-batch."""
        algo, started = self.algo, time.perf_counter()
        self.model.train()
        stats = StepStats(tokens=int(sum(mb.mask.sum() for mb in micro_batches)),
                          entropy_sum=0.0 if algo.entropy_coef > 0 else None,
                          kl_sum=0.0 if self.algo.kl_coef > 0 else None)
        olds = [p.old for p in prepared] if prepared is not None else []
        # Token-level aggregation over the optimizer step; FSDP averages over the data- and context-parallel
        # ranks, so scale back up (tensor-parallel ranks hold the same micro-batches; context-parallel ones
        # each compute the whole loss and send back their piece's gradient, see `automodel.gather_sequence`).
        scale = self.data_parallel * self.context_parallel * updates / max(step_tokens, 1)
        for update in range(updates):
            for index in range(update, len(micro_batches), updates):
                mb = micro_batches[index]
                shard = self._split(mb)
                with self._passes(mb, shard, measure=prepared is None):
                    logprobs, entropy = token_logprobs(self.model, mb, algo.entropy_coef > 0, self.chunk_tokens,
                                                       shard, self.vocab_parallel)
                if prepared is None:
                    p = Prepared(logprobs.detach(), self._reference_logprobs(mb, shard))
                    olds.append(p.old)
                else:
                    p = prepared[index]
                terms = (Objective(nll(logprobs, mb.mask), 0.0, int(mb.mask.sum()), None, None) if self.sft else
                         objective(algo, logprobs, p.old, p.ref, mb.engine_logprobs, mb.advantages, mb.mask,
                                   mb.sequence, entropy))
                with self._passes(mb, shard):
                    (terms.loss * scale).backward()
                stats.loss_sum += float(terms.loss.detach())
                stats.clipped_tokens += terms.clipped_frac * terms.kept_tokens
                stats.kept_tokens += terms.kept_tokens
                if terms.kl_sum is not None:
                    stats.kl_sum += terms.kl_sum
                if terms.entropy_sum is not None:
                    stats.entropy_sum += terms.entropy_sum
            stepping = time.perf_counter()
            norm = (automodel.clip_gradients(self.model, self.mesh, self.train_config.grad_clip) if self.mesh
                    else torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_config.grad_clip))
            stats.grad_norm += float(_full_tensor(norm)) / updates
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            stats.seconds_optimizer += time.perf_counter() - stepping
        stats.seconds_forward_backward = time.perf_counter() - started - stats.seconds_optimizer
        return stats, olds

    # ------------------------------------------------------------------

    def full_weights(self, for_sync: bool = False) -> dict[str, torch.Tensor] | None:
        """The unsharded weights, on rank 0 (a collective: every rank calls it), as the model holds them (fp32
        for checkpoints); for the weight sync without the frozen ones and in the engines' dtype."""
        state = fsdp.full_state_dict(self.model, frozen=not for_sync)
        if self.rank != 0:
            return None
        weights = {}
        for key, value in state.items():
            if for_sync and (key in self.frozen or key in self.tied_copies):
                continue
            for name, tensor in self._engine_tensors(key, value):
                dtype = sync_dtype(tensor.dtype, self.engine_dtype) if for_sync else tensor.dtype
                weights[name] = tensor.detach().to("cpu", dtype, copy=True)
        return weights

    def _engine_tensors(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One of the model's tensors as the engines name it: Hugging Face tensors, or an adapter's in PEFT's files."""
        if self.lora:
            return [(lora.file_key(key), tensor)]
        return automodel.hf_tensors(self.model, key, tensor)

    @property
    def tied_copies(self) -> set[str]:
        """The state-dict names of a parameter an earlier name holds too (a tied output layer): the engines tie
        it themselves, so it travels once."""
        seen, copies = set(), set()
        for key, value in self.model.state_dict(keep_vars=True).items():
            if id(value) in seen:
                copies.add(key)
            seen.add(id(value))
        return copies

    def weight_meta(self):
        """Name, full shape and dtype (the engines', for floating-point ones) of every weight the engines load,
        in sync order (frozen ones never change, so they never travel). Remembers which of the model's tensors
        holds each."""
        metas, self.sources = [], {}
        for key, value in self.model.state_dict().items():
            if key in self.frozen or key in self.tied_copies:
                continue
            meta_tensor = torch.empty(value.shape, dtype=value.dtype, device="meta")
            for name, meta in self._engine_tensors(key, meta_tensor):
                metas.append((name, meta))
                self.sources[name] = key
        return sync_metas(tensor_meta(metas), self.engine_dtype)

    def open_channel(self, host: str, port: int, size: int, bucket_bytes: int) -> None:
        """Rank 0 joins the broadcast channel to the workers; every rank learns the bucket plan."""
        self.buckets = plan_buckets(self.weight_meta(), bucket_bytes)
        self.channel = Channel(host, port, 0, size, self.device) if self.rank == 0 else None

    def broadcast_weights(self) -> int:
        """Gather the full tensors bucket by bucket (a collective) and broadcast each bucket from rank 0 (the
        channel casts them to the plan's dtypes); the bytes rank 0 sent."""
        state, sent = self.model.state_dict(), 0
        for bucket in self.buckets:
            full = {}
            for key in dict.fromkeys(self.sources[meta.name] for meta, _ in bucket.entries):
                full.update(self._engine_tensors(key, _full_tensor(state[key])))
            if self.channel is not None:
                sent += self.channel.send(bucket, full)
        return sent

    def save(self, directory: str) -> None:
        """Policy in Hugging Face format (under LoRA its adapters, in PEFT's format), optimizer and scheduler
        state (rank 0 writes), and every rank's random generator states."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        directory = Path(directory)
        weights = fsdp.full_state_dict(self.model, frozen=False) if self.lora else self.full_weights()
        optimizer = get_optimizer_state_dict(self.model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            if self.lora:
                self.model.save_pretrained(directory / "adapter", state_dict=weights, save_embedding_layers=False)
            elif automodel.is_native(self.model):
                from huggingface_hub import save_torch_state_dict

                (directory / "policy").mkdir(parents=True, exist_ok=True)
                save_torch_state_dict(weights, directory / "policy")
                self.model.config.save_pretrained(directory / "policy")
            else:
                self.model.save_pretrained(directory / "policy", state_dict=weights)
            torch.save({"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}, directory / "optimizer.pt")
        torch.distributed.barrier()  # the directory exists now
        torch.save(rng_state(), directory / f"rng_rank{self.rank}.pt")
        torch.distributed.barrier()

    def restore(self, directory: str) -> None:
        """Optimizer, scheduler and random generator states from a checkpoint (the weights are loaded at start)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = torch.load(Path(directory) / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        rng = Path(directory) / f"rng_rank{self.rank}.pt"
        if rng.exists():  # absent when the world size changed since the checkpoint: keep the fresh seed
            set_rng_state(torch.load(rng, weights_only=False))

    def close(self) -> None:
        fsdp.destroy_process_group()


def stochastic(model: torch.nn.Module) -> bool:
    """Whether the model's training forward draws random numbers: dropout (a module, or a config rate such as
    `attention_dropout`) or router jitter noise above 0."""
    config = model.config.get_text_config()
    rates = [value for key, value in vars(config).items()
             if isinstance(value, (int, float)) and ("dropout" in key or "pdrop" in key or "jitter" in key)]
    return any(rate > 0 for rate in rates) or any(
        isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules())


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def rng_state() -> dict:
    """Every random generator a training step may draw from (dropout, a user's sampling in the loss)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
