"""``restart_failed_workers`` through node agents (``processes_per_worker`` > 1), at two levels: a
local process lost inside an agent is replaced by the agent, and a lost agent by the learner, as a
lost worker. Either way the learner sees what a flat pool shows when the corresponding worker is
lost at the same step: the same observations, rewards, flags, final observations and infos (the
restart reason aside, which names the agent and its local process), and the same restart counts."""

from __future__ import annotations

import copy
import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest

from clusterenv_core import EnvError, EnvPool
from clusterenv_core.protocol import RESTART_INFO_KEY
from tests.envs import FailingEnv, HangingEnv, ProcessIdEnv, cartpole_in_process, counting_env, lost_once
from tests.helpers import wait_until_ended

pytestmark = pytest.mark.timeout(180)

REASON = "<the restart reason>"


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert wait_until_ended([pid])


def _local_process_of(pool: EnvPool, index: int) -> int:
    """The id of the process env ``index`` runs in: an agent's local process, or a flat worker."""
    return pool.call("process_id", indices=[index])[0]


def _snapshot(pool: EnvPool, result) -> dict:
    """What the step showed, copied; restart reasons replaced by a marker and kept apart."""
    infos = copy.deepcopy(result.infos)
    reasons = {}
    for index, info in infos.items():
        if RESTART_INFO_KEY in info:
            reasons[index] = info[RESTART_INFO_KEY]
            info[RESTART_INFO_KEY] = REASON
    ended = np.flatnonzero(result.terminated | result.truncated)
    final = {}
    if pool.autoreset_mode == "same_step":
        final = {int(index): np.array(result.final_observation(int(index))) for index in ended}
    return {
        "obs": np.array(result.obs),
        "rewards": result.rewards.copy(),
        "terminated": result.terminated.copy(),
        "truncated": result.truncated.copy(),
        "infos": infos,
        "reset_infos": copy.deepcopy(result.reset_infos),
        "final_obs": final,
        "reasons": reasons,
    }


def _run_losing(mode: str, lose: str, processes_per_worker: int, num_workers: int, **options) -> tuple:
    """8 envs of 3-step episodes, half a step out of phase; before step 4, the process of env 4 is
    killed (``lose="process"``) or the worker of env 4 (``"worker"``). Returns each step's snapshot
    from step 4 on, the pool's restart counts, and the ids of the processes killed and now running."""
    env_fns = [counting_env] * 8
    with EnvPool(
        env_fns,
        num_workers=num_workers,
        processes_per_worker=processes_per_worker,
        autoreset_mode=mode,
        restart_failed_workers=True,
        timeout=30,
        **options,
    ) as pool:
        actions = np.zeros(8, np.int64)
        pool.reset(seeds=list(range(8)))
        pool.step(actions)
        pool.reset(mask=np.array([False, False, False, False, False, True, False, True]))
        for _ in range(2):
            pool.step(actions)
        killed = _local_process_of(pool, 4) if lose == "process" else pool.worker_pids[int(pool.worker_of[4])]
        gone = [_local_process_of(pool, index) for index in pool.blocks[int(pool.worker_of[4])]]
        _kill(killed)
        snapshots = [_snapshot(pool, pool.step(actions)) for _ in range(6)]
        running = [_local_process_of(pool, index) for index in range(8)]
        return snapshots, (pool.restarts, pool.env_restarts), killed, gone, running


def _assert_same_steps(actual: list[dict], expected: list[dict]) -> None:
    for step, (got, want) in enumerate(zip(actual, expected)):
        for key in ("obs", "rewards", "terminated", "truncated"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step}: {key}")
        for key in ("infos", "reset_infos"):
            assert got[key] == want[key], f"step {step}: {key}"
        assert got["final_obs"].keys() == want["final_obs"].keys(), f"step {step}: final observations"
        for index, final in got["final_obs"].items():
            np.testing.assert_array_equal(final, want["final_obs"][index], err_msg=f"step {step}: final obs {index}")
        assert got["reasons"].keys() == want["reasons"].keys(), f"step {step}: restart reasons"


