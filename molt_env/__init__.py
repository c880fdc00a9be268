"""molt_env: the task side of Molt.

The Gymnasium `Env` base for text (and chat-message) tasks, the registry that
maps names to environments, and the `Trajectory` record with its validator:
the only thing that crosses from rollout to training. Imports no torch at
module import time.
"""
