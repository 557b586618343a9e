"""The Ray backend (``backend="ray"``): results of ``DummyVecEnv`` and ``SyncVectorEnv`` exactly, flat
actors and node agents; per-env calls, asynchronous batches, worker-side inference; failing, hanging
and killed actors; nothing left after close. Every test shares one Ray instance of two CPUs (the
``ray_session`` fixture), started by the first of them; all are marked ``slow``, which the fast loop
(``-m "not slow"``) skips."""

from __future__ import annotations

import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("ray")

from clusterenv_cleanrl import ClusterVectorEnv  # noqa: E402
from clusterenv_core import EnvError, EnvPool, WorkerLostError, WorkerTimeoutError  # noqa: E402
from clusterenv_core.protocol import RESTART_INFO_KEY  # noqa: E402
from tests.envs import (  # noqa: E402
    FailingEnv,
    HangingEnv,
    SuicidalEnv,
    cartpole_with_statistics,
    make_cartpole,
    make_dict_env,
)
from tests.helpers import run_and_compare, run_side_by_side, wait_for_events  # noqa: E402
from tests.test_async_batches import (  # noqa: E402
    check_full_batch_is_sync_vector_env,
    check_trajectories_match_envs_alone,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1
RAY = {"backend": "ray", "timeout": 30}
short_cartpole = functools.partial(cartpole_with_statistics, max_episode_steps=40)


def _failing_at(fail_at: int) -> gym.Env:
    return FailingEnv(gym.make("CartPole-v1"), fail_at=fail_at)


def _hanging(path: str) -> gym.Env:
    return HangingEnv(gym.make("CartPole-v1"), hang_at=2, hanging=path)


def _processes(pids: list[int]) -> list:
    import psutil

    processes = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return processes


@pytest.mark.parametrize("processes", [1, 2])
def test_vec_env_is_dummy_vec_env(no_leaks, processes):
    for env_fn in (make_cartpole, make_dict_env):
        episodes, _ = run_side_by_side([env_fn] * 4, steps=200, num_workers=2, processes_per_worker=processes, **RAY)
        assert episodes > 3


@pytest.mark.parametrize("processes", [1, 2])
def test_vector_env_is_sync_vector_env(no_leaks, processes):
    mode = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP} if GYMNASIUM_1 else {}
    env_fns = [short_cartpole] * 4
    cluster = ClusterVectorEnv(env_fns, num_workers=2, processes_per_worker=processes, **mode, **RAY)
    sync = gym.vector.SyncVectorEnv(env_fns, **mode)
    with cluster:
        counts = run_and_compare(cluster, sync, 200, seed=1)
    sync.close()
    assert counts["terminated"] > 3 and counts["truncated"] > 3, counts


def test_per_env_calls(no_leaks):
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 5
    with EnvPool(env_fns, num_workers=2, **RAY) as pool:
        pool.set_attr("marker", ["a", "b", "c"], indices=[4, 0, 2])
        assert pool.get_attr("marker", indices=[0, 2, 4]) == ["b", "c", "a"]
        assert pool.call("has_wrapper_attr", ["marker"], indices=[-1]) == [True]
        assert pool.get_attr("spec", indices=[3])[0].id == "CartPole-v1"
        with pytest.raises(IndexError):
            pool.get_attr("spec", indices=[5])


@pytest.mark.skipif(not GYMNASIUM_1, reason="next-step autoreset is gymnasium 1.x's SyncVectorEnv")
def test_async_batches(no_leaks):
    check_trajectories_match_envs_alone(4, recvs=100, **RAY)
    check_full_batch_is_sync_vector_env(steps=100, **RAY)


