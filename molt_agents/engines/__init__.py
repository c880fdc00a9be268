"""Rollout engines: one async interface (`Engine`), backends selected by name."""

from molt_agents.engines.base import Engine, Sample, SamplingParams

__all__ = ["Engine", "Sample", "SamplingParams", "make_engine"]


ENGINES = ("vllm", "hf")


def make_engine(name: str, model, **kwargs) -> Engine:
    """Build the engine `name` over the model directory `model`.

    "vllm": vLLM in process (the rollout engine). "hf": the transformers
    fallback (no vLLM needed; captures MoE expert routes on CPU).
    """
    if name == "vllm":
        from molt_agents.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model, **kwargs)
    if name == "hf":
        from molt_agents.engines.hf_engine import HFEngine

        return HFEngine(model, **kwargs)
    raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}")
