"""Node agents (``processes_per_worker`` > 1): each worker steps its block on local processes of its
own and answers once per request for the block. Results must be those of ``DummyVecEnv`` and
``SyncVectorEnv`` exactly; failures name the global env index and the worker; nothing is left
running after close or after the learner dies. The ``check_*`` functions also run on MPI
(``tests/mpi_scripts/node_agents.py``, from ``tests/test_mpi_backend.py``)."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_cleanrl import ClusterVectorEnv
from clusterenv_core import EnvError, EnvPool, EnvValueError
from clusterenv_core.protocol import RESTART_INFO_KEY
from tests.envs import (
    CallCounter,
    EchoActionEnv,
    FailingEnv,
    HangingEnv,
    SuicidalEnv,
    cartpole_with_statistics,
    make_cartpole,
    make_dict_env,
)
from tests.helpers import assert_same, descendants, launch, run_and_compare, run_side_by_side, wait_until_ended
from tests.test_action_forms import ACTION_SPACES, OTHER_DTYPES, _alternately_as
from tests.test_async_batches import check_full_batch_is_sync_vector_env, check_trajectories_match_envs_alone
from tests.test_cleanrl_vector_env import TextObsEnv

pytestmark = pytest.mark.timeout(180)

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1
short_cartpole = functools.partial(cartpole_with_statistics, max_episode_steps=40)


def _failing_at(fail_at: int) -> gym.Env:
    return FailingEnv(gym.make("CartPole-v1"), fail_at=fail_at)


def _call_counter() -> gym.Env:
    return CallCounter(gym.make("CartPole-v1"))


def check_vec_env_is_dummy_vec_env(processes: int, num_envs: int, steps: int = 300, **options) -> None:
    """``ClusterVecEnv`` on 2 node agents of ``processes`` processes each == ``DummyVecEnv``."""
    for env_fn in (make_cartpole, make_dict_env):
        episodes, _ = run_side_by_side(
            [env_fn] * num_envs, steps=steps, num_workers=2, processes_per_worker=processes, **options
        )
        assert episodes > 5


def check_vector_env_is_sync_vector_env(mode: str | None, steps: int = 300, **options) -> None:
    """``ClusterVectorEnv`` on 2 node agents of 2 processes == ``SyncVectorEnv`` in ``mode``."""
    mode_kwargs = {} if mode is None else {"autoreset_mode": mode}
    env_fns = [short_cartpole] * 8
    cluster = ClusterVectorEnv(env_fns, num_workers=2, processes_per_worker=2, timeout=30, **mode_kwargs, **options)
    sync = gym.vector.SyncVectorEnv(env_fns, **mode_kwargs)
    with cluster:
        counts = run_and_compare(cluster, sync, steps, seed=1)
    sync.close()
    assert counts["terminated"] > 5 and counts["truncated"] > 5, counts


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "num_envs"), [(2, 8), (3, 7)])
def test_vec_env_is_dummy_vec_env(processes, num_envs):
    check_vec_env_is_dummy_vec_env(processes, num_envs)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"] if GYMNASIUM_1 else [None])
def test_vector_env_is_sync_vector_env(mode):
    check_vector_env_is_sync_vector_env(mode)


def test_spaces_without_buffers_are_sync_vector_env():
    env_fns = [TextObsEnv] * 4
    cluster = ClusterVectorEnv(env_fns, num_workers=1, processes_per_worker=2, timeout=30)
    sync = gym.vector.SyncVectorEnv(env_fns)
    with cluster:
        run_and_compare(cluster, sync, 40, seed=2)
    sync.close()


@pytest.mark.parametrize("name", ["box", "discrete", "multi_binary", "dict", "tuple", "nested", "tuple_with_text"])
def test_envs_get_the_actions_and_dtypes_sync_vector_env_gives(name):
    # Every other batch in another dtype than the space's, where the baselines hand that dtype on.
    env_fns = [functools.partial(EchoActionEnv, ACTION_SPACES[name], check_action=False)] * 4
    sync = gym.vector.SyncVectorEnv(env_fns)
    cluster = ClusterVectorEnv(env_fns, num_workers=1, processes_per_worker=2)
    batch_of = _alternately_as(OTHER_DTYPES[name]) if name in OTHER_DTYPES else lambda batch: batch
    with cluster:
        assert_same(cluster.reset(seed=1), sync.reset(seed=1), "reset")
        sync.action_space.seed(2)
        for step in range(8):
            actions = batch_of(sync.action_space.sample())
            assert_same(cluster.step(actions), sync.step(actions), f"step {step}")
    sync.close()


def test_async_batches_give_each_env_its_trajectory_alone():
    check_trajectories_match_envs_alone(4, recvs=150, processes_per_worker=2)


@pytest.mark.skipif(not GYMNASIUM_1, reason="next-step autoreset is gymnasium 1.x's SyncVectorEnv")
def test_cleanrl_envpool_api_full_batches_are_sync_vector_env():
    check_full_batch_is_sync_vector_env(steps=100, processes_per_worker=2)


def check_a_failing_env_names_its_global_index_and_worker_and_the_agent_lives_on(**options) -> None:
    env_fns = [make_cartpole] * 5 + [functools.partial(_failing_at, 3)] + [make_cartpole] * 2
    with EnvPool(env_fns, num_workers=2, processes_per_worker=2, **options) as pool:
        pool.reset(seeds=list(range(8)))
        zeros = np.zeros(8, np.int64)
        pool.step(zeros)
        pool.step(zeros)
        with pytest.raises(EnvValueError, match="injected failure at step 3") as caught:
            pool.step(zeros)
        error = caught.value
        # Env 5 is slot 1 of worker 1's block, in the agent's local process 0 (slots 0 and 1).
        assert (error.env_index, error.worker_index) == (5, 1)
        assert "local process 0 of the node agent" in error.operation
        assert "injected failure at step 3" in error.remote_traceback
        pool.reset(seeds=list(range(8)))
        result = pool.step(zeros)
        assert not result.terminated.any()
        assert pool.get_attr("fail_at", indices=[5]) == [3]


def test_a_failing_env_names_its_global_index_and_worker_and_the_agent_lives_on():
    check_a_failing_env_names_its_global_index_and_worker_and_the_agent_lives_on()


def test_env_restarts_are_counted_as_on_a_flat_pool():
    env_fns = [make_cartpole] * 3 + [functools.partial(_failing_at, 2)] + [functools.partial(_failing_at, 4)]
    counts = []
    for processes in (1, 2):
        with EnvPool(env_fns, num_workers=2, processes_per_worker=processes, restart_failed_envs=True) as pool:
            pool.reset(seeds=list(range(5)))
            infos = [pool.step(np.zeros(5, np.int64)).infos for _ in range(6)]
            restarted = [sorted(index for index, info in step.items() if RESTART_INFO_KEY in info) for step in infos]
            counts.append((pool.restarts, pool.env_restarts, restarted))
    assert counts[1] == counts[0]
    assert counts[1][:2] == ({"envs": 4, "workers": 0}, [0, 0, 0, 3, 1])


def test_per_env_calls_are_those_of_a_flat_pool():
    def calls(processes: int) -> list:
        env_fns = [_call_counter] * 6
        with EnvPool(env_fns, num_workers=2, processes_per_worker=processes) as pool:
            pool.set_attr("calls", [10, 20, 30], indices=[5, 0, 3])
            return [
                pool.call("bump", (2,), indices=[5, 1, 5, 3]),
                pool.get_attr("calls"),
                pool.env_is_wrapped(CallCounter, indices=[4, 2]),
                pool.env_is_wrapped(gym.wrappers.RecordVideo),
            ]

    assert calls(2) == calls(1)
    with EnvPool([make_cartpole] * 4, num_workers=2, processes_per_worker=2) as pool:
        with pytest.raises(EnvError, match="no_such_attribute") as caught:
            pool.get_attr("no_such_attribute", indices=[3])
        assert (caught.value.env_index, caught.value.worker_index) == (3, 1)
        assert isinstance(caught.value, AttributeError)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "processes_per_worker must be an int >= 1"),
        (-2, ValueError, "processes_per_worker must be an int >= 1"),
        (4, ValueError, "more than the 3 env"),
        (2.0, TypeError, "processes_per_worker must be an int"),
        ("2", TypeError, "processes_per_worker must be an int"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(no_leaks, value, error, message):
    with pytest.raises(error, match=message):
        EnvPool([make_cartpole] * 7, num_workers=2, processes_per_worker=value)


def test_an_inline_worker_is_refused_before_anything_starts_saying_why(no_leaks):
    with pytest.raises(ValueError, match="inline_worker=True runs the last worker") as caught:
        EnvPool([make_cartpole] * 4, num_workers=2, processes_per_worker=2, backend_options={"inline_worker": True})
    assert "run the pool without inline_worker" in str(caught.value)


def test_close_leaves_nothing_running(no_leaks):
    with EnvPool([make_cartpole] * 4, num_workers=2, processes_per_worker=2) as pool:
        pool.reset()
        pool.step(np.zeros(4, np.int64))
        started = descendants()  # the learner's fork server aside: it outlives pools by design
        assert len(started) >= 2 + 2 * 2  # the agents and their local processes, at least
    assert wait_until_ended(list(started)), [psutil.Process(pid).cmdline() for pid in started if psutil.pid_exists(pid)]


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.slow)])
def test_killed_learner_leaves_no_process(no_leaks, tmp_path, backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py", reason="backend='mpi' needs mpi4py")
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            sys.path.insert(0, ROOT)
            import numpy as np, psutil
            from clusterenv_core import EnvPool
            from tests.envs import make_cartpole
            pool = EnvPool([make_cartpole] * 4, backend=BACKEND, num_workers=2, processes_per_worker=2)
            pool.reset()
            pool.step(np.zeros(4, np.int64))
            print(*[process.pid for process in psutil.Process().children(recursive=True)], flush=True)
            time.sleep(60)
            """
        )
        .replace("ROOT", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        .replace("BACKEND", repr(backend))
    )
    # A session of its own: MPICH's process manager ends whole process groups.
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids = [int(pid) for pid in learner.stdout.readline().split()]
    learner.kill()
    learner.wait()
    assert len(pids) >= 2 + 2 * 2
    assert wait_until_ended(pids, within=10), [pid for pid in pids if psutil.pid_exists(pid)]


