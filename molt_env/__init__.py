"""molt_env: the task side of Molt.

The Gymnasium `Env` base for text (and chat-message) tasks, the registry that
maps names to environments, and the `Trajectory` record with its validator:
the only thing that crosses from rollout to training. Imports no torch.
"""

import logging

# torchao (a NeMo AutoModel dependency) ships kernels built for CUDA torch; on
# the CPU wheel each import logs one load failure per kernel, and torch warns
# about its enum registrations. Neither matters to Molt; keep real errors.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

from molt_env.env import Env  # noqa: E402
from molt_env.registry import make, register, register_family, registered  # noqa: E402
from molt_env.spaces import Chat, Text, as_messages  # noqa: E402
from molt_env.trajectory import InvalidTrajectory, Trajectory, check, validate  # noqa: E402

__all__ = [
    "Chat", "Env", "InvalidTrajectory", "Text", "Trajectory",
    "as_messages", "check", "make", "register", "register_family", "registered", "validate",
]
