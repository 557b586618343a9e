"""The MPI backend under real MPI launches: spawn (plain python), MPMD and SPMD (mpiexec).

Each test runs a script of ``tests/mpi_scripts`` in a new session (MPICH's process manager kills
whole process groups on failures; never pytest's) with a timeout, and reads what rank 0 printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("mpi4py", reason="backend='mpi' needs mpi4py (pip install -e '.[mpi]')")

from tests.helpers import assert_exit_codes, launch, wait_until_ended

MODES = ("spawn", "mpmd", "spmd")


def worker_pids(output: str) -> list[int]:
    match = re.search(r"^WORKERS ((?:\d+ ?)+)$", output, re.MULTILINE)
    assert match, output
    return [int(pid) for pid in match.group(1).split()]


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    assert wait_until_ended(pids, within), f"worker ranks still running: {pids}"


def shm_names() -> set[str]:
    """The names in ``/dev/shm`` (none where there is no such directory)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(autouse=True)
def no_shm_left():
    """Every launch leaves no shared-memory segment (MPICH's or ours) behind, even one whose ranks
    were killed: each rank removes the names of MPICH's segments once every rank has started."""
    before = shm_names()
    yield
    deadline = time.monotonic() + 5
    while True:
        left = shm_names() - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


# -- contract: identical to DummyVecEnv ------------------------------------------------------------


CONTRACT_CHECKS = ("cartpole", "dict", "vector", "rollout")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mpmd", "spmd"])
@pytest.mark.parametrize("check", CONTRACT_CHECKS)
def test_matches_dummy_vec_env(mode, check):
    """2000 steps side by side with DummyVecEnv (``vector``: ClusterVectorEnv with SyncVectorEnv):
    obs, rewards, flags, infos identical; ``rollout``: worker-side rollouts equal a reference."""
    code, output, _ = launch(mode, "contract.py", check)
    assert code == 0 and f"OK {check}" in output, output
    assert_exit_codes(output, "0,0,0")


@pytest.mark.slow
def test_matches_dummy_vec_env_spawned():
    """The same checks from one plain python process, which spawns a pool for each in turn (a world
    launch serves one pool)."""
    code, output, _ = launch("spawn", "contract.py", *CONTRACT_CHECKS)
    assert code == 0 and all(f"OK {check}" in output for check in CONTRACT_CHECKS), output


@pytest.mark.slow
def test_reset_keywords_reach_the_envs_as_sent():
    """The learner's choice of reset keywords (SB3's: ``options`` only when set) travels to MPI
    workers unchanged: the envs get what DummyVecEnv passes them."""
    code, output, _ = launch("spawn", "contract.py", "reset_keywords")
    assert code == 0 and "OK reset_keywords" in output, output


@pytest.mark.slow
def test_spawn_under_mpiexec_gives_every_learner_its_own_workers():
    """launch="spawn" in a job of two ranks: two learners, each spawning two worker ranks of its own,
    both identical to DummyVecEnv."""
    code, output, _ = launch("learners", "contract.py", "several_learners")
    assert code == 0 and output.count("OK several_learners") == 2, output
    assert_exit_codes(output, "0,0")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_ppo_parameters_identical_to_dummy_vec_env(mode):
    """Seeded SB3 PPO (2048 steps): the same parameters, bit for bit, as with DummyVecEnv."""
    code, output, _ = launch(mode, "contract.py", "ppo")
    assert code == 0 and "OK ppo" in output, output


@pytest.mark.slow
def test_fuzzer_agrees_on_mpi():
    """The differential fuzzer's properties (tests/test_fuzz.py) with spawned MPI workers, flat and node agents."""
    pytest.importorskip("hypothesis")
    code, output, _ = launch("spawn", "fuzz.py", "4")
    assert code == 0 and "OK fuzz" in output, output


@pytest.mark.slow
def test_async_batches_on_mpi():
    """Asynchronous batches (tests/test_async_batches.py) with spawned MPI workers."""
    code, output, _ = launch("spawn", "async_batches.py")
    assert code == 0, output
    for check in ("trajectories", "partial blocks", "no starvation", "unread reply", "reset_envs rows", "lost rank"):
        assert f"OK async {check}" in output, output


# -- faults ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_env_exception_is_env_error_and_pool_stays_usable(mode):
    code, output, _ = launch(mode, "faults.py", "env_exception")
    assert code == 0 and "OK env_exception" in output, output
    if mode != "spawn":
        assert_exit_codes(output, "0,0,0")