def test_a_failing_env_is_named_with_its_remote_traceback_and_the_actor_lives_on(no_leaks):
    env_fns = [make_cartpole] * 3 + [functools.partial(_failing_at, 2)]
    with EnvPool(env_fns, num_workers=2, **RAY) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        pids = pool.worker_pids
        pool.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(EnvError) as caught:
            pool.step(np.zeros(4, dtype=np.int64))
        error = caught.value
        assert (error.env_index, error.worker_index, error.exc_type) == (3, 1, "builtins.ValueError")
        assert "injected failure at step 2" in str(error) and "in step" in error.remote_traceback
        pool.reset()
        pool.step(np.zeros(4, dtype=np.int64))
        assert pool.worker_pids == pids


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_killed_actor_is_a_worker_lost_error_naming_it(no_leaks, how):
    import ray

    pool = EnvPool([make_cartpole] * 4, num_workers=2, **RAY)
    try:
        pool.reset(seeds=[0, 1, 2, 3])
        if how == "SIGKILL":
            os.kill(pool.worker_pids[1], signal.SIGKILL)
        else:
            ray.kill(pool._transport.actors[1])
        began = time.monotonic()
        with pytest.raises(WorkerLostError, match=r"worker 1 \(Ray actor, pid \d+ on .*, envs 2-3\) died"):
            pool.step(np.zeros(4, dtype=np.int64))
        assert time.monotonic() - began < 10
    finally:
        pool.close()


def test_a_hanging_env_is_a_timeout_and_close_kills_the_actor(no_leaks, tmp_path):
    path = str(tmp_path / "hanging")
    pool = EnvPool([make_cartpole, functools.partial(_hanging, path)], num_workers=2, backend="ray", timeout=3)
    try:
        pool.reset()
        pool.step(np.zeros(2, dtype=np.int64))
        began = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="worker 1"):
            pool.step(np.zeros(2, dtype=np.int64))
        assert 3 <= time.monotonic() - began < 10
        wait_for_events(path, 1)
    finally:
        pool.close()


@pytest.mark.parametrize("processes", [1, 2])
def test_close_ends_the_actors_and_what_they_started(no_leaks, processes):
    pool = EnvPool([make_cartpole] * 4, num_workers=2, processes_per_worker=processes, **RAY)
    pool.reset()
    started = _processes(pool.worker_pids)
    assert len(started) >= 2 * processes  # an agent's local processes are its children
    pool.close()
    deadline = time.monotonic() + 10
    while any(process.is_running() for process in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process.is_running() for process in started)


def test_actors_and_their_processes_run_at_the_learners_niceness(no_leaks):
    """As local workers do, not at the niceness 15 Ray starts its workers with (they all but stopped,
    and missed the pool's timeout, while processes at niceness 0 kept the node's cores busy); a
    runtime env's RAY_worker_niceness among actor_options sets another."""
    learner = os.getpriority(os.PRIO_PROCESS, 0)
    for options, expected in (({}, learner), ({"runtime_env": {"env_vars": {"RAY_worker_niceness": "7"}}}, 7)):
        ray_options = {"actor_options": options, "cpus_per_actor": 0.5}
        layout = {"num_workers": 2, "processes_per_worker": 2}
        with EnvPool([make_cartpole] * 4, **layout, backend_options=ray_options, **RAY) as pool:
            processes = _processes(pool.worker_pids)
            assert len(processes) >= 2 * 3  # each actor, its 2 local processes (and their helpers)
            assert {process.nice() for process in processes} == {expected}


def test_bad_options_are_value_errors_before_anything_starts():
    with pytest.raises(ValueError, match="placement"):
        EnvPool([make_cartpole], backend="ray", backend_options={"placement": "NEAR"})
    with pytest.raises(ValueError, match="cpus_per_actor"):
        EnvPool([make_cartpole], backend="ray", backend_options={"cpus_per_actor": 0})
    with pytest.raises(ValueError, match="num_cpus"):
        EnvPool([make_cartpole], backend="ray", backend_options={"actor_options": {"num_cpus": 2}})
    for replace_timeout in (0, -1, "60", True):
        with pytest.raises(ValueError, match="replace_timeout"):
            EnvPool([make_cartpole], backend="ray", backend_options={"replace_timeout": replace_timeout})


def test_actors_that_cannot_be_placed_are_a_clear_error(no_leaks):
    with pytest.raises(WorkerTimeoutError, match="Ray could not place 2 actors of 2 CPUs"):
        EnvPool([make_cartpole] * 2, num_workers=2, backend="ray", backend_options={"cpus_per_actor": 2}, timeout=1)


