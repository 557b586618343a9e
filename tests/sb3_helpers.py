"""Helpers of the tests that compare clusterenv_sb3's algorithms with SB3's (tests/helpers.py holds
the rest: it imports neither SB3 nor torch, which the gymnasium 0.29 venv does not have)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import stable_baselines3 as sb3
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.logger import KVWriter, Logger
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import DummyVecEnv

from clusterenv_sb3 import ClusterVecEnv
from tests.helpers import assert_same


class RecordingCallback(BaseCallback):
    """Keeps what callbacks see at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = []
        self.rollout_ends = 0

    def _on_step(self) -> bool:
        loc = self.locals
        self.steps.append(
            {
                "rewards": np.array(loc["rewards"]),
                "actions": np.array(loc["actions"]),  # what the envs got
                "dones": np.array(loc["dones"]),
                "infos": [dict(info) for info in loc["infos"]],
                "new_obs": np.array(loc["new_obs"]),
                "num_timesteps": self.num_timesteps,
            }
        )
        return True

    def _on_rollout_end(self) -> None:
        self.rollout_ends += 1


class RecordingWriter(KVWriter):
    """An SB3 logger output that keeps every dump."""

    def __init__(self) -> None:
        self.dumps: list[dict] = []

    def write(self, key_values, key_excluded, step=0) -> None:
        self.dumps.append(dict(key_values))

    def close(self) -> None:
        pass


def recording_logger() -> tuple[Logger, RecordingWriter]:
    writer = RecordingWriter()
    return Logger(folder=None, output_formats=[writer]), writer


def cluster_vec_env(
    env_id: str, n_envs: int = 4, seed: int = 0, num_workers: int = 2, processes_per_worker: int = 1, **make_kwargs
) -> ClusterVecEnv:
    return make_vec_env(
        env_id,
        n_envs=n_envs,
        seed=seed,
        env_kwargs=make_kwargs or None,
        vec_env_cls=ClusterVecEnv,
        vec_env_kwargs={"num_workers": num_workers, "processes_per_worker": processes_per_worker},
    )


def dummy_vec_env(env_id: str, n_envs: int = 4, seed: int = 0, **make_kwargs) -> DummyVecEnv:
    return make_vec_env(env_id, n_envs=n_envs, seed=seed, env_kwargs=make_kwargs or None, vec_env_cls=DummyVecEnv)


def first_segments(algorithm, env, segments: int, prepare=None, **kwargs):
    """Collect ``segments`` times with a train() in between, as learn() does; returns the buffers
    after each collection and what the callback saw. ``prepare(model)`` runs before collecting."""
    model = algorithm(env=env, seed=0, device="cpu", **kwargs)
    if prepare is not None:
        prepare(model)
    callback = RecordingCallback()
    _, cb = model._setup_learn(10**6, callback)
    snapshots = []
    for index in range(segments):
        if isinstance(model, OnPolicyAlgorithm):
            assert model.collect_rollouts(model.env, cb, model.rollout_buffer, model.n_steps)
            buf = model.rollout_buffer
            snapshots.append(
                {
                    name: getattr(buf, name).copy()
                    for name in (
                        "observations",
                        "actions",
                        "rewards",
                        "episode_starts",
                        "values",
                        "log_probs",
                        "returns",
                        "advantages",
                    )
                }
            )
        else:
            rollout = model.collect_rollouts(
                model.env,
                callback=cb,
                train_freq=model.train_freq,
                replay_buffer=model.replay_buffer,
                learning_starts=model.learning_starts,
            )
            assert rollout.continue_training
            buf = model.replay_buffer
            snapshots.append(
                {
                    name: getattr(buf, name)[: buf.pos].copy()
                    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
                }
            )
        snapshots[-1]["num_timesteps"] = model.num_timesteps
        snapshots[-1]["last_obs"] = np.array(model._last_obs)
        if index < segments - 1:
            np.random.seed(index)  # SB3's DQN draws from numpy's global RNG while acting; ours does not
            if isinstance(model, OnPolicyAlgorithm):
                model.train()
            else:
                model.train(gradient_steps=model.gradient_steps, batch_size=model.batch_size)
    state = {key: value.clone() for key, value in model.policy.state_dict().items()}
    extra = {"ep_info_buffer": list(model.ep_info_buffer), "callback": callback, "state": state}
    if isinstance(model, sb3.DQN):
        extra.update(n_calls=model._n_calls, episode_num=model._episode_num, exploration_rate=model.exploration_rate)
    else:
        extra["last_episode_starts"] = model._last_episode_starts.copy()
    return model, snapshots, extra


def assert_same_collection(ours, reference, float_tol: float = 1e-5) -> None:
    (_, got, got_extra), (_, want, want_extra) = ours, reference
    for index, (g, w) in enumerate(zip(got, want)):
        for name in w:
            if name in ("values", "log_probs", "returns", "advantages", "rewards"):
                np.testing.assert_allclose(g[name], w[name], rtol=float_tol, atol=float_tol, err_msg=f"{name} #{index}")
            else:
                np.testing.assert_array_equal(g[name], w[name], err_msg=f"{name} #{index}")
    assert len(got_extra["ep_info_buffer"]) == len(want_extra["ep_info_buffer"]) > 0
    for g, w in zip(got_extra["ep_info_buffer"], want_extra["ep_info_buffer"]):
        assert (g["r"], g["l"]) == (w["r"], w["l"])
    got_steps, want_steps = got_extra["callback"].steps, want_extra["callback"].steps
    assert len(got_steps) == len(want_steps)
    for t, (g, w) in enumerate(zip(got_steps, want_steps)):
        assert_same(g["actions"], w["actions"], f"callback actions at step {t}")
        assert_same(g["dones"], w["dones"], f"dones at step {t}")
        assert_same(g["new_obs"], w["new_obs"], f"new_obs at step {t}")
        assert_same(g["rewards"], w["rewards"], f"callback rewards at step {t}")
        assert_same(g["infos"], w["infos"], f"infos at step {t}")
        assert g["num_timesteps"] == w["num_timesteps"]
    assert got_extra["callback"].rollout_ends == want_extra["callback"].rollout_ends
    for key in ("n_calls", "episode_num", "exploration_rate", "last_episode_starts"):
        if key in want_extra:
            np.testing.assert_array_equal(got_extra[key], want_extra[key], err_msg=key)
    for name, value in want_extra["state"].items():
        th.testing.assert_close(got_extra["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def eval_return(model, env_id: str = "CartPole-v1") -> float:
    """Mean return of 10 deterministic episodes from the same start states every run (unseeded, the
    mean of a half-trained policy moves a lot: Pendulum's by +-150)."""
    evaluation = DummyVecEnv([lambda: gym.make(env_id)])
    evaluation.seed(0)
    mean, _ = evaluate_policy(model, evaluation, n_eval_episodes=10, warn=False)
    return mean
