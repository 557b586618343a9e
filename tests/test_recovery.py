"""Opt-in recovery: a raising env or a lost worker is replaced and its episodes end truncated."""

from __future__ import annotations

import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_core import ClusterEnvError, EnvError, EnvPool, WorkerLostError
from clusterenv_core import channel as channel_module
from clusterenv_core.protocol import RESTART_INFO_KEY
from tests.envs import (
    ActionDtypeEnv,
    ChattyEnv,
    FailingEnv,
    HangingEnv,
    ResetFailingEnv,
    ResetKeywordsEnv,
    SuicidalEnv,
    lost_once,
    write_event,
)
from tests.helpers import interrupt_at_events, wait_until_ended

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def _with(wrapper, **kwargs):
    return wrapper(gym.make("CartPole-v1"), **kwargs)


def _zeros(pool):
    return np.zeros(pool.num_envs, np.int64)


def _obs_copy(pool):
    return pool.buffers.obs[0].copy()


def _dies_then_cannot_be_rebuilt(flag: str) -> gym.Env:
    """CartPole that kills its worker at step 2; building it again fails (a licence server gone)."""
    if os.path.exists(flag):
        raise RuntimeError("the simulator's licence server is unreachable")
    open(flag, "w").close()
    return SuicidalEnv(gym.make("CartPole-v1"), die_at=2)


def _hangs_then_rebuilds_slowly(flag: str, rebuilding: str) -> gym.Env:
    """CartPole whose first process hangs at step 1; building it again takes 2 s (a slow simulator),
    from an event written to ``rebuilding``."""
    if os.path.exists(flag):
        write_event(rebuilding)
        time.sleep(2.0)
        return gym.make("CartPole-v1")
    open(flag, "w").close()
    return HangingEnv(gym.make("CartPole-v1"), hang_at=1)


def test_raising_env_is_replaced_same_step():
    env_fns = [CARTPOLE, functools.partial(_with, FailingEnv, fail_at=4), CARTPOLE]
    with EnvPool(env_fns, num_workers=2, restart_failed_envs=True, max_restarts=2) as pool:
        pool.reset(seeds=[0, 1, 2])
        for _ in range(3):
            pool.step(_zeros(pool))
        before = _obs_copy(pool)
        result = pool.step(_zeros(pool))
        assert result.truncated.tolist() == [False, True, False]
        assert not result.terminated[1] and result.rewards[1] == 0.0
        assert "ValueError: injected failure at step 4" in result.infos[1][RESTART_INFO_KEY]
        assert "restart 1 of 2" in result.infos[1][RESTART_INFO_KEY]
        np.testing.assert_array_equal(result.final_observation(1), before[1])
        assert not np.array_equal(result.obs[1], before[1])  # a new episode started
        assert pool.restarts == {"envs": 1, "workers": 0}
        # The replacement fails again at its own 4th step: second restart, then the error surfaces.
        for _ in range(4):
            result = pool.step(_zeros(pool))
        assert RESTART_INFO_KEY in result.infos[1] and pool.restarts["envs"] == 2
        for _ in range(3):
            pool.step(_zeros(pool))
        with pytest.raises(EnvError, match="injected failure at step 4"):
            pool.step(_zeros(pool))


def test_raising_env_is_replaced_next_step():
    env_fns = [CARTPOLE, functools.partial(_with, FailingEnv, fail_at=2)]
    with EnvPool(env_fns, num_workers=1, autoreset_mode="next_step", restart_failed_envs=True) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(_zeros(pool))
        before = _obs_copy(pool)
        result = pool.step(_zeros(pool))
        assert result.truncated.tolist() == [False, True]
        np.testing.assert_array_equal(result.obs[1], before[1])  # the episode's last observation
        result = pool.step(_zeros(pool))  # the replacement resets, as next_step does after an episode end
        assert result.rewards[1] == 0.0 and not result.truncated[1]
        assert not np.array_equal(result.obs[1], before[1])


