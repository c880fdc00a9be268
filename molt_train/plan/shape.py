"""A model's architecture numbers and parameter counts, from its `config.json` alone.

The plan needs, without weights or torch: how many parameters there are and
which of them are experts (expert parallelism splits those), the largest
decoder block (FSDP2 gathers one block whole at a time), the embeddings and
output head (the root unit), and the sizes that set activation and KV-cache
memory. Decoder families are counted by formula: Llama/Qwen-style attention
(grouped heads, optional q/k norms and biases), DeepSeek's multi-head latent
attention, dense and mixture-of-experts MLPs with shared experts and dense
leading layers. Any other architecture (vision-language models among them)
is built by transformers on the meta device and its parameters are counted
by name; `tests/test_plan.py` checks that both ways agree on every recipe's
model and on the tiny ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# model_type -> attention kind; q/k RMS norms per head for the Qwen3 family, q/k/v biases for Qwen2.
FORMULA_TYPES = {"llama": "gqa", "mistral": "gqa", "qwen2": "gqa", "qwen3": "gqa", "qwen3_moe": "gqa",
                 "mixtral": "gqa", "qwen2_moe": "gqa", "olmoe": "gqa", "deepseek_v3": "mla", "kimi_k2": "mla"}
QK_NORM = {"qwen3", "qwen3_moe", "olmoe"}
QKV_BIAS = {"qwen2", "qwen2_moe"}


@dataclass(frozen=True)
class Shape:
    """What the memory model reads of a model: sizes of the language model, and parameter counts."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # query/key width per head (MLA: nope + rope)
    value_dim: int  # value width per head
    intermediate: int  # dense MLP width
    vocab: int
    tied: bool
    experts: int = 0  # routed experts per MoE layer
    top_k: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    kv_cache_per_token: int = 0  # elements of K and V cached per token and layer (MLA: the latent)
    kv_cache_replicated: bool = False  # MLA's latent is the same on every tensor-parallel rank
    params: int = 0
    expert_params: int = 0  # routed experts' weights (split by expert parallelism)
    block_params: int = 0  # the largest decoder block
    block_expert_params: int = 0  # the routed experts of that block
    root_params: int = 0  # outside the decoder blocks: embeddings, head, final norm
    vision_params: int = 0
    counted_by: str = "formula"


def text_config(config: dict) -> dict:
    """The language model's fields (a vision-language model keeps them in `text_config`)."""
    return {**config, **(config.get("text_config") or {})}


def sizes(config: dict) -> Shape:
    """The model's sizes without its parameter counts, for any architecture and without torch: what the KV
    cache depends on."""
    return Shape(**_sizes(text_config(config)))


def shape(config: dict) -> Shape:
    """The model's shape; by formula for the families above, else by a meta-device build."""
    text = text_config(config)
    sizes = _sizes(text)
    if config.get("model_type") in FORMULA_TYPES and "vision_config" not in config:
        return Shape(**sizes, **_formula_counts(text, sizes))
    if config.get("model_type") in ("qwen2_vl", "qwen2_5_vl"):  # a Qwen2 language model beside a ViT
        counts = _formula_counts({**text, "model_type": "qwen2"}, sizes)
        vision = _qwen_vit(config["vision_config"], config.get("model_type"))
        return Shape(**sizes, **{**counts, "params": counts["params"] + vision, "vision_params": vision,
                                 "root_params": counts["root_params"] + vision})
    return Shape(**sizes, **_meta_counts(config), counted_by="meta")


