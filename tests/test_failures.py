"""Failures reach the learner as clear errors, never as hangs, and close() cleans up everything."""

from __future__ import annotations

import atexit
import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_core import ClusterEnvError, EnvError, EnvPool, WorkerLostError, WorkerTimeoutError
from clusterenv_core import channel as channel_module
from tests.envs import (
    BigInfoEnv,
    CallCounter,
    ChildStartingEnv,
    CrashingEnv,
    FailingCloseEnv,
    FailingEnv,
    HangingEnv,
    LockHoldingEnv,
    SlowCartPole,
    SlowCloseEnv,
    SuicidalEnv,
    ThreadLeavingEnv,
    UnprintableFailureEnv,
)
from tests.helpers import (
    buffer_mappings,
    clusterenv_threads,
    events,
    interrupt_at_events,
    interrupt_soon,
    process_ended,
    wait_for_events,
    wait_until_ended,
)

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def _wrapped(wrapper, **kwargs):
    return wrapper(gym.make("CartPole-v1"), **kwargs)


def _step_zeros(pool: EnvPool):
    return pool.step(np.zeros(pool.num_envs, dtype=np.int64))


def test_env_exception_names_env_worker_and_remote_traceback(no_leaks):
    env_fns = [CARTPOLE] * 4
    env_fns[3] = functools.partial(_wrapped, FailingEnv, fail_at=2)
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset(seeds=[0, 1, 2, 3])
    _step_zeros(pool)
    with pytest.raises(EnvError) as caught:
        _step_zeros(pool)
    error = caught.value
    assert (error.env_index, error.worker_index, error.exc_type) == (3, 1, "builtins.ValueError")
    assert isinstance(error, ValueError)  # what DummyVecEnv would raise, for code that catches it
    assert "env 3 on worker 1" in str(error)
    assert "injected failure at step 2" in str(error)
    assert "Traceback (most recent call last)" in error.remote_traceback
    assert "in step" in error.remote_traceback
    # The pool stays in sync and usable: the other worker's reply was consumed.
    pool.reset()
    _step_zeros(pool)
    pool.close()


def test_env_methods_raise_the_builtin_type_dummy_vec_env_raises(no_leaks):
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    for venv in (DummyVecEnv([CARTPOLE] * 2), ClusterVecEnv([CARTPOLE] * 2)):
        with pytest.raises(TypeError):
            venv.env_method("spec")  # an attribute, not a method
        with pytest.raises(AttributeError):
            venv.env_method("no_such_method")
        venv.close()


def test_envs_failing_together_report_the_first_env(no_leaks):
    """Replies are read last worker first; the error raised is still the lowest env's."""
    env_fns = [CARTPOLE] * 6
    env_fns[1] = env_fns[4] = functools.partial(_wrapped, FailingEnv, fail_at=1)
    pool = EnvPool(env_fns, num_workers=3)
    pool.reset(seeds=list(range(6)))
    with pytest.raises(EnvError) as caught:
        _step_zeros(pool)
    assert (caught.value.env_index, caught.value.worker_index) == (1, 0)
    pool.reset()
    _step_zeros(pool)  # every worker's reply was read: the pool is in step
    pool.close()


def test_env_constructor_failure_names_the_index(no_leaks):
    def broken():
        raise RuntimeError("no such simulator")

    with pytest.raises(EnvError, match="creating the env failed in env 2 on worker 1") as caught:
        EnvPool([CARTPOLE, CARTPOLE, broken], num_workers=2)
    assert "no such simulator" in caught.value.remote_traceback


def test_a_factory_that_returns_no_env_is_named(no_leaks):
    def forgot_to_return():
        gym.make("CartPole-v1")

    with pytest.raises(EnvError, match="creating the env failed in env 1 on worker 0") as caught:
        EnvPool([CARTPOLE, forgot_to_return], num_workers=1)
    assert "the env factory returned NoneType, not an environment (it has no reset, step, " in str(caught.value)


def test_unpicklable_factory_is_rejected_before_start(no_leaks):
    lock = threading.Lock()
    with pytest.raises(ValueError, match=r"env_fns\[1\] cannot be pickled"):
        EnvPool([CARTPOLE, lambda: (lock, gym.make("CartPole-v1"))[1]])


def test_a_module_that_builds_a_pool_when_a_worker_imports_it_fails_the_pool(no_leaks):
    """A module without ``if __name__ == "__main__":`` that builds a pool at import, and defines the
    env factory: each worker unpickling the factory imports it and would start workers of its own,
    which import it again (a fork bomb). The worker's pool is refused before anything starts, and
    the pool being built fails, saying why."""
    from tests.pool_at_import import cartpole_from_this_module, worker_options

    started = time.monotonic()
    with pytest.raises(EnvError) as caught:
        EnvPool([cartpole_from_this_module] * 2, num_workers=2, backend_options=worker_options(1))
    assert time.monotonic() - started < 30  # an error, not a timeout
    error = caught.value
    assert (error.env_index, error.worker_index) == (0, 0)
    assert (error.operation, error.exc_type) == ("unpickling the env factory", "builtins.RuntimeError")
    message = str(error)
    assert "a pool is being constructed while a worker imports the module 'tests.pool_at_import'" in message
    assert "Construct the pool in 'tests.pool_at_import' under `if __name__ == \"__main__\":`" in message