def test_default_is_one_actor_per_node_with_a_process_per_cpu():
    with EnvPool([make_cartpole] * 3, backend="ray") as pool:
        assert pool.num_workers == 1  # the test Ray is one node, of 2 CPUs
        assert pool.processes_per_worker == 2
        pool.reset(seeds=[0, 1, 2])
        assert pool.step(np.zeros(3, dtype=np.int64)).rewards.tolist() == [1.0] * 3
    with EnvPool([make_cartpole] * 3, backend="ray", num_workers=2) as pool:
        assert pool.processes_per_worker == 1  # a layout of the user's: one process per actor unless told
    with EnvPool([make_cartpole], backend="ray") as pool:
        assert pool.processes_per_worker == 1  # at most the envs of a block


# -- worker-side inference (flat actors) -------------------------------------------------------------


def test_rollouts_act_with_each_sync_put_once_for_all_actors(no_leaks, monkeypatch):
    torch = pytest.importorskip("torch")
    import ray

    from tests.policies import LinearPolicy, assert_rollout_matches, reference_rollout

    puts = []
    put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kwargs: puts.append(value) or put(value, **kwargs))
    torch.manual_seed(1)
    policy = LinearPolicy(greedy=True)
    seeds = [10, 11, 12, 13]
    expected, last_obs = reference_rollout(policy, seeds, 60)
    with EnvPool.make("CartPole-v1", 4, num_workers=2, **RAY) as pool:
        pool.reset(seeds=seeds)
        actors = pool.deploy(policy)
        assert_rollout_matches(actors.rollout(60), expected, last_obs)
        assert len(puts) == 1  # the deployed weights: one object for both actors
        with torch.no_grad():
            policy.linear.weight.neg_()
        assert actors.publish_weights(policy) == 1
        second = actors.rollout(5)
        assert len(puts) == 2 and (second.versions == 1).all()
        with torch.no_grad():
            np.testing.assert_array_equal(second.actions[0], policy.linear(torch.as_tensor(second.obs[0])).argmax(-1))
        # Published while a segment runs: where memory is not shared (as with MPI) the weights go
        # out with the next segment's request.
        actors.rollout_async(50)
        actors.publish_weights(policy)
        assert (actors.rollout_wait().versions == 1).all() and len(puts) == 2
        assert (actors.rollout(5).versions == 2).all() and len(puts) == 3


def test_a_segment_longer_than_the_timeout_completes_on_progress_and_a_stuck_one_times_out(no_leaks):
    """As ``tests/test_inference.run_rollout_timeout_checks`` on the local backend, with a timeout of
    three seconds: the first progress report comes a quarter of it after the segment starts, and a
    Ray call's dispatch on two busy cores, shared with other test runs, can take a good part of 0.4 s
    (once more than a second)."""
    pytest.importorskip("torch")
    from clusterenv_core.shutdown import CLOSE_TIMEOUT
    from tests.envs import SlowCartPole
    from tests.policies import LinearPolicy

    slow = [functools.partial(SlowCartPole, 0.1)] * 2  # 40 steps: 4 s, longer than the timeout
    with EnvPool(slow, num_workers=2, **RAY) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        assert actors.rollout(40, timeout=3.0).rewards.shape == (40, 2)
        actors.rollout_async(40, timeout=3.0)  # the wait starts late, as when training overlaps
        time.sleep(4.5)
        assert actors.rollout_wait().rewards.shape == (40, 2)
        actors.rollout_async(400, timeout=3.0)
        time.sleep(3.0)  # progress reports queue up; closing reads past them and ends the segment early
        started = time.monotonic()
        pool.close()
        assert time.monotonic() - started < CLOSE_TIMEOUT
    hanging = [functools.partial(gym.make, "CartPole-v1"), functools.partial(HangingEnv, gym.make("CartPole-v1"), 5)]
    with EnvPool(hanging, num_workers=2, **RAY) as pool:
        pool.reset()
        actors = pool.deploy(LinearPolicy())
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="worker 1"):
            actors.rollout(100, timeout=3.0)
        assert time.monotonic() - started < 10.0


