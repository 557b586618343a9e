"""Worker-side inference through node agents (``processes_per_worker`` > 1): each agent deploys the
policy on its local processes, relays the learner's weights and collects a segment there, answering
once for its block. W agents of P processes must act exactly as W * P flat workers where the blocks
coincide (local process p of agent w seeds as flat worker w * P + p); failures name the global env,
the agent and its local process; nothing is left running. ``check_*`` functions also run on MPI
(``tests/mpi_scripts/node_agent_inference.py``)."""

from __future__ import annotations

import functools
import time
import warnings

import gymnasium as gym
import numpy as np
import psutil
import pytest

torch = pytest.importorskip("torch")

from clusterenv_core import ClusterEnvError, EnvError, EnvPool, EnvValueError  # noqa: E402
from clusterenv_core.errors import CloseTimeoutWarning  # noqa: E402
from clusterenv_core.node_agent_actors import with_env_restarts  # noqa: E402
from clusterenv_core.protocol import RESTART_INFO_KEY  # noqa: E402
from clusterenv_core.shutdown import CLOSE_TIMEOUT  # noqa: E402
from tests.envs import FailingEnv, HangingEnv, SlowCartPole, SpacesEnv, SuicidalEnv  # noqa: E402
from tests.helpers import descendants, launch, wait_for_events, wait_until_ended  # noqa: E402
from tests.policies import ConstantPolicy, LinearPolicy, NumpyLinearPolicy  # noqa: E402

pytestmark = pytest.mark.timeout(240)

AGENTS = {"num_workers": 2, "processes_per_worker": 2}
FLAT = {"num_workers": 4}


def _segments(policy_class: type, backend: str = "local", **layout) -> list[np.ndarray]:
    """Two sampled segments of 8 CartPoles, with weights published between them."""
    torch.manual_seed(3)
    policy = policy_class() if policy_class is NumpyLinearPolicy else policy_class(greedy=False)
    with EnvPool.make("CartPole-v1", 8, backend=backend, **layout) as pool:
        pool.reset(seeds=list(range(8)))
        actors = pool.deploy(policy, seed=42)
        first = actors.rollout(60)
        kept = [first.obs, first.actions, first.log_probs, first.rewards, first.terminated, first.last_obs]
        kept = [array.copy() for array in kept]
        with torch.no_grad():
            policy.linear.weight.mul_(-2.0)
        actors.publish_weights(policy)
        second = actors.rollout(40)
        kept += [array.copy() for array in (second.obs, second.actions, second.log_probs, second.versions)]
        kept.append(np.array(sorted((t, index) for t, infos in enumerate(second.infos) for index in infos)))
        assert (second.versions == 1).all()
    return kept


def check_sampled_rollouts_are_those_of_flat_workers(policy_class: type, backend: str = "local", **options) -> None:
    """W=2 agents of P=2 processes sample exactly as 4 flat workers, before and after new weights
    (``options``: more of the pool's, for both)."""
    agents = _segments(policy_class, backend, **AGENTS, **options)
    flat = _segments(policy_class, backend, **FLAT, **options)
    assert 0.2 < agents[1].mean() < 0.8  # sampled, not greedy
    for kept_by_agents, kept_by_flat in zip(agents, flat):
        np.testing.assert_array_equal(kept_by_agents, kept_by_flat)


@pytest.mark.parametrize(
    "policy_class", [LinearPolicy, pytest.param(NumpyLinearPolicy, marks=pytest.mark.slow)], ids=["torch", "numpy"]
)
def test_sampled_rollouts_are_those_of_flat_workers(policy_class):
    # Drawn from each process's torch generator, or from its numpy generator by a numpy actor.
    check_sampled_rollouts_are_those_of_flat_workers(policy_class)