def test_a_module_that_builds_a_pool_when_an_entry_point_imports_it_fails_the_pool(no_leaks):
    """The same module reached by an env id's entry point, imported as the worker creates the env."""
    from tests.pool_at_import import worker_options

    gym.register("PoolAtImport-v0", entry_point="tests.pool_at_import:cartpole_from_this_module")
    try:
        with pytest.raises(EnvError, match="creating the env failed in env 0 on worker 0") as caught:
            EnvPool.make("PoolAtImport-v0", 1, backend_options=worker_options(1))
    finally:
        gym.registry.pop("PoolAtImport-v0")
    assert "while a worker imports the module 'tests.pool_at_import'" in str(caught.value)


def test_an_env_may_build_a_pool_of_its_own(no_leaks):
    """What is refused is a pool built by an import: an env that builds one when created is allowed."""
    from tests.envs import SubPoolEnv

    pool = EnvPool([SubPoolEnv], num_workers=1)
    assert pool.reset(seeds=[0]).obs.shape == (1, 4)
    assert pool.step(np.zeros(1, dtype=np.int64)).obs.shape == (1, 4)
    pool.close()


def test_a_misspelt_option_is_a_type_error_as_for_any_python_call(no_leaks):
    # What SyncVectorEnv or DummyVecEnv would raise for it, so code written for them behaves alike.
    with pytest.raises(TypeError, match="bad options for backend 'local': .*unexpected keyword argument 'autoreset'"):
        EnvPool([CARTPOLE] * 2, backend_options={"autoreset": "next_step"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": 3}, "num_workers"),
        ({"timeout": 0}, "timeout"),
        ({"autoreset_mode": "sometimes"}, "autoreset_mode"),
        ({"backend": "carrier-pigeon"}, "unknown backend"),
    ],
)
def test_bad_configuration_is_rejected(no_leaks, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EnvPool([CARTPOLE] * 2, **kwargs)


@pytest.mark.parametrize("option", ["restart_failed_envs", "restart_failed_workers"])
def test_a_switch_given_as_a_string_is_refused(no_leaks, option):
    # bool("False") is True: taken as a switch, the string would turn restarts on without a word.
    with pytest.raises(TypeError, match=f"{option} must be a bool, got 'False'"):
        EnvPool([CARTPOLE] * 2, **{option: "False"})


def test_refused_constructions_keep_no_file_descriptor(no_leaks):
    lock = threading.Lock()
    refusals = [
        ({"num_workers": 0}, ValueError),
        ({"num_workers": 1.5}, TypeError),
        ({"restart_failed_envs": "no"}, TypeError),
    ]
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        for kwargs, error in refusals:
            with pytest.raises(error):
                EnvPool([CARTPOLE] * 2, **kwargs)
        with pytest.raises(ValueError, match="cannot be pickled"):
            EnvPool([CARTPOLE, lambda: (lock, gym.make("CartPole-v1"))[1]])
    assert len(os.listdir("/proc/self/fd")) == open_before


@pytest.mark.parametrize("adapter", ["ClusterVecEnv", "ClusterVectorEnv"])
def test_close_unmaps_the_shared_memory_while_the_object_lives_on(no_leaks, adapter):
    # A closed env often stays referenced (a model's env, a list of runs): its memory must go anyway.
    from clusterenv_cleanrl import ClusterVectorEnv
    from clusterenv_sb3 import ClusterVecEnv

    before = buffer_mappings()
    if adapter == "ClusterVecEnv":
        env = ClusterVecEnv([CARTPOLE] * 4, num_workers=2, restart_failed_workers=True)
        env.reset()
        env.step(np.zeros(4, dtype=np.int64))
    else:
        env = ClusterVectorEnv([CARTPOLE] * 4, num_workers=2)
        env.reset(seed=0)
        env.step(np.zeros(4, dtype=np.int64))
    assert buffer_mappings() > before
    env.close()
    assert buffer_mappings() == before
    with pytest.raises(ClusterEnvError, match="closed"):
        env.reset()


def test_an_attribute_that_cannot_be_pickled_is_named_with_its_env(no_leaks):
    # test_env_output covers a method's result.
    with EnvPool([CARTPOLE, CARTPOLE, LockHoldingEnv, LockHoldingEnv], num_workers=2) as pool:
        with pytest.raises(EnvError, match=r"get_attr lock failed in env 3 on worker 1: .*the attribute 'lock' of env 3"):
            pool.get_attr("lock", indices=[3])
        assert pool.get_attr("spec", indices=[3])[0].id == "CartPole-v1"  # the worker lives on


def test_bad_actions_raise_before_anything_is_sent(no_leaks):
    pool = EnvPool([CARTPOLE] * 3, num_workers=2)
    pool.reset(seeds=[0, 1, 2])
    for actions in (np.zeros(2, np.int64), np.zeros((3, 1), np.int64), np.array([0.0, np.nan, 1.0]), [0.5, 1, 0]):
        with pytest.raises(ValueError):
            pool.step(actions)
    with pytest.raises(ValueError, match="seeds"):
        pool.reset(seeds=[1, 2])
    result = _step_zeros(pool)  # nothing was sent: the pool is still in step with its workers
    assert result.rewards.tolist() == [1.0, 1.0, 1.0]
    pool.close()
    with EnvPool.make("Pendulum-v1", 2, num_workers=1) as pool:
        pool.reset(seeds=[0, 1])
        with pytest.raises(ValueError, match="complex values for a real space"):
            pool.step(np.array([[0.5 + 1j], [0.0]]))
        pool.step(np.array([[0.5], [0.0]]))


def _module(directory, name: str) -> str:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.py").write_text("class Thing:\n    pass\n")
    return str(directory)


def test_a_request_the_worker_cannot_unpickle_is_reported_and_the_worker_lives_on(no_leaks, tmp_path):
    # A module on the learner's path only after the workers started: they cannot import it.
    pool = EnvPool([CARTPOLE] * 2, num_workers=2)
    pool.reset(seeds=[0, 1])
    sys.path.insert(0, _module(tmp_path / "learner", "learner_only"))
    try:
        import learner_only

        with pytest.raises(EnvError) as caught:
            pool.set_attr("thing", [learner_only.Thing()], indices=[1])
    finally:
        sys.path.remove(str(tmp_path / "learner"))
        sys.modules.pop("learner_only", None)
    error = caught.value
    assert (error.env_index, error.worker_index, error.exc_type) == (None, 1, "pickle.UnpicklingError")
    assert "the worker cannot unpickle the message (ModuleNotFoundError: No module named 'learner_only')" in str(error)
    assert "ModuleNotFoundError" in error.remote_traceback
    # The worker read past the message and answers the next request.
    pool.set_attr("thing", [7], indices=[1])
    assert pool.get_attr("thing", indices=[1]) == [7]
    _step_zeros(pool)
    pool.close()


def test_a_reply_the_learner_cannot_unpickle_is_reported_and_the_pool_lives_on(no_leaks, tmp_path):
    from tests.envs import cartpole_holding_a_worker_only_object

    factory = functools.partial(cartpole_holding_a_worker_only_object, _module(tmp_path, "worker_only"))
    pool = EnvPool([CARTPOLE, factory], num_workers=2)
    pool.reset(seeds=[0, 1])
    with pytest.raises(EnvError) as caught:
        pool.get_attr("thing", indices=[1])
    error = caught.value
    assert (error.env_index, error.worker_index, error.exc_type) == (None, 1, "pickle.UnpicklingError")
    assert "the learner cannot unpickle the message (ModuleNotFoundError: No module named 'worker_only')" in str(error)
    assert pool.get_attr("spec", indices=[1])[0].id == "CartPole-v1"
    _step_zeros(pool)
    pool.close()


@pytest.mark.parametrize("how, status", [("segfault", "killed by SIGSEGV"), ("exit", "exited with code 3")])
def test_a_dead_worker_says_why(no_leaks, how, status):
    """WorkerLostError carries the exit status and the last lines the worker wrote to stderr: here
    the env's own message and, after a segfault, faulthandler's traceback of where it happened."""
    env_fns = [CARTPOLE, functools.partial(_wrapped, CrashingEnv, crash_at=2, how=how)]
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset(seeds=[0, 1])
    _step_zeros(pool)
    with pytest.raises(WorkerLostError) as caught:
        _step_zeros(pool)
    message = str(caught.value)
    assert "worker 1 (pid" in message and ", env 1) " in message and status in message, message
    assert "The last lines it wrote to stderr" in message and "simulator: giving up at step 2" in message, message
    if how == "segfault":
        assert "Fatal Python error: Segmentation fault" in message and "in step" in message, message
    pool.close()


def test_killed_worker_raises_worker_lost_on_next_call(no_leaks):
    pool = EnvPool([CARTPOLE] * 4, num_workers=2)
    pool.reset()
    os.kill(pool._transport.processes[1].pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerLostError, match="worker 1 .* killed by SIGKILL"):
        _step_zeros(pool)
    assert time.monotonic() - started < 10
    with pytest.raises(ClusterEnvError, match="unusable"):
        pool.reset()
    pool.close()


def test_worker_dying_during_step_raises_worker_lost(no_leaks):
    env_fns = [CARTPOLE, functools.partial(_wrapped, SuicidalEnv, die_at=3)]
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset()
    _step_zeros(pool)
    _step_zeros(pool)
    started = time.monotonic()
    with pytest.raises(WorkerLostError):
        _step_zeros(pool)
    assert time.monotonic() - started < 10
    pool.close()


def test_stuck_env_times_out_and_close_kills_it(no_leaks):
    env_fns = [CARTPOLE, functools.partial(_wrapped, HangingEnv, hang_at=1)]
    pool = EnvPool(env_fns, num_workers=2, timeout=2.0)
    pool.reset()
    started = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"worker 1 \(pid \d+, env 1\) did not answer within 2 s"):
        _step_zeros(pool)
    assert 2.0 <= time.monotonic() - started < 6.0
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 5