def _dies_at(die_at: int) -> gym.Env:
    return SuicidalEnv(gym.make("CartPole-v1"), die_at=die_at)


def test_a_lost_local_process_is_the_agents_error_naming_it(no_leaks):
    env_fns = [make_cartpole] * 3 + [functools.partial(_dies_at, 2)]
    with EnvPool(env_fns, num_workers=1, processes_per_worker=2) as pool:
        pool.reset()
        pool.step(np.zeros(4, np.int64))
        with pytest.raises(EnvError) as caught:
            pool.step(np.zeros(4, np.int64))
        error = caught.value
        assert (error.env_index, error.worker_index) == (None, 0)
        assert error.operation == "step in the node agent's local processes"
        assert error.exc_type == "clusterenv_core.errors.WorkerLostError"
        assert re.match(r"local process 1 of worker 0 \(a node agent; pid \d+, envs 2-3\) ", error.remote_message)
        with pytest.raises(EnvError, match="unusable|failed"):  # the agent lives on, its local pool does not
            pool.step(np.zeros(4, np.int64))


# -- MPI: tests/mpi_scripts/node_agents.py -----------------------------------------------------------


@pytest.mark.slow
def test_on_mpi_spawn_node_agents_are_the_baselines():
    pytest.importorskip("mpi4py", reason="backend='mpi' needs mpi4py")
    code, output, _ = launch("spawn", "node_agents.py")
    assert code == 0, output
    for check in ("dummy even", "dummy uneven", "async trajectories", "env error", "local process replaced"):
        assert f"OK {check}" in output, output