def test_a_failed_automatic_reset_keeps_the_episodes_last_step_same_step():
    # The step that ended the episode succeeded; only the reset after it raised. The episode keeps
    # its terminating step (reward, flag, final observation), and the new env starts the next one.
    env_fns = [functools.partial(ResetFailingEnv, fail_at=2), functools.partial(ResetFailingEnv, fail_at=0)]
    with EnvPool(env_fns, num_workers=1, restart_failed_envs=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(_zeros(pool))
        pool.step(_zeros(pool))
        result = pool.step(_zeros(pool))
        assert (result.rewards[0], result.terminated[0], result.truncated[0]) == (1.0, True, False)
        np.testing.assert_array_equal(result.final_observation(0), [1.0, 3.0])
        np.testing.assert_array_equal(result.obs[0], [1.0, 0.0])  # the new env's first reset
        assert "RuntimeError: injected failure at reset 2" in result.infos[0][RESTART_INFO_KEY]
        assert pool.restarts == {"envs": 1, "workers": 0} and pool.env_restarts == [1, 0]


def test_a_failed_automatic_reset_starts_no_phantom_episode_next_step():
    env_fns = [functools.partial(ResetFailingEnv, fail_at=2), functools.partial(ResetFailingEnv, fail_at=0)]
    with EnvPool(env_fns, num_workers=1, autoreset_mode="next_step", restart_failed_envs=True) as pool:
        pool.reset(seeds=[0, 1])
        for _ in range(3):
            result = pool.step(_zeros(pool))
        assert result.terminated[0] and result.rewards[0] == 1.0
        result = pool.step(_zeros(pool))  # the reset step: the old env's reset raises here
        assert (result.rewards[0], result.terminated[0], result.truncated[0]) == (0.0, False, False)
        np.testing.assert_array_equal(result.obs[0], [1.0, 0.0])
        assert "injected failure at reset 2" in result.infos[0][RESTART_INFO_KEY]
        result = pool.step(_zeros(pool))
        np.testing.assert_array_equal(result.obs[0], [1.0, 1.0])
        assert pool.restarts == {"envs": 1, "workers": 0}


def test_a_worker_lost_in_a_reset_step_starts_no_phantom_episode_next_step():
    # Env 0's episode ends at step 3; its worker dies in the reset of step 4. Env 0 takes that reset
    # step on the replacement; env 1, mid-episode in the same block, ends truncated.
    env_fns = [functools.partial(ResetFailingEnv, fail_at=2, kill=True)] + [functools.partial(ResetFailingEnv, fail_at=0)] * 2
    with EnvPool(env_fns, num_workers=2, autoreset_mode="next_step", restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1, 2])
        pool.step(_zeros(pool))
        pool.reset(mask=np.array([False, True, False]))  # env 1's episodes run a step behind
        for _ in range(2):
            result = pool.step(_zeros(pool))
        assert result.terminated.tolist() == [True, False, True]
        before = _obs_copy(pool)
        result = pool.step(_zeros(pool))
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert (result.rewards[0], result.terminated[0], result.truncated[0]) == (0.0, False, False)
        np.testing.assert_array_equal(result.obs[0], [1.0, 0.0])  # the new env's first reset
        assert (result.rewards[1], result.terminated[1], result.truncated[1]) == (0.0, False, True)
        np.testing.assert_array_equal(result.obs[1], before[1])
        for index in (0, 1):
            assert "worker 0 was replaced" in result.infos[index][RESTART_INFO_KEY]
        assert not result.truncated[2] and RESTART_INFO_KEY not in result.infos.get(2, {})
        result = pool.step(_zeros(pool))
        np.testing.assert_array_equal(result.obs[0], [1.0, 1.0])  # a step, not a second reset
        assert (result.rewards[0], result.rewards[1], result.truncated[1]) == (1.0, 0.0, False)