def test_a_step_waits_one_timeout_for_all_workers(no_leaks):
    # The workers step at once, so each has the timeout from the step's start, however late the
    # learner reads its reply: not one timeout after the reply read before it.
    env_fns = [functools.partial(_wrapped, HangingEnv, hang_at=1), functools.partial(SlowCartPole, 1.8)]
    pool = EnvPool(env_fns, num_workers=2, timeout=2.0)
    pool.reset()
    started = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"worker 0 \(pid \d+, env 0\) did not answer within 2 s"):
        _step_zeros(pool)
    assert 2.0 <= time.monotonic() - started < 3.0
    pool.close()


def _child_starting_then_dying(die_at: int) -> gym.Env:
    return SuicidalEnv(ChildStartingEnv(gym.make("CartPole-v1")), die_at=die_at)


def test_processes_the_envs_started_and_left_running_end_with_their_worker(no_leaks):
    env_fns = [functools.partial(_wrapped, ChildStartingEnv), functools.partial(_child_starting_then_dying, 2)]
    pool = EnvPool(env_fns, num_workers=2, restart_failed_workers=True)
    pool.reset()
    first = pool.get_attr("helper_pid")
    assert not any(process_ended(pid) for pid in first)
    _step_zeros(pool)
    _step_zeros(pool)  # env 1 kills its worker: the replacement builds it anew, with a new helper
    assert pool.restarts["workers"] == 1
    assert wait_until_ended(first[1:]) and not process_ended(first[0])
    helpers = pool.get_attr("helper_pid")
    assert helpers[0] == first[0] and not process_ended(helpers[1])
    pool.close()
    assert wait_until_ended(helpers)


