"""A worker is the learner's twin: imports, warnings, interpreter flags, helper processes and large
closures behave as in the process the user's code was written for (DummyVecEnv's, SyncVectorEnv's).

Each test runs a user's script in a fresh interpreter, as users run them: the flags, warning filters
and memory it checks are the script's own. Every applicable backend: local (fork server, fresh
interpreters), the inline worker, MPI spawn.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import process_ended, wait_until_ended

try:
    import mpi4py  # noqa: F401
except ImportError:
    HAS_MPI = False
else:
    HAS_MPI = True

BACKENDS = {
    "fork_server": {},
    "fresh": {"fork_server": False},
    "inline": {"inline_worker": True},
    "mpi": {"backend": "mpi"},
}
WORKER_BACKENDS = ["fork_server", "fresh", "mpi"]  # those whose envs run in worker processes


def backend_params(names: list[str]) -> list:
    return [
        pytest.param(name, marks=pytest.mark.skipif(name == "mpi" and not HAS_MPI, reason="needs mpi4py"))
        for name in names
    ]


def run_script(path: Path, *args: str, flags: tuple[str, ...] = (), cwd: Path | None = None, timeout: float = 180):
    """Run a user's script as ``python [flags] script args`` (a new session: MPICH's process manager
    ends its own process group when a rank dies)."""
    return subprocess.run(
        [sys.executable, *flags, str(path), *args],
        cwd=cwd or path.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# -- 1. imports resolve to the learner's files ------------------------------------------------------


def _user_project(root: Path) -> Path:
    """A user's project whose env factories live in its own ``tests`` package, as ClusterEnv's own
    checkout (installed in editable mode here) has one too; also ``examples`` and ``benchmarks``."""
    write(root / "tests" / "__init__.py", "")
    write(
        root / "tests" / "myenvs.py",
        """
        import gymnasium as gym

        def make_env():
            return gym.make("CartPole-v1")
        """,
    )
    write(root / "examples" / "__init__.py", "")
    write(root / "examples" / "shapes.py", "SIZE = 7\n")
    return write(
        root / "run.py",
        """
        import json, sys
        import numpy as np
        from stable_baselines3.common.vec_env import DummyVecEnv
        from clusterenv_sb3 import ClusterVecEnv
        from tests.myenvs import make_env
        from examples.shapes import SIZE

        def make_sized():
            env = make_env()
            env.unwrapped.size = SIZE
            return env

        if __name__ == "__main__":
            options = json.loads(sys.argv[1])
            fns = [make_env, make_env, make_sized, make_sized]
            cluster, dummy = ClusterVecEnv(fns, num_workers=2, **options), DummyVecEnv(fns)
            for env in (cluster, dummy):
                env.seed(3)
            assert np.array_equal(cluster.reset(), dummy.reset())
            for _ in range(20):
                actions = np.array([dummy.action_space.sample() for _ in range(4)])
                a, b = cluster.step(actions), dummy.step(actions)
                assert all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3]))
            assert cluster.get_attr("size", [2, 3]) == [7, 7]
            cluster.close()
            print("same as DummyVecEnv")
        """,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_a_projects_own_tests_package_resolves_on_the_workers(tmp_path, backend):
    script = _user_project(tmp_path / "project")
    result = run_script(script, json.dumps(BACKENDS[backend]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "same as DummyVecEnv" in result.stdout


def test_a_module_imported_from_a_directory_the_path_no_longer_has_is_the_learners(tmp_path):
    """The factory's module came from a directory taken off ``sys.path`` since: the worker loads it
    from the learner's file, not whatever its name finds there."""
    write(tmp_path / "elsewhere" / "terrain.py", "import gymnasium as gym\nHEIGHT = 3\n")
    script = write(
        tmp_path / "project" / "run.py",
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path / 'elsewhere')!r})
        import terrain
        sys.path.remove({str(tmp_path / 'elsewhere')!r})
        import gymnasium as gym
        from clusterenv_core import EnvPool

        def make():
            env = gym.make("CartPole-v1")
            env.unwrapped.height = terrain.HEIGHT
            return env

        if __name__ == "__main__":
            with EnvPool([make] * 2, num_workers=2) as pool:
                print("height", pool.get_attr("height"))
        """,
    )
    write(tmp_path / "project" / "terrain.py", "raise ImportError('the wrong terrain')\n")
    result = run_script(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "height [3, 3]" in result.stdout


# -- 2. warning filters and interpreter flags -------------------------------------------------------


def _warning_script(root: Path) -> Path:
    return write(
        root / "warns.py",
        """
        import json, sys, warnings
        import gymnasium as gym
        import numpy as np
        from clusterenv_core import EnvError
        from clusterenv_sb3 import ClusterVecEnv

        class WarningEnv(gym.Env):
            observation_space = gym.spaces.Box(-1, 1, (1,))
            action_space = gym.spaces.Discrete(2)

            def reset(self, *, seed=None, options=None):
                return np.zeros(1, np.float32), {}

            def step(self, action):
                warnings.warn("the simulator is drifting", UserWarning)
                return np.zeros(1, np.float32), 0.0, False, False, {}

        if __name__ == "__main__":
            if "filter" in sys.argv:
                warnings.filterwarnings("ignore", message="the simulator")
            env = ClusterVecEnv([WarningEnv] * 2, num_workers=2, **json.loads(sys.argv[1]))
            env.reset()
            try:
                env.step(np.zeros(2, dtype=np.int64))
                print("stepped")
            except (EnvError, UserWarning) as error:
                print("raised", type(error).__name__, getattr(error, "exc_type", ""))
            env.close()
        """,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_warning_filters_reach_the_envs_set_in_the_script_or_by_flags(tmp_path, backend):
    script, options = _warning_script(tmp_path), json.dumps(BACKENDS[backend])
    shown = run_script(script, options)
    assert "stepped" in shown.stdout and "warns.py:16: UserWarning: the simulator is drifting" in shown.stderr, shown.stderr

    for flags, args in (((), ("filter",)), (("-W", "ignore:the simulator"), ())):
        ignored = run_script(script, options, *args, flags=flags)
        assert "stepped" in ignored.stdout, ignored.stderr[-3000:]
        assert "drifting" not in ignored.stderr

    raised = run_script(script, options, flags=("-W", "error:the simulator"))
    # DummyVecEnv raises the UserWarning; an env's arrives as the EnvError carrying it.
    assert "raised EnvError builtins.UserWarning" in raised.stdout, raised.stdout + raised.stderr[-3000:]


def test_workers_run_with_the_learners_interpreter_flags(tmp_path):
    # The env's own view of its flags: a method of a wrapper the script defines.
    script = write(
        tmp_path / "flags.py",
        """
        import sys
        import gymnasium as gym
        from clusterenv_core import EnvPool

        class Flags(gym.Wrapper):
            def flags(self):
                return [sys.flags.optimize, sys.flags.dev_mode, sys.flags.dont_write_bytecode]

        if __name__ == "__main__":
            for options in ({}, {"fork_server": False}):
                with EnvPool([lambda: Flags(gym.make("CartPole-v1"))] * 2, num_workers=2, backend_options=options) as pool:
                    print(pool.call("flags"))
        """,
    )
    result = run_script(script, flags=("-O", "-X", "dev", "-B"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[[1, True, 1], [1, True, 1]]"] * 2


# -- 3. no ResourceWarning from ClusterEnv ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_no_resource_warning_under_dev_mode(tmp_path, backend):
    script = write(
        tmp_path / "dev.py",
        """
        import json, sys
        import numpy as np
        from stable_baselines3.common.env_util import make_vec_env
        from clusterenv_sb3 import ClusterVecEnv

        if __name__ == "__main__":
            for _ in range(2):  # a second pool reuses the fork server
                env = make_vec_env("CartPole-v1", n_envs=4, vec_env_cls=ClusterVecEnv, vec_env_kwargs=json.loads(sys.argv[1]))
                env.reset()
                for _ in range(5):
                    env.step(np.zeros(4, dtype=np.int64))
                env.close()
            print("closed")
        """,
    )
    result = run_script(script, json.dumps(BACKENDS[backend]), flags=("-X", "dev", "-W", "error::ResourceWarning"))
    assert result.returncode == 0 and "closed" in result.stdout, result.stderr[-3000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-3000:]


def test_a_fork_server_that_ends_with_its_learner_leaves_no_resource_warning(tmp_path):
    """The server runs with the learner's flags: when it reads end-of-file (the learner gone, or a
    close() racing the kill that follows) it closes its own socket, under -X dev too."""
    script = write(
        tmp_path / "server_eof.py",
        """
        import os, sys
        from clusterenv_core.transports.local.fork_server import ForkServer

        server = ForkServer(sys.executable, dict(os.environ))
        server.control.close()
        print("server exit", server.process.wait(30))
        """,
    )
    result = run_script(script, flags=("-X", "dev", "-W", "error::ResourceWarning"))
    assert "server exit 0" in result.stdout, result.stderr[-3000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-3000:]


# -- 4. env helper processes die with their worker ----------------------------------------------------


def _helper_script(root: Path) -> Path:
    return write(
        root / "helpers.py",
        """
        import json, subprocess, sys, time
        import gymnasium as gym
        import numpy as np
        from clusterenv_sb3 import ClusterVecEnv

        class SimulatorEnv(gym.Env):
            # Starts a simulator process, as Unity or a game binary would, and stops it in close().
            observation_space = gym.spaces.Box(-1, 1, (1,))
            action_space = gym.spaces.Discrete(2)

            def __init__(self):
                self.simulator = subprocess.Popen(["sleep", "1000"])

            def simulator_pid(self):
                return self.simulator.pid

            def reset(self, *, seed=None, options=None):
                return np.zeros(1, np.float32), {}

            def step(self, action):
                return np.zeros(1, np.float32), 0.0, False, False, {}

            def close(self):
                self.simulator.kill()

        if __name__ == "__main__":
            env = ClusterVecEnv([SimulatorEnv] * 4, num_workers=2, **json.loads(sys.argv[1]))
            env.reset()
            print(json.dumps({"workers": env.pool.worker_pids, "helpers": env.env_method("simulator_pid")}), flush=True)
            time.sleep(600)
        """,
    )


@pytest.mark.slow
@pytest.mark.parametrize("learner_signal", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("backend", backend_params(WORKER_BACKENDS))
def test_helper_processes_die_when_a_worker_and_then_the_learner_are_killed(tmp_path, backend, learner_signal):
    """The double fault of a preempted job: a worker SIGKILLed (the OOM killer), then the learner
    killed without close(). Every process the envs started is gone within 15 s."""
    script = _helper_script(tmp_path)
    learner = subprocess.Popen(
        [sys.executable, str(script), json.dumps(BACKENDS[backend])],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        started = json.loads(learner.stdout.readline())
        helpers = started["helpers"]
        assert len(helpers) == 4 and not any(process_ended(pid) for pid in helpers)
        os.kill(started["workers"][0], signal.SIGKILL)
        assert wait_until_ended(started["workers"][:1])
        learner.send_signal(learner_signal)
        learner.wait(10)
        assert wait_until_ended(helpers, within=15.0), [pid for pid in helpers if not process_ended(pid)]
    finally:
        if learner.poll() is None:
            learner.kill()
        try:
            os.killpg(learner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- 5. a large closure is pickled, shipped and held once ---------------------------------------------


def _closure_script(root: Path) -> Path:
    return write(
        root / "closure.py",
        """
        import functools, json, sys
        import gymnasium as gym
        import numpy as np
        import psutil
        from clusterenv_core import EnvPool

        MiB = 2**20

        def make(table):
            env = gym.make("CartPole-v1")
            env.unwrapped.table = table
            return env

        if __name__ == "__main__":
            options, shape = json.loads(sys.argv[1]), sys.argv[2]
            table = np.random.default_rng(0).random(100 * MiB // 8)  # 100 MiB, as a terrain or a dataset
            if shape == "one factory":
                env_fns = [functools.partial(make, table)] * 8
            else:  # one factory per env, all closing over the same table
                env_fns = [functools.partial(make, table) for _ in range(8)]
            learner = psutil.Process()
            before = learner.memory_info().rss
            with EnvPool(env_fns, num_workers=2, **options) as pool:
                pool.reset(seeds=list(range(8)))
                print(json.dumps({
                    "learner": (learner.memory_info().rss - before) / MiB,
                    "workers": [psutil.Process(pid).memory_info().rss / MiB for pid in pool.worker_pids],
                }))
        """,
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["one factory", "factories sharing an array"])
@pytest.mark.parametrize(
    "options",
    [{}, {"restart_failed_workers": True}, pytest.param({"backend": "mpi"}, marks=backend_params(["mpi"])[0].marks)],
    ids=["local", "local with restarts", "mpi"],
)
def test_a_large_closure_is_held_once_by_the_learner_and_each_worker(tmp_path, options, shape):
    result = run_script(_closure_script(tmp_path), json.dumps(options), shape)
    assert result.returncode == 0, result.stderr[-3000:]
    memory = json.loads(result.stdout.splitlines()[-1])
    # A pickle of the table (100 MiB) while restarts may need it; none once sent, without them.
    assert memory["learner"] < (150 if options.get("restart_failed_workers") else 50), memory
    # A worker: the interpreter and its imports (~40-70 MiB) and one table for its four envs, as
    # the learner's envs hold one between them.
    assert all(rss < 250 for rss in memory["workers"]), memory


# -- 6. silent or inconsistent edges ------------------------------------------------------------------


@pytest.mark.slow
def test_a_close_cut_short_by_a_hanging_env_close_names_env_worker_and_time(tmp_path):
    script = write(
        tmp_path / "hang.py",
        """
        import time, warnings
        import gymnasium as gym
        from clusterenv_core import CloseTimeoutWarning, EnvPool

        class HangsInClose(gym.Wrapper):
            def close(self):
                if self.get_wrapper_attr("hangs"):
                    time.sleep(1000)
                super().close()

        def make():
            env = HangsInClose(gym.make("CartPole-v1"))
            env.unwrapped.hangs = False
            return env

        if __name__ == "__main__":
            pool = EnvPool([make] * 4, num_workers=2, timeout=1)
            pool.set_attr("hangs", [True], indices=[3])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                started = time.monotonic()
                pool.close()
                print(f"closed in {time.monotonic() - started:.1f} s")
            for warning in caught:
                print(f"{warning.category.__name__} at {warning.filename.rsplit('/', 1)[-1]}:{warning.lineno}: {warning.message}")
        """,
    )
    result = run_script(script)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("closed in 5.") and len(lines) == 2, lines
    close_line = script.read_text().splitlines().index("        pool.close()") + 1  # the warning points at it
    assert lines[1].startswith(f"CloseTimeoutWarning at hang.py:{close_line}: env 3 on worker 1 did not finish close() within 5"), lines
    assert lines[1].endswith("s; its worker was ended"), lines


@pytest.mark.slow
def test_backend_options_reach_the_backend_from_every_adapter():
    import gymnasium as gym

    from clusterenv_cleanrl import ClusterVectorEnv
    from clusterenv_sb3 import ClusterVecEnv

    make = lambda: gym.make("CartPole-v1")  # noqa: E731
    for adapter in (ClusterVecEnv, ClusterVectorEnv):
        for options in ({"backend_options": {"fork_server": False}}, {"fork_server": False}):
            env = adapter([make] * 2, num_workers=2, **options)
            assert env.pool._transport.forks_workers is False
            env.close()
        with pytest.raises(TypeError, match="backend option\\(s\\) fork_server given both as keywords and in backend_options"):
            adapter([make] * 2, fork_server=True, backend_options={"fork_server": False})


@pytest.mark.slow
def test_the_learner_threads_warning_is_one_line_once_per_process(tmp_path):
    script = write(
        tmp_path / "threads.py",
        """
        import warnings
        import torch
        torch.set_num_threads(2)
        import gymnasium as gym
        from clusterenv_core import EnvPool, learner_threads
        learner_threads.os.cpu_count = lambda: 2

        if __name__ == "__main__":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    EnvPool([lambda: gym.make("CartPole-v1")] * 2, num_workers=2).close()
            for warning in caught:
                print(warning.category.__name__, str(warning.message))
        """,
    )
    result = run_script(script)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    assert line.startswith("LearnerThreadsWarning torch runs 2 threads beside 2 ClusterEnv workers on 2 cores")
    assert "torch.set_num_threads(1)" in line and len(line) < 250