def test_a_replacement_ends_episodes_the_learner_reset_next_step():
    # Env 0's episode ended, then the learner reset every env: the step in which the worker dies is
    # a step of env 0's new episode, which ends truncated, not a reset step.
    env_fns = [functools.partial(ResetFailingEnv, fail_at=0), lambda: SuicidalEnv(ResetFailingEnv(fail_at=0), die_at=4)]
    with EnvPool(env_fns, num_workers=1, autoreset_mode="next_step", restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        for _ in range(3):
            result = pool.step(_zeros(pool))
        assert result.terminated[0]
        pool.reset(seeds=[0, 1])
        result = pool.step(_zeros(pool))
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert result.truncated.tolist() == [True, True]
        np.testing.assert_array_equal(result.obs[0], [2.0, 0.0])  # its last observation, from the reset


@pytest.mark.parametrize("num_workers", [1, 2])
def test_env_restarts_are_counted_in_a_step_that_fails(num_workers):
    # Env 0 is replaced at step 2, in which env 1 (replaced at step 1) raises with no budget left.
    env_fns = [functools.partial(_with, FailingEnv, fail_at=2), functools.partial(_with, FailingEnv, fail_at=1)]
    with EnvPool(env_fns, num_workers=num_workers, restart_failed_envs=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(_zeros(pool))
        with pytest.raises(EnvError, match="injected failure at step 1"):
            pool.step(_zeros(pool))
        assert pool.restarts == {"envs": 2, "workers": 0} and pool.env_restarts == [1, 1]


def test_env_restarts_of_a_step_cut_short_by_ctrl_c_are_counted(ctrl_c_after_send):
    # Ctrl-C once worker 0 has its step: that step's reply is read and dropped by the next call, and
    # the env it replaced counts all the same (a replacement worker gets what is left of its budget).
    env_fns = [functools.partial(_with, FailingEnv, fail_at=1), CARTPOLE]
    with EnvPool(env_fns, num_workers=2, restart_failed_envs=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        ctrl_c_after_send()
        with pytest.raises(KeyboardInterrupt):
            pool.step(_zeros(pool))  # worker 0 got its step, in which env 0 is replaced; worker 1 none
        pool.reset(seeds=[0, 1])
        assert pool.restarts == {"envs": 1, "workers": 0} and pool.env_restarts == [1, 0]


@pytest.mark.parametrize("interrupted_reply", [1, 2])
def test_env_restarts_read_just_before_ctrl_c_cut_the_reading_call_short_are_counted_once(
    ctrl_c_after_send, ctrl_c_at_call, interrupted_reply
):
    # Both workers get their step, in which each replaces its env; Ctrl-C cuts the next call short
    # just after it read the first or the second reply, as it takes it in: each restart counts once.
    env_fns = [functools.partial(_with, FailingEnv, fail_at=1)] * 2
    with EnvPool(env_fns, num_workers=2, restart_failed_envs=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        ctrl_c_after_send(sends=2)
        with pytest.raises(KeyboardInterrupt):
            pool.step(_zeros(pool))
        ctrl_c_at_call(channel_module, "replaced_envs", calls=interrupted_reply)
        with pytest.raises(KeyboardInterrupt):
            pool.reset(seeds=[0, 1])
        pool.reset(seeds=[0, 1])
        assert pool.restarts == {"envs": 2, "workers": 0} and pool.env_restarts == [1, 1]


def test_an_envs_restart_budget_outlives_its_worker():
    # max_restarts bounds the replacements of the same env, whichever worker process ran it.
    env_fns = [CARTPOLE, functools.partial(_with, FailingEnv, fail_at=2)]
    options = {"restart_failed_envs": True, "restart_failed_workers": True, "max_restarts": 1}
    with EnvPool(env_fns, num_workers=1, **options) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(_zeros(pool))
        result = pool.step(_zeros(pool))  # env 1 raises: its one replacement
        assert RESTART_INFO_KEY in result.infos[1]
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        pool.step(_zeros(pool))  # the worker is replaced: not an env restart
        assert pool.restarts == {"envs": 1, "workers": 1}
        pool.step(_zeros(pool))
        with pytest.raises(EnvError, match="injected failure at step 2"):  # no budget left for env 1
            pool.step(_zeros(pool))


def test_lost_worker_is_replaced_same_step():
    env_fns = [CARTPOLE, CARTPOLE, CARTPOLE, functools.partial(_with, SuicidalEnv, die_at=3)]
    options = {"restart_failed_workers": True, "restart_failed_envs": True, "max_restarts": 1}
    with EnvPool(env_fns, num_workers=2, **options) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        pool.step(_zeros(pool))
        pool.step(_zeros(pool))
        before = _obs_copy(pool)
        old_pid = pool._transport.processes[1].pid
        result = pool.step(_zeros(pool))
        assert pool._transport.processes[1].pid != old_pid
        assert result.truncated.tolist() == [False, False, True, True]
        assert result.rewards.tolist()[2:] == [0.0, 0.0]
        for index in (2, 3):
            assert "worker 1 was replaced (restart 1 of 1)" in result.infos[index][RESTART_INFO_KEY]
            assert "SIGKILL" in result.infos[index][RESTART_INFO_KEY]
            np.testing.assert_array_equal(result.final_observation(index), before[index])
        assert RESTART_INFO_KEY not in result.infos.get(0, {})
        assert pool.restarts == {"envs": 0, "workers": 1}
        pool.step(_zeros(pool))
        pool.step(_zeros(pool))
        with pytest.raises(WorkerLostError):  # the replacement dies too, and the budget is spent
            pool.step(_zeros(pool))


def _dtype_echoing_envs(num_envs: int) -> list:
    return [functools.partial(ActionDtypeEnv, gym.spaces.Box(-1.0, 1.0, (1,), np.float32))] * num_envs


def _lose_worker(pid: int, how: str) -> None:
    """``killed``: the worker is gone before it is told anything (sending to it fails); ``stopped``:
    it takes the request and never answers (its reply times out)."""
    os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    if how == "killed":
        assert wait_until_ended([pid])
        return
    deadline = time.monotonic() + 5
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"worker {pid} not stopped after 5 s"
        time.sleep(0.01)


def test_a_replacement_resets_its_envs_as_automatic_resets_do():
    """A lost worker's replacement resets its envs with ``reset()``, as automatic resets do (not with
    the ``seed=None, options=None`` of the learner's unseeded resets)."""
    with EnvPool([ResetKeywordsEnv] * 2, num_workers=2, restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        _lose_worker(pool._transport.processes[1].pid, "killed")
        result = pool.step(_zeros(pool))
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert result.truncated.tolist() == [False, True]
        assert result.reset_infos[1] == {"reset_keywords": ""}


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_worker_lost_while_told_new_action_dtypes_is_replaced(how):
    # Actions in float64 after float32: the workers are told the new dtype before the step starts.
    with EnvPool(_dtype_echoing_envs(2), num_workers=2, timeout=2.0, restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(np.zeros((2, 1), np.float32))
        _lose_worker(pool.worker_pids[0], how)
        result = pool.step(np.zeros((2, 1), np.float64))
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert result.truncated.tolist() == [True, False] and RESTART_INFO_KEY in result.infos[0]
        assert result.infos[1]["dtype"] == "float64"
        result = pool.step(np.zeros((2, 1), np.float64))  # the replacement was told the dtype
        assert [result.infos[index]["dtype"] for index in (0, 1)] == ["float64", "float64"]


def test_a_worker_lost_while_told_the_spaces_dtypes_for_asynchronous_batches_is_replaced():
    options = {"autoreset_mode": "next_step", "restart_failed_workers": True}
    with EnvPool(_dtype_echoing_envs(2), num_workers=2, **options) as pool:
        batches = pool.async_batches(1)
        batches.reset(seeds=[0, 1])
        for _ in range(2):
            batches.recv()
        pool.step(np.zeros((2, 1), np.float64))  # the workers read float64, batches give float32
        batches.reset(seeds=[0, 1])
        _lose_worker(pool.worker_pids[0], "killed")
        for _ in range(2):
            batches.send(np.zeros((1, 1), np.float64), batches.recv().env_ids)
        infos: dict[int, list] = {0: [], 1: []}
        # Env 0's episode ends truncated, its reset step follows, then steps. A replacement forked
        # from the fork server can return all three before env 1's worker is next scheduled.
        for _ in range(1000):
            result = batches.recv()
            env = int(result.env_ids[0])
            infos[env].append(result.infos.get(env, {}))
            batches.send(np.zeros((1, 1), np.float64), result.env_ids)
            if len(infos[0]) >= 3 and infos[1]:
                break
        assert pool.restarts == {"envs": 0, "workers": 1} and RESTART_INFO_KEY in infos[0][0]
        assert {info["dtype"] for info in infos[0][2:]} == {"float32"}  # the replacement reads the space's dtype
        assert {info["dtype"] for info in infos[1]} == {"float32"}


def test_a_replacement_workers_stderr_is_forwarded_however_often_it_was_replaced(capfd):
    # Each replacement gets a new pipe, whose number is often that of the last one, closed at its
    # end-of-file: it must be read all the same, or a worker writing much would block on it.
    with EnvPool([ChattyEnv] * 2, num_workers=2, restart_failed_workers=True, max_restarts=5, timeout=10) as pool:
        pool.reset(seeds=[0, 1])
        for restart in range(4):
            os.kill(pool.worker_pids[0], signal.SIGKILL)
            time.sleep(0.2)  # the learner's reader sees the end of the dead worker's stderr
            pool.step(_zeros(pool))
            started = time.monotonic()
            pool.call("say", (f"line after restart {restart + 1}", 4000), indices=[0])  # ~100 KiB
            assert time.monotonic() - started < 5
        time.sleep(0.5)
        assert pool.restarts["workers"] == 4
    assert "line after restart 4" in capfd.readouterr().err


@pytest.mark.slow
def test_stuck_worker_is_replaced_next_step():
    env_fns = [CARTPOLE, functools.partial(_with, HangingEnv, hang_at=2)]
    with EnvPool(
        env_fns, num_workers=2, timeout=3.0, autoreset_mode="next_step", restart_failed_workers=True
    ) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(_zeros(pool))
        before = _obs_copy(pool)
        result = pool.step(_zeros(pool))
        assert result.truncated.tolist() == [False, True]
        assert "did not answer within 3 s" in result.infos[1][RESTART_INFO_KEY]
        np.testing.assert_array_equal(result.obs[1], before[1])
        result = pool.step(_zeros(pool))
        assert result.rewards[1] == 0.0 and not result.truncated[1]


@pytest.mark.slow
def test_ctrl_c_while_a_lost_worker_is_replaced_then_resume(tmp_path):
    # The step times out after 1 s and the replacement builds its env for 2 s: Ctrl-C lands there.
    rebuilding = str(tmp_path / "rebuilding")
    env_fns = [CARTPOLE, functools.partial(_hangs_then_rebuilds_slowly, str(tmp_path / "hung"), rebuilding)]
    with EnvPool(env_fns, num_workers=2, timeout=1.0, restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        interrupt_at_events(rebuilding, 1)
        with pytest.raises(KeyboardInterrupt):
            pool.step(_zeros(pool))
        result = pool.step_wait()  # the replacement is done again, and counted once
        assert result.truncated.tolist() == [False, True]
        assert "restart 1 of 3" in result.infos[1][RESTART_INFO_KEY]
        assert pool.restarts == {"envs": 0, "workers": 1}
        for _ in range(3):
            assert not pool.step(_zeros(pool)).truncated.any()


@pytest.mark.slow
def test_ctrl_c_while_a_lost_worker_is_replaced_in_asynchronous_batches(tmp_path):
    rebuilding = str(tmp_path / "rebuilding")
    env_fns = [CARTPOLE, functools.partial(_hangs_then_rebuilds_slowly, str(tmp_path / "hung"), rebuilding)]
    with EnvPool(env_fns, num_workers=2, timeout=1.0, autoreset_mode="next_step", restart_failed_workers=True) as pool:
        batches = pool.async_batches(1)
        batches.reset(seeds=[0, 1])
        for _ in range(2):
            batches.send(np.zeros(1, np.int64), batches.recv().env_ids)  # env 1's worker hangs
        interrupt_at_events(rebuilding, 1)
        with pytest.raises(KeyboardInterrupt):
            while True:
                batches.send(np.zeros(1, np.int64), batches.recv().env_ids)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            result = batches.recv()
            if result.env_ids[0] == 1:
                break
            batches.send(np.zeros(1, np.int64), result.env_ids)
        assert result.env_ids.tolist() == [1] and result.truncated[0]
        assert RESTART_INFO_KEY in result.infos[1] and pool.restarts["workers"] == 1


def test_sb3_adapter_passes_restart_options():
    pytest.importorskip("stable_baselines3")
    from clusterenv_sb3 import ClusterVecEnv

    env_fns = [CARTPOLE, functools.partial(_with, FailingEnv, fail_at=2)]
    venv = ClusterVecEnv(env_fns, num_workers=2, restart_failed_envs=True)
    try:
        venv.reset()
        venv.step(np.zeros(2, np.int64))
        _, _, dones, infos = venv.step(np.zeros(2, np.int64))
        assert dones.tolist() == [False, True]
        assert infos[1]["TimeLimit.truncated"] is True
        assert RESTART_INFO_KEY in infos[1] and "terminal_observation" in infos[1]
    finally:
        venv.close()


def test_a_replacement_that_cannot_build_its_envs_leaves_the_pool_failed(tmp_path):
    env_fns = [CARTPOLE, functools.partial(_dies_then_cannot_be_rebuilt, str(tmp_path / "built"))]
    with EnvPool(env_fns, num_workers=2, restart_failed_workers=True, max_restarts=3) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(_zeros(pool))
        with pytest.raises(EnvError, match="licence server is unreachable") as caught:
            pool.step(_zeros(pool))
        assert (caught.value.env_index, caught.value.worker_index) == (1, 1)
        assert isinstance(caught.value.__cause__, WorkerLostError)
        # Not an env without its block (AttributeErrors that SB3's has_attr would take for "no such
        # attribute"), nor restarts spent on replacements that cannot build: the pool is done.
        for call in (lambda: pool.step(_zeros(pool)), pool.reset, lambda: pool.get_attr("spec")):
            with pytest.raises(ClusterEnvError, match="unusable after an earlier failure"):
                call()
        assert pool.restarts["workers"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stuck"])
def test_a_worker_lost_during_a_segment_is_replaced_and_its_part_collected_anew(tmp_path, how):
    torch = pytest.importorskip("torch")
    from tests.policies import LinearPolicy, reference_rollout

    flag = str(tmp_path / "built")
    env_fns = [CARTPOLE, CARTPOLE, CARTPOLE, functools.partial(lost_once, flag, how, 4)]
    with EnvPool(env_fns, num_workers=2, timeout=2.0, restart_failed_workers=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        policy = LinearPolicy()
        actors = pool.deploy(policy)
        old_pid = pool.worker_pids[1]
        rollout = actors.rollout(6)  # env 3's worker is lost at its 4th step
        assert pool.worker_pids[1] != old_pid
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert rollout.restarted_envs == [2, 3]
        expected_cause = "SIGKILL" if how == "killed" else "did not answer within"
        for index in (2, 3):
            reason = rollout.infos[0][index][RESTART_INFO_KEY]
            assert "worker 1 was replaced (restart 1 of 1)" in reason and expected_cause in reason
        assert not any(RESTART_INFO_KEY in info for infos in rollout.infos[1:] for info in infos.values())
        assert RESTART_INFO_KEY not in rollout.infos[0].get(0, {})
        # Worker 0's part is the segment it would have collected anyway.
        expected, last_obs = reference_rollout(policy, [0, 1], 6)
        for t, step in enumerate(expected):
            np.testing.assert_array_equal(rollout.obs[t][:2], step["obs"])
            assert rollout.rewards[t][:2].tolist() == step["rewards"]
        np.testing.assert_array_equal(rollout.last_obs[:2], last_obs)
        # The replacement's part: new episodes from a reset, six steps acted on by the deployed policy.
        assert np.all(np.abs(rollout.obs[0][2:]) <= 0.05)  # CartPole's reset range
        with torch.no_grad():
            greedy = policy.act(torch.as_tensor(np.asarray(rollout.obs)[:, 2:]))["actions"].numpy()
        np.testing.assert_array_equal(rollout.actions[:, 2:], greedy)
        assert rollout.rewards[:, 2:].tolist() == [[1.0, 1.0]] * 6 and (rollout.versions == 0).all()
        following = actors.rollout(6)
        assert following.restarted_envs == [] and RESTART_INFO_KEY not in following.infos[0].get(2, {})
        np.testing.assert_array_equal(following.obs[0], rollout.last_obs)
        pool.step(_zeros(pool))


@pytest.mark.slow
def test_a_worker_lost_again_during_a_segment_with_no_restarts_left_fails_the_pool():
    pytest.importorskip("torch")
    from tests.policies import LinearPolicy

    env_fns = [CARTPOLE, functools.partial(_with, SuicidalEnv, die_at=3)]  # its replacement dies at step 3, too
    with EnvPool(env_fns, num_workers=2, restart_failed_workers=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        with pytest.raises(WorkerLostError, match="worker 1"):
            actors.rollout(8)
        assert pool.restarts == {"envs": 0, "workers": 1}
        with pytest.raises(ClusterEnvError, match="unusable after an earlier failure"):
            actors.rollout(8)
    with EnvPool(env_fns, num_workers=2) as pool:  # restarts off: the first loss is fatal
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        with pytest.raises(WorkerLostError, match="worker 1"):
            actors.rollout(8)
        assert pool.restarts == {"envs": 0, "workers": 0}


@pytest.mark.slow
def test_ctrl_c_while_a_worker_lost_during_a_segment_is_replaced_then_resume(tmp_path):
    pytest.importorskip("torch")
    from tests.policies import LinearPolicy

    # The segment times out after 1 s and the replacement builds its env for 2 s: Ctrl-C lands there.
    rebuilding = str(tmp_path / "rebuilding")
    env_fns = [CARTPOLE, functools.partial(_hangs_then_rebuilds_slowly, str(tmp_path / "hung"), rebuilding)]
    with EnvPool(env_fns, num_workers=2, timeout=1.0, restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        interrupt_at_events(rebuilding, 1)
        with pytest.raises(KeyboardInterrupt):
            actors.rollout(4)
        assert actors.wait_interrupted and pool.restarts["workers"] == 1  # interrupted while replacing
        rollout = actors.rollout_wait()  # the replacement is done again, and counted once
        assert rollout.restarted_envs == [1] and "restart 1 of 3" in rollout.infos[0][1][RESTART_INFO_KEY]
        assert pool.restarts == {"envs": 0, "workers": 1}
        assert actors.rollout(4).restarted_envs == []


@pytest.mark.slow
def test_a_worker_replaced_in_a_step_takes_the_deployed_policy():
    torch = pytest.importorskip("torch")
    from tests.policies import LinearPolicy

    with EnvPool([CARTPOLE] * 2, num_workers=2, restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        actors.rollout(3)
        version = actors.publish_weights(torch.zeros(actors.weights_nbytes // 4).numpy())
        _lose_worker(pool.worker_pids[1], "killed")
        assert pool.step(_zeros(pool)).truncated.tolist() == [False, True]
        rollout = actors.rollout(3)  # the replacement acts with the current weights
        assert rollout.restarted_envs == [] and (rollout.versions == version).all()