@pytest.mark.slow
def test_close_waits_one_timeout_for_all_stuck_workers(no_leaks, tmp_path):
    hanging = str(tmp_path / "hanging")
    env_fns = [functools.partial(_wrapped, HangingEnv, hang_at=1, hanging=hanging)] * 4
    pool = EnvPool(env_fns, num_workers=4)
    pool.reset()
    pool.step_async(np.zeros(4, np.int64))
    wait_for_events(hanging, 4)  # every worker is inside its env's step
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 8  # 5 s for them all, then the kill (not 5 s a worker)


@pytest.mark.slow
def test_close_lets_envs_take_their_time_to_close(no_leaks, tmp_path):
    # As DummyVecEnv and SubprocVecEnv wait for it: killed at 5 s, a recorder would leave half a
    # file. The second worker's time counts from when it was asked, not from the first one's answer.
    paths = [str(tmp_path / f"video{index}") for index in range(2)]
    env_fns = [functools.partial(_wrapped, SlowCloseEnv, seconds=seconds, path=path) for seconds, path in zip((5.5, 6.5), paths)]
    pool = EnvPool(env_fns, num_workers=2, timeout=7.0)
    pool.reset()
    _step_zeros(pool)
    pool.close()
    assert all(os.path.exists(path) for path in paths)


@pytest.mark.parametrize("where", ["closing its envs", "exiting"])
def test_ctrl_c_during_close_kills_the_workers_and_releases_everything(no_leaks, tmp_path, where):
    # An env that takes 60 s to close, or a thread that keeps its worker from exiting for 60 s.
    if where == "closing its envs":
        env_fns = [functools.partial(_wrapped, SlowCloseEnv, seconds=60.0, path=str(tmp_path / "never"))] * 2
    else:
        env_fns = [functools.partial(_wrapped, ThreadLeavingEnv, seconds=60.0)] * 2
    threads = clusterenv_threads()
    pool = EnvPool(env_fns, num_workers=2, timeout=30.0)
    pool.reset()
    interrupt_soon(1.0)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert time.monotonic() - started < 5
    pool.close()  # nothing left to do
    assert not clusterenv_threads() - threads


def test_a_second_ctrl_c_during_close_still_kills_every_worker(no_leaks, tmp_path, monkeypatch):
    # The first Ctrl-C cuts short the wait for the envs to close (60 s); the second lands while
    # close() waits for the first worker it killed, which would leave the other one running.
    closing = str(tmp_path / "closing")
    env_fns = [functools.partial(_wrapped, SlowCloseEnv, seconds=60.0, path=str(tmp_path / "never"), closing=closing)] * 2
    threads = clusterenv_threads()
    pool = EnvPool(env_fns, num_workers=2, timeout=30.0)
    pool.reset()
    pids = pool.worker_pids
    worker_class = type(pool._transport.processes[0])  # subprocess.Popen, or ForkedWorker from the fork server
    wait = worker_class.wait
    second_ctrl_c = []

    def wait_for_a_killed_worker(process, timeout=None):
        if timeout is None and not second_ctrl_c:  # close() waits for killed workers without a timeout
            second_ctrl_c.append(process.pid)
            signal.raise_signal(signal.SIGINT)
        return wait(process, timeout)

    monkeypatch.setattr(worker_class, "wait", wait_for_a_killed_worker)
    interrupt_at_events(closing, 2)  # both envs are closing
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert time.monotonic() - started < 5
    assert second_ctrl_c == pids[:1]
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    assert not clusterenv_threads() - threads