def test_node_agents_sample_as_flat_actors():
    pytest.importorskip("torch")
    from tests.policies import LinearPolicy
    from tests.test_node_agent_inference import check_sampled_rollouts_are_those_of_flat_workers

    # 4 flat actors on the session's 2 CPUs: half a CPU each.
    check_sampled_rollouts_are_those_of_flat_workers(
        LinearPolicy, "ray", timeout=30, backend_options={"cpus_per_actor": 0.5}
    )


def test_sb3_ppo_on_ray_actors_collects_what_sb3_collects():
    pytest.importorskip("stable_baselines3")
    import stable_baselines3 as sb3
    from stable_baselines3.common.env_util import make_vec_env

    from clusterenv_sb3 import PPO, ClusterVecEnv
    from tests.sb3_helpers import assert_same_collection, dummy_vec_env, first_segments
    from tests.test_sb3_worker_inference import ObsSeededPolicy

    kwargs = dict(policy=ObsSeededPolicy, n_steps=32, batch_size=64, n_epochs=2)
    reference = first_segments(sb3.PPO, dummy_vec_env("CartPole-v1", max_episode_steps=25), 2, **kwargs)
    env = make_vec_env(
        "CartPole-v1",
        n_envs=4,
        seed=0,
        env_kwargs={"max_episode_steps": 25},
        vec_env_cls=ClusterVecEnv,
        vec_env_kwargs={"num_workers": 2, **RAY},
    )
    try:
        ours = first_segments(PPO, env, 2, **kwargs)
        assert_same_collection(ours, reference)
        assert ours[0].policy_sync.stats.syncs == 1 and env.pool.actors.policy_version == 1
    finally:
        env.close()


WORKER_SIDE = {  # clusterenv_sb3's worker-side algorithms: env id, options, timesteps
    "A2C": ("CartPole-v1", {"n_steps": 8}, 256),
    "DQN": ("CartPole-v1", {"learning_starts": 64, "train_freq": 4, "batch_size": 32}, 256),
    "SAC": ("Pendulum-v1", {"learning_starts": 64, "train_freq": 4, "gradient_steps": 2, "batch_size": 32}, 256),
    "TD3": ("Pendulum-v1", {"learning_starts": 64, "train_freq": 4, "gradient_steps": 2, "batch_size": 32}, 256),
}


@pytest.mark.parametrize("name", sorted(WORKER_SIDE))
def test_worker_side_algorithms_with_aaps_learn_on_ray_actors_what_they_learn_on_local_workers(name, one_torch_thread):
    """clusterenv_sb3's A2C, DQN, SAC and TD3 acting on the workers, with AAPS: seeded, the same
    parameters after training on Ray actors as on local workers of the same layout (flat, and node
    agents)."""
    pytest.importorskip("stable_baselines3")
    import torch
    from stable_baselines3.common.env_util import make_vec_env

    import clusterenv_sb3

    env_id, options, timesteps = WORKER_SIDE[name]
    if name == "TD3":  # AAPS compares TD3 actors through their Gaussian exploration noise
        from stable_baselines3.common.noise import NormalActionNoise

        options = {**options, "action_noise": NormalActionNoise(np.zeros(1), 0.3 * np.ones(1))}
    states = {}
    for backend, processes in [(backend, processes) for processes in (1, 2) for backend in ("local", "ray")]:
        env = make_vec_env(
            env_id,
            n_envs=4,
            seed=0,
            vec_env_cls=clusterenv_sb3.ClusterVecEnv,
            vec_env_kwargs={"backend": backend, "num_workers": 2, "processes_per_worker": processes},
        )
        try:
            model = getattr(clusterenv_sb3, name)(
                "MlpPolicy", env, seed=0, device="cpu", policy_kwargs={"net_arch": [16]}, **options
            )
            model.learn(timesteps, callback=clusterenv_sb3.AAPSCallback(kl_threshold=0.01))
            assert model.policy_sync.stats.updates > 0
            states[backend, processes] = {key: value.clone() for key, value in model.policy.state_dict().items()}
        finally:
            env.close()
    for processes in (1, 2):
        for key, value in states["local", processes].items():
            torch.testing.assert_close(states["ray", processes][key], value, rtol=0, atol=0, msg=f"x{processes}: {key}")