@pytest.mark.parametrize("mode", MODES)
def test_close_ends_every_worker_rank_with_code_0(mode):
    code, output, _ = launch(mode, "faults.py", "close_exit")
    assert code == 0 and "OK close_exit" in output, output
    # SPMD worker ranks never run the rest of the script.
    assert output.count("AFTER CLOSE") == 1 and "AFTER CLOSE rank 0" in output, output
    if mode == "spawn":
        assert_gone(worker_pids(output), within=2.0)
    else:
        assert_exit_codes(output, "0,0,0")


def test_spawned_worker_death_is_worker_lost_error_at_once():
    """A rank killed by SIGKILL: WorkerLostError (its doorbell closes); the learner lives on and
    exits 0; MPICH ends the other spawned rank."""
    code, output, _ = launch("spawn", "faults.py", "worker_death")
    assert code == 0, output
    match = re.search(r"OK worker_death WorkerLostError after ([\d.]+) s", output)
    assert match and float(match.group(1)) < 2.0, output
    assert "OK closed" in output, output
    assert_gone(worker_pids(output))


def test_spawned_worker_death_blames_no_rank_that_did_not_die():
    """Worker 0 dies while worker 1 still steps; MPICH then ends worker 1 too, so the learner
    may find either dead: it names worker 0, or says all are lost, never worker 1 alone."""
    code, output, _ = launch("spawn", "faults.py", "first_rank_dies")
    assert code == 0, output
    match = re.search(r"OK first_rank_dies WorkerLostError: (.*)", output)
    assert match and not match.group(1).startswith("worker 1 "), output
    assert match.group(1).startswith(("worker 0 ", "all MPI workers of this pool (2) are lost")), output
    assert_gone(worker_pids(output))


@pytest.mark.slow
def test_no_spawn_after_close_killed_a_stuck_rank():
    code, output, _ = launch("spawn", "faults.py", "spawn_after_a_killed_rank")
    assert code == 0, output
    match = re.search(r"OK spawn_after_a_killed_rank ClusterEnvError after ([\d.]+) s: .*cannot spawn", output)
    assert match and float(match.group(1)) < 1.0, output


@pytest.mark.slow
def test_close_receives_the_segments_of_a_pending_rollout():
    """A rollout started and not waited for: close() receives its segments, so no message is left
    unmatched (UCX warned of each) and no worker is kept from its close request (a large segment
    made close() kill the rank, after which the process could not spawn)."""
    code, output, _ = launch("spawn", "faults.py", "close_pending_rollout")
    assert code == 0 and "OK close_pending_rollout" in output, output
    assert "unexpected tag-receive" not in output, output


@pytest.mark.slow
@pytest.mark.parametrize("where", ["closing envs", "disconnecting", "waiting for exits"])
def test_ctrl_c_during_close_ends_the_ranks_and_releases_everything(where):
    """As with the local backend: KeyboardInterrupt at once, nothing left running or held. Ranks still
    closing their envs are killed, which ends MPICH's process manager, so this process can spawn no
    more pools; ranks that had answered their close request disconnect and exit, and it can."""
    code, output, _ = launch("spawn", "faults.py", "ctrl_c_during_close", where, timeout=120.0)
    assert code == 0, output
    match = re.search(r"OK interrupted after ([\d.]+) s", output)
    assert match and float(match.group(1)) < 5.0, output
    assert "RANKS LEFT []" in output and "THREADS LEFT []" in output and "DESCRIPTORS LEFT 0" in output, output
    if where == "closing envs":
        assert "NEXT POOL refused: MPI's process manager of this process ended" in output, output
    else:
        assert "NEXT POOL spawned" in output, output


@pytest.mark.slow
def test_a_second_ctrl_c_during_close_still_kills_the_ranks_that_did_not_exit():
    """Ctrl-C while close() waits for the ranks to exit, then again in the second it gives them
    before it kills them: they are killed all the same, and KeyboardInterrupt comes after that."""
    code, output, _ = launch("spawn", "faults.py", "second_ctrl_c_during_close", timeout=120.0)
    assert code == 0, output
    match = re.search(r"OK interrupted 2 times, after ([\d.]+) s", output)
    assert match and float(match.group(1)) < 5.0, output
    assert "RANKS LEFT []" in output, output


@pytest.mark.parametrize("mode", ["mpmd", "spmd"])
def test_world_worker_death_ends_the_job(mode):
    """Under mpiexec a dead rank makes MPICH kill the whole job, learner included: bounded, not a hang."""
    code, output, seconds = launch(mode, "faults.py", "worker_death", timeout=120.0)
    # The learner may still see WorkerLostError first (the doorbell closes before MPICH acts).
    assert code != 0 and seconds < 60.0, output


