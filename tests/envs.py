"""Environments the tests run on workers: a structured env, and envs that fail on purpose."""

from __future__ import annotations

import copy
import functools
import os
import random
import signal
import threading
import time
import warnings
from collections import OrderedDict

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class DictObsEnv(gym.Env):
    """Dict observations, continuous actions, random termination, infos on some steps.

    Wrap in ``TimeLimit`` to get truncation.
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode: str | None = None) -> None:
        self.observation_space = spaces.Dict(
            {
                "position": spaces.Box(-10.0, 10.0, (3,), np.float32),
                "velocity": spaces.Box(-1.0, 1.0, (2,), np.float64),
                "mode": spaces.Discrete(4),
                "flags": spaces.MultiBinary(3),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.render_mode = render_mode
        self.position = np.zeros(3, np.float32)
        self.steps = 0

    def _obs(self) -> dict:
        return {
            "position": self.position.copy(),
            "velocity": self.np_random.uniform(-1, 1, 2),
            "mode": np.int64(self.steps % 4),
            "flags": self.np_random.integers(0, 2, 3, dtype=np.int8),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        self.steps = 0
        info = {"start": self.position.copy()} if options is None else {"options": dict(options)}
        return self._obs(), info

    def step(self, action):
        self.steps += 1
        self.position[:2] += np.asarray(action, np.float32)
        reward = float(-np.abs(self.position).sum() + self.np_random.normal())
        terminated = bool(self.np_random.random() < 0.04)
        info = {"steps": self.steps} if self.steps % 3 == 0 else {}
        if self.steps % 7 == 0:
            info["vector"] = self.position.copy()
        return self._obs(), reward, terminated, False, info

    def render(self):
        return np.full((8, 8, 3), self.steps % 255, np.uint8)


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def cartpole_with_statistics(max_episode_steps: int | None = None) -> gym.Env:
    """CartPole recording episode statistics; episodes of at most ``max_episode_steps`` (default 500)."""
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1", max_episode_steps=max_episode_steps))


def make_dict_env(max_episode_steps: int = 25):
    return gym.wrappers.TimeLimit(DictObsEnv(render_mode="rgb_array"), max_episode_steps=max_episode_steps)


class FailingEnv(gym.Wrapper):
    """Raises ``ValueError`` at step ``fail_at`` of its lifetime (counting every step)."""

    def __init__(self, env: gym.Env, fail_at: int) -> None:
        super().__init__(env)
        self.fail_at = fail_at
        self.total_steps = 0

    def step(self, action):
        self.total_steps += 1
        if self.total_steps == self.fail_at:
            raise ValueError(f"injected failure at step {self.total_steps}")
        return self.env.step(action)


class ResetFailingEnv(gym.Env):
    """Episodes of 3 steps (the third terminates, reward 1 each step, observation [episode, step]);
    ``reset`` raises on its ``fail_at``-th call of the env's lifetime, or with ``kill=True`` kills
    its process then (as a segfault in native code would)."""

    observation_space = spaces.Box(0.0, 1000.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, fail_at: int, kill: bool = False) -> None:
        self.fail_at = fail_at
        self.kill = kill
        self.resets = 0
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        if self.resets == self.fail_at:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at reset {self.resets}")
        self.steps = 0
        return np.array([self.resets, 0], np.float32), {}

    def step(self, action):
        self.steps += 1
        return np.array([self.resets, self.steps], np.float32), 1.0, self.steps == 3, False, {}


class ProcessIdEnv(gym.Wrapper):
    """An env with a method that returns the id of the process it runs in: a test finds a node
    agent's local processes through it (``pool.call("process_id")``) to kill one."""

    def process_id(self) -> int:
        return os.getpid()


def counting_env() -> gym.Env:
    """:class:`ResetFailingEnv` that never fails (episodes of 3 steps, observation [episode, step],
    the same whether reset seeded or not), findable by process: a lost worker's replacement starts
    the same episodes wherever it runs."""
    return ProcessIdEnv(ResetFailingEnv(fail_at=0))


def cartpole_in_process() -> gym.Env:
    return ProcessIdEnv(gym.make("CartPole-v1"))