def test_ctrl_c_while_close_releases_the_views_still_ends_the_workers(no_leaks, monkeypatch):
    # close() marks the pool closed first, so a later close() does nothing: Ctrl-C in its first
    # steps (dropping the pool's views of the shared memory) must not skip ending the workers.
    pool = EnvPool([CARTPOLE] * 2, num_workers=2)
    pool.reset()
    pids = pool.worker_pids

    def interrupted_release():
        raise KeyboardInterrupt

    monkeypatch.setattr(pool.buffers, "release", interrupted_release)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert pool.closed
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def test_an_env_failing_to_close_is_raised_once_everything_is_released(no_leaks):
    pool = EnvPool([CARTPOLE, CARTPOLE, functools.partial(_wrapped, FailingCloseEnv)], num_workers=2)
    pool.reset()
    with pytest.raises(EnvError) as caught:
        pool.close()
    error = caught.value
    assert (error.env_index, error.worker_index, error.operation) == (2, 1, "close")
    assert "could not flush the recording" in str(error) and "in close" in error.remote_traceback
    assert pool.closed
    pool.close()  # idempotent, and the fixture checks that nothing is left


def test_an_exception_whose_str_fails_is_reported_and_the_worker_lives_on(no_leaks):
    pool = EnvPool([CARTPOLE, functools.partial(_wrapped, UnprintableFailureEnv, fail_at=2)], num_workers=2)
    pool.reset(seeds=[0, 1])
    pids = pool.worker_pids
    _step_zeros(pool)
    with pytest.raises(EnvError, match=r"tests\.envs\.UnprintableError: <str\(\) of the UnprintableError failed: RuntimeError: handle released>"):
        _step_zeros(pool)
    assert pool.worker_pids == pids
    pool.reset()
    _step_zeros(pool)
    pool.close()


def test_close_is_idempotent_and_calls_after_close_fail(no_leaks):
    pool = EnvPool([CARTPOLE] * 2, num_workers=2)
    pids = pool.worker_pids
    pool.close()
    pool.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    with pytest.raises(ClusterEnvError, match="closed"):
        pool.reset()


def test_close_during_pending_step(no_leaks):
    pool = EnvPool([CARTPOLE] * 4, num_workers=2)
    pool.reset()
    pool.step_async(np.zeros(4, np.int64))
    pool.close()


