"""What several test modules share: exact comparison of results and the contract runs against
DummyVecEnv and SyncVectorEnv, Ctrl-C on a timer or at an event an env writes, what a closed pool
must not leave behind, and MPI launches. Imports neither SB3 nor torch at import (the gymnasium
0.29 venv of ``.ci/gym029.sh`` has neither; tests/sb3_helpers.py holds what needs them); the envs
workers run are in tests/envs.py, the shared fixtures in tests/conftest.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_core.transports.local import fork_server

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1

# -- exact comparison ------------------------------------------------------------------------------

# Wall-clock episode durations (SB3 Monitor, gymnasium RecordEpisodeStatistics) cannot match.
WALL_CLOCK_KEYS = {"t", "_t"}


def assert_same(actual: Any, expected: Any, path: str = "value") -> None:
    """Equal values, dtypes and container types, recursively; arrays compared element-wise and exactly.

    The wall-clock entries of episode statistics are compared for presence and type only.
    """
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: {type(actual)} is not an ndarray"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        if expected.dtype == object:
            for i, (a, e) in enumerate(zip(actual.ravel(), expected.ravel())):
                assert_same(a, e, f"{path}[{i}]")
        else:
            assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"), (
                f"{path}: {actual} != {expected}"
            )
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
        assert list(actual) == list(expected) or set(actual) == set(expected), (
            f"{path}: keys {list(actual)} != {list(expected)}"
        )
        for key in expected:
            if key in WALL_CLOCK_KEYS and path.endswith("['episode']"):
                assert type(actual[key]) is type(expected[key]), f"{path}[{key!r}]: type differs"
                continue
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, np.generic):
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"


def key_order(value):
    """The keys of every dict in ``value``, in order (``assert_same`` accepts any order)."""
    if isinstance(value, dict):
        return [(key, key_order(item)) for key, item in value.items()]
    if isinstance(value, tuple) or (isinstance(value, np.ndarray) and value.dtype == object):
        return [key_order(item) for item in value]
    return None


def assert_same_results(actual, expected, what: str) -> None:
    assert_same(actual, expected, what)
    assert key_order(actual) == key_order(expected), f"{what}: keys in another order"


def random_actions(space: gym.Space, rng: np.random.Generator):
    if isinstance(space, gym.spaces.MultiDiscrete):
        return rng.integers(0, space.nvec)
    return rng.uniform(space.low, space.high).astype(space.dtype)


def run_and_compare(cluster, sync, steps: int, seed: int = 0) -> dict[str, int]:
    """Step a ClusterVectorEnv and a SyncVectorEnv with the same random actions, resetting ended
    episodes in DISABLED mode, and compare every result; returns how many episodes terminated and
    were truncated."""
    rng = np.random.default_rng(seed)
    assert_same_results(cluster.reset(seed=seed), sync.reset(seed=seed), "reset")
    disabled = GYMNASIUM_1 and cluster.autoreset_mode == gym.vector.AutoresetMode.DISABLED
    counts = {"terminated": 0, "truncated": 0}
    for step in range(steps):
        actions = random_actions(sync.action_space, rng)
        result = cluster.step(actions)
        expected = sync.step(actions)
        assert_same_results(result, expected, f"step {step}")
        _, _, terminated, truncated, _ = expected
        counts["terminated"] += int(terminated.sum())
        counts["truncated"] += int(truncated.sum())
        if disabled and (terminated | truncated).any():
            mask = terminated | truncated
            assert_same_results(
                cluster.reset(options={"reset_mask": mask.copy()}),
                sync.reset(options={"reset_mask": mask.copy()}),
                f"partial reset after step {step}",
            )
    return counts


def run_side_by_side(env_fns, steps: int = 2000, seed: int = 3, on_start=None, **cluster_kwargs) -> tuple[int, float]:
    """ClusterVecEnv(env_fns, **cluster_kwargs) and DummyVecEnv(env_fns) give identical results for
    ``steps`` steps of the same random actions (also run by tests/mpi_scripts/contract.py and
    tests/cluster/multihost.py). ``on_start(cluster_vec_env)`` runs once both exist. Returns the
    episodes ended and the seconds the steps took."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    # ClusterVecEnv first: in an SPMD MPI launch, worker ranks turn into workers right here.
    actual = ClusterVecEnv(env_fns, **{"num_workers": 2, **cluster_kwargs})
    expected = DummyVecEnv(env_fns)
    try:
        if on_start is not None:
            on_start(actual)
        expected.seed(seed)
        actual.seed(seed)
        assert_same(actual.reset(), expected.reset(), "reset obs")
        assert_same(actual.reset_infos, expected.reset_infos, "reset_infos")
        expected.action_space.seed(seed)
        episodes_ended = 0
        stepping = time.monotonic()
        for t in range(steps):
            actions = np.stack([expected.action_space.sample() for _ in range(expected.num_envs)])
            want = expected.step(actions)
            got = actual.step(actions)
            for name, g, w in zip(("obs", "rewards", "dones", "infos"), got, want):
                assert_same(g, w, f"{name} at step {t}")
            assert_same(actual.reset_infos, expected.reset_infos, f"reset_infos at step {t}")
            episodes_ended += int(want[2].sum())
        seconds = time.monotonic() - stepping
        assert episodes_ended > 10, "the run must cover many automatic resets"
        assert_same(actual.get_attr("spec"), expected.get_attr("spec"), "get_attr")
    finally:
        actual.close()
        expected.close()
    return episodes_ended, seconds


