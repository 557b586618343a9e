"""Worker-side inference and AAPS: divergences, the sync trigger, weights, rollouts."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from clusterenv_core import ClusterEnvError, EnvError, EnvPool, WorkerTimeoutError  # noqa: E402
from clusterenv_core import channel as channel_module  # noqa: E402
from clusterenv_core.aaps import PolicySync, divergence  # noqa: E402
from clusterenv_core.inference import (  # noqa: E402
    LearnerGone,
    WeightsRegion,
    flatten_weights,
    load_weights,
    weights_fields,
)
from clusterenv_core.policy import (  # noqa: E402
    Bernoulli,
    Categorical,
    DeployablePolicy,
    Gaussian,
    Greedy,
    MultiCategorical,
)
from clusterenv_core.shutdown import CLOSE_TIMEOUT  # noqa: E402
from tests.envs import ActionDtypeEnv, FailingEnv, HangingEnv, SlowCartPole  # noqa: E402
from tests.helpers import buffer_mappings, interrupt_soon, process_ended, wait_for_events, wait_until_ended  # noqa: E402
from tests.policies import (  # noqa: E402
    BernoulliPolicy,
    ConstantPolicy,
    LinearPolicy,
    NumpyLinearPolicy,
    assert_rollout_matches,
    reference_rollout,
)

D = torch.distributions



def test_rollouts_hand_envs_the_policys_dtype_whatever_the_learner_stepped_with():
    # SB3's PPO samples float32 actions for a MultiBinary space and hands them on as they are.
    env_fns = [functools.partial(ActionDtypeEnv, gym.spaces.MultiBinary(3))] * 2
    with EnvPool(env_fns, num_workers=2) as pool:
        pool.reset()
        actors = pool.deploy(BernoulliPolicy(), seed=0)
        first = actors.rollout(2)
        pool.step(np.ones((2, 3), np.int8))  # an evaluation step, say, with int8 actions
        second = actors.rollout(2)
        for rollout in (first, second):
            assert [info["dtype"] for info in rollout.infos[0].values()] == ["float32", "float32"]
        assert [info["dtype"] for info in pool.step(np.ones((2, 3), np.int8)).infos.values()] == ["int8", "int8"]


def test_env_restarts_are_counted_in_a_segment_that_fails():
    # Env 0 is replaced at its step 2; env 1 at its first step, and its replacement raises there too,
    # with no budget left.
    env_fns = [lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=2), lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=1)]
    with EnvPool(env_fns, num_workers=2, restart_failed_envs=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        with pytest.raises(EnvError):
            pool.deploy(LinearPolicy(), seed=0).rollout(4)
        assert pool.restarts == {"envs": 2, "workers": 0} and pool.env_restarts == [1, 1]


def test_env_restarts_of_a_segment_cut_short_by_ctrl_c_are_counted(ctrl_c_after_send):
    # Ctrl-C once worker 0 has its rollout request: its reply is read and dropped by the next call,
    # and the env replaced in its segment counts all the same; the replacement, failing too with no
    # budget left, is reported by that call.
    env_fns = [lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=2), lambda: gym.make("CartPole-v1")]
    with EnvPool(env_fns, num_workers=2, restart_failed_envs=True, max_restarts=1) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy(), seed=0)
        ctrl_c_after_send()
        with pytest.raises(KeyboardInterrupt):
            actors.rollout_async(4)
        with pytest.raises(EnvError, match="rollout sent before Ctrl-C failed in env 0 on worker 0"):
            pool.reset(seeds=[0, 1])
        assert pool.restarts == {"envs": 1, "workers": 0} and pool.env_restarts == [1, 0]


def test_an_env_error_in_a_segment_cut_short_by_ctrl_c_is_raised_by_the_next_call(ctrl_c_after_send):
    # Ctrl-C once worker 0 has its rollout request, in whose segment env 0 raises: the next call
    # reads the reply and raises that error, as rollout_wait would have; the policy stays deployed.
    env_fns = [lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=2), lambda: gym.make("CartPole-v1")]
    with EnvPool(env_fns, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy(), seed=0)
        ctrl_c_after_send()
        with pytest.raises(KeyboardInterrupt):
            actors.rollout_async(4)
        with pytest.raises(EnvError, match="injected failure at step 2") as caught:
            pool.reset(seeds=[0, 1])
        error = caught.value
        assert (error.env_index, error.worker_index, error.operation) == (0, 0, "rollout sent before Ctrl-C")
        pool.reset(seeds=[0, 1])
        assert actors.rollout(4).rewards.shape == (4, 2)


def test_an_env_error_kept_by_a_call_that_ctrl_c_cut_short_once_every_reply_was_read_is_raised_by_rollout_async(
    ctrl_c_after_send, ctrl_c_at_call
):
    # Both workers get their rollout request, in whose segments both envs raise; Ctrl-C cuts the
    # next call short once it read both replies, as it takes in worker 1's: the next rollout_async
    # raises env 0's error, once.
    env_fns = [lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=2)] * 2
    with EnvPool(env_fns, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy(), seed=0)
        ctrl_c_after_send(sends=2)
        with pytest.raises(KeyboardInterrupt):
            actors.rollout_async(4)
        ctrl_c_at_call(channel_module, "replaced_envs", calls=2)
        with pytest.raises(KeyboardInterrupt):
            pool.reset(seeds=[0, 1])
        with pytest.raises(EnvError, match="rollout sent before Ctrl-C failed in env 0 on worker 0"):
            actors.rollout_async(4)
        pool.reset(seeds=[0, 1])
        assert actors.rollout(4).rewards.shape == (4, 2)


def test_divergences_match_closed_forms():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    expected = D.kl_divergence(D.Categorical(logits=p), D.Categorical(logits=q))
    torch.testing.assert_close(Categorical(p).divergence(Categorical(q)), expected)

    mp, mq, sp, sq = (torch.randn(5, 2, generator=gen) for _ in range(4))
    expected = D.kl_divergence(D.Normal(mp, sp.exp()), D.Normal(mq, sq.exp())).sum(-1)
    torch.testing.assert_close(Gaussian(mp, sp).divergence(Gaussian(mq, sq)), expected)

    parts_p, parts_q = [p, p[:, :2]], [q, q[:, :2]]
    expected = sum(D.kl_divergence(D.Categorical(logits=a), D.Categorical(logits=b)) for a, b in zip(parts_p, parts_q))
    torch.testing.assert_close(MultiCategorical(parts_p).divergence(MultiCategorical(parts_q)), expected)

    expected = D.kl_divergence(D.Bernoulli(logits=p), D.Bernoulli(logits=q)).sum(-1)
    torch.testing.assert_close(Bernoulli(p).divergence(Bernoulli(q)), expected)

    q_values = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 1.0], [5.0, 4.0]])
    changed = torch.tensor([[2.0, 1.0], [3.0, 0.0], [0.0, 1.0], [4.0, 5.0]])
    assert Greedy(q_values).divergence(Greedy(changed)).mean().item() == 0.5

    assert Categorical(p).divergence(Categorical(p)).abs().max().item() < 1e-6


def test_distributions_of_different_kinds_are_not_compared():
    logits = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="cannot compare a Categorical policy with a Greedy policy"):
        Categorical(logits).divergence(Greedy(logits))
    with pytest.raises(TypeError, match="cannot compare a Categorical policy with a Bernoulli policy"):
        divergence(LinearPolicy(), BernoulliPolicy(obs_size=4), np.zeros((4, 4), np.float32))


def test_the_test_policies_fulfil_the_deployable_policy_protocol():
    assert isinstance(LinearPolicy(), DeployablePolicy) and isinstance(BernoulliPolicy(), DeployablePolicy)
    assert not isinstance(torch.nn.Linear(4, 2), DeployablePolicy)


class FakeActors:
    """Records what PolicySync publishes, without workers (a stand-in for WorkerActors)."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.weights_nbytes = 40
        self.num_workers = 3
        self.published = []

    def publish_weights(self, policy):
        self.policy_version += 1
        self.published.append(flatten_weights(policy))
        return self.policy_version


