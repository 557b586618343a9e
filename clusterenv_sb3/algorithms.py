"""SB3's PPO, A2C, DQN, SAC and TD3 with worker-side inference: the workers act, the learner only learns.

The algorithms are in :mod:`clusterenv_sb3.on_policy` (PPO, A2C) and :mod:`clusterenv_sb3.off_policy`
(DQN, SAC, TD3); this module is what they share: :class:`WorkerInferenceMixin` (the env check,
deployment, segments, overlap and the sync after updates), and how a segment reads as SB3's VecEnv
steps (:class:`_Segment`).

``clusterenv_sb3.PPO``, ``A2C``, ``DQN``, ``SAC`` and ``TD3`` are Stable-Baselines3's algorithms with their
constructors unchanged (plus ``overlap_collection``, and ``max_behaviour_weight`` for PPO and
A2C), learning from rollout segments that the ClusterEnv workers collect with their own copy of
the policy. The policy is deployed once, when learning starts; after every learner update
(``train()``) the workers get the new weights, or, with
:class:`~clusterenv_sb3.aaps_callback.AAPSCallback`, only when AAPS says the policy drifted enough
(:class:`clusterenv_core.aaps.PolicySync` decides). Each segment fills SB3's own buffers as SB3's
``collect_rollouts`` would, step by step: callbacks' ``on_step``, Monitor episode stats,
``num_timesteps``, episode starts, terminal observations and bootstrapping on truncation.

Design:

- PPO and A2C recompute values and log-probabilities with the learner's current policy, in one
  batched pass per segment (with AAPS or overlap the workers' copy may be stale), and weight each
  step's advantage by pi_learner / pi_workers, truncated at ``max_behaviour_weight`` (decoupled
  PPO: the clip is relative to the learner's policy, the weight corrects for who acted). With
  ``always`` sync and no overlap the two policies agree and the weights are 1.
- DQN sends its exploration rate to the workers as the rollout context (``epsilon``; 1.0 before
  ``learning_starts``, where SB3 samples uniformly). One rate holds for a whole ``train_freq``
  segment, where SB3 moves it after every step.
- SAC and TD3 deploy the actor only; the context says whether the segment is warm-up (uniform
  random actions before ``learning_starts``) and carries Gaussian exploration noise, which the
  workers draw per env and step.
- With ``overlap_collection`` the learner trains while the workers collect: its torch threads start
  within the cores its machine's workers leave, and get the caller's setting back once the learner
  is the bottleneck (:class:`_LearnerThreads`).
- The env must be a bare :class:`~clusterenv_sb3.ClusterVecEnv`: workers step the raw envs, so
  VecEnv wrappers (``VecNormalize``, ``VecFrameStack``, ``VecTransposeImage``, ...) would never see
  the data; they are refused instead of silently bypassed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv, VecEnvWrapper

from clusterenv_core.aaps import PolicySync
from clusterenv_core.errors import ClusterEnvError
from clusterenv_core.inference import same_state
from clusterenv_core.learner_threads import spare_cores
from clusterenv_core.rollout import Rollout
from clusterenv_sb3.cluster_vec_env import ClusterVecEnv
from clusterenv_sb3.policies import make_deployable

if TYPE_CHECKING:  # the mixins below run inside SB3's algorithms, whose attributes they use
    from stable_baselines3.common.base_class import BaseAlgorithm as _AlgorithmBase

    from clusterenv_core.pool import EnvPool
else:
    _AlgorithmBase = object

DEFAULT_SYNC: dict[str, Any] = {"mode": "always", "threshold": 0.01, "max_staleness": None, "probe_size": 256}


def check_cluster_vec_env(env: Any, algorithm: str) -> ClusterVecEnv:
    """``env`` if it is a bare :class:`ClusterVecEnv`; a clear error otherwise."""
    if isinstance(env, ClusterVecEnv):
        return env
    if isinstance(env, VecEnvWrapper):
        chain: list[str] = []
        inner: VecEnv = env
        while isinstance(inner, VecEnvWrapper):
            chain.append(type(inner).__name__)
            inner = inner.venv
        if isinstance(inner, ClusterVecEnv):
            hint = ""
            if "VecTransposeImage" in chain:
                hint = (
                    " (SB3 adds VecTransposeImage itself for channel-last image observations: make the envs "
                    "channel-first, e.g. with a gymnasium observation wrapper inside the env factory)"
                )
            raise ValueError(
                f"clusterenv_sb3.{algorithm} needs the ClusterVecEnv itself, got it wrapped in "
                f"{' > '.join(chain)}{hint}. With worker-side inference the workers step the raw envs and act on "
                "their raw observations, so VecEnv wrappers (VecNormalize, VecFrameStack, ...) would be bypassed. "
                "Move the wrapping into the env factories (gymnasium wrappers), or use "
                f"stable_baselines3.{algorithm} with the wrapped ClusterVecEnv (learner-side inference)."
            )
    raise TypeError(
        f"clusterenv_sb3.{algorithm} runs the policy on ClusterEnv workers and needs a clusterenv_sb3.ClusterVecEnv "
        f"as env, got {type(env).__name__}; use stable_baselines3.{algorithm} for other environments"
    )


class _LearnerThreads:
    """The learner's torch threads during an overlapped ``learn()``, where it works while this
    machine's workers collect the next segment.

    They start within the cores those workers leave (at least one thread): while the learner waits
    for the workers, its threads would only take their cores (with torch's default of one per core,
    overlapped PPO on HalfCheetah ran 40% slower here). Once the workers collected two segments in a
    row in well under the time between them, they are what waits, for the learner (a CNN's
    training, many gradient steps per segment): it gets the caller's threads back (capped, PPO on
    Pong ran 20% slower). :meth:`restore` ends ``learn()`` with the caller's setting.

    :param cap: the threads to start with; no change when the caller's setting is not above it
    """

    #: the workers wait for the learner when collecting a segment took less than this part of the
    #: time between two segments (they collect all the time while the learner waits for them)
    IDLE_WORKERS_FRACTION = 2 / 3

    def __init__(self, cap: int) -> None:
        self.threads = th.get_num_threads()
        self.capped = cap < self.threads
        self.idle_in_a_row = 0
        self._last_arrival: float | None = None
        if self.capped:
            th.set_num_threads(cap)

    def segment_arrived(self, collect_seconds: float, ahead: bool) -> None:
        """A segment arrived that the workers took ``collect_seconds`` to collect; ``ahead``: it was
        started before the learner's last update (the first of a ``learn()`` is not)."""
        now = time.perf_counter()
        if ahead and self.capped and self._last_arrival is not None:
            workers_idle = collect_seconds < self.IDLE_WORKERS_FRACTION * (now - self._last_arrival)
            self.idle_in_a_row = self.idle_in_a_row + 1 if workers_idle else 0
            if self.idle_in_a_row >= 2:
                self.restore()
        self._last_arrival = now

    def restore(self) -> None:
        if self.capped:
            th.set_num_threads(self.threads)
            self.capped = False


