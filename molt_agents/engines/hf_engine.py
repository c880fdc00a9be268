"""The transformers fallback engine: batched sampling over a Hugging Face model.

For machines without vLLM, and as a second way to capture mixture-of-experts
routes on CPU (router hooks). Same interface and contract as the vLLM
engine: each step advances every running request by one token in one
left-padded batch. There is no KV cache (each step recomputes the whole
sequence): simple and exact, fine for the small models it serves; use vLLM
for speed.

Expert routes: forward hooks on the model's top-k routers record, for every
position, the experts each MoE layer chose when that position was first
computed. A sample's `routes` is int16 `[prompt + completion, layers, top_k]`;
the last sampled token was never fed back, so its row is -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from molt_agents.engines.base import SamplingParams
from molt_agents.engines.stepped import Progress, SteppedEngine
from molt_agents.hf_model import as_model_input, load_model, router_modules
from molt_agents.multimodal import join_images


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 top_logprobs: int = 0) -> tuple[int, float, dict[int, float] | None]:
    """Sample one token from `logits` [vocab]; its logprob under the processed distribution."""
    logits = logits.float()
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, -1)
        token = int(torch.argmax(logits))
    else:
        logits = logits / params.temperature
        if params.top_k and params.top_k < logits.numel():
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) >= params.top_p  # keep the first token past p
            logits = logits.scatter(0, order[drop], float("-inf"))
        logprobs = torch.log_softmax(logits, -1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    top = None
    if top_logprobs:
        values, ids = torch.topk(logprobs, top_logprobs)
        top = dict(zip(ids.tolist(), values.tolist()))
    return token, float(logprobs[token]), top


def checkpoint_layout(model) -> dict[str, tuple[str, torch.Tensor]]:
    """For every checkpoint tensor that the loaded model stores otherwise (transformers fuses the experts
    of a layer, for one): the model tensor holding it and where, as flat indices shaped like the checkpoint
    tensor. Found by saving a probe: each model tensor filled with its elements' indices goes through
    transformers' own conversion back to the checkpoint's layout."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    probe, starts, start = {}, [], 0
    for name, tensor in state.items():
        probe[name] = torch.arange(start, start + tensor.numel()).view(tensor.shape)
        starts.append((start, name))
        start += tensor.numel()
    layout = {}
    for name, index in revert_weight_conversion(model, probe).items():
        if name in state:
            continue
        first = int(index.min())
        offset, target = max(s for s in starts if s[0] <= first)
        if int(index.max()) >= offset + state[target].numel():
            raise ValueError(f"checkpoint tensor {name!r} spans several tensors of {type(model).__name__}")
        layout[name] = (target, index - offset)
    return layout


@dataclass
class _Request:
    ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    prompt_len: int
    images: dict | None = None  # the processor's image tensors for this prompt's image tokens
    routes: list[np.ndarray] = field(default_factory=list)  # per position: [layers, top_k]


class HFEngine(SteppedEngine):
    def __init__(self, model: str | Path, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 4096,
                 max_batch: int = 32, device: str | None = None, stepping: str | None = None):
        """`stepping`: where the steps run (`SteppedEngine`); default: a thread on GPU, the event loop on CPU."""
        from transformers import AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_model(model, getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))  # for stop strings
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_model_len, self.max_batch, self.seed = max_model_len, max_batch, seed
        self._requests: dict[str, _Request] = {}
        self._layout = None  # checkpoint_layout(model), built when a weight update first needs it
        self._captured: list[torch.Tensor] = []
        self._routers = router_modules(self.model)
        for router in self._routers:
            router.register_forward_hook(lambda module, args, output: self._captured.append(output[-1]))
        super().__init__(stepping=stepping or ("thread" if self.device.type == "cuda" else "loop"))

    def _backend_start(self, request_id, prompt_ids, params: SamplingParams, index, images=None):
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len={self.max_model_len}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        self._requests[request_id] = _Request(list(prompt_ids), params, generator, len(prompt_ids),
                                              images.tensors if images is not None else None)

    def _backend_has_work(self) -> bool:
        return bool(self._requests)

    def _backend_abort(self, request_ids):
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def _backend_reload(self, named_tensors):
        """Weights by the model's own names, or by its checkpoint's (per-expert tensors that transformers
        fuses on load; a trainer other than transformers sends those)."""
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in state:
                    state[name].copy_(tensor)
                    continue
                if self._layout is None:
                    self._layout = checkpoint_layout(self.model)
                if name not in self._layout:
                    raise KeyError(f"weight {name!r} is neither in {type(self.model).__name__} nor in its checkpoint")
                target, index = self._layout[name]
                state[target].view(-1)[index.view(-1)] = tensor.reshape(-1).to(state[target].dtype)

    @torch.no_grad()
    def _backend_step(self) -> list[Progress]:
        batch = list(self._requests.items())[: self.max_batch]
        width = max(len(r.ids) for _, r in batch)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, request) in enumerate(batch):  # left padding: the last column is every row's next position
            input_ids[row, width - len(request.ids):] = torch.tensor(request.ids)
            attention[row, width - len(request.ids):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        images = join_images([r.images for _, r in batch if r.images])  # in row order, as the image tokens are
        extra = {name: as_model_input(torch.from_numpy(value), self.model) for name, value in images.items()}
        self._captured.clear()
        logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                            position_ids=positions.to(self.device), **extra).logits[:, -1]
        layers = [c.reshape(len(batch), width, -1).cpu() for c in self._captured]

        progress = []
        for row, (request_id, request) in enumerate(batch):
            if layers:  # positions seen for the first time in this step
                n = len(request.ids)
                for position in range(len(request.routes), n):
                    column = width - n + position
                    request.routes.append(np.stack([layer[row, column].numpy() for layer in layers]))
            token, logprob, top = sample_token(logits[row], request.params, request.generator,
                                               request.params.top_logprobs)
            request.ids.append(token)
            finish = self._finish_reason(request, token)
            item = Progress(request_id, [token], [logprob], [top] if top is not None else None,
                            finished=finish is not None, finish_reason=finish or "stop")
            if finish is not None:
                del self._requests[request_id]
                item.routes = np.stack(request.routes) if request.routes else None  # padded by `fit_routes`
            progress.append(item)
        return progress

    def _finish_reason(self, request: _Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or token in self.eos_ids:
            return "stop"
        generated = len(request.ids) - request.prompt_len
        if params.stop:
            tail = self.tokenizer.decode(request.ids[request.prompt_len:][-32:], skip_special_tokens=False)
            if any(stop in tail for stop in params.stop):
                return "stop"
        if generated >= params.max_tokens or len(request.ids) >= self.max_model_len:
            return "length"
        return None
