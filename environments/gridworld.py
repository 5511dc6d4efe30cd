"""A grid world from Gymnasium's toy-text FrozenLake, through the Gymnasium bridge.

Walk from ``S`` to the goal ``G`` without stepping into a hole ``H``; ``@`` marks you. The lake is
not slippery, so every move does what it says. The reward is 1.0 on reaching the goal.
"""

from __future__ import annotations

from typing import Any

from sdk.gym import GymnasiumEnvironment


class GridWorldEnv(GymnasiumEnvironment):
    """FrozenLake 4x4 (not slippery) played with the ``step(action)`` tool."""

    env_id = "FrozenLake-v1"
    make_kwargs = {"is_slippery": False, "map_name": "4x4"}
    action_names = ("left", "down", "right", "up")
    task = "Walk from S to the goal G on the frozen lake without falling into a hole H. @ marks you."

    def _observation_text(self, observation: Any) -> str:
        grid = [[cell.decode() for cell in row] for row in self.env.unwrapped.desc]  # type: ignore[attr-defined]
        width = len(grid[0])
        grid[int(observation) // width][int(observation) % width] = "@"
        return "\n".join("".join(row) for row in grid)