def check_a_local_process_lost_mid_steps_is_replaced_as_a_flat_pools_worker(mode: str, **options) -> None:
    """Agent 1's local process 0 runs envs 4-5, as worker 2 of a flat pool of 4 workers does (a
    local one: the MPI backend replaces no rank, but an agent on a rank replaces its local processes)."""
    agents, counts, killed, _, running = _run_losing(mode, "process", 2, 2, **options)
    flat, flat_counts, _, _, _ = _run_losing(mode, "process", processes_per_worker=1, num_workers=4)
    _assert_same_steps(agents, flat)
    assert counts == flat_counts == ({"envs": 0, "workers": 1}, [0] * 8)
    first = agents[0]
    assert sorted(first["reasons"]) == [4, 5] and first["truncated"][[4, 5]].any()
    for index in (4, 5):
        reason = first["reasons"][index]
        assert reason.startswith("local process 0 of worker 1 (a node agent) was replaced (restart 1 of 3) after: ")
        assert "SIGKILL" in reason
        assert flat[0]["reasons"][index].startswith("worker 2 was replaced (restart 1 of 3) after: ")
    assert killed not in running and running[4] == running[5]  # the new local process runs both


@pytest.mark.parametrize("mode", ["same_step", "next_step"])
def test_a_local_process_lost_mid_steps_is_replaced_as_a_flat_pools_worker(no_leaks, mode):
    check_a_local_process_lost_mid_steps_is_replaced_as_a_flat_pools_worker(mode)


@pytest.mark.parametrize("mode", ["same_step", "next_step"])
def test_a_lost_agent_is_replaced_as_a_flat_pools_worker_with_nothing_of_it_left(no_leaks, mode):
    agents, counts, killed, gone, running = _run_losing(mode, "worker", processes_per_worker=2, num_workers=2)
    flat, flat_counts, _, _, _ = _run_losing(mode, "worker", processes_per_worker=1, num_workers=2)
    _assert_same_steps(agents, flat)
    assert counts == flat_counts == ({"envs": 0, "workers": 1}, [0] * 8)
    for index in range(4, 8):
        assert agents[0]["reasons"][index].startswith("worker 1 was replaced (restart 1 of 3) after: ")
    # The old agent's local processes ended with it; the new agent started its own.
    assert wait_until_ended(gone, within=10)
    assert not set(gone) & set(running[4:]) and len(set(running[4:])) == 2


def test_a_local_process_lost_during_asynchronous_batches_is_replaced(no_leaks):
    options = {"autoreset_mode": "next_step", "restart_failed_workers": True, "processes_per_worker": 2}
    with EnvPool([counting_env] * 4, num_workers=2, **options) as pool:
        batches = pool.async_batches(2)
        batches.reset(seeds=list(range(4)))
        _kill(_local_process_of(pool, 3))
        reasons: dict[int, str] = {}
        deadline = time.monotonic() + 30  # worker 0's envs step on while worker 1 replaces its process
        while 3 not in reasons and time.monotonic() < deadline:
            result = batches.recv()
            reasons.update({index: info[RESTART_INFO_KEY] for index, info in result.infos.items()})
            batches.send(np.zeros(2, np.int64), result.env_ids)
        assert list(reasons) == [3]
        assert reasons[3].startswith("local process 1 of worker 1 (a node agent) was replaced (restart 1 of 3)")
        assert pool.restarts == {"envs": 0, "workers": 1}