@pytest.mark.slow
def test_spawned_hang_is_timeout_and_close_kills_the_rank():
    code, output, _ = launch("spawn", "faults.py", "hang")
    assert code == 0, output
    match = re.search(r"OK hang WorkerTimeoutError after ([\d.]+) s", output)
    assert match and 1.9 < float(match.group(1)) < 10.0, output
    assert "OK closed" in output, output
    assert_gone(worker_pids(output))


@pytest.mark.slow
def test_rollout_timeout_bounds_the_time_without_progress():
    """tests/test_inference.py's checks over MPI: progress reports cross the MPI transport too."""
    code, output, _ = launch("spawn", "faults.py", "rollout_progress")
    assert code == 0 and "OK rollout_progress" in output, output


@pytest.mark.slow
def test_ctrl_c_while_the_rows_or_arrays_after_a_reply_come_in_loses_no_reply():
    """tests/test_inference.py's checks over MPI, where the rows and arrays are messages to wait for:
    Ctrl-C there no longer loses the reply (the next call then timed out waiting for it)."""
    code, output, _ = launch("spawn", "faults.py", "ctrl_c_receiving_rows_and_arrays", timeout=120.0)
    assert code == 0, output
    assert "OK ctrl_c_receiving_rows_and_arrays rollout_wait" in output, output
    assert "OK ctrl_c_receiving_rows_and_arrays reset" in output, output


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mpmd", "spmd"])
def test_world_hang_is_timeout_then_abort_at_exit(mode):
    """A stuck world rank cannot be killed alone: WorkerTimeoutError, close() returns, and the learner
    aborts the job at exit instead of waiting in MPI_Finalize forever."""
    code, output, seconds = launch(mode, "faults.py", "hang", timeout=120.0)
    assert "OK hang WorkerTimeoutError" in output and "OK closed" in output, output
    # The learner says it aborts; MPICH's own MPI_Abort report may be cut off as the job ends.
    assert code != 0 and "aborting the MPI job" in output, output
    assert seconds < 60.0


def test_spawned_workers_exit_when_the_learner_is_killed():
    code, output, _ = launch("spawn", "faults.py", "learner_kill")
    assert code == -signal.SIGKILL, output
    assert_gone(worker_pids(output))


@pytest.mark.parametrize("mode", MODES)
def test_learner_exception_closes_the_workers(mode):
    code, output, _ = launch(mode, "faults.py", "learner_exception")
    assert code == 1 and "RuntimeError: the learner crashed" in output, output
    if mode == "spawn":
        assert_gone(worker_pids(output))
    else:
        assert_exit_codes(output, "256,0,0")  # the learner's status 1, then both workers' 0


def test_killed_world_learner_ends_the_job():
    code, output, seconds = launch("spmd", "faults.py", "learner_kill", timeout=120.0)
    assert code != 0 and seconds < 60.0, output


# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mpmd", "spmd"])
def test_wrong_num_workers_is_value_error_naming_the_right_one(mode):
    code, output, _ = launch(mode, "faults.py", "wrong_num_workers")
    assert code == 0 and "OK wrong_num_workers" in output and "pass num_workers=2" in output, output
    assert_exit_codes(output, "0,0,0")


@pytest.mark.slow
def test_worker_program_with_the_backend_argument_serves_too():
    code, output, _ = launch("mpmd", "contract.py", "cartpole", worker=[sys.executable, "-m", "clusterenv_core.worker", "mpi"])
    assert code == 0 and "OK cartpole" in output, output
    assert_exit_codes(output, "0,0,0")


def _worker_without(module: str) -> list[str]:
    """The worker program in an interpreter where ``module`` cannot be imported."""
    code = (
        f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = ['worker']; "
        "runpy.run_module('clusterenv_core.worker', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    "worker, reason",
    [
        ([sys.executable, "-m", "clusterenv_core.worker", "carrier-pigeon"], "unknown backend 'carrier-pigeon'"),
        ([sys.executable, "-m", "clusterenv_core.worker", "mpi", "sideways"], "unknown argument 'sideways'"),
        (_worker_without("gymnasium"), "cannot import what the worker needs: ModuleNotFoundError: import of gymnasium"),
        (_worker_without("mpi4py"), "cannot import what the worker needs: ModuleNotFoundError: import of mpi4py"),
    ],
    ids=["bad backend", "bad argument", "no gymnasium", "no mpi4py"],
)
def test_worker_program_that_cannot_serve_ends_the_job_within_seconds(worker, reason):
    """Without this the learner would wait in MPI_Init forever: the launcher does not end a job
    whose rank exits before initializing MPI."""
    code, output, seconds = launch("mpmd", "contract.py", "cartpole", worker=worker, timeout=60)
    assert code != 0, output
    assert reason in output and "aborting the MPI job" in output, output
    assert seconds < 20, f"the job took {seconds:.1f} s to end"