@pytest.mark.slow
def test_on_an_spmd_launch_the_worker_ranks_are_node_agents_and_the_baselines():
    pytest.importorskip("mpi4py", reason="backend='mpi' needs mpi4py")
    code, output, _ = launch("spmd", "node_agents.py", "spmd")
    assert code == 0 and "OK spmd dummy uneven" in output, output


def _hangs_at(hang_at: int) -> gym.Env:
    return HangingEnv(gym.make("CartPole-v1"), hang_at=hang_at)


@pytest.mark.slow
def test_a_local_process_stuck_in_an_env_is_its_agents_error_and_ends_within_its_orphan_grace_once_the_agent_is_gone(
    no_leaks,
):
    # Env 3 runs on agent 1 (envs 2-3), in its local process 1. The agent waits for that process the
    # timeout, the learner for the agent longer: the agent names its stuck process, never the learner
    # the agent as stuck.
    env_fns = [make_cartpole] * 3 + [functools.partial(_hangs_at, 2)]
    with EnvPool(env_fns, num_workers=2, processes_per_worker=2, timeout=2) as pool:
        pool.reset()
        pool.step(np.zeros(4, np.int64))
        started = descendants()
        with pytest.raises(EnvError) as caught:
            pool.step(np.zeros(4, np.int64))
        error = caught.value
        assert (error.env_index, error.worker_index) == (None, 1)
        assert (error.operation, error.exc_type) == (
            "step in the node agent's local processes",
            "clusterenv_core.errors.WorkerTimeoutError",
        )
        said = r"local process 1 of worker 1 \(a node agent; pid (\d+), env 3\) did not answer within 2 s"
        named = re.fullmatch(said, error.remote_message)
        assert named, error.remote_message
        # The agent goes, its local process still stuck in the env: that one ends by itself.
        os.kill(pool.worker_pids[1], signal.SIGKILL)
        assert wait_until_ended([int(named.group(1))], within=10 + 5)  # the local backend's orphan_grace, and some
    assert wait_until_ended(list(started))