def _ppo_parameters(backend: str, **layout) -> dict:
    from stable_baselines3.common.env_util import make_vec_env

    from clusterenv_sb3 import PPO, AAPSCallback, ClusterVecEnv

    env = make_vec_env(
        "CartPole-v1", n_envs=8, seed=0, vec_env_cls=ClusterVecEnv, vec_env_kwargs={"backend": backend, **layout}
    )
    try:
        model = PPO("MlpPolicy", env, seed=0, device="cpu", n_steps=32, batch_size=64, n_epochs=2)
        model.learn(3 * 32 * 8, callback=AAPSCallback(kl_threshold=1e-4))
        stats = model.policy_sync.stats
        assert stats.syncs > 0  # one weights message per agent, as per flat worker
        assert stats.weight_bytes_sent == stats.syncs * env.pool.actors.weights_nbytes * layout["num_workers"]
        return {key: value.clone() for key, value in model.policy.state_dict().items()}
    finally:
        env.close()


def check_seeded_sb3_ppo_learns_the_parameters_flat_workers_give(backend: str = "local") -> None:
    """SB3's PPO, seeded, with AAPS, on 2 agents of 2 processes and on 4 flat workers: the same parameters."""
    torch.set_num_threads(1)
    agents, flat = _ppo_parameters(backend, **AGENTS), _ppo_parameters(backend, **FLAT)
    assert agents.keys() == flat.keys()
    for key, value in flat.items():
        torch.testing.assert_close(agents[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_seeded_sb3_ppo_with_aaps_learns_the_parameters_flat_workers_give(one_torch_thread):
    pytest.importorskip("stable_baselines3")
    check_seeded_sb3_ppo_learns_the_parameters_flat_workers_give()


@pytest.mark.slow
def test_seeded_sb3_sac_with_aaps_learns_the_parameters_flat_workers_give(one_torch_thread):
    pytest.importorskip("stable_baselines3")
    from clusterenv_sb3 import SAC, AAPSCallback
    from tests.sb3_helpers import cluster_vec_env

    torch.set_num_threads(1)

    def parameters(layout: dict) -> tuple[dict, int]:
        env = cluster_vec_env("Pendulum-v1", n_envs=4, **layout)
        try:
            model = SAC(
                "MlpPolicy",
                env,
                seed=3,
                learning_starts=64,
                train_freq=4,
                gradient_steps=2,
                batch_size=32,
                policy_kwargs={"net_arch": [32, 32]},
            )
            model.learn(800, callback=AAPSCallback(kl_threshold=0.05))
            stats = model.policy_sync.stats
            assert 0 < stats.syncs < stats.updates
            return {key: value.clone() for key, value in model.policy.state_dict().items()}, stats.syncs
        finally:
            env.close()

    (agents, agent_syncs), (flat, flat_syncs) = parameters(AGENTS), parameters(FLAT)
    assert agent_syncs == flat_syncs
    for key, value in flat.items():
        torch.testing.assert_close(agents[key], value, rtol=0, atol=0, msg=key)


def test_a_redeploy_replaces_the_policy_on_every_local_process_and_one_refused_leaves_none(tmp_path):
    # Each env writes its process's pid to a file of its own as it steps.
    env_fns = [functools.partial(SlowCartPole, 0.0, stepping=str(tmp_path / f"env{index}")) for index in range(6)]
    with EnvPool(env_fns, num_workers=2, processes_per_worker=3) as pool:
        pool.reset(seeds=list(range(6)))
        first = pool.deploy(ConstantPolicy(0))
        assert not first.rollout(3).actions.any()
        second = pool.deploy(ConstantPolicy(1))
        assert second.rollout(3).actions.all()
        with pytest.raises(ClusterEnvError, match="no longer deployed"):
            first.rollout(3)
        # Env 5's process, agent 1's local process 2, cannot take the next policy: none acts on the pool.
        refusing = int((tmp_path / "env5").read_text().split()[0])
        with pytest.raises(EnvError, match=r"\(worker 0 took it; no policy is deployed on the pool now") as caught:
            pool.deploy(ConstantPolicy(0, refused_by=(refusing,)))
        error = caught.value
        assert (error.env_index, error.worker_index) == (None, 1)
        assert error.operation.startswith("deploying the policy (in local process 2 of the node agent) (worker 0 took")
        assert "this worker cannot take the policy" in str(error)
        assert pool.actors is None
        assert not pool.deploy(ConstantPolicy(0)).rollout(3).actions.any()  # the pool stays usable


def test_preload_reaches_the_local_processes(tmp_path, monkeypatch):
    (tmp_path / "preloaded_module.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # before the pool starts: workers get the learner's path
    env_fns = [functools.partial(SpacesEnv, gym.spaces.Discrete(2), gym.spaces.Discrete(2))] * 4
    with EnvPool(env_fns, num_workers=2, processes_per_worker=2) as pool:
        assert pool.call("has_module", ["preloaded_module"]) == [False] * 4
        pool.preload(["preloaded_module"])
        assert pool.call("has_module", ["preloaded_module"]) == [True] * 4


def _failing_at(fail_at: int) -> gym.Env:
    return FailingEnv(gym.make("CartPole-v1"), fail_at=fail_at)


def check_an_env_error_mid_rollout_names_env_agent_and_local_process(**options) -> None:
    """Env 5 (slot 1 of agent 1, in its local process 0) raises at its step 3; the agent lives on."""
    env_fns = [gym.make] * 5 + [functools.partial(_failing_at, 3)] + [gym.make] * 2
    env_fns = [functools.partial(fn, "CartPole-v1") if fn is gym.make else fn for fn in env_fns]
    with EnvPool(env_fns, num_workers=2, processes_per_worker=2, **options) as pool:
        pool.reset(seeds=list(range(8)))
        actors = pool.deploy(LinearPolicy())
        with pytest.raises(EnvValueError, match="injected failure at step 3") as caught:
            actors.rollout(5)
        error = caught.value
        assert (error.env_index, error.worker_index) == (5, 1)
        assert error.operation == "rollout (in local process 0 of the node agent)"
        assert "injected failure at step 3" in error.remote_traceback
        pool.reset(seeds=list(range(8)))
        rollout = actors.rollout(5)  # the agent and its local processes live on
        assert rollout.rewards.shape == (5, 8) and (rollout.rewards == 1).all()


def test_an_env_error_mid_rollout_names_env_agent_and_local_process():
    check_an_env_error_mid_rollout_names_env_agent_and_local_process()


def test_env_restarts_in_a_segment_are_those_of_flat_workers():
    # Env 1 raises at its 5th step and its replacement at its own 5th (step 9), env 6 at its 7th.
    def collect(layout: dict) -> tuple:
        env_fns = [functools.partial(gym.make, "CartPole-v1")] * 8
        env_fns[1], env_fns[6] = functools.partial(_failing_at, 5), functools.partial(_failing_at, 7)
        with EnvPool(env_fns, restart_failed_envs=True, **layout) as pool:
            pool.reset(seeds=list(range(8)))
            rollout = pool.deploy(LinearPolicy(), seed=0).rollout(12)
            said = [
                sorted(index for index, info in infos.items() if RESTART_INFO_KEY in info) for infos in rollout.infos
            ]
            return pool.restarts, pool.env_restarts, said

    # The new envs reset unseeded: what they return differs from run to run, their restarts do not.
    agents, flat = collect(AGENTS), collect(FLAT)
    assert agents == flat
    assert agents[:2] == ({"envs": 3, "workers": 0}, [0, 2, 0, 0, 0, 0, 1, 0])
    assert [step for step, indices in enumerate(agents[2]) if indices] == [4, 6, 9]


def test_an_agent_names_each_replaced_env_at_the_step_its_info_says_it_was_replaced():
    said = {RESTART_INFO_KEY: "replaced"}
    result = {"seconds": 0.1, "steps": {2: {"infos": {5: said}}, 4: {"infos": {5: said, 6: {"other": 1}}}}}
    # Env 5 replaced three times: at steps 2 and 4, and once more at step 4, whose info says it once.
    assert with_env_restarts(result, [5, 5, 5]) == {
        "seconds": 0.1,
        "steps": {
            2: {"infos": {5: said}, "env_restarts": [5]},
            4: {"infos": {5: said, 6: {"other": 1}}, "env_restarts": [5, 5]},
        },
    }
    assert with_env_restarts({"seconds": 0.1}, []) == {"seconds": 0.1}


def _dies_at(die_at: int) -> gym.Env:
    return SuicidalEnv(gym.make("CartPole-v1"), die_at=die_at)


def test_a_local_process_lost_mid_rollout_is_the_agents_error(no_leaks):
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 3 + [functools.partial(_dies_at, 4)]
    with EnvPool(env_fns, num_workers=1, processes_per_worker=2) as pool:
        pool.reset()
        actors = pool.deploy(LinearPolicy())
        lost = r"local process 1 of worker 0 \(a node agent; pid \d+, envs 2-3\) "
        with pytest.raises(EnvError, match=lost) as caught:
            actors.rollout(10)
        error = caught.value
        assert (error.env_index, error.worker_index) == (None, 0)
        assert error.operation == "rollout in the node agent's local processes"
        assert error.exc_type == "clusterenv_core.errors.WorkerLostError"


def test_close_leaves_nothing_running(no_leaks):
    with EnvPool.make("CartPole-v1", 4, num_workers=2, processes_per_worker=2) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        pool.deploy(LinearPolicy()).rollout(20)
        started = descendants()
        assert len(started) >= 2 + 2 * 2  # the agents and their local processes, at least
    assert wait_until_ended(list(started)), [pid for pid in started if psutil.pid_exists(pid)]


@pytest.mark.slow
def test_close_ends_a_pending_segment_early_and_the_agents_exit_by_themselves(tmp_path, no_leaks):
    """A segment far longer than close() waits for a busy worker: the agents see the close request at
    their local processes' next report, their close ends the local processes' segments, and all exit."""
    stepping = str(tmp_path / "stepping")
    env_fns = [functools.partial(SlowCartPole, 0.01, stepping=stepping)] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", CloseTimeoutWarning)
        with EnvPool(env_fns, num_workers=2, processes_per_worker=2) as pool:
            pool.reset(seeds=[0, 1, 2, 3])
            pool.deploy(LinearPolicy()).rollout_async(100_000)  # 1,000 s of stepping
            wait_for_events(stepping, 8)  # every local process is collecting
            agents = list(pool._transport.processes)
            started = time.monotonic()
    assert time.monotonic() - started < CLOSE_TIMEOUT
    assert [agent.returncode for agent in agents] == [0, 0]


@pytest.mark.slow
def test_progress_reaches_the_learner_and_weights_reach_the_local_processes_mid_segment(no_leaks):
    """A segment longer than its timeout completes, the agents forwarding their local processes'
    progress; weights published while it runs reach them; a local process that stops stepping is
    its agent's error naming it after about the timeout."""
    slow = [functools.partial(SlowCartPole, 0.02)] * 4  # 60 steps: 1.2 s, three times the timeout
    with EnvPool(slow, num_workers=2, processes_per_worker=2) as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        actors = pool.deploy(LinearPolicy())
        assert actors.rollout(60, timeout=0.4).rewards.shape == (60, 4)
        actors.rollout_async(60, timeout=0.4)
        time.sleep(0.3)
        actors.publish_weights(LinearPolicy())
        overlapped = actors.rollout_wait()
        assert overlapped.versions[0].tolist() == [0] * 4 and overlapped.versions[-1].tolist() == [1] * 4
        assert (np.diff(overlapped.versions, axis=0) >= 0).all()
    hanging = [functools.partial(gym.make, "CartPole-v1")] * 3 + [lambda: HangingEnv(gym.make("CartPole-v1"), 5)]
    with EnvPool(hanging, num_workers=1, processes_per_worker=2) as pool:
        pool.reset()
        actors = pool.deploy(LinearPolicy())
        started = time.monotonic()
        stuck = r"local process 1 of worker 0 \(a node agent; pid \d+, envs 2-3\) did not answer within 1 s"
        with pytest.raises(EnvError, match=stuck) as caught:
            actors.rollout(20, timeout=1.0)
        assert time.monotonic() - started < 5.0
        assert caught.value.exc_type == "clusterenv_core.errors.WorkerTimeoutError"


# -- MPI: tests/mpi_scripts/node_agent_inference.py ------------------------------------------------


@pytest.mark.slow
def test_on_mpi_spawn_agents_act_as_flat_workers():
    pytest.importorskip("mpi4py", reason="backend='mpi' needs mpi4py")

    code, output, _ = launch("spawn", "node_agent_inference.py", timeout=600)
    assert code == 0, output
    for check in ("sampled rollouts", "seeded ppo", "env error"):
        assert f"OK {check}" in output, output