@pytest.mark.skipif(not GYMNASIUM_1, reason="the rollouts' test envs use gymnasium 1.x's autoreset modes")
def test_worker_rollouts_on_ray_actors_are_those_of_local_workers():
    """CleanRL's WorkerRollouts (PPO batches, the weights pushed between segments) on Ray actors,
    flat and as node agents: the batches of local workers of the same layout."""
    torch = pytest.importorskip("torch")
    from clusterenv_cleanrl import WorkerRollouts
    from tests.test_cleanrl_rollouts import SEEDS, GreedyAgent, make_env

    def batches(backend: str, processes: int) -> list:
        torch.manual_seed(0)
        agent = GreedyAgent()
        envs = ClusterVectorEnv(
            [make_env] * len(SEEDS),
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            num_workers=2,
            processes_per_worker=processes,
            backend=backend,
        )
        with envs:
            rollouts = WorkerRollouts(envs, agent, 20, seed=SEEDS[0])
            collected = [rollouts.collect_ppo(0.99)]
            with torch.no_grad():
                agent.actor.bias.add_(1.0)
            assert rollouts.after_update()  # pushed: every update, by default
            collected.append(rollouts.collect_ppo(0.99))
            rollouts.close()
        return collected

    for processes in (1, 2):
        for ours, reference in zip(batches("ray", processes), batches("local", processes)):
            for field in ("obs", "actions", "logprobs", "rewards", "dones", "values", "next_obs", "next_done"):
                torch.testing.assert_close(getattr(ours, field), getattr(reference, field), rtol=0, atol=0)
            np.testing.assert_array_equal(ours.versions, reference.versions)
            assert ours.episodes == reference.episodes


# -- the fuzzer, briefly -----------------------------------------------------------------------------


def test_fuzz_through_ray_actors():
    """A few of the differential fuzzer's scenarios (tests/test_fuzz.py) through Ray actors, flat and
    as node agents: ClusterVecEnv == DummyVecEnv and ClusterVectorEnv == SyncVectorEnv."""
    from hypothesis import given, settings

    from tests import test_fuzz

    brief = settings(test_fuzz.FUZZ, max_examples=3)

    @brief
    @given(test_fuzz.SB3_SCENARIOS.filter(test_fuzz._agent_blocks))
    def vec_env(scenario):
        test_fuzz.check_vec_env(scenario, backend="ray", processes_per_worker=1 + scenario["seed"] % 2)

    @brief
    @given(test_fuzz.SCENARIOS)
    def vector_env(scenario):
        test_fuzz.check_vector_env(scenario, test_fuzz.AUTORESET_MODES[0], backend="ray")

    vec_env()
    vector_env()


# -- replacing lost actors (restart_failed_workers) -------------------------------------------------


def _suicidal_at(die_at: int) -> gym.Env:
    return SuicidalEnv(gym.make("CartPole-v1"), die_at=die_at)


def test_a_lost_actor_is_replaced_and_its_envs_start_new_episodes(no_leaks):
    env_fns = [make_cartpole] * 3 + [functools.partial(_suicidal_at, 3)]
    options = {"restart_failed_workers": True, "max_restarts": 1}
    with EnvPool(env_fns, num_workers=2, **options, **RAY) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        zeros = np.zeros(4, dtype=np.int64)
        pool.step(zeros)
        pool.step(zeros)
        before = [pool.buffers.obs[0][index].copy() for index in range(4)]
        old_pid = pool.worker_pids[1]
        result = pool.step(zeros)
        assert pool.worker_pids[1] != old_pid
        assert result.truncated.tolist() == [False, False, True, True]
        for index in (2, 3):
            assert "worker 1 was replaced (restart 1 of 1)" in result.infos[index][RESTART_INFO_KEY]
            np.testing.assert_array_equal(result.final_observation(index), before[index])
        assert pool.restarts == {"envs": 0, "workers": 1}
        (replacement,) = pool.worker_replacements
        assert replacement["worker"] == 1 and replacement["envs"] == [2, 3]
        assert (replacement["from"]["pid"], replacement["to"]["pid"]) == (old_pid, pool.worker_pids[1])
        assert (replacement["cause"], replacement["in_bundle"]) == ("lost", True)
        pool.step(zeros)
        pool.step(zeros)
        with pytest.raises(WorkerLostError, match="worker 1"):  # the replacement dies too: the budget is spent
            pool.step(zeros)


