"""ClusterVecEnv(backend="mpi") against DummyVecEnv, and ClusterVectorEnv against SyncVectorEnv, in
whatever MPI launch mode this script runs in.

Usage (the checks run in order; a world launch serves one pool, so give it one check)::

    python contract.py cartpole dict ppo                                          # spawn
    mpiexec -n 1 python contract.py cartpole : -n 2 python -m clusterenv_core.worker   # MPMD
    mpiexec -n 3 python contract.py cartpole                                      # SPMD
    mpiexec -n 2 python contract.py several_learners                              # 2 learners, each spawning

Rank 0 (every rank, for ``several_learners``) prints ``OK <check>`` for every check that passed; a
failed check raises.
In SPMD launches the MPI pool is created before anything else, so worker ranks do no other work.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from clusterenv_sb3 import ClusterVecEnv  # noqa: E402
from tests.envs import make_dict_env  # noqa: E402


def side_by_side(env_fns, **options) -> None:
    from tests.helpers import run_side_by_side

    run_side_by_side(env_fns, backend="mpi", num_workers=2, **options)


def vector() -> None:
    """ClusterVectorEnv(backend="mpi") against SyncVectorEnv (the CleanRL contract), 2000 steps."""
    from clusterenv_cleanrl import ClusterVectorEnv
    from tests.envs import cartpole_with_statistics
    from tests.helpers import run_and_compare

    env_fns = [functools.partial(cartpole_with_statistics, max_episode_steps=40)] * 4
    cluster = ClusterVectorEnv(env_fns, backend="mpi", num_workers=2)  # first: SPMD worker ranks stop here
    sync = gym.vector.SyncVectorEnv(env_fns)
    with cluster:
        counts = run_and_compare(cluster, sync, 2000, seed=1)
    sync.close()
    assert counts["terminated"] > 50 and counts["truncated"] > 5, counts


def reset_keywords() -> None:
    """ClusterVecEnv(backend="mpi") passes each env's reset the keywords DummyVecEnv passes."""
    from tests.test_sb3_contract import check_reset_keywords_match_dummy_vec_env

    check_reset_keywords_match_dummy_vec_env(backend="mpi")


def ppo() -> None:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    torch.set_num_threads(1)

    def train(vec_env_cls, **vec_env_kwargs):
        venv = make_vec_env("CartPole-v1", n_envs=4, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)
        model = PPO("MlpPolicy", venv, n_steps=128, batch_size=128, n_epochs=2, seed=0, device="cpu")
        model.learn(total_timesteps=2048)
        venv.close()
        return model.policy.state_dict()

    actual = train(ClusterVecEnv, backend="mpi", num_workers=2)
    expected = train(DummyVecEnv)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def rollout() -> None:
    """Worker-side inference over MPI: deploy, rollouts equal to a sequential reference, new weights."""
    import torch

    from clusterenv_core import EnvPool
    from tests.policies import LinearPolicy, assert_rollout_matches, reference_rollout

    pool = EnvPool.make("CartPole-v1", 5, backend="mpi", num_workers=2)  # first: SPMD worker ranks stop here
    try:
        torch.manual_seed(1)
        policy = LinearPolicy(greedy=True)
        seeds = [10, 11, 12, 13, 14]
        pool.reset(seeds=seeds)
        actors = pool.deploy(policy)
        expected, last_obs = reference_rollout(policy, seeds, 120)
        assert_rollout_matches(actors.rollout(120), expected, last_obs)
        with torch.no_grad():
            policy.linear.weight.neg_()
        assert actors.publish_weights(policy) == 1
        segment = actors.rollout(10)
        assert (segment.versions == 1).all()
        with torch.no_grad():
            greedy = policy.linear(torch.as_tensor(segment.obs[0])).argmax(-1).numpy()
        np.testing.assert_array_equal(segment.actions[0], greedy)
    finally:
        pool.close()


CHECKS = {
    "cartpole": lambda: side_by_side([functools.partial(gym.make, "CartPole-v1")] * 8),
    # 5 envs on 2 workers: uneven blocks; Dict observations, Box actions, truncation at 25 steps.
    "dict": lambda: side_by_side([make_dict_env] * 5),
    # Under mpiexec with launch="spawn", every world rank is a learner with worker ranks of its own.
    "several_learners": lambda: side_by_side([functools.partial(gym.make, "CartPole-v1")] * 4, launch="spawn"),
    "vector": vector,
    "reset_keywords": reset_keywords,
    "ppo": ppo,
    "rollout": rollout,
}

if __name__ == "__main__":
    for check in sys.argv[1:]:
        CHECKS[check]()
        print(f"OK {check}", flush=True)
