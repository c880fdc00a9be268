"""The OpenAI-compatible loopback server and its per-rollout sessions."""

from molt_agents.loopback.protocol import APIError
from molt_agents.loopback.server import Loopback
from molt_agents.loopback.session import Session

__all__ = ["APIError", "Loopback", "Session"]