@pytest.mark.slow
def test_learner_gives_up_on_a_rank_that_never_starts_mpi(monkeypatch):
    """A worker program that dies before any of ClusterEnv runs (here: at once) cannot abort the
    job; the learner's wait in MPI_Init is bounded by the connect timeout instead.

    The learner ends inside MPI_Init, holding the GIL, so nothing removes the segment MPICH created
    there: the one case that leaves one (docs/mpi.md, "Shared memory"). The test removes it.
    """
    monkeypatch.setenv("CLUSTERENV_MPI_CONNECT_TIMEOUT", "5")
    before = shm_names()
    code, output, seconds = launch("mpmd", "contract.py", "cartpole", worker=[sys.executable, "-c", "raise SystemExit(1)"], timeout=60)
    left = shm_names() - before
    for name in left:
        os.unlink(os.path.join("/dev/shm", name))
    assert code != 0 and "Timeout" in output and "mpi/runtime.py" in output, output
    assert seconds < 30, f"the job took {seconds:.1f} s to end"
    assert len(left) <= 1 and all(name.startswith("mpich_shm_") for name in left), left


def test_worker_program_outside_an_mpi_job_says_how_to_launch_it():
    result = subprocess.run(
        [sys.executable, "-m", "clusterenv_core.worker", "mpi"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "mpiexec -n 1 python train.py : -n 4 python -m clusterenv_core.worker" in result.stderr
    bare = subprocess.run([sys.executable, "-m", "clusterenv_core.worker"], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "usage: python -m clusterenv_core.worker" in bare.stderr


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_only_mpich_segment_names_this_process_maps_are_removed():
    """unlink_shared_memory_names removes the names of MPICH's segments this process maps, and
    leaves every other file in /dev/shm alone: another program's segment, even one mapped here,
    and an MPICH segment this process does not map (another job's)."""
    import mmap

    from clusterenv_core.transports.mpi.runtime import unlink_shared_memory_names

    tag = f"{os.getpid()}_{time.monotonic_ns()}"
    paths = {name: f"/dev/shm/{name}" for name in (f"mpich_shm_{tag}_0", f"user_segment_{tag}", f"mpich_shm_{tag}_other")}
    maps = []
    try:
        for name, path in paths.items():
            with open(path, "wb") as file:
                file.truncate(4096)
            if not name.endswith("_other"):
                with open(path, "r+b") as file:
                    maps.append(mmap.mmap(file.fileno(), 4096))
        unlink_shared_memory_names()
        left = {name for name, path in paths.items() if os.path.exists(path)}
        assert left == {f"user_segment_{tag}", f"mpich_shm_{tag}_other"}
        unlink_shared_memory_names()  # names already removed (mapped as "(deleted)") are skipped
    finally:
        for segment in maps:
            segment.close()
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.slow
def test_importing_clusterenv_does_not_import_mpi4py():
    code = "import sys, clusterenv_core, clusterenv_sb3; assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"heartbeat_timeout": 1.5, "heartbeat_interval": 1.0}, "at least twice heartbeat_interval"),
        ({"heartbeat_timeout": -1.0}, "heartbeat_timeout must be a non-negative"),
        ({"heartbeat_interval": 0.0}, "heartbeat_interval must be a positive"),
    ],
)
def test_bad_heartbeat_options_are_value_errors(options, message):
    from clusterenv_core.transports.mpi import MPITransport

    with pytest.raises(ValueError, match=message):
        MPITransport(**options)


def test_heartbeats_can_be_turned_off_and_bound_a_silent_peer_by_default():
    """The multi-host behaviour is tested in tests/cluster/netns.sh (partition, kill, host down)."""
    from clusterenv_core.transports.mpi import MPITransport

    assert MPITransport(heartbeat_timeout=0).heartbeat_timeout == 0
    default = MPITransport()
    assert 2 * default.heartbeat_interval <= default.heartbeat_timeout <= 30.0