def write_event(path: str | None) -> None:
    """One line more in ``path`` (nothing if None), for a test to wait on (tests/helpers.py's
    ``wait_for_events``) where it would otherwise sleep until the env is there. One short write in
    append mode: envs in several processes can share the file."""
    if path is not None:
        with open(path, "a") as file:
            file.write(f"{os.getpid()}\n")


class CallCounter(gym.Wrapper):
    """CartPole with a method that counts its calls: ``bump(k)`` adds ``k``, returns the count."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.calls = 0

    def bump(self, k: int = 1) -> int:
        self.calls += k
        return self.calls

    def sleep_then_bump(self, seconds: float, sleeping: str | None = None) -> int:
        """``bump()`` after ``seconds``, from an event written to ``sleeping``."""
        write_event(sleeping)
        time.sleep(seconds)
        return self.bump()


class SuicidalEnv(gym.Wrapper):
    """Kills its own process at step ``die_at`` (as a segfault in native env code would)."""

    def __init__(self, env: gym.Env, die_at: int) -> None:
        super().__init__(env)
        self.die_at = die_at
        self.total_steps = 0

    def step(self, action):
        self.total_steps += 1
        if self.total_steps == self.die_at:
            os.kill(os.getpid(), 9)
        return self.env.step(action)


class HangingEnv(gym.Wrapper):
    """Sleeps for an hour at step ``hang_at``, writing an event to ``hanging`` as it starts to."""

    def __init__(self, env: gym.Env, hang_at: int, hanging: str | None = None) -> None:
        super().__init__(env)
        self.hang_at = hang_at
        self.hanging = hanging
        self.total_steps = 0

    def step(self, action):
        self.total_steps += 1
        if self.total_steps == self.hang_at:
            write_event(self.hanging)
            time.sleep(3600)
        return self.env.step(action)


def lost_once(flag: str, how: str, at: int) -> gym.Env:
    """CartPole whose first build kills its worker (``killed``) or hangs (``stuck``) at step ``at``;
    builds after it (the flag file exists) are plain CartPole."""
    if os.path.exists(flag):
        return gym.make("CartPole-v1")
    open(flag, "w").close()
    wrapper = SuicidalEnv if how == "killed" else HangingEnv
    return wrapper(gym.make("CartPole-v1"), at)


class SlowCartPole(gym.Wrapper):
    """CartPole whose step sleeps ``seconds`` first (a slow simulator that leaves the CPU idle),
    writing an event to ``stepping`` as each step begins."""

    def __init__(self, seconds: float, stepping: str | None = None) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.seconds = seconds
        self.stepping = stepping

    def step(self, action):
        write_event(self.stepping)
        time.sleep(self.seconds)
        return self.env.step(action)


class IntFlagsEnv(gym.Wrapper):
    """Returns ``terminated`` as an int and ``truncated`` as a 0-d bool array, as older envs do;
    DummyVecEnv and SyncVectorEnv take both as flags."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, int(terminated), np.array(truncated), info


class NestedDictEnv(gym.Env):
    """A Dict observation holding a Dict: SyncVectorEnv takes it, SB3's vectorizers do not."""

    observation_space = spaces.Dict({"outer": spaces.Box(-1.0, 1.0, (2,)), "inner": spaces.Dict({"t": spaces.Box(0.0, 1e6, (1,))})})
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, False, self.t >= 5, {}

    def _obs(self) -> dict:
        return {"outer": np.zeros(2, np.float32), "inner": {"t": np.array([self.t], np.float32)}}


class JitteryEnv(gym.Wrapper):
    """Sleeps up to ``max_seconds`` (uniform, from its own unseeded RNG) before each step: the order
    in which envs finish varies from run to run, their trajectories do not."""

    def __init__(self, env: gym.Env, max_seconds: float) -> None:
        super().__init__(env)
        self.max_seconds = max_seconds
        self.jitter = random.Random()

    def step(self, action):
        time.sleep(self.jitter.uniform(0.0, self.max_seconds))
        return self.env.step(action)


