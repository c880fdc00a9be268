"""Shared fixtures: the tiny models and the session's vLLM engine.

vLLM keeps process-global parallel state, so one process holds one engine at
a time: `vllm_engines.get(model_dir)` returns the live engine for that model,
closing the previous one when a test asks for a different model. Tests of one
model therefore share one engine (about 2 s to start, plus the import).
"""

import asyncio
import os

import pytest

# Keep the 2-core test machine responsive: one thread per process unless asked otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def dense_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("dense")


@pytest.fixture(scope="session")
def moe_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("moe")


class OneEngineAtATime:
    def __init__(self):
        self.model_dir, self.engine = None, None

    def get(self, model_dir, **kwargs):
        from molt_agents.engines import make_engine

        if self.model_dir != (model_dir, kwargs):
            self.close()
            self.engine = make_engine("vllm", model_dir, **kwargs)
            self.model_dir = (model_dir, kwargs)
        return self.engine

    def close(self):
        if self.engine is not None:
            self.engine.close()
        self.model_dir, self.engine = None, None


@pytest.fixture(scope="session")
def vllm_engines():
    engines = OneEngineAtATime()
    yield engines
    engines.close()


@pytest.fixture
def vllm_dense(vllm_engines, dense_dir):
    return vllm_engines.get(dense_dir)


@pytest.fixture
def vllm_moe(vllm_engines, moe_dir):
    return vllm_engines.get(moe_dir)


def run(coroutine):
    """Run a coroutine to completion from a sync test."""
    return asyncio.run(coroutine)