class _CartPoleThatLeavesWorkAtExit(gym.Wrapper):
    """CartPole whose close() leaves a thread to finish, in a process where it registered an
    atexit handler: both write ``<what> <pid>`` lines to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.path = path
        atexit.register(self._write, "atexit")

    def _write(self, what: str) -> None:
        with open(self.path, "a") as file:
            file.write(f"{what} {os.getpid()}\n")

    def close(self) -> None:
        threading.Thread(target=lambda: (time.sleep(0.3), self._write("thread"))).start()
        super().close()


def test_a_closing_worker_finishes_what_its_envs_left_to_do_at_exit(no_leaks, tmp_path):
    # Workers end without the interpreter's teardown (a second with torch imported), but they still
    # wait for the threads their envs left and run the atexit handlers.
    path = tmp_path / "exits"
    with EnvPool([functools.partial(_CartPoleThatLeavesWorkAtExit, str(path))] * 2, num_workers=2) as pool:
        pids = pool.worker_pids
    assert sorted(path.read_text().splitlines()) == sorted(f"{what} {pid}" for what in ("atexit", "thread") for pid in pids)


def test_no_network_port_is_opened(no_leaks):
    # The learner's own, if any, are not the pool's (a Ray the session started has some).
    learner = psutil.Process()
    before = set(learner.net_connections(kind="inet"))
    with EnvPool([CARTPOLE] * 2, num_workers=2) as pool:
        pool.reset()
        assert set(learner.net_connections(kind="inet")) - before == set()
        for process in [psutil.Process(p.pid) for p in pool._transport.processes]:
            assert process.net_connections(kind="inet") == []


def test_interpreter_exit_closes_the_pool(no_leaks, tmp_path):
    script = tmp_path / "forget_to_close.py"
    script.write_text(
        textwrap.dedent(
            """
            import gymnasium as gym, functools
            from clusterenv_core import EnvPool
            pool = EnvPool([functools.partial(gym.make, "CartPole-v1")] * 2, num_workers=2)
            pool.reset()
            print(*pool.worker_pids)
            """
        )
    )
    output = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    pids = [int(pid) for pid in output.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_a_forked_child_exiting_leaves_the_pool_to_its_parent(no_leaks, tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(
        textwrap.dedent(
            """
            import gymnasium as gym, functools, os, sys
            import numpy as np
            from clusterenv_core import EnvPool
            pool = EnvPool([functools.partial(gym.make, "CartPole-v1")] * 2, num_workers=2)
            pool.reset(seeds=[0, 1])
            child = os.fork()
            if child == 0:
                sys.exit(0)  # exits as a Python process does: its exit handlers run
            os.waitpid(child, 0)
            print(pool.step(np.zeros(2, np.int64)).rewards.tolist())
            pool.close()
            """
        )
    )
    output = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert output.returncode == 0, output.stderr
    assert output.stdout.strip() == "[1.0, 1.0]"


def test_killed_learner_leaves_no_worker(no_leaks, tmp_path):
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(
            """
            import gymnasium as gym, functools, sys, time
            sys.path.insert(0, ROOT)
            from clusterenv_core import EnvPool
            from tests.envs import ChildStartingEnv
            env_fns = [functools.partial(gym.make, "CartPole-v1"), lambda: ChildStartingEnv(gym.make("CartPole-v1"))]
            pool = EnvPool(env_fns, num_workers=2)
            pool.reset()
            print(*pool.worker_pids, *pool.get_attr("helper_pid", indices=[1]), flush=True)
            time.sleep(60)
            """
        ).replace("ROOT", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    *pids, helper = [int(pid) for pid in learner.stdout.readline().split()]
    learner.kill()
    learner.wait()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) for pid in pids), "workers outlived their learner"
    assert wait_until_ended([helper]), "a process an env started outlived the learner"


@pytest.mark.slow
def test_workers_of_a_killed_learner_end_even_with_a_hanging_env(no_leaks, tmp_path):
    hanging = str(tmp_path / "hanging")
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(
            """
            import gymnasium as gym, functools, sys
            import numpy as np
            sys.path.insert(0, ROOT)
            from clusterenv_core import EnvPool
            from tests.envs import HangingEnv
            pool = EnvPool([lambda: HangingEnv(gym.make("CartPole-v1"), hang_at=1, hanging=HANGING)] * 2, num_workers=2)
            pool.reset()
            print(*pool.worker_pids, flush=True)
            pool.step(np.zeros(2, np.int64))  # hangs
            """
        )
        .replace("ROOT", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        .replace("HANGING", repr(hanging))
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in learner.stdout.readline().split()]
    wait_for_events(hanging, 2)  # the workers are inside the hanging step
    learner.kill()
    learner.wait()
    # The workers' 10 s of grace, and a margin for a loaded machine.
    assert wait_until_ended(pids, within=20), "workers outlived their learner"


def test_differing_spaces_are_rejected(no_leaks):
    def other():
        return gym.make("MountainCar-v0")

    with pytest.raises(ValueError, match="env 2 has observation space"):
        EnvPool([CARTPOLE, CARTPOLE, other], num_workers=2)


def test_a_shared_space_that_compares_by_identity_is_one_space_across_workers(no_leaks):
    from tests.envs import ShadeEnv

    with EnvPool([ShadeEnv] * 4, num_workers=2) as pool:  # each worker has its own copy of the space
        assert type(pool.observation_space).__name__ == "Shade"
        pool.reset(seeds=[0, 1, 2, 3])
        assert pool.step(np.array([0, 1, 1, 0])).obs == ["light", "dark", "dark", "light"]


@pytest.mark.parametrize("env_fns", [[], ()])
def test_no_envs_is_rejected(no_leaks, env_fns):
    with pytest.raises(ValueError, match="at least one"):
        EnvPool(env_fns)
    with pytest.raises(ValueError, match="num_envs"):
        EnvPool.make("CartPole-v1", 0)
    with pytest.raises(ValueError, match="num_envs"):
        EnvPool.make("CartPole-v1", -3)


def test_step_after_close_fails_clearly(no_leaks):
    pool = EnvPool([CARTPOLE] * 2, num_workers=1)
    pool.reset()
    pool.close()
    with pytest.raises(ClusterEnvError, match="closed"):
        _step_zeros(pool)


def test_ctrl_c_right_after_a_request_went_out_keeps_requests_and_replies_paired(no_leaks, ctrl_c_after_send):
    # CPython's sendall runs signal handlers after writing: the request is out when Ctrl-C raises.
    pool = EnvPool([lambda: CallCounter(gym.make("CartPole-v1"))] * 2, num_workers=2)
    pool.reset(seeds=[0, 1])
    ctrl_c_after_send()
    with pytest.raises(KeyboardInterrupt):
        pool.call("bump", indices=[0])
    assert pool.get_attr("calls") == [1, 0]  # the call's reply was read as its own, not as this one's
    ctrl_c_after_send()
    with pytest.raises(KeyboardInterrupt):
        _step_zeros(pool)  # worker 0 got its step, worker 1 none
    assert pool.get_attr("calls") == [1, 0]
    assert pool.call("bump", (2,)) == [3, 2]
    assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]
    pool.close()


def test_a_reply_read_before_ctrl_c_cut_step_wait_short_is_returned_when_it_resumes(no_leaks):
    # step_wait reads worker 1 first (the last to get its step), then waits for worker 0's slow env:
    # Ctrl-C there leaves worker 1's reply read; the resumed step_wait still returns its info.
    env_fns = [functools.partial(SlowCartPole, seconds=1.5), lambda: BigInfoEnv(gym.make("CartPole-v1"), 3)]
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset(seeds=[0, 1])
    pool.step_async(np.zeros(2, dtype=np.int64))
    interrupt_soon(0.5)
    with pytest.raises(KeyboardInterrupt):
        pool.step_wait()
    result = pool.step_wait()
    assert list(result.infos) == [1] and result.infos[1]["frame"].tolist() == [1, 1, 1]
    assert result.rewards.tolist() == [1.0, 1.0]
    pool.close()


@pytest.mark.slow
def test_an_env_error_read_before_ctrl_c_cut_step_wait_short_is_raised_when_it_resumes(no_leaks):
    env_fns = [functools.partial(SlowCartPole, seconds=1.5), functools.partial(_wrapped, FailingEnv, fail_at=1)]
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset(seeds=[0, 1])
    pool.step_async(np.zeros(2, dtype=np.int64))
    interrupt_soon(0.5)
    with pytest.raises(KeyboardInterrupt):
        pool.step_wait()
    with pytest.raises(EnvError, match="injected failure at step 1") as caught:
        pool.step_wait()
    assert (caught.value.env_index, caught.value.worker_index, caught.value.operation) == (1, 1, "step")
    assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]  # the worker lives on
    pool.close()


@pytest.mark.slow
def test_an_env_error_in_a_step_cut_short_by_ctrl_c_is_raised_by_the_next_call(no_leaks, ctrl_c_after_send):
    # Ctrl-C once both workers have their step (in which env 0 raises): the next call reads the
    # replies and raises env 0's error, as step_wait would have, also when Ctrl-C cuts that read
    # short while worker 1 still steps; the worker lives on.
    env_fns = [functools.partial(_wrapped, FailingEnv, fail_at=1), functools.partial(SlowCartPole, seconds=2.0)]
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset(seeds=[0, 1])
    ctrl_c_after_send(sends=2)
    with pytest.raises(KeyboardInterrupt):
        _step_zeros(pool)
    interrupt_soon(0.5)  # while the next call waits for worker 1's step
    with pytest.raises(KeyboardInterrupt):
        pool.reset(seeds=[0, 1])
    with pytest.raises(EnvError, match="injected failure at step 1") as caught:
        pool.reset(seeds=[0, 1])
    error = caught.value
    assert (error.env_index, error.worker_index, error.operation) == (0, 0, "step sent before Ctrl-C")
    assert "raise ValueError" in error.remote_traceback
    pool.reset(seeds=[0, 1])
    assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]
    pool.close()


@pytest.mark.parametrize("interrupted_call", ["replaced_envs", "remote_error"])
def test_an_env_error_read_just_before_ctrl_c_cut_the_reading_call_short_is_raised_by_the_next_call(
    no_leaks, ctrl_c_after_send, ctrl_c_at_call, interrupted_call
):
    # Ctrl-C once worker 0 has its step, in which env 0 raises; Ctrl-C again just after the next
    # call read that reply, as it takes it in: the reply is read, and the call after raises its error.
    env_fns = [functools.partial(_wrapped, FailingEnv, fail_at=1), CARTPOLE]
    pool = EnvPool(env_fns, num_workers=2)
    pool.reset(seeds=[0, 1])
    ctrl_c_after_send()
    with pytest.raises(KeyboardInterrupt):
        _step_zeros(pool)
    ctrl_c_at_call(channel_module, interrupted_call)
    with pytest.raises(KeyboardInterrupt):
        pool.reset(seeds=[0, 1])
    with pytest.raises(EnvError, match="injected failure at step 1") as caught:
        pool.reset(seeds=[0, 1])
    assert (caught.value.env_index, caught.value.worker_index, caught.value.operation) == (0, 0, "step sent before Ctrl-C")
    pool.reset(seeds=[0, 1])
    assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]
    pool.close()


@pytest.mark.parametrize(
    "next_call",
    [
        _step_zeros,
        lambda pool: pool.reset(seeds=[0, 1]),
        lambda pool: pool.call("render"),
        lambda pool: pool.get_attr("total_steps"),
        lambda pool: pool.set_attr("fail_at", [0, 0]),
        lambda pool: pool.env_is_wrapped(FailingEnv),
    ],
    ids=["step", "reset", "call", "get_attr", "set_attr", "env_is_wrapped"],
)
def test_an_env_error_kept_by_a_call_that_ctrl_c_cut_short_once_every_reply_was_read_is_raised_by_any_next_call(
    no_leaks, ctrl_c_after_send, ctrl_c_at_call, next_call
):
    # Both workers get their step, in which both envs raise; Ctrl-C cuts the next call short once it
    # read both replies, as it takes in worker 1's: nothing is left unread, and whatever comes next
    # (the plain step path too) raises env 0's error, once.
    pool = EnvPool([functools.partial(_wrapped, FailingEnv, fail_at=1)] * 2, num_workers=2)
    pool.reset(seeds=[0, 1])
    ctrl_c_after_send(sends=2)
    with pytest.raises(KeyboardInterrupt):
        _step_zeros(pool)
    ctrl_c_at_call(channel_module, "replaced_envs", calls=2)
    with pytest.raises(KeyboardInterrupt):
        pool.reset(seeds=[0, 1])
    with pytest.raises(EnvError, match="injected failure at step 1") as caught:
        next_call(pool)
    assert (caught.value.env_index, caught.value.worker_index, caught.value.operation) == (0, 0, "step sent before Ctrl-C")
    pool.reset(seeds=[0, 1])
    assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]
    pool.close()


def test_a_request_that_cannot_be_pickled_leaves_nothing_awaited(no_leaks, monkeypatch):
    from clusterenv_core.transports.local import transport

    pool = EnvPool([CARTPOLE] * 2, num_workers=2, timeout=3.0)
    pool.reset(seeds=[0, 1])
    with pytest.raises(TypeError, match="pickle"):
        pool.set_attr("lock", [threading.Lock()], indices=[0])
    frame = transport.frame_message
    interrupted = []

    def interrupted_while_pickling(message):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return frame(message)

    monkeypatch.setattr(transport, "frame_message", interrupted_while_pickling)
    with pytest.raises(KeyboardInterrupt):
        pool.call("render")
    started = time.monotonic()  # no reply is awaited from either: the step does not wait for one
    assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]
    assert time.monotonic() - started < 1.0
    pool.close()


def test_a_large_reply_that_came_in_time_is_read_however_late(no_leaks):
    pool = EnvPool([lambda: BigInfoEnv(gym.make("CartPole-v1"), 4_000_000)] * 2, num_workers=2, timeout=1.0)
    pool.reset(seeds=[0, 1])
    pool.step_async(np.zeros(2, np.int64))
    time.sleep(1.5)  # the learner trains meanwhile; the workers answered at once, their replies half sent
    assert pool.step_wait().infos[1]["frame"].nbytes == 4_000_000
    pool.close()


@pytest.mark.slow
def test_keyboard_interrupt_during_step_then_resume_or_close(no_leaks, tmp_path):
    # Steps of 1.5 s, interrupted once both began: the interrupting thread has ample slack on a
    # loaded machine.
    stepping = str(tmp_path / "stepping")
    pool = EnvPool([functools.partial(SlowCartPole, seconds=1.5, stepping=stepping)] * 2, num_workers=2)
    pool.reset(seeds=[0, 1])
    pool.step_async(np.zeros(2, np.int64))
    wait_for_events(stepping, 2)  # both envs are in their 1.5 s step
    interrupt_soon(0.2)  # Ctrl-C lands in the wait, with 1.3 s to spare
    with pytest.raises(KeyboardInterrupt):
        pool.step_wait()
    result = pool.step_wait()  # the interrupted step is still pending and completes
    assert result.rewards.tolist() == [1.0, 1.0]
    interrupt_at_events(stepping, 4)
    with pytest.raises(KeyboardInterrupt):
        _step_zeros(pool)
    pool.close()


def test_after_an_interrupted_step_every_call_finishes_it_first(no_leaks, tmp_path):
    """Ctrl-C in a step, then a reset, a new step or an env call, as after an interrupted
    ``learn()`` or CleanRL loop (whose ``step`` has no ``step_wait``): the interrupted step ends, its
    results dropped, and the call goes ahead, as with DummyVecEnv and SyncVectorEnv."""
    from tests.envs import SlowCartPole

    stepping = str(tmp_path / "stepping")
    pool = EnvPool([functools.partial(SlowCartPole, seconds=0.5, stepping=stepping)] * 2, num_workers=2)
    pool.reset(seeds=[0, 1])
    for then in ("reset", "step", "call"):
        pool.reset(seeds=[0, 1])
        interrupt_at_events(stepping, events(stepping) + 2)  # once both envs are in the step
        with pytest.raises(KeyboardInterrupt):
            _step_zeros(pool)
        if then == "reset":
            pool.reset(seeds=[0, 1])
            assert pool.get_attr("_elapsed_steps") == [0, 0]
        elif then == "step":
            assert _step_zeros(pool).rewards.tolist() == [1.0, 1.0]
            assert pool.get_attr("_elapsed_steps") == [2, 2]
        else:
            assert pool.get_attr("_elapsed_steps") == [1, 1]
    # A step started and not waited for is the caller's mistake, not an interrupt: still refused.
    pool.step_async(np.zeros(2, np.int64))
    with pytest.raises(ClusterEnvError, match="call step_wait first"):
        pool.reset()
    pool.step_wait()
    pool.close()


def test_adapters_are_usable_after_an_interrupted_step(no_leaks, tmp_path):
    from clusterenv_cleanrl import ClusterVectorEnv
    from clusterenv_sb3 import ClusterVecEnv
    from tests.envs import SlowCartPole

    stepping = str(tmp_path / "stepping")
    env_fns = [functools.partial(SlowCartPole, seconds=0.5, stepping=stepping)] * 2
    for venv in (ClusterVecEnv(env_fns), ClusterVectorEnv(env_fns)):
        with venv:
            venv.reset()
            interrupt_at_events(stepping, events(stepping) + 2)  # once both envs are in the step
            with pytest.raises(KeyboardInterrupt):
                venv.step(np.zeros(2, np.int64))
            venv.reset()
            assert venv.step(np.zeros(2, np.int64))[1].tolist() == [1.0, 1.0]


def test_nested_observation_spaces_are_refused_as_by_dummy_vec_env(no_leaks):
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv
    from tests.envs import NestedDictEnv

    with pytest.raises(NotImplementedError, match="Nested observation spaces are not supported") as expected:
        DummyVecEnv([NestedDictEnv])
    with pytest.raises(NotImplementedError) as caught:
        ClusterVecEnv([NestedDictEnv] * 2)
    assert str(caught.value) == str(expected.value)


def test_many_create_step_close_cycles_leak_nothing(no_leaks):
    def cycle(seed: int) -> None:
        pool = EnvPool([CARTPOLE] * 2, num_workers=1)
        pool.reset(seeds=[seed, seed + 1])
        for _ in range(5):
            _step_zeros(pool)
        pool.close()

    process = psutil.Process()
    cycle(0)  # first use opens long-lived descriptors (imports, random sources)
    # A closed pool's memory mapping (and its descriptor) lives as long as views of it do: until
    # the pool and its results are collected. Collect earlier tests' pools before counting.
    gc.collect()
    fds = process.num_fds()
    # 20 cycles: a descriptor kept by any cycle shows, and one kept now and then likely does; each
    # cycle starts a worker (about 0.45 s here).
    for seed in range(1, 20):
        cycle(seed)
    gc.collect()
    assert process.num_fds() == fds