class OrderedInfoEnv(gym.Wrapper):
    """CartPole whose infos are OrderedDicts (empty ones: CartPole has no info keys)."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, OrderedDict(info)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, OrderedDict(info)


class SlowCloseEnv(gym.Wrapper):
    """CartPole whose ``close()`` takes ``seconds`` and then writes ``path`` (a recorder finishing its
    file); it writes an event to ``closing`` as ``close()`` begins."""

    def __init__(self, env: gym.Env, seconds: float, path: str, closing: str | None = None) -> None:
        super().__init__(env)
        self.seconds = seconds
        self.path = path
        self.closing = closing

    def close(self):
        write_event(self.closing)
        time.sleep(self.seconds)
        with open(self.path, "w") as file:
            file.write("done")
        super().close()


class LightsEnv(gym.Env):
    """Toggle 3 lights to match a target (MultiBinary actions); pressing costs 0.3 times the mean
    of the action, so the reward's last bits depend on the action's dtype."""

    observation_space = spaces.Box(0.0, 1.0, (6,), np.float32)
    action_space = spaces.MultiBinary(3)

    def _obs(self):
        return np.concatenate([self.state, self.target]).astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.state = self.np_random.integers(0, 2, 3)
        self.target = self.np_random.integers(0, 2, 3)
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        self.state = np.logical_xor(self.state, action).astype(np.int64)
        solved = bool(np.all(self.state == self.target))
        cost = 0.3 * action.mean()  # float32 arithmetic for float32 actions, float64 for integers
        return self._obs(), float(solved) - float(cost), solved, self.t >= 10, {}


class ThreadLeavingEnv(gym.Wrapper):
    """CartPole that leaves a non-daemon thread running for ``seconds`` (its process cannot exit sooner)."""

    def __init__(self, env: gym.Env, seconds: float) -> None:
        super().__init__(env)
        threading.Thread(target=time.sleep, args=(seconds,), daemon=False).start()


class ActionDtypeEnv(gym.Env):
    """Says in its info the dtype of the action it got; never ends."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self, action_space: spaces.Space) -> None:
        self.action_space = action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {"dtype": str(np.asarray(action).dtype)}


class BigInfoEnv(gym.Wrapper):
    """CartPole whose step info holds ``nbytes`` bytes: a reply larger than a socket's buffer."""

    def __init__(self, env: gym.Env, nbytes: int) -> None:
        super().__init__(env)
        self.nbytes = nbytes

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, reward, terminated, truncated, {"frame": np.ones(self.nbytes, np.uint8)}


class SameReprKey:
    """A Dict space key whose repr is that of every other such key (they differ by ``value``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "key"

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SameReprKey) and other.value == self.value


class MaskedObsEnv(gym.Env):
    """Observations are masked arrays (an ndarray subclass); every episode ends at its first step."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def _obs(self):
        return np.ma.masked_array(np.zeros(3, np.float32), mask=[False, True, False])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action):
        return self._obs(), 0.0, True, False, {}


class SpacesEnv(gym.Env):
    """Observations in a given space (sampled from the env's RNG), any action space; ends every 9 steps.

    Covers the buffered leaf spaces, nesting, and spaces that fall back to pickling.
    """

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space) -> None:
        # Own copies: the env seeds its observation space, which must not be shared between envs.
        self.observation_space = copy.deepcopy(observation_space)
        self.action_space = copy.deepcopy(action_space)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        assert self.action_space.contains(action), action
        self.t += 1
        return self.observation_space.sample(), float(self.t), self.t % 9 == 0, False, {}

    def has_module(self, name: str) -> bool:
        """Whether this worker process has imported module ``name``."""
        import sys

        return name in sys.modules


class EchoActionEnv(gym.Env):
    """Puts the action it received into its info, so a test sees exactly which action reached which env.

    Episodes end every 5 steps; observations come from the env's RNG.
    """

    def __init__(self, action_space: spaces.Space, check_action: bool = True) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = copy.deepcopy(action_space)
        self.check_action = check_action  # Box.contains refuses float64 actions for a float32 Box
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action):
        assert not self.check_action or self.action_space.contains(action), f"{action!r} is not in {self.action_space}"
        self.t += 1
        obs = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return obs, float(self.t), self.t % 5 == 0, False, {"action": action}