# -- Ctrl-C ----------------------------------------------------------------------------------------


def _enable_ctrl_c() -> None:
    """Called in the main thread, the only one that may set a handler."""
    # A run started in the background of a shell without job control inherits SIGINT ignored, and
    # Python then installs no handler for it: give Ctrl-C the meaning it has at a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _ctrl_c_main_thread() -> None:
    # To the main thread: a process-wide signal may land on another thread, and the main thread then
    # only notices it when its wait returns.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def interrupt_soon(delay: float) -> None:
    """Ctrl-C in ``delay`` seconds, delivered to the main thread."""
    _enable_ctrl_c()
    threading.Timer(delay, _ctrl_c_main_thread).start()


def events(path: str) -> int:
    """How many events an env wrote to ``path`` (see tests/envs.py's ``write_event``)."""
    try:
        with open(path) as file:
            return file.read().count("\n")
    except FileNotFoundError:
        return 0


def wait_for_events(path: str, count: int, within: float = 30.0) -> None:
    """Wait until envs wrote ``count`` events to ``path`` in all; fails after ``within`` seconds."""
    deadline = time.monotonic() + within
    while events(path) < count:
        assert time.monotonic() < deadline, f"{events(path)} of {count} events in {path} after {within:g} s"
        time.sleep(0.01)


def interrupt_at_events(path: str, count: int, within: float = 30.0) -> None:
    """Ctrl-C (to the main thread) as soon as envs wrote ``count`` events to ``path`` in all, as when
    they are inside the step that writes them; no Ctrl-C if that takes more than ``within`` seconds
    (the test then fails on the missing KeyboardInterrupt)."""

    def interrupt() -> None:
        deadline = time.monotonic() + within
        while events(path) < count:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        _ctrl_c_main_thread()

    _enable_ctrl_c()
    threading.Thread(target=interrupt, daemon=True).start()


# -- what a closed pool must not leave behind ------------------------------------------------------
# The fork server outlives pools by design (it holds nothing of theirs and ends by itself;
# tests/test_fork_server.py checks that): it is told apart.


def _fork_server_pids() -> set[int]:
    return {server.process.pid for server in fork_server._servers.values()}


