"""A user's own env module, next to their training script (reached by a ``"user_envs:ModuleEnv"`` entry point)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class ModuleEnv(gym.Env):
    """Observations of ``size`` values from the env's RNG; reward = the action; never ends by itself."""

    def __init__(self, size: int = 2, scale: float = 1.0) -> None:
        self.observation_space = gym.spaces.Box(-scale, scale, (size,), np.float32)
        self.action_space = gym.spaces.Discrete(3)
        self.scale = scale

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {"scale": self.scale}

    def step(self, action):
        return self._obs(), float(action), bool(self.np_random.random() < 0.05), False, {}

    def _obs(self) -> np.ndarray:
        return self.np_random.uniform(-self.scale, self.scale, self.observation_space.shape).astype(np.float32)