class Coin(spaces.Space):
    """A custom space (no buffers, no gymnasium batching of its own): ``"heads"`` or ``"tails"``."""

    def __init__(self, seed=None) -> None:
        super().__init__(None, None, seed)

    def sample(self, mask=None, probability=None):
        return ("heads", "tails")[int(self.np_random.integers(2))]

    def contains(self, x) -> bool:
        return x in ("heads", "tails")

    def __eq__(self, other) -> bool:
        return isinstance(other, Coin)


class MisbehavingEnv(gym.Env):
    """A well-behaved env (Box(3) or Dict observations) that, at step ``bad_at``, returns or does
    what ``mode`` names: what users' envs get wrong while being written."""

    MODES = (
        "obs_shape",
        "obs_scalar",
        "obs_rows",
        "obs_complex",
        "obs_none",
        "dict_missing_key",
        "dict_float_discrete",
        "dict_extra_key",
        "reward_array",
        "flag_not_bool",
        "step_tuple",
        "reset_obs_only",
        "info_unpicklable",
        "system_exit",
    )

    def __init__(self, mode: str, bad_at: int = 3) -> None:
        assert mode in self.MODES, mode
        self.mode, self.bad_at = mode, bad_at
        self.dict_obs = mode.startswith("dict")
        box = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.observation_space = spaces.Dict({"a": box, "b": spaces.Discrete(2)}) if self.dict_obs else box
        self.action_space = spaces.Discrete(2)
        self.reward = 1.0  # the reward of every good step
        self.t = 0

    def make_lock(self) -> threading.Lock:
        """A method whose result cannot be pickled."""
        return threading.Lock()

    def _obs(self):
        value = np.full(3, self.t / 100, np.float32)
        return {"a": value, "b": np.int64(self.t % 2)} if self.dict_obs else value

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        if self.mode == "reset_obs_only" and (options or {}).get("bad"):
            return self._obs()
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        obs, reward, terminated, info = self._obs(), self.reward, False, {}
        if self.t == self.bad_at:
            mode = self.mode
            if mode == "obs_shape":
                obs = np.zeros(5)
            elif mode == "obs_scalar":  # numpy would broadcast it over the row
                obs = np.float32(0.5)
            elif mode == "obs_rows":  # (1, 3) for (3,): numpy would drop the axis
                obs = obs[None]
            elif mode == "obs_complex":  # numpy would drop the imaginary part
                obs = obs + 1j
            elif mode == "obs_none":  # numpy would store NaNs
                obs = None
            elif mode == "dict_float_discrete":  # numpy would truncate 1.5 to 1
                obs = dict(obs, b=1.5)
            elif mode == "dict_missing_key":
                obs = {"a": obs["a"]}
            elif mode == "dict_extra_key":
                obs = dict(obs, z=1)
            elif mode == "reward_array":
                reward = np.array([1.0, 2.0])
            elif mode == "flag_not_bool":
                terminated = "yes"
            elif mode == "step_tuple":
                return obs, reward, terminated, info
            elif mode == "info_unpicklable":
                info = {"fine": 1, "lock": threading.Lock()}
            elif mode == "system_exit":
                raise SystemExit(4)
        return obs, reward, terminated, False, info


class CrashingEnv(gym.Wrapper):
    """Writes a line to stderr, then crashes its process at step ``crash_at``: ``segfault`` (as a
    bug in an env's C code would: faulthandler dumps the traceback) or ``exit`` (``os._exit(3)``)."""

    def __init__(self, env: gym.Env, crash_at: int, how: str = "segfault") -> None:
        super().__init__(env)
        self.crash_at, self.how = crash_at, how
        self.total_steps = 0

    def step(self, action):
        self.total_steps += 1
        if self.total_steps == self.crash_at:
            import ctypes
            import sys

            print(f"simulator: giving up at step {self.total_steps}", file=sys.stderr, flush=True)
            if self.how == "segfault":
                ctypes.string_at(0)
            os._exit(3)
        return self.env.step(action)


