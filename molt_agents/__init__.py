"""molt_agents: the rollout side of Molt.

Engines (vLLM, transformers fallback) that generate from token ids, the
loopback server that captures what any OpenAI-client agent samples, the env
runner, `ChatAgent`, and the tiny offline models the tests and default run use.
"""

import molt_env  # noqa: F401,E402  (the base package; also quiets known library noise)