def _drift(policy: LinearPolicy, amount: float) -> None:
    with torch.no_grad():
        policy.linear.weight[0] += amount


def test_aaps_pushes_exactly_when_the_threshold_is_crossed():
    torch.manual_seed(0)
    policy = LinearPolicy()
    probe = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    actors = FakeActors()
    sync = PolicySync(actors, policy, mode="aaps", threshold=0.0)
    sync.observe(probe, leading_dims=1)
    snapshot = sync.deployed
    _drift(policy, 0.3)
    crossing = divergence(snapshot, policy, probe)
    assert crossing > 0

    sync.threshold = crossing  # equal is not above: no push
    assert sync.after_update() is False and actors.published == []
    assert sync.stats.last_divergence == pytest.approx(crossing)
    sync.threshold = np.nextafter(crossing, 0)  # just below: push
    assert sync.after_update() is True
    np.testing.assert_array_equal(actors.published[-1], flatten_weights(policy))
    assert divergence(sync.deployed, policy, probe) == 0.0  # the snapshot is the pushed policy
    assert sync.summary()["syncs"] == 1 and sync.summary()["weight_bytes_sent"] == 40 * 3


def test_sync_modes_and_staleness_bound():
    policy = LinearPolicy()
    actors = FakeActors()
    always = PolicySync(actors, policy, mode="always")
    never = PolicySync(actors, policy, mode="never")
    stale = PolicySync(actors, policy, mode="aaps", threshold=1e9, max_staleness=3)
    stale.observe(np.zeros((8, 4), np.float32), leading_dims=1)
    pushes = [(always.after_update(), never.after_update(), stale.after_update()) for _ in range(6)]
    assert [p[0] for p in pushes] == [True] * 6
    assert [p[1] for p in pushes] == [False] * 6
    assert [p[2] for p in pushes] == [False, False, True, False, False, True]
    with pytest.raises(ValueError):
        PolicySync(actors, policy, mode="sometimes")


