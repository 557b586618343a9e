"""What learners derive from a Rollout (clusterenv_core.rollout) on nested observations; the
adapters' tests check it on arrays against SB3 and CleanRL."""

from __future__ import annotations

import numpy as np
import pytest

from clusterenv_core.rollout import Rollout


def _observation(value: np.ndarray) -> dict:
    """A Dict observation holding a tuple, every leaf derived from ``value`` (a scalar, or an array
    of leading axes)."""
    value = np.asarray(value, np.float32)
    return {"pos": np.stack([value, 2 * value], axis=-1), "pair": (value.copy(), -value)}


def _nested_rollout() -> Rollout:
    """Three steps of two envs: env 0 truncated at t=0, env 1 terminated and truncated at t=1
    (not a timeout), env 0 terminated at t=2. The observation before step t of env i is 10 t + i,
    the last one 100 + i, the final ones 1000 + 10 t + i."""
    ends = [(0, 0), (1, 1), (2, 0)]
    return Rollout(
        obs=_observation(10 * np.arange(3)[:, None] + np.arange(2)),
        actions=np.zeros((3, 2), np.int64),
        rewards=np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        terminated=np.array([[False, False], [False, True], [True, False]]),
        truncated=np.array([[True, False], [False, True], [False, False]]),
        log_probs=np.zeros((3, 2), np.float32),
        values=np.zeros((3, 2), np.float32),
        versions=np.zeros((3, 2), np.int64),
        last_obs=_observation(100 + np.arange(2)),
        infos=[{}, {}, {}],
        reset_infos=[{}, {}, {}],
        pickled_final_obs={(t, i): _observation(1000 + 10 * t + i) for t, i in ends},
    )


def _assert_observation(actual: dict, value: np.ndarray) -> None:
    expected = _observation(value)
    np.testing.assert_array_equal(actual["pos"], expected["pos"])
    assert isinstance(actual["pair"], tuple)
    for leaf, expected_leaf in zip(actual["pair"], expected["pair"]):
        np.testing.assert_array_equal(leaf, expected_leaf)


def test_episode_ends_and_timeouts():
    rollout = _nested_rollout()
    np.testing.assert_array_equal(rollout.dones, [[True, False], [False, True], [True, False]])
    np.testing.assert_array_equal(rollout.timeouts, [[True, False], [False, False], [False, False]])


def test_observations_at_and_after_each_step():
    rollout = _nested_rollout()
    _assert_observation(rollout.obs_at(1), [10, 11])
    _assert_observation(rollout.obs_after(1), [20, 21])
    _assert_observation(rollout.obs_after(2), [100, 101])  # after the last step: last_obs
    _assert_observation(rollout.final_observations(np.array([2, 1]), np.array([0, 1])), [1020, 1011])


def test_next_observations_are_final_where_episodes_ended():
    rollout = _nested_rollout()
    next_obs = rollout.next_observations()
    _assert_observation(next_obs, [[1000, 11], [20, 1011], [1020, 101]])
    next_obs["pos"][:] = 0  # copies: the rollout's arrays are the pool's
    assert rollout.obs["pos"].any() and rollout.last_obs["pos"].any()


def test_rewards_bootstrap_at_timeouts_only():
    rollout = _nested_rollout()
    asked = []

    def values(final_obs: dict) -> np.ndarray:
        asked.append(final_obs)
        return final_obs["pair"][0]  # V = the observation's value

    rewards = rollout.bootstrapped_rewards(0.5, values)
    assert rewards.dtype == np.float32
    np.testing.assert_array_equal(rewards, [[1.0 + 0.5 * 1000, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert len(asked) == 1  # one call for the whole segment
    _assert_observation(asked[0], [1000])
    rollout.truncated[:] = False
    no_timeouts = rollout.bootstrapped_rewards(0.5, lambda final_obs: pytest.fail("no episode timed out"))
    np.testing.assert_array_equal(no_timeouts, rollout.rewards.astype(np.float32))