def expert_count(text: dict) -> int:
    """Routed experts per MoE layer of a language model's config fields; 0 for a dense model."""
    return next((text[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if text.get(key)), 0)


def _sizes(text: dict) -> dict:
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    experts = expert_count(text)
    mla = "kv_lora_rank" in text and text.get("kv_lora_rank")
    if mla:
        head_dim = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        value_dim, kv_heads = text["v_head_dim"], heads
        kv_cache = text["kv_lora_rank"] + text["qk_rope_head_dim"]  # vLLM caches MLA's compressed latent
    else:
        head_dim = text.get("head_dim") or hidden // heads
        value_dim, kv_heads = head_dim, text.get("num_key_value_heads") or heads
        kv_cache = 2 * kv_heads * head_dim
    layers = text["num_hidden_layers"]
    return dict(model_type=text.get("model_type", "?"), hidden=hidden, layers=layers, heads=heads,
                kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                intermediate=text.get("intermediate_size") or 4 * hidden, vocab=text["vocab_size"],
                tied=bool(text.get("tie_word_embeddings", False)), experts=experts,
                top_k=text.get("num_experts_per_tok") or text.get("num_experts_per_token") or 0,
                expert_intermediate=text.get("moe_intermediate_size") or text.get("intermediate_size") or 0,
                moe_layers=sum(_is_moe_layer(text, index) for index in range(layers)) if experts else 0,
                kv_cache_per_token=kv_cache, kv_cache_replicated=bool(mla))


def _is_moe_layer(text: dict, index: int) -> bool:
    if "first_k_dense_replace" in text:  # DeepSeek
        return index >= text["first_k_dense_replace"] and index % text.get("moe_layer_freq", 1) == 0
    if index in (text.get("mlp_only_layers") or []):
        return False
    return (index + 1) % (text.get("decoder_sparse_step") or 1) == 0


# ----------------------------------------------------------------------------- by formula

def _attention(text: dict, sizes: dict) -> int:
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    if text.get("kv_lora_rank"):  # multi-head latent attention
        qk = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        q_rank, kv_rank = text.get("q_lora_rank"), text["kv_lora_rank"]
        q = hidden * q_rank + q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk
        kv = (hidden * (kv_rank + text["qk_rope_head_dim"]) + kv_rank
              + kv_rank * heads * (text["qk_nope_head_dim"] + text["v_head_dim"]))
        return q + kv + heads * text["v_head_dim"] * hidden
    head_dim = sizes["head_dim"]
    q, kv = heads * head_dim, sizes["kv_heads"] * head_dim
    count = hidden * (q + 2 * kv) + q * hidden
    if text.get("model_type") in QKV_BIAS or text.get("attention_bias"):
        count += q + 2 * kv + (hidden if text.get("attention_bias") else 0)
    if text.get("model_type") in QK_NORM:
        count += 2 * head_dim if text.get("model_type") != "olmoe" else q + kv
    return count


def _mlp(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up, down


def _moe(text: dict, experts: int) -> tuple[int, int]:
    """(all parameters, routed experts' parameters) of one MoE layer."""
    hidden = text["hidden_size"]
    routed = experts * _mlp(hidden, text["moe_intermediate_size"] if "moe_intermediate_size" in text
                            else text["intermediate_size"])
    router = hidden * experts  # (DeepSeek's score-correction bias is a buffer, not trained)
    shared = 0
    if text.get("n_shared_experts"):
        shared = _mlp(hidden, text["n_shared_experts"] * text["moe_intermediate_size"])
    if text.get("shared_expert_intermediate_size"):
        shared = _mlp(hidden, text["shared_expert_intermediate_size"]) + hidden  # + its gate
    return routed + router + shared, routed


def _formula_counts(text: dict, sizes: dict) -> dict:
    hidden, vocab, moe_layers = text["hidden_size"], text["vocab_size"], sizes["moe_layers"]
    attention, norms = _attention(text, sizes), 2 * hidden
    dense_block = attention + norms + _mlp(hidden, text["intermediate_size"])
    moe_all, moe_routed = _moe(text, sizes["experts"]) if sizes["experts"] else (0, 0)
    moe_block = attention + norms + moe_all
    root = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2) + hidden
    params = root + (sizes["layers"] - moe_layers) * dense_block + moe_layers * moe_block
    largest_moe = moe_layers and moe_block >= dense_block
    return dict(params=params, expert_params=moe_layers * moe_routed,
                block_params=moe_block if largest_moe else dense_block,
                block_expert_params=moe_routed if largest_moe else 0, root_params=root)


def _qwen_vit(vision: dict, model_type: str) -> int:
    """Qwen2-VL / Qwen2.5-VL's vision transformer: a 3-d patch embedding, blocks, and the patch merger."""
    width = vision.get("hidden_size") if model_type == "qwen2_5_vl" else vision["embed_dim"]
    inner = vision["intermediate_size"] if model_type == "qwen2_5_vl" else int(width * vision["mlp_ratio"])
    patch = vision.get("in_chans", 3) * vision.get("temporal_patch_size", 2) * vision["patch_size"] ** 2 * width
    attention = 3 * width * width + 3 * width + width * width + width
    if model_type == "qwen2_5_vl":  # RMS norms (weight only), gated MLP with biases
        block = 2 * width + attention + 2 * (width * inner + inner) + inner * width + width
        merger_norm = width
    else:  # layer norms (weight and bias), two-layer MLP with biases
        block = 4 * width + attention + width * inner + inner + inner * width + width
        merger_norm = 2 * width
    merged = width * vision.get("spatial_merge_size", 2) ** 2
    out = vision.get("out_hidden_size") or vision.get("hidden_size")
    merger = merger_norm + merged * merged + merged + merged * out + out
    return patch + vision["depth"] * block + merger


# ----------------------------------------------------------------------------- by a meta-device build

BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
VISION = ("visual", "vision", "image_newline", "connector", "multi_modal_projector")


def _meta_counts(config: dict) -> dict:
    """Parameter counts of transformers' own class for `config`, built on the meta device (no memory)."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    auto = (transformers.AutoModelForImageTextToText if "vision_config" in config
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    counts = {"params": 0, "expert_params": 0, "root_params": 0, "vision_params": 0}
    blocks: dict[int, list[int]] = {}
    seen = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        count, expert = parameter.numel(), ".experts." in name or name.endswith(".experts")
        counts["params"] += count
        counts["expert_params"] += count if expert else 0
        if any(part in name for part in VISION):
            counts["vision_params"] += count
            counts["root_params"] += count
            continue
        match = BLOCK.search(name)
        if match:
            totals = blocks.setdefault(int(match.group(1)), [0, 0])
            totals[0] += count
            totals[1] += count if expert else 0
        else:
            counts["root_params"] += count
    largest = max(blocks.values(), default=[0, 0])
    return {**counts, "block_params": largest[0], "block_expert_params": largest[1]}
