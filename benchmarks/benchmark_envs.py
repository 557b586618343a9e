"""Envs the benchmarks share. Workers import this module to build them: it imports gymnasium and
numpy only, so that workers start without what the benchmark scripts themselves import (SB3, torch)."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np


class NoopEnv(gym.Env):
    """Returns at once: what remains of a step is the backend's round trip."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(4, np.float32), {}

    def step(self, action):
        return np.zeros(4, np.float32), 0.0, False, False, {}


class BusyCartPole(gym.Wrapper):
    """CartPole whose step busy-waits ``busy_us`` microseconds."""

    def __init__(self, busy_us: float = 200.0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.busy_s = busy_us * 1e-6

    def step(self, action):
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


class SleepyCartPole(gym.Wrapper):
    """CartPole whose step sleeps ``sleep_us`` microseconds: a slow step that leaves the core idle,
    so that many such processes on few cores model a host with a core for each (no contention)."""

    def __init__(self, sleep_us: float = 200.0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.sleep_s = sleep_us * 1e-6

    def step(self, action):
        time.sleep(self.sleep_s)
        return self.env.step(action)