def _copy(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {name: np.array(value) for name, value in obs.items()}
    return np.array(obs)


class _Segment:
    """One rollout read as SB3's VecEnv would have returned it, step by step."""

    def __init__(self, rollout: Rollout, env: VecEnv) -> None:
        self.rollout = rollout
        self.env = env
        self.dones = rollout.dones
        # Python lists: cheaper than numpy arrays to index per env. The timeouts are what
        # ClusterVecEnv reports as TimeLimit.truncated.
        self._dones, self._timeouts = self.dones.tolist(), rollout.timeouts.tolist()

    def step(self, t: int) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """``rewards`` (float32, as DummyVecEnv), ``dones`` and ``infos`` of step ``t``, built as
        :meth:`ClusterVecEnv.step_wait` builds them (and its ``reset_infos`` updated likewise)."""
        rollout, env = self.rollout, self.env
        dones = self.dones[t].copy()
        step_dones, step_timeouts, step_infos = self._dones[t], self._timeouts[t], rollout.infos[t]
        infos = []
        for index in range(env.num_envs):
            info = dict(step_infos.get(index, {}))
            info["TimeLimit.truncated"] = step_timeouts[index]
            if step_dones[index]:
                info["terminal_observation"] = _copy(rollout.final_observation(t, index))
                env.reset_infos[index] = rollout.reset_infos[t].get(index, {})
            infos.append(info)
        return rollout.rewards[t].astype(np.float32), dones, infos

    def next_obs(self, t: int) -> Any:
        """The observation after step ``t`` (a copy)."""
        return _copy(self.rollout.obs_after(t))


# What deploying a policy imports on the workers. Starting torch takes a worker a second or more:
# begun when the algorithm is made, it overlaps the learner building its policy, instead of
# delaying the first segment of learn().
_DEPLOY_MODULES = ("torch", "clusterenv_sb3.policies")


class WorkerInferenceMixin(_AlgorithmBase):
    """What PPO and DQN share: the env check, deployment, segments, overlap and the sync after updates."""

    env: VecEnv | None
    _policy_sync: PolicySync | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        env = kwargs.get("env", args[1] if len(args) > 1 else None)
        if isinstance(env, ClusterVecEnv) and not env.pool.closed:
            try:
                env.pool.preload(_DEPLOY_MODULES)
            except ClusterEnvError:
                pass  # a pool in use or broken: the checks of _init_worker_inference and learn() say why
        super().__init__(*args, **kwargs)  # the SB3 algorithm's constructor

    def _init_worker_inference(self, overlap_collection: bool) -> None:
        self.overlap_collection = bool(overlap_collection)
        self._sync_config = dict(DEFAULT_SYNC)
        self._policy_sync = None
        self._deployed_pool: EnvPool | None = None
        self._weights_after_learn: dict[str, th.Tensor] | None = None  # to see weights loaded in between
        self._started: tuple[int, dict] | None = None  # (n_steps, context) of a segment being collected
        self._learn_started = False  # no segment requested yet in this learn()
        self._learner_threads: _LearnerThreads | None = None  # during an overlapped learn()
        if getattr(self, "use_sde", False):
            raise ValueError(
                "gSDE (use_sde=True) is not supported with worker-side inference: its exploration matrix is "
                f"sampled per env on the learner; use use_sde=False or stable_baselines3.{type(self).__name__}"
            )
        if self.env is not None:
            check_cluster_vec_env(self.env, self._algorithm_name())

    @classmethod
    def _algorithm_name(cls) -> str:
        for base in cls.__mro__:
            if base.__module__.startswith("stable_baselines3"):
                return base.__name__
        return cls.__name__

    @property
    def policy_sync(self) -> PolicySync | None:
        """The :class:`~clusterenv_core.aaps.PolicySync` that decides when the workers get new weights
        (``None`` until learning starts): its ``stats`` and ``summary()`` count syncs and policy lag."""
        return self._policy_sync

    def configure_sync(
        self, mode: str = "always", threshold: float = 0.01, max_staleness: int | None = None, probe_size: int = 256
    ) -> None:
        """Set how the workers' weights follow the learner for the current ``learn()`` call
        (:class:`~clusterenv_sb3.AAPSCallback` calls this; each ``learn()`` starts from ``always``)."""
        self._sync_config = {
            "mode": mode,
            "threshold": threshold,
            "max_staleness": max_staleness,
            "probe_size": probe_size,
        }
        if self._policy_sync is not None:
            self._apply_sync_config()

    @property
    def _sync(self) -> PolicySync:
        """The sync of the deployed policy, which exists once learning started."""
        if self._policy_sync is None:
            raise ClusterEnvError(f"{type(self).__name__} has deployed no policy yet: learning has not started")
        return self._policy_sync

    def _apply_sync_config(self) -> None:
        self._sync.configure(**self._sync_config)

    def set_env(self, env: Any, force_reset: bool = True) -> None:
        # Check what SB3 would make of env (it may add VecTransposeImage) before adopting it.
        check_cluster_vec_env(self._wrap_env(env, verbose=0), self._algorithm_name())
        self._drain_started()
        super().set_env(env, force_reset)

    def _excluded_save_params(self) -> list[str]:
        return [
            *super()._excluded_save_params(),
            "_policy_sync",
            "_deployed_pool",
            "_started",
            "_learner_threads",
            "_weights_after_learn",
            "_learn_started",
        ]

    def _setup_learn(
        self, total_timesteps: int, callback: Any = None, *args: Any, **kwargs: Any
    ) -> tuple[int, BaseCallback]:
        check_cluster_vec_env(self.env, self._algorithm_name())
        self._drain_started()
        self._sync_config = dict(DEFAULT_SYNC)  # an AAPSCallback among the callbacks reconfigures it
        result = super()._setup_learn(total_timesteps, callback, *args, **kwargs)
        self._ensure_deployed()
        self._learn_started = True
        return result

    def _ensure_deployed(self) -> None:
        """Deploy the policy on the env's pool once, and again when another policy replaced it there.
        Later learn() calls keep the workers' weights as the sync left them (see :meth:`_rollout`)."""
        pool = check_cluster_vec_env(self.env, self._algorithm_name()).pool
        sync = self._policy_sync
        acting = self._acting_policy()
        if (
            sync is None
            or self._deployed_pool is not pool
            or pool.actors is not sync.actors  # another model deployed its policy on the pool since
            or cast(Any, sync.policy).acting_module() is not acting
        ):
            learner = self._make_deployable(acting)
            actors = pool.deploy(learner.deployable_copy(), seed=self.seed)
            self._deployed_pool = pool
            self._policy_sync = PolicySync(actors, learner, **self._sync_config)
        else:
            self._apply_sync_config()

    def _acting_policy(self) -> th.nn.Module:
        return self.policy

    def _make_deployable(self, acting: th.nn.Module) -> Any:
        """The learner-side wrapper of the acting module (its copy is what the workers get)."""
        return make_deployable(acting)

    def learn(self, *args: Any, **kwargs: Any) -> Any:
        if self.overlap_collection and isinstance(self.env, ClusterVecEnv) and not self.env.pool.closed:
            pool = self.env.pool
            # A node agent's local processes collect on its host's cores, each as a flat worker would.
            self._learner_threads = _LearnerThreads(spare_cores(pool.workers_on_this_host * pool.processes_per_worker))
        failed = True
        try:
            learned = super().learn(*args, **kwargs)  # type: ignore[safe-super]  # the SB3 algorithm's, next in the MRO
            failed = False
            return learned
        finally:
            try:
                # An env's error in a segment started ahead and never used (a callback stopped
                # learning) is raised, unless learning failed already: that error is the one to see.
                self._drain_started(quiet=failed)
            finally:
                self._after_learn()

    def _after_learn(self) -> None:
        """Give the learner its torch threads back and remember the weights learn() left."""
        if self._learner_threads is not None:
            self._learner_threads.restore()
            self._learner_threads = None
        if self._policy_sync is not None:
            self._weights_after_learn = {
                name: value.detach().clone() for name, value in self._acting_policy().state_dict().items()
            }

    def train(self, *args: Any, **kwargs: Any) -> None:
        """SB3's update, then the sync decision (push the new weights, or not)."""
        super().train(*args, **kwargs)  # type: ignore[misc]  # the SB3 algorithm's, next in the MRO
        if self._policy_sync is not None:
            self._policy_sync.after_update()

    # -- segments ---------------------------------------------------------------------------------

    def _segment_request(self) -> tuple[int, dict]:
        """(n_steps, context) of the next segment."""
        raise NotImplementedError

    def _rollout(self, env: VecEnv) -> Rollout:
        """The next segment: the one started ahead (overlap), or one collected now."""
        env = check_cluster_vec_env(env, self._algorithm_name())
        if self._deployed_pool is not env.pool:
            raise RuntimeError("the policy is not deployed on this env's workers: learn() deploys it")
        sync = self._sync
        n_steps, context = self._segment_request()
        if self._learn_started:
            self._learn_started = False
            if self._first_segment_needs_push(sync):
                sync.push()
        if self._started is None:
            sync.actors.rollout_async(n_steps, context)
        elif self._started[0] != n_steps:
            raise RuntimeError(f"a segment of {self._started[0]} steps was started ahead, {n_steps} are needed")
        ahead, self._started = self._started is not None, None
        rollout = sync.actors.rollout_wait()  # the pool's timeout bounds the time without progress
        if self._learner_threads is not None:
            self._learner_threads.segment_arrived(rollout.collect_seconds, ahead)
        sync.record_rollout(rollout.versions)
        if sync.mode == "aaps":
            sync.observe(rollout.obs)
        return rollout

    def _first_segment_needs_push(self, sync: PolicySync) -> bool:
        """Whether a learn()'s first segment needs the current weights pushed. Decided here, once the
        callbacks have set the mode: weights changed since the last learn() ended (``load``,
        ``set_parameters``, a callback's ``on_training_start``) are acted with in any mode, as SB3's
        algorithm would; in ``always`` mode also those a ``never`` or ``aaps`` learn() left unpublished."""
        if sync.workers_current():
            return False
        if sync.mode == "always":
            return True
        return self._weights_after_learn is not None and not same_state(
            self._acting_policy().state_dict(), self._weights_after_learn
        )

    def _start_next_segment(self, uncounted: int = 0) -> None:
        """With ``overlap_collection``, start the next segment now, so it is collected while training.

        :param uncounted: env steps already collected that ``num_timesteps`` does not count yet
        """
        if self.overlap_collection and self.num_timesteps + uncounted < self._total_timesteps and self._started is None:
            n_steps, context = self._segment_request()
            self._sync.actors.rollout_async(n_steps, context)
            self._started = (n_steps, context)

    def _drain_started(self, quiet: bool = True) -> None:
        """Finish a segment started ahead and never used (learning stopped early or failed); its steps
        are dropped, but the observations continue from where the envs are.

        :param quiet: drop the segment's error instead of raising it (a lost worker's, or an env's).
            Either way the next learn() resets the envs, whose state the error leaves unknown.
        """
        if self._started is None:
            return
        self._started = None
        try:
            rollout = self._sync.actors.rollout_wait()
        except Exception:
            self._last_obs = None  # SB3's _setup_learn resets the envs then
            if quiet:  # a failed pool also says so at its next use
                return
            raise
        self._last_obs = _copy(rollout.last_obs)
        self._last_episode_starts = rollout.dones[-1]
