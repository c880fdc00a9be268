"""molt_env: the task side of Molt.

The Gymnasium `Env` base for text (and chat-message) tasks, the registry that
maps names to environments, and the `Trajectory` record with its validator:
the only thing that crosses from rollout to training. Imports no torch.
"""

from molt_env.env import Env
from molt_env.judge import Judge, JudgeError
from molt_env.registry import make, register, register_family, registered
from molt_env.spaces import Chat, Text, as_messages
from molt_env.trajectory import InvalidTrajectory, Trajectory, check, validate

__all__ = [
    "Chat", "Env", "InvalidTrajectory", "Judge", "JudgeError", "Text", "Trajectory",
    "as_messages", "check", "make", "register", "register_family", "registered", "validate",
]
