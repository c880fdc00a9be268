"""A group: the episodes a rollout worker played of one environment seed, as they come back to the driver.

Its own module, apart from `batch` (torch), so that the driver can create the rollout workers before it
imports torch: see `runtime`.
"""

from __future__ import annotations

from dataclasses import dataclass

from molt_env.trajectory import Trajectory


@dataclass
class Group:
    """The episodes a rollout worker played of one training environment seed (`index` is the group's place
    in the run's data): the segments of those that finished, the failure text of those that did not
    (`molt_agents.episode.failure_text`), and the seconds it took."""

    index: int
    trajectories: list[Trajectory]
    failures: list[str]
    seconds: float = 0.0

    def rewards(self) -> list[float]:
        """One reward per finished episode (its segments share it)."""
        return list({t.rollout_id: t.reward for t in self.trajectories}.values())
