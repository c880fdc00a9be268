"""molt_agents: the rollout side of Molt.

Engines (vLLM, transformers fallback) that generate from token ids, the
loopback server that captures what any OpenAI-client agent samples, the env
runner, `ChatAgent`, and the tiny offline models the tests and default run use.
"""

import logging

# torchao (a NeMo AutoModel dependency) ships kernels built for CUDA torch; on
# the CPU wheel each import logs one load failure per kernel, and torch warns
# about its enum registrations. Neither matters to Molt; keep real errors.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