class FuzzEnv(gym.Env):
    """An env drawn by the differential fuzzer (``tests/test_fuzz.py``): any observation and action
    spaces, random episode lengths, terminations and truncations, and infos of every shape, all from
    the env's own RNG, so the same seeds give the same run in any vectorizer.

    :param observation_space: the observation space (copied)
    :param action_space: the action space (copied)
    :param terminate_p: probability of a termination at each step
    :param max_steps: episodes are truncated after this many steps
    :param info_kind: ``"none"``, ``"scalars"`` (Python and numpy numbers), ``"nested"`` (dicts and
        arrays inside) or ``"mixed"`` (a random one of these each step)
    """

    INFO_KINDS = ("none", "scalars", "nested", "mixed")

    def __init__(
        self, observation_space: spaces.Space, action_space: spaces.Space, terminate_p: float, max_steps: int, info_kind: str
    ) -> None:
        self.observation_space = copy.deepcopy(observation_space)
        self.action_space = copy.deepcopy(action_space)
        self.terminate_p, self.max_steps, self.info_kind = terminate_p, max_steps, info_kind
        self.check_action = True  # an action outside the space fails the step, on both sides alike
        self.t = 0

    def _info(self) -> dict:
        kind = self.info_kind
        if kind == "mixed":
            kind = self.INFO_KINDS[int(self.np_random.integers(3))]
        if kind == "none":
            return {}
        if kind == "scalars":
            return {"t": self.t, "x": float(self.np_random.random()), "y": np.float32(self.np_random.random())}
        return {"nested": {"a": np.arange(3) * self.t, "b": [self.t, "s"]}, "flag": bool(self.t % 2)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        info = self._info()
        if options is not None:
            info["options"] = options
        return self.observation_space.sample(), info

    def step(self, action):
        with warnings.catch_warnings():  # Box.contains warns about numpy scalars for 0-d spaces
            warnings.simplefilter("ignore")
            assert not self.check_action or self.action_space.contains(action), f"{action!r} is not in {self.action_space}"
        self.t += 1
        terminated = bool(self.np_random.random() < self.terminate_p)
        truncated = self.t >= self.max_steps
        reward = float(self.np_random.normal())
        return self.observation_space.sample(), reward, terminated, truncated, self._info()


def cartpole_holding_a_worker_only_object(module_dir: str) -> gym.Env:
    """CartPole whose ``thing`` is an object of a module only its worker imports (the factory puts
    ``module_dir`` on the worker's path), as an env package installed on the worker hosts alone."""
    import sys

    sys.path.insert(0, module_dir)
    import worker_only

    env = gym.make("CartPole-v1")
    env.unwrapped.thing = worker_only.Thing()
    return env


class UnprintableError(Exception):
    """An exception whose ``str()`` fails, as some C extensions' do once their handle is gone."""

    def __str__(self) -> str:
        raise RuntimeError("handle released")


class UnprintableFailureEnv(gym.Wrapper):
    """Raises :class:`UnprintableError` at step ``fail_at``."""

    def __init__(self, env: gym.Env, fail_at: int) -> None:
        super().__init__(env)
        self.fail_at, self.total_steps = fail_at, 0

    def step(self, action):
        self.total_steps += 1
        if self.total_steps == self.fail_at:
            raise UnprintableError()
        return self.env.step(action)


class FailingCloseEnv(gym.Wrapper):
    """Raises from ``close()``, as a recorder that cannot flush its file does."""

    def close(self) -> None:
        super().close()
        raise OSError("could not flush the recording")


class StateInInfoEnv(gym.Env):
    """Reports its state array in its info and changes that array in place at every step."""

    observation_space = spaces.Box(-100.0, 100.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position = np.zeros(2)
        return self.position.astype(np.float32), {}

    def step(self, action):
        self.position += 1.0
        return self.position.astype(np.float32), 0.0, False, False, {"position": self.position}


class SameInfoDictEnv(gym.Env):
    """Returns one info dict at every step, its plain values changed in place."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.info = {"steps": 0, "speed": np.float64(0.0)}
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.info["steps"] += 1
        self.info["speed"] = np.float64(self.info["steps"] / 2)
        return np.zeros(2, np.float32), 0.0, False, False, self.info


class OneStepEnv(gym.Env):
    """Every episode is one step, which terminates with reward 1."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.ones(2, np.float32), 1.0, True, False, {}


class InPlaceStateEnv(gym.Env):
    """Returns its one state array from ``step`` and ``reset`` and changes it in place, as
    hand-written envs often do; episodes truncate after 3 steps."""

    observation_space = spaces.Box(-100.0, 100.0, (2,), np.float32)
    action_space = spaces.Discrete(3)

    def __init__(self) -> None:
        self.state = np.zeros(2, dtype=np.float32)
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state[:] = 0.0
        self.steps = 0
        return self.state, {}

    def step(self, action):
        self.state += float(action) + 1.0
        self.steps += 1
        return self.state, float(action), False, self.steps == 3, {}


class LockHoldingEnv(gym.Wrapper):
    """CartPole holding a lock, which cannot be pickled."""

    def __init__(self) -> None:
        import threading

        super().__init__(gym.make("CartPole-v1"))
        self.lock = threading.Lock()


class ChattyEnv(gym.Wrapper):
    """CartPole that writes to its process's stderr on request (a simulator's log)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def say(self, text: str, repeat: int = 1) -> None:
        import sys

        for _ in range(repeat):
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


class MatrixActionEnv(gym.Env):
    """Actions in a Box of shape (2, 2) with uneven bounds; the env checks the shape it gets."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Box(np.array([[-1, 0], [2, -3]], np.float32), np.array([[1, 4], [5, -1]], np.float32))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        assert np.shape(action) == (2, 2), np.shape(action)
        self.steps += 1
        reward = -float(np.abs(action - self.action_space.low).sum())
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), reward, False, self.steps == 6, {}


class ChildStartingEnv(gym.Wrapper):
    """CartPole that starts a helper process (a simulator server, say) and never ends it."""

    def __init__(self, env: gym.Env) -> None:
        import subprocess
        import sys

        super().__init__(env)
        self.helper_pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


class Shade(spaces.Space):
    """A custom space that compares by identity, as a space defining no ``__eq__`` does."""

    def __init__(self) -> None:
        super().__init__(None, None)

    def sample(self, mask=None, probability=None):
        return ("light", "dark")[int(self.np_random.integers(2))]

    def contains(self, x) -> bool:
        return x in ("light", "dark")


#: One instance for every env, as a module's constant: each worker imports its own.
SHADE = Shade()


class ShadeEnv(gym.Env):
    """Observes a :data:`SHADE`; its action is a ``Discrete(2)``."""

    observation_space = SHADE
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return ("light", "dark")[int(self.np_random.integers(2))], {}

    def step(self, action):
        return ("light", "dark")[int(action)], float(action), False, False, {}


class SubPoolEnv(gym.Env):
    """CartPole stepped in a pool of one worker that the env builds when it is created: a pool inside
    a worker that no import builds (an env that distributes sub-envs of its own)."""

    def __init__(self) -> None:
        from clusterenv_core import EnvPool

        self.pool = EnvPool([functools.partial(gym.make, "CartPole-v1")], num_workers=1)
        self.observation_space = self.pool.observation_space
        self.action_space = self.pool.action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.pool.reset(seeds=[seed]).obs[0].copy(), {}

    def step(self, action):
        result = self.pool.step(np.array([action]))
        return result.obs[0].copy(), float(result.rewards[0]), bool(result.terminated[0]), bool(result.truncated[0]), {}

    def close(self) -> None:
        self.pool.close()


class SeedOnlyResetEnv(gym.Env):
    """A hand-written env whose ``reset`` takes ``seed`` but no ``options``: SB3's vec envs and
    gymnasium 0.29's ``SyncVectorEnv`` reset it (they pass ``options`` only when set), gymnasium
    1.x's ``SyncVectorEnv`` does not. Episodes truncate after 3 steps."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, seed=None):
        super().reset(seed=seed)
        self.steps = 0
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), {}

    def step(self, action):
        self.steps += 1
        return self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32), float(action), False, self.steps == 3, {}


class ResetKeywordsEnv(SeedOnlyResetEnv):
    """Says in each reset's info which keywords its ``reset`` got, in order: ``"seed,options"``, or
    ``""`` for ``reset()``. Episodes truncate after 3 steps."""

    def reset(self, **keywords):
        obs, _ = super().reset(seed=keywords.get("seed"))
        return obs, {"reset_keywords": ",".join(keywords)}


class WhereCartPole(gym.Wrapper):
    """CartPole that says where it runs: ``where()`` is its process's host name and pid."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def where(self) -> tuple[str, int]:
        import socket

        return socket.gethostname(), os.getpid()
