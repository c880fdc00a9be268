"""`frozen_lake`: Gymnasium's FrozenLake as a text environment; how to bring any Gymnasium env in.

The adapter renders the wrapped environment's state as text, parses the
policy's reply into one of its discrete actions, and passes its reward
through. A reply that names no move is an invalid action: the episode
continues with a "try again" message and counts the mistake.
"""

from __future__ import annotations

import gymnasium

from molt_env import Env

MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}


def parse_move(reply: str) -> int | None:
    words = [w.strip(".,!?:;\"'").lower() for w in reply.split()]
    found = [MOVES[w] for w in words if w in MOVES]
    return found[-1] if found else None


class FrozenLake(Env):
    max_turns = 30

    def __init__(self, map_name: str = "4x4", is_slippery: bool = False):
        self.inner = gymnasium.make("FrozenLake-v1", map_name=map_name, is_slippery=is_slippery)
        self.desc = ["".join(cell.decode() for cell in row) for row in self.inner.unwrapped.desc]

    def _board(self, state: int) -> str:
        width = len(self.desc[0])
        rows = [list(row) for row in self.desc]
        rows[state // width][state % width] = "P"
        return "\n".join("".join(row) for row in rows)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        state, info = self.inner.reset(seed=seed)
        self.invalid = 0
        return ("Walk from S to G on the frozen lake without falling into a hole H. You are P.\n"
                f"{self._board(state)}\nReply with one move: left, down, right or up."), {"state": int(state)}

    def step(self, action: str):
        move = parse_move(action)
        if move is None:
            self.invalid += 1
            return "That is not a move. Reply with left, down, right or up.", 0.0, False, False, {"invalid": True}
        state, reward, terminated, truncated, info = self.inner.step(move)
        observation = "" if terminated else f"{self._board(state)}\nYour move?"
        return observation, float(reward), terminated, truncated, {"state": int(state)}