def test_a_stuck_actor_is_replaced(no_leaks, tmp_path):
    path = str(tmp_path / "hanging")
    env_fns = [make_cartpole, functools.partial(_hanging, path)]
    with EnvPool(env_fns, num_workers=2, backend="ray", timeout=3, restart_failed_workers=True) as pool:
        pool.reset(seeds=[0, 1])
        pool.step(np.zeros(2, dtype=np.int64))
        result = pool.step(np.zeros(2, dtype=np.int64))
        assert result.truncated.tolist() == [False, True]
        assert "did not answer within 3 s" in result.infos[1][RESTART_INFO_KEY]
        assert pool.step(np.zeros(2, dtype=np.int64)).rewards.tolist() == [1.0, 1.0]


def test_training_goes_on_through_a_lost_node_with_or_without_room_and_no_node_is_a_bounded_clear_error():
    """On a simulated cluster of its own (tests/ray_scripts/elastic_training.py, in a process of its
    own): a node removed during SB3 PPO's ``learn()`` and during ``clusterenv_sb3.PPO`` with AAPS,
    a node added afterwards; both runs finish, the lost block is rebuilt on the new node, and the
    time from the loss to the next full step is printed. A node lost with no room left: after
    ``replace_timeout`` the block runs on a surviving node, outside its bundle, and moves back at a
    reset once a node is added. Every node lost fails the pool after ``replace_timeout``, saying
    what to do."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "ray_scripts", "elastic_training.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for run in ("sb3_ppo", "aaps_ppo"):
        phase = report[run]
        assert phase["timesteps"] == 6 * 32 * 4 and phase["restarts"] == {"envs": 0, "workers": 1}
        assert phase["lost_node_held_a_worker"]
        (replacement,) = phase["replacements"]
        start, stop = phase["blocks"][replacement["worker"]]
        assert replacement["envs"] == list(range(start, stop)) and replacement["from"] != replacement["to"]
        assert (replacement["cause"], replacement["in_bundle"]) == ("lost", True)
        assert phase["restart_infos"] == list(range(start, stop))
        print(f"{run}: from the node's loss to the next full step: {phase['seconds_to_next_full_step']} s")
        assert phase["seconds_to_next_full_step"] < 30
    # SB3's PPO: the lost envs' episodes ended with the step; worker-side, their part was collected anew.
    assert all(report["sb3_ppo"]["dones"][index] for index in report["sb3_ppo"]["restart_infos"])
    assert report["aaps_ppo"]["restarted_envs"] == report["aaps_ppo"]["restart_infos"]
    no_room = report["no_room"]
    displaced, moved_back = no_room["replacements"]
    start, stop = no_room["blocks"][displaced["worker"]]
    assert no_room["truncated"] == [start <= index < stop for index in range(NUM_ENVS_ELASTIC)]
    assert (displaced["cause"], displaced["in_bundle"], displaced["envs"]) == ("lost", False, list(range(start, stop)))
    assert displaced["seconds"] >= 3  # replace_timeout: the bundle waited that long for room
    print(f"no room: from the node's loss to the next full step: {no_room['seconds_to_next_full_step']} s")
    assert no_room["seconds_to_next_full_step"] < 30
    assert (moved_back["cause"], moved_back["in_bundle"]) == ("moved back", True)
    assert moved_back["worker"] == displaced["worker"]
    assert moved_back["from"] == displaced["to"] != moved_back["to"]
    assert no_room["restarts"] == {"envs": 0, "workers": 1}  # moving back is no restart
    assert no_room["rewards_after_move"] == [1.0] * NUM_ENVS_ELASTIC
    no_node = report["no_node"]
    assert "no node can take its envs" in no_node["error"] and "within replace_timeout (3 s" in no_node["error"]
    assert "Add a node" in no_node["error"]
    assert no_node["seconds_to_error"] < 20


NUM_ENVS_ELASTIC = 6  # tests/ray_scripts/elastic_training.py's


def test_the_launch_example_trains_on_a_simulated_three_node_cluster():
    """examples/ray/train_sb3_ppo_ray.py with ``--address`` naming a simulated cluster of three nodes
    (tests/ray_scripts/example_on_cluster.py, in a process of its own): an actor per node, trained."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "ray_scripts", "example_on_cluster.py")
    args = ["--timesteps", "2048", "--n-envs", "8", "--eval-episodes", "1", "--restart-failed-workers"]
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "8 envs on 3 Ray actors x 1 processes, 3 nodes with CPUs" in done.stdout, done.stdout
    assert "trained 2048 steps" in done.stdout and "mean return over 1 episodes" in done.stdout, done.stdout