def test_a_local_process_lost_again_with_its_restarts_spent_is_a_clear_error(no_leaks):
    with EnvPool(
        [counting_env] * 4, num_workers=1, processes_per_worker=2, restart_failed_workers=True, max_restarts=1
    ) as pool:
        pool.reset()
        actions = np.zeros(4, np.int64)
        _kill(_local_process_of(pool, 3))
        assert RESTART_INFO_KEY in pool.step(actions).infos[3]
        _kill(_local_process_of(pool, 0))  # another local process: a budget of its own
        assert RESTART_INFO_KEY in pool.step(actions).infos[0]
        assert pool.restarts == {"envs": 0, "workers": 2}
        _kill(_local_process_of(pool, 2))
        with pytest.raises(EnvError) as caught:
            pool.step(actions)
        error = caught.value
        assert (error.env_index, error.worker_index) == (None, 0)
        assert error.exc_type == "clusterenv_core.errors.WorkerLostError"
        assert "local processes" in error.operation and "SIGKILL" in error.remote_message
        assert "not replaced again: replaced 1 time(s), max_restarts=1" in error.remote_message
        assert pool.restarts == {"envs": 0, "workers": 2}


def test_a_lost_agent_keeps_its_envs_restart_budgets():
    # max_restarts bounds the replacements of one env, whichever agent and local process ran it.
    env_fns = [cartpole_in_process] * 3 + [lambda: ProcessIdEnv(FailingEnv(gym.make("CartPole-v1"), fail_at=2))]
    options = {"restart_failed_envs": True, "restart_failed_workers": True, "max_restarts": 1}
    with EnvPool(env_fns, num_workers=1, processes_per_worker=2, **options) as pool:
        pool.reset(seeds=list(range(4)))
        actions = np.zeros(4, np.int64)
        pool.step(actions)
        assert RESTART_INFO_KEY in pool.step(actions).infos[3]  # env 3 raises: its one replacement
        _kill(pool.worker_pids[0])
        pool.step(actions)  # the agent is replaced: no env restart
        assert pool.restarts == {"envs": 1, "workers": 1} and pool.env_restarts == [0, 0, 0, 1]
        pool.step(actions)
        with pytest.raises(EnvError, match="injected failure at step 2"):  # no budget left for env 3
            pool.step(actions)


def test_carried_env_restarts_of_the_wrong_length_are_refused_before_anything_starts(no_leaks):
    with pytest.raises(ValueError, match="carried_env_restarts: expected 4 counts"):
        EnvPool([counting_env] * 4, num_workers=2, carried_env_restarts=[0, 0, 0])


def _hangs_at_step_2() -> gym.Env:
    return ProcessIdEnv(HangingEnv(gym.make("CartPole-v1"), hang_at=2))


@pytest.mark.slow
def test_a_local_process_stuck_past_the_timeout_is_replaced_by_its_agent():
    # The agent waits for its local process the timeout, the learner for the agent longer (by the
    # time a replacement may take too): the agent replaces its stuck process, never the learner the agent.
    env_fns = [cartpole_in_process] * 3 + [_hangs_at_step_2]
    with EnvPool(env_fns, num_workers=2, processes_per_worker=2, restart_failed_workers=True, timeout=2) as pool:
        pool.reset(seeds=list(range(4)))
        actions = np.zeros(4, np.int64)
        pool.step(actions)
        agent, stuck = pool.worker_pids[1], _local_process_of(pool, 3)
        result = pool.step(actions)
        assert result.truncated.tolist() == [False, False, False, True]  # env 3's process only
        assert RESTART_INFO_KEY not in result.infos.get(2, {})
        assert result.infos[3][RESTART_INFO_KEY] == (
            "local process 1 of worker 1 (a node agent) was replaced (restart 1 of 3) after: "
            f"local process 1 of worker 1 (a node agent; pid {stuck}, env 3) did not answer within 2 s"
        )
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert pool.worker_pids[1] == agent and _local_process_of(pool, 3) != stuck
        assert wait_until_ended([stuck])  # killed to be replaced
        pool.step(actions)