def _ray_own(process: psutil.Process) -> bool:
    """Whether ``process`` is one of Ray's own (its daemons, agents and idle worker processes) in a
    Ray this process started: Ray starts and ends them as it sees fit. The Ray backend's actors
    (titled ``ray::WorkerActor``) are ClusterEnv's workers, and what they start is theirs."""
    try:
        command = process.cmdline()
        name = process.name()
    except psutil.Error:
        return False
    title = command[0] if command else name
    if title.startswith("ray::"):
        return not title.startswith("ray::WorkerActor")
    ray_script = any(part.endswith(".py") and f"{os.sep}ray{os.sep}" in part for part in command[:3])
    return name in ("raylet", "gcs_server") or ray_script


def descendants() -> set[int]:
    """This process's descendants (worker processes and what their envs started), fork servers and
    Ray's own processes aside."""
    children = [child for child in psutil.Process().children(recursive=True) if not _ray_own(child)]
    return {child.pid for child in children} - _fork_server_pids()


def clusterenv_threads() -> set[threading.Thread]:
    """ClusterEnv's threads in this process, the fork servers' reapers aside."""
    return {
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("clusterenv") and thread.name != fork_server.REAPER_THREAD
    }


def shm_entries() -> set[str]:
    """The names in /dev/shm, MPICH's aside: its segments belong to MPI jobs that may run beside
    local-backend tests (the MPI tests check those)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if not name.startswith("mpich_")}


def buffer_mappings() -> int:
    """The learner's mappings of pools' shared memory (memory files named clusterenv-buffers)."""
    with open("/proc/self/maps") as maps:
        return sum("clusterenv-buffers" in line for line in maps)


def process_ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped
    except psutil.NoSuchProcess:
        return True


def wait_until_ended(pids: list[int], within: float = 5.0) -> bool:
    """Whether every process of ``pids`` ended within ``within`` seconds."""
    deadline = time.monotonic() + within
    while not all(process_ended(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(process_ended(pid) for pid in pids)


# -- MPI launches ----------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "mpi_scripts")
_BESIDE = os.path.join(os.path.dirname(sys.executable), "mpiexec")
MPIEXEC = _BESIDE if os.access(_BESIDE, os.X_OK) else shutil.which("mpiexec")
WORKERS = 2


def launch(
    mode: str, script: str, *args: str, timeout: float = 300.0, worker: list[str] | None = None
) -> tuple[int, str, float]:
    """Run ``script`` in launch ``mode`` with 2 worker ranks (``learners``: 2 ranks under mpiexec, for
    scripts whose learners spawn their own); returns (exit code, output, seconds).

    MPMD worker ranks run ``worker`` (default: the worker program without arguments, as users type it).
    """
    path = os.path.join(SCRIPTS, script)
    python = sys.executable
    if mode == "spawn":
        command = [python, path, *args]
    else:
        assert MPIEXEC, "mpiexec not found next to the interpreter nor on PATH"
        if mode == "learners":  # two ranks, each a learner (launch="spawn" under mpiexec)
            command = [MPIEXEC, "-print-all-exitcodes", "-n", "2", python, path, *args]
        elif mode == "mpmd":
            worker = worker or [python, "-m", "clusterenv_core.worker"]
            command = [
                MPIEXEC,
                "-print-all-exitcodes",
                "-n",
                "1",
                python,
                path,
                *args,
                ":",
                "-n",
                str(WORKERS),
                *worker,
            ]
        else:
            command = [MPIEXEC, "-print-all-exitcodes", "-n", str(WORKERS + 1), python, path, *args]
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout:g} s:\n{output}")
    return process.returncode, output, time.monotonic() - started


def assert_exit_codes(output: str, codes: str) -> None:
    """mpiexec -print-all-exitcodes: e.g. ``0,0,0`` (learner first)."""
    assert re.search(rf"Exit codes: \[[^\]]+\] {re.escape(codes)}\s*$", output, re.MULTILINE), output
