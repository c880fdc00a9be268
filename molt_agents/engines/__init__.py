"""Rollout engines: one async interface (`Engine`), backends selected by name."""

from molt_agents.engines.base import Engine, Sample, SamplingParams

__all__ = ["Engine", "Sample", "SamplingParams", "make_engine"]


def make_engine(name: str, model, **kwargs) -> Engine:
    """Build the engine `name` ("vllm") over the model directory `model`."""
    if name == "vllm":
        from molt_agents.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model, **kwargs)
    raise ValueError(f"unknown engine {name!r}; available: vllm")