@pytest.mark.slow
def test_sb3_ppo_learns_on_through_a_lost_local_process():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    from clusterenv_sb3 import ClusterVecEnv

    class KillALocalProcess(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps == 4 * 40:
                _kill(self.training_env.env_method("process_id", indices=[3])[0])
            return True

    venv = ClusterVecEnv(
        [cartpole_in_process] * 4, num_workers=2, processes_per_worker=2, restart_failed_workers=True
    )
    try:
        model = PPO("MlpPolicy", venv, n_steps=32, batch_size=64, n_epochs=1, seed=0, device="cpu")
        model.learn(total_timesteps=4 * 32 * 3, callback=KillALocalProcess())
        assert model.num_timesteps == 4 * 32 * 3
        assert venv.pool.restarts == {"envs": 0, "workers": 1}
    finally:
        venv.close()


def _segment_losing_a_process(tmp_path, name: str, **layout) -> tuple:
    """A 6-step segment of 4 CartPoles in which env 3's process is killed at its 4th step."""
    torch = pytest.importorskip("torch")
    from tests.policies import LinearPolicy

    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 3
    env_fns.append(functools.partial(lost_once, str(tmp_path / name), "killed", 4))
    torch.manual_seed(0)
    with EnvPool(env_fns, restart_failed_workers=True, max_restarts=1, timeout=30, **layout) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        rollout = pool.deploy(LinearPolicy()).rollout(6)
        kept = [np.array(rollout.obs), rollout.actions.copy(), rollout.rewards.copy(), rollout.last_obs.copy()]
        return kept, rollout.restarted_envs, rollout.infos, dict(pool.restarts)


def test_a_local_process_lost_mid_rollout_is_replaced_by_its_agent_as_a_flat_worker_is(tmp_path, no_leaks):
    agents = _segment_losing_a_process(tmp_path, "agents", num_workers=1, processes_per_worker=2)
    flat = _segment_losing_a_process(tmp_path, "flat", num_workers=2)
    # The other process's part is what the flat pool's other worker collects; the replacement's is a
    # new segment from a reset (unseeded, as on the flat pool).
    (obs, actions, rewards, last_obs), (flat_obs, flat_actions, flat_rewards, flat_last_obs) = agents[0], flat[0]
    np.testing.assert_array_equal(obs[:, :2], flat_obs[:, :2])  # time-major
    np.testing.assert_array_equal(actions[:, :2], flat_actions[:, :2])
    np.testing.assert_array_equal(rewards[:, :2], flat_rewards[:, :2])
    np.testing.assert_array_equal(last_obs[:2], flat_last_obs[:2])
    assert np.all(np.abs(obs[0, 2:]) <= 0.05)  # CartPole's reset range
    assert agents[1] == flat[1] == [2, 3]
    assert agents[3] == flat[3] == {"envs": 0, "workers": 1}
    for index in (2, 3):
        reason = agents[2][0][index][RESTART_INFO_KEY]
        assert reason.startswith("local process 1 of worker 0 (a node agent) was replaced (restart 1 of 1)"), reason
        assert "worker 1 was replaced (restart 1 of 1)" in flat[2][0][index][RESTART_INFO_KEY]
    assert not any(RESTART_INFO_KEY in info for infos in agents[2][1:] for info in infos.values())


def test_a_lost_agent_is_replaced_with_the_deployed_policy_during_a_segment(no_leaks):
    pytest.importorskip("torch")
    from tests.policies import LinearPolicy

    with EnvPool.make(
        "CartPole-v1", 8, num_workers=2, processes_per_worker=2, restart_failed_workers=True, timeout=30
    ) as pool:
        pool.reset(seeds=list(range(8)))
        actors = pool.deploy(LinearPolicy())
        actors.rollout(4)
        agent = pool.worker_pids[1]
        _kill(agent)
        rollout = actors.rollout(6)
        assert pool.worker_pids[1] != agent
        assert rollout.restarted_envs == [4, 5, 6, 7] and pool.restarts == {"envs": 0, "workers": 1}
        assert "worker 1 was replaced (restart 1 of 3)" in rollout.infos[0][4][RESTART_INFO_KEY]
        assert np.all(np.abs(rollout.obs[0][4:]) <= 0.05)  # the new agent's envs start from a reset
        assert actors.rollout(6).restarted_envs == []  # the new agent acts with the deployed policy