def test_flatten_and_load_weights_round_trip():
    a, b = LinearPolicy(), LinearPolicy()
    load_weights(b, flatten_weights(a))
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
    with pytest.raises(ValueError):
        load_weights(b, np.zeros(3, np.float32))


def test_a_reader_waits_for_a_live_writer_and_gives_up_on_a_dead_one():
    fields = weights_fields(3)
    views = {field.name: np.zeros((1, *field.shape), field.dtype) for field in fields}
    learner_alive = True
    reader, writer = WeightsRegion(views, writer_alive=lambda: learner_alive), WeightsRegion(views)
    out = np.empty(3, np.float32)

    def end_write() -> None:  # the rest of WeightsRegion.write
        writer.weights[:] = 1.0
        writer.header[1] = 1
        writer.header[0] += 1

    writer.header[0] += 1  # a write begun, which the learner ends later than the reader's first check
    threading.Timer(0.6, end_write).start()
    assert reader.read_newer(0, out) == 1
    assert out.tolist() == [1.0, 1.0, 1.0]
    writer.header[0] += 1  # another write begun, by a learner that then dies
    learner_alive = False
    with pytest.raises(LearnerGone):
        reader.read_newer(1, out)


@pytest.mark.slow
def test_workers_exit_when_the_learner_dies_in_the_middle_of_a_weights_write(tmp_path):
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            sys.path.insert(0, ROOT)
            from clusterenv_core import EnvPool
            from tests.policies import LinearPolicy
            pool = EnvPool.make("CartPole-v1", 2, num_workers=2)
            pool.reset(seeds=[0, 1])
            actors = pool.deploy(LinearPolicy())
            actors.weights.header[0] += 1  # as if killed between the two increments of a write
            actors.rollout_async(100)
            print(*pool.worker_pids, flush=True)
            time.sleep(60)
            """
        ).replace("ROOT", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in learner.stdout.readline().split()]
    assert len(pids) == 2
    learner.kill()
    learner.wait()

    wait_until_ended(pids, within=10)  # they check every quarter second; the rest is a loaded machine's slack
    left = [pid for pid in pids if not process_ended(pid)]
    for pid in left:  # not to leave them spinning for ever
        os.kill(pid, signal.SIGKILL)
    assert left == [], "workers outlived their learner, waiting for its unfinished weights write"


@pytest.mark.parametrize("processes_per_worker", [1, 2], ids=["flat", "agents"])
def test_rollout_equals_sequential_reference(processes_per_worker):
    # Through node agents too: blocks of 3 and 2 envs, each on 2 local processes (2 + 1, 1 + 1).
    torch.manual_seed(1)
    policy = LinearPolicy(greedy=True)
    seeds = [10, 11, 12, 13, 14]
    expected, last_obs = reference_rollout(policy, seeds, 120)
    with EnvPool.make("CartPole-v1", 5, num_workers=2, processes_per_worker=processes_per_worker) as pool:
        pool.reset(seeds=seeds)
        actors = pool.deploy(policy)
        rollout = actors.rollout(120)
        assert rollout.obs.shape == (120, 5, 4) and rollout.actions.shape == (120, 5)
        assert_rollout_matches(rollout, expected, last_obs)
        assert sum(len(s["final"]) for s in expected) > 5
        with torch.no_grad():
            logits = policy.linear(torch.as_tensor(rollout.obs[7]))
        np.testing.assert_allclose(rollout.values[7], logits.sum(-1).numpy(), rtol=1e-6)
        assert (rollout.versions == 0).all()


def test_close_unmaps_the_weights_and_segment_regions():
    before = buffer_mappings()
    pool = EnvPool.make("CartPole-v1", 4, num_workers=2)
    pool.reset(seeds=[0, 1, 2, 3])
    actors = pool.deploy(LinearPolicy())
    actors.rollout(8)
    actors.publish_weights(LinearPolicy())
    pool.close()
    assert buffer_mappings() == before
    with pytest.raises(ClusterEnvError, match="closed"):
        actors.publish_weights(LinearPolicy())
    with pytest.raises(ClusterEnvError, match="closed"):
        actors.rollout(8)


@pytest.mark.slow
def test_close_ends_a_pending_segment_early_and_lets_the_workers_exit_by_themselves(tmp_path):
    """A segment started and not waited for (overlapped collection at the end of training), far longer
    than close() waits for a busy worker: the workers end it at their next step, answer the close
    request and exit, none killed; the pool's timeout (60 s) plays no part."""
    stepping = str(tmp_path / "stepping")
    with EnvPool([functools.partial(SlowCartPole, 0.01, stepping=stepping)] * 2, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        pool.deploy(LinearPolicy()).rollout_async(100_000)  # 1,000 s of stepping
        wait_for_events(stepping, 4)  # the workers are collecting
        processes = list(pool._transport.processes)
        started = time.monotonic()
    assert time.monotonic() - started < CLOSE_TIMEOUT
    assert [process.returncode for process in processes] == [0, 0]


@pytest.mark.slow
def test_superseded_and_failed_deploys_release_their_regions_while_referenced():
    # Models keep their WorkerActors, and a caught deploy error its traceback: neither may keep memory.
    before = buffer_mappings()
    pool = EnvPool.make("CartPole-v1", 3, num_workers=3)
    try:
        pool.reset(seeds=[0, 1, 2])
        pool_only = buffer_mappings()
        first = pool.deploy(ConstantPolicy(0))
        first.rollout(3)
        first.rollout(3)  # both segment regions of this length
        second = pool.deploy(ConstantPolicy(1))
        second.rollout(3)
        with pytest.raises(EnvError, match="no policy is deployed") as caught:
            pool.deploy(ConstantPolicy(1, refused_by=(pool.worker_pids[2],)))
        assert buffer_mappings() == pool_only  # none of the three holds a region any more
        for superseded in (first, second):
            with pytest.raises(ClusterEnvError, match="no longer deployed"):
                superseded.rollout(3)
            with pytest.raises(ClusterEnvError, match="no longer deployed"):
                superseded.rollout_wait()
            with pytest.raises(ClusterEnvError, match="no longer deployed"):
                superseded.publish_weights(ConstantPolicy(0))
        third = pool.deploy(ConstantPolicy(1))
        assert third.rollout(3).actions.all()
    finally:
        pool.close()  # a failed check must not leave this pool's workers to the next tests
    assert buffer_mappings() == before
    assert caught.value.worker_index == 2


@pytest.mark.slow
def test_repeated_deploys_do_not_grow_the_shared_memory():
    # Each deploy of another policy replaces the last one's weights and segment regions: their pages
    # go back to the system, except those a kept Rollout still views, which stay readable.
    with EnvPool.make("CartPole-v1", 2, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        memory_fd = pool._transport.memory_fd

        def deploy_and_collect():
            actors = pool.deploy(LinearPolicy(), seed=0)
            return actors.rollout(2000), actors.rollout(2000)  # both segment regions of this length

        kept = deploy_and_collect()[1]
        kept_obs = kept.obs.copy()
        deploy_and_collect()
        allocated = os.fstat(memory_fd).st_blocks  # the pool's, the kept segment's, the last deploy's
        for _ in range(4):
            deploy_and_collect()
        assert os.fstat(memory_fd).st_blocks <= allocated + allocated // 4
        assert np.array_equal(kept.obs, kept_obs)


@pytest.mark.slow
def test_an_env_error_read_before_ctrl_c_cut_rollout_wait_short_is_raised_when_it_resumes():
    # rollout_wait reads worker 0's failed segment, then waits for worker 1's slow one: Ctrl-C
    # there leaves worker 0's reply read, and the resumed rollout_wait raises its error.
    env_fns = [lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=2), functools.partial(SlowCartPole, seconds=0.3)]
    with EnvPool(env_fns, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy(), seed=0)
        actors.rollout_async(4)
        interrupt_soon(0.5)
        with pytest.raises(KeyboardInterrupt):
            actors.rollout_wait()
        with pytest.raises(EnvError, match="injected failure at step 2") as caught:
            actors.rollout_wait()
        assert (caught.value.env_index, caught.value.worker_index) == (0, 0)
        assert not actors.pending
        pool.reset(seeds=[0, 1])


@pytest.mark.slow
def test_an_interrupted_rollout_is_finished_by_the_next_call():
    with EnvPool([functools.partial(SlowCartPole, seconds=0.05)] * 2, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        actors.rollout_async(10)
        interrupt_soon(0.1)
        with pytest.raises(KeyboardInterrupt):
            actors.rollout_wait()
        assert actors.pending
        assert actors.rollout(3).rewards.shape == (3, 2)  # the interrupted segment ended first
        assert not actors.pending
        started = time.perf_counter()
        actors.rollout_async(4)
        time.sleep(1.0)  # the learner busy elsewhere: the workers' time does not count it
        rollout = actors.rollout_wait()
        assert 4 * 0.05 <= rollout.collect_seconds < 0.95 < time.perf_counter() - started


@pytest.mark.parametrize("interrupted", ["rollout_wait", "reset"])
def test_ctrl_c_while_the_rows_or_arrays_after_a_reply_come_in_loses_no_reply(interrupted):
    run_ctrl_c_receiving_rows_and_arrays_checks("local", interrupted)  # MPI: tests/test_mpi_backend.py


def ctrl_c_in(transport, receive: str) -> None:
    """Ctrl-C (a real SIGINT) once, as the transport's next ``receive`` of the rows or arrays that
    follow a reply starts: the reply is read by then."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # as tests.helpers.interrupt_soon
        signal.signal(signal.SIGINT, signal.default_int_handler)
    received = getattr(transport, receive)

    def interrupted(*args):
        delattr(transport, receive)
        signal.raise_signal(signal.SIGINT)
        received(*args)

    setattr(transport, receive, interrupted)


def run_ctrl_c_receiving_rows_and_arrays_checks(backend: str, interrupted: str) -> None:
    """Ctrl-C while the learner receives the arrays of worker 0's segment (``interrupted``:
    ``"rollout_wait"``) or the rows of its reset (``"reset"``); the MPI backend waits for their
    messages, milliseconds for a large segment. They are received and the reply kept before the
    KeyboardInterrupt comes, so the resumed rollout_wait returns the whole segment, and the next
    reset works, instead of waiting until the timeout for a reply already read."""
    policy = LinearPolicy(greedy=True)
    seeds = [10, 11, 12, 13]
    expected, last_obs = reference_rollout(policy, seeds, 60)
    with EnvPool.make("CartPole-v1", 4, num_workers=2, backend=backend, timeout=3.0) as pool:
        first_obs = pool.reset(seeds=seeds).obs.copy()
        actors = pool.deploy(policy)
        if interrupted == "rollout_wait":
            actors.rollout_async(60)
            ctrl_c_in(pool._transport, "recv_arrays")
            with pytest.raises(KeyboardInterrupt):
                actors.rollout_wait()
            assert_rollout_matches(actors.rollout_wait(), expected, last_obs)
        else:
            ctrl_c_in(pool._transport, "recv_rows")
            with pytest.raises(KeyboardInterrupt):
                pool.reset(seeds=seeds)
        np.testing.assert_array_equal(pool.reset(seeds=seeds).obs, first_obs)
        assert_rollout_matches(actors.rollout(60), expected, last_obs)


@pytest.mark.slow
def test_published_weights_reach_workers_and_versions_are_recorded():
    policy = LinearPolicy(greedy=True)
    with EnvPool.make("CartPole-v1", 4, num_workers=2) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        actors = pool.deploy(policy)
        assert actors.weights_nbytes == sum(p.numel() for p in policy.parameters()) * 4
        first = actors.rollout(5)
        assert (first.versions == 0).all()
        with torch.no_grad():
            policy.linear.weight.neg_()
            policy.linear.bias.neg_()
        assert actors.publish_weights(policy) == 1
        second = actors.rollout(5)
        assert (second.versions == 1).all()
        with torch.no_grad():
            np.testing.assert_array_equal(second.actions[0], policy.linear(torch.as_tensor(second.obs[0])).argmax(-1))
        # Overlapped collection: weights published while a segment runs are used from the next step on.
        actors.rollout_async(400)
        actors.publish_weights(policy)
        overlapped = actors.rollout_wait()
        assert set(np.unique(overlapped.versions)) <= {1, 2}
        assert overlapped.versions[-1].tolist() == [2, 2, 2, 2]
        assert (np.diff(overlapped.versions, axis=0) >= 0).all()
        # Another module with as many weights (10), shaped otherwise: refused, nothing published.
        other = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(1, 1))
        with pytest.raises(ValueError, match="publish a module like the deployed one"):
            actors.publish_weights(other)
        assert actors.policy_version == 2


def test_consecutive_segments_never_share_a_region():
    """A segment stays intact while the next one is collected (overlap), for many segments."""
    with EnvPool.make("CartPole-v1", 2, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        previous = actors.rollout(8)
        kept = previous.obs.copy()
        for _ in range(5):
            actors.rollout_async(8)
            current = actors.rollout_wait()
            np.testing.assert_array_equal(previous.obs, kept)  # not overwritten by the newer segment
            np.testing.assert_array_equal(current.obs[0], previous.last_obs)
            previous, kept = current, current.obs.copy()


@pytest.mark.slow
def test_sampling_rollouts_are_reproducible_with_a_seed():
    def collect():
        torch.manual_seed(3)
        with EnvPool.make("CartPole-v1", 4, num_workers=2) as pool:
            pool.reset(seeds=[0, 1, 2, 3])
            actors = pool.deploy(LinearPolicy(greedy=False), seed=42)
            rollout = actors.rollout(50)
            return rollout.actions.copy(), rollout.log_probs.copy()

    (a1, l1), (a2, l2) = collect(), collect()
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(l1, l2)
    assert 0 < a1.mean() < 1


@pytest.mark.slow
def test_a_policys_numpy_actor_acts_on_the_workers_with_the_loaded_weights_and_a_seeded_generator():
    def collect(seed):
        with EnvPool.make("CartPole-v1", 4, num_workers=2) as pool:
            pool.reset(seeds=[0, 1, 2, 3])
            policy = NumpyLinearPolicy()
            with torch.no_grad():
                policy.linear.weight.zero_()
                policy.linear.bias.zero_()
            actors = pool.deploy(policy, seed=seed)
            even = actors.rollout(200)  # zero weights: each action a coin flip
            with torch.no_grad():
                policy.linear.bias.copy_(torch.tensor([0.0, 50.0]))
            actors.publish_weights(policy)
            always_right = actors.rollout(20)
            return even.actions.copy(), even.log_probs.copy(), always_right.actions.copy()

    actions, log_probs, always_right = collect(7)
    assert 0.4 < actions.mean() < 0.6  # never the torch act's -1
    np.testing.assert_allclose(log_probs, np.log(0.5), rtol=1e-6)
    assert (always_right == 1).all()  # the weights published later show through the numpy actor
    again = collect(7)
    np.testing.assert_array_equal(actions, again[0])
    assert not np.array_equal(actions, collect(-7)[0])  # negative seeds (torch takes them) work too


def test_a_seed_torch_would_refuse_on_some_worker_is_refused_before_anything_is_sent():
    with EnvPool.make("CartPole-v1", 2, num_workers=2) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(ConstantPolicy(0))
        # Worker 1 would seed torch with 2**64, which torch refuses while worker 0 takes 2**64 - 1.
        for seed in (2**64 - 1, -(2**63) - 1):
            with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 18446744073709551614\]"):
                pool.deploy(ConstantPolicy(1), seed=seed)
        with pytest.raises(TypeError, match="seed must be an int"):
            pool.deploy(ConstantPolicy(1), seed=1.5)
        assert pool.actors is actors  # nothing was sent: every worker still acts with it
        assert not actors.rollout(3).actions.any()
        for seed in (2**64 - 2, -(2**63)):  # the ends of the range
            assert not pool.deploy(ConstantPolicy(0), seed=seed).rollout(3).actions.any()


def test_a_deploy_that_fails_on_some_workers_leaves_no_policy_acting():
    with EnvPool.make("CartPole-v1", 3, num_workers=3) as pool:
        pool.reset(seeds=[0, 1, 2])
        first = pool.deploy(ConstantPolicy(0))
        assert not first.rollout(3).actions.any()
        with pytest.raises(EnvError, match=r"workers 0, 1 took it; no policy is deployed on the pool now") as caught:
            pool.deploy(ConstantPolicy(1, refused_by=(pool.worker_pids[2],)))
        assert caught.value.worker_index == 2 and "this worker cannot take the policy" in str(caught.value)
        # Workers 0 and 1 hold the new policy, worker 2 the first: neither may act for the whole pool.
        assert pool.actors is None
        with pytest.raises(ClusterEnvError, match="a later deploy\\(\\) failed once sent"):
            first.rollout(3)
        with pytest.raises(ClusterEnvError, match="no longer deployed"):
            first.publish_weights(ConstantPolicy(0))
        again = pool.deploy(ConstantPolicy(1))  # the pool stays usable
        assert pool.actors is again and again.rollout(3).actions.all()


def test_rollout_errors_are_clear():
    env_fns = [functools.partial(gym.make, "CartPole-v1"), lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=3)]
    with EnvPool(env_fns, num_workers=2) as pool:
        pool.reset()
        with pytest.raises(TypeError, match="act"):
            pool.deploy(torch.nn.Linear(4, 2))
        actors = pool.deploy(LinearPolicy())
        with pytest.raises(ValueError, match="n_steps"):
            actors.rollout(0)
        with pytest.raises(EnvError, match="env 1 on worker 1"):
            actors.rollout(5)
        pool.reset()  # still usable
        actors.rollout_async(2)
        with pytest.raises(ClusterEnvError, match="rollout is pending"):
            pool.step(np.zeros(2, np.int64))
        actors.rollout_wait()


@pytest.mark.slow
def test_rollout_timeout_bounds_the_time_without_progress():
    run_rollout_timeout_checks("local")  # MPI: tests/test_mpi_backend.py, in a process of its own


def run_rollout_timeout_checks(backend: str) -> None:
    """A segment longer than its timeout completes while workers report progress; a worker that
    stops stepping raises WorkerTimeoutError after about the timeout, not the timeout times n_steps."""
    slow = [functools.partial(SlowCartPole, 0.02)] * 2  # 40 steps: 0.8 s, twice the timeout
    with EnvPool(slow, num_workers=2, backend=backend) as pool:
        pool.reset(seeds=[0, 1])
        actors = pool.deploy(LinearPolicy())
        assert actors.rollout(40, timeout=0.4).rewards.shape == (40, 2)
        actors.rollout_async(40, timeout=0.4)  # the wait starts late, as when training overlaps
        time.sleep(1.0)
        assert actors.rollout_wait().rewards.shape == (40, 2)
        with pytest.raises(ValueError, match="timeout"):
            actors.rollout(5, timeout=0)
        actors.rollout_async(40, timeout=0.4)
        time.sleep(0.5)  # progress reports queue up; closing reads past them
        started = time.monotonic()
        pool.close()
        assert time.monotonic() - started < 3.0
    hanging = [functools.partial(gym.make, "CartPole-v1"), lambda: HangingEnv(gym.make("CartPole-v1"), hang_at=5)]
    with EnvPool(hanging, num_workers=2, backend=backend) as pool:
        pool.reset()
        actors = pool.deploy(LinearPolicy())
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="worker 1"):
            actors.rollout(100, timeout=1.0)
        assert time.monotonic() - started < 5.0