def test_the_cluster_definitions_beside_the_example_are_valid():
    """examples/ray/ray_up.yaml passes Ray's own schema of ``ray up`` configs; both definitions
    install ``clusterenv-rl[ray,sb3]`` on every node and give the head no CPUs for env actors."""
    import json

    import jsonschema
    import ray
    import yaml

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ray")
    with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as file:
        schema = json.load(file)
    with open(os.path.join(examples, "ray_up.yaml")) as file:
        ray_up = yaml.safe_load(file)
    jsonschema.validate(ray_up, schema)
    assert any('"clusterenv-rl[ray,sb3]"' in command for command in ray_up["setup_commands"])
    assert ray_up["available_node_types"][ray_up["head_node_type"]]["resources"] == {"CPU": 0}
    with open(os.path.join(examples, "raycluster.yaml")) as file:
        cluster = yaml.safe_load(file)
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    pods = [spec["headGroupSpec"]["template"], *(group["template"] for group in spec["workerGroupSpecs"])]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        command = container["args"][0]
        assert '"clusterenv-rl[ray,sb3]"' in command and "$KUBERAY_GEN_RAY_START_CMD" in command
        assert container["image"].startswith(f"rayproject/ray:{spec['rayVersion']}-")


def test_the_throughput_benchmark_runs_in_smoke_mode(tmp_path):
    """benchmarks/ray_throughput.py, a tiny run (no timing is checked): every vectorizer steps, the
    table and the JSON come out."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    output = tmp_path / "ray_throughput.json"
    arguments = ["--seconds", "0.2", "--rounds", "1", "--workloads", "cartpole", "--envs", "4", "--ray-layouts", "1x2"]
    done = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "ray_throughput.py"), *arguments, "--json", str(output)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert sorted(result["vectorizer"] for result in report["results"]) == ["local", "naive", "ray 1x2"]
    assert all(result["steps_per_s"] > 0 and result["learner_us"] > 0 for result in report["results"])
    assert set(report["ratios"]["cartpole"]) == {"ray 1x2 vs naive", "ray 1x2 vs local"}


def test_the_actors_and_their_processes_end_with_a_killed_learner(ray_session, tmp_path):
    """A learner killed with its pool open (on the session's Ray): Ray ends the actors it owned, and
    a node agent's local processes end with their actor."""
    import subprocess
    import sys
    import textwrap

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    address = ray_session.get_runtime_context().gcs_address
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import functools, sys, time
            import gymnasium as gym, ray
            sys.path.insert(0, {root!r})
            ray.init(address={address!r}, logging_level="warning")
            from clusterenv_core import EnvPool
            env_fns = [functools.partial(gym.make, "CartPole-v1")] * 4
            pool = EnvPool(env_fns, num_workers=2, processes_per_worker=2, backend="ray")
            pool.reset()
            print(*pool.worker_pids, flush=True)
            time.sleep(600)
            """
        )
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in learner.stdout.readline().split()]
        assert len(pids) == 2
        started = _processes(pids)
        assert len(started) > 2
    finally:
        learner.kill()
        learner.wait()
    deadline = time.monotonic() + 30
    while any(process.is_running() and process.status() != "zombie" for process in started):
        assert time.monotonic() < deadline, "actors or their processes outlived the learner"
        time.sleep(0.1)
