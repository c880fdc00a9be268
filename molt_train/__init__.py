"""molt_train: the bundled trainer.

The config tree and `molt-train`, the Ray runtime and the one asynchronous
loop, the policy actor (FSDP2, NeMo AutoModel), algorithms as pure functions,
weight sync to the engines, checkpoints and metrics.
"""

import molt_agents  # noqa: F401  (quiets known library noise, see there)
