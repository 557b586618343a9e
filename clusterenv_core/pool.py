"""The learner-side pool: batched reset and step over environments that live on workers.

:class:`EnvPool` is what the SB3 and CleanRL adapters are built on. It hands out views of its
preallocated buffers (callers copy what they keep) and raises the errors of
:mod:`clusterenv_core.errors` for anything that goes wrong remotely; it never waits without a timeout.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np

from clusterenv_core import registry
from clusterenv_core.buffers import BatchBuffers, BatchSpec, field_views, fields_nbytes
from clusterenv_core.errors import (
    ClusterEnvError,
    EnvAttributeError,
    EnvError,
    SpaceMismatchError,
    WorkerLostError,
    WorkerTimeoutError,
)
from clusterenv_core.transports import Transport, make_transport
from clusterenv_core.protocol import AUTORESET_MODES, PROGRESS, RESTART_INFO_KEY
from clusterenv_core.rollout import Rollout, RolloutArrays, rollout_fields, time_major

DEFAULT_TIMEOUT = 60.0
# Starting a worker (interpreter, imports, env construction) may take longer than a step may.
_START_TIMEOUT = 60.0
_CLOSE_TIMEOUT = 5.0


@dataclass
class ResetResult:
    """What a reset returns. Arrays are views of the pool's buffers, valid until the next call."""

    obs: Any
    infos: dict[int, dict] = field(default_factory=dict)  # only non-empty infos, by env index


@dataclass
class StepResult:
    """What a step returns. Arrays are views of the pool's buffers, valid until the next call.

    ``infos`` holds the non-empty step infos by env index. In ``same_step`` mode, ``reset_infos``
    holds the non-empty infos of the automatic resets, and :meth:`final_observation` gives the last
    observation of each env whose episode ended.
    """

    obs: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: dict[int, dict]
    reset_infos: dict[int, dict]
    pickled_final_obs: dict[int, Any]
    _buffers: BatchBuffers

    def final_observation(self, index: int) -> Any:
        """The observation env ``index`` ended its episode with (``same_step`` mode, done envs only)."""
        if index in self.pickled_final_obs:
            return self.pickled_final_obs[index]
        return self._buffers.final_obs_layout.read(self._buffers.final_obs, index)


def _blocks(num_envs: int, num_workers: int) -> list[range]:
    """Contiguous blocks of envs, the first ``num_envs % num_workers`` one env larger."""
    size, extra = divmod(num_envs, num_workers)
    blocks, start = [], 0
    for worker in range(num_workers):
        stop = start + size + (worker < extra)
        blocks.append(range(start, stop))
        start = stop
    return blocks


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or timeout == float("inf"):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class EnvPool:
    """Environments on worker processes, stepped in parallel in contiguous blocks.

    :param env_fns: picklable callables that each build one environment (closures and classes
        from ``__main__`` work: they are serialized with cloudpickle)
    :param backend: ``"local"`` (processes on this machine) or ``"mpi"``
    :param num_workers: number of workers (default: the worker ranks of an MPI launch, else
        ``min(len(env_fns), os.cpu_count())``)
    :param timeout: seconds any single wait for a worker may last before
        :class:`~clusterenv_core.errors.WorkerTimeoutError`; a worker that dies is reported sooner
    :param autoreset_mode: ``"same_step"``, ``"next_step"`` or ``"disabled"``
        (see :mod:`clusterenv_core.worker`)
    :param restart_failed_envs: replace an env that raises in ``step`` by a new one from its factory
        instead of raising :class:`~clusterenv_core.errors.EnvError`
    :param restart_failed_workers: replace a worker that dies or times out during a step by a new
        one (local backend) instead of raising :class:`~clusterenv_core.errors.WorkerLostError`
    :param max_restarts: how many times one env, or one worker, may be replaced; the next failure
        raises its error
    :param backend_options: keyword arguments of the backend's transport

    A replaced env or worker ends its interrupted episodes as truncated, with the reason under the
    info key :data:`~clusterenv_core.protocol.RESTART_INFO_KEY`; :attr:`restarts` counts them. Both are
    off by default: a restart changes the data a run sees (an episode cut short, a fresh env RNG), so
    it is opted into, never silent.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        backend: str = "local",
        num_workers: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        autoreset_mode: str = "same_step",
        restart_failed_envs: bool = False,
        restart_failed_workers: bool = False,
        max_restarts: int = 3,
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        env_fns = list(env_fns)
        num_envs = len(env_fns)
        if num_envs == 0:
            raise ValueError("env_fns is empty: at least one environment factory is needed")
        for index, env_fn in enumerate(env_fns):
            if not callable(env_fn):
                raise TypeError(f"env_fns[{index}] is not callable: {env_fn!r}")
        timeout = _check_timeout(timeout)
        if autoreset_mode not in AUTORESET_MODES:
            raise ValueError(f"autoreset_mode must be one of {AUTORESET_MODES}, got {autoreset_mode!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, (int, np.integer)) or max_restarts < 0:
            raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
        # Constructing a transport starts nothing; it may know how many workers there are (MPI ranks).
        transport = make_transport(backend, **(backend_options or {}))
        if num_workers is None:
            num_workers = transport.default_num_workers() or min(num_envs, os.cpu_count() or 1)
        if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)):
            raise TypeError(f"num_workers must be an int, got {num_workers!r}")
        if not 1 <= num_workers <= num_envs:
            raise ValueError(f"num_workers must be between 1 and num_envs={num_envs}, got {num_workers}")

        self.num_envs = num_envs
        self.num_workers = int(num_workers)
        self.timeout = float(timeout)
        self.autoreset_mode = autoreset_mode
        self.restart_failed_envs = bool(restart_failed_envs)
        self.restart_failed_workers = bool(restart_failed_workers)
        self.max_restarts = int(max_restarts)
        #: how many envs and workers were replaced so far
        self.restarts = {"envs": 0, "workers": 0}
        self._worker_restarts = [0] * self.num_workers
        self.blocks = _blocks(num_envs, self.num_workers)
        self.worker_of = np.repeat(np.arange(self.num_workers), [len(block) for block in self.blocks])
        # Serialize before anything starts, so an unpicklable factory fails here and names itself.
        pickled_blocks = [_pickle_factories(env_fns, block) for block in self.blocks]
        # The learner's env registry, so ids registered here (by the script or an env package) build there.
        self._registry = registry.snapshot()

        self._transport: Transport = transport
        self.backend = backend
        self._awaiting: set[int] = set()  # workers whose reply to the last message is still unread
        self._failure: ClusterEnvError | None = None
        self._stepping = False
        self._lost_in_step: dict[int, ClusterEnvError] = {}  # workers to replace before the step completes
        self._weights = None  # published policy weights, once a policy is deployed
        #: version of the last published weights (0: those deployed; -1: no policy deployed yet)
        self.policy_version = -1
        self._rollout_pending = None  # the region of a rollout started and not yet waited for
        self._rollout_timeout = self.timeout  # its timeout without progress
        self._batched_action_space = None  # built on first use, for spaces without buffers
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._transport, self._awaiting)
        try:
            self._start(pickled_blocks)
        except BaseException:
            self.close()
            raise

    @classmethod
    def make(cls, env_id: str, num_envs: int, make_kwargs: dict | None = None, **pool_kwargs: Any) -> EnvPool:
        """A pool of ``num_envs`` copies of ``gymnasium.make(env_id, **make_kwargs)``."""
        if not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
        import gymnasium

        env_fn = functools.partial(gymnasium.make, env_id, **(make_kwargs or {}))
        return cls([env_fn] * int(num_envs), **pool_kwargs)

    def _start(self, pickled_blocks: list[list[bytes]]) -> None:
        self._transport.start(self.num_workers, self.timeout)
        self._init_payloads = [
            {
                "env_fns": pickled_blocks[worker],
                "first_index": block.start,
                "autoreset_mode": self.autoreset_mode,
                "max_env_restarts": self.max_restarts if self.restart_failed_envs else 0,
                "restarted": False,
                "sys_path": list(sys.path),
                "registry": self._registry,
            }
            for worker, block in enumerate(self.blocks)
        ]
        for worker in range(self.num_workers):
            self._send(worker, ("init", self._init_payloads[worker]))
        start_timeout = max(self.timeout, _START_TIMEOUT)
        descriptions = self._gather(range(self.num_workers), "creating the envs", timeout=start_timeout)
        spaces = [pair for worker in range(self.num_workers) for pair in descriptions[worker]["spaces"]]
        self.observation_space, self.action_space = spaces[0]
        for index, (observation_space, action_space) in enumerate(spaces):
            if observation_space != self.observation_space:
                raise SpaceMismatchError(
                    f"env {index} has observation space {observation_space}, env 0 has {self.observation_space}: "
                    "all envs of a pool must share their spaces"
                )
            if action_space != self.action_space:
                raise SpaceMismatchError(
                    f"env {index} has action space {action_space}, env 0 has {self.action_space}: "
                    "all envs of a pool must share their spaces"
                )
        first = descriptions[0]
        self.metadata: dict = first["metadata"]
        self.render_mode: str | None = first["render_mode"]
        self.spec = first["spec"]

        self.batch_spec = BatchSpec(self.num_envs, self.observation_space, self.action_space)
        self.buffers = self._transport.share_buffers(self.batch_spec, self.blocks)
        for worker, block in enumerate(self.blocks):
            self._send(worker, ("attach", {"spec": self.batch_spec, "block": block}))
        self._gather(range(self.num_workers), "attaching buffers", timeout=start_timeout)
        self._obs_layout = self.buffers.obs_layout
        self._act_layout = self.buffers.act_layout
        # Batched observations: views of the buffers, or per-env values for spaces without buffers.
        self._obs: Any = self._obs_layout.batch(self.buffers.obs) if self._obs_layout.buffered else [None] * self.num_envs
        # Observations before the current step, kept only to end the episodes of a replaced worker.
        self._obs_before_step: list[np.ndarray] | list = (
            ([np.empty_like(a) for a in self.buffers.obs] if self._obs_layout.buffered else [])
            if self.restart_failed_workers
            else []
        )

    # -- hot path ---------------------------------------------------------------------------------

    def step_async(self, actions: Any, per_env: bool = False) -> None:
        """Write ``actions`` and start every worker stepping; returns at once.

        :param actions: by default a batch, an element of ``action_space`` batched over the envs
            (gymnasium's ``batch_space``: a ``(num_envs, ...)`` array per leaf, a dict or tuple of
            those); split per env as ``SyncVectorEnv`` splits it
        :param per_env: ``actions[i]`` is env ``i``'s action instead (SB3's ``DummyVecEnv``
            convention: a list of dicts or tuples for ``Dict``/``Tuple`` spaces). For one-array
            spaces both forms are the same.
        :raises TypeError: a scalar or a container of the wrong type, before anything is sent
        :raises ValueError: wrong shape, count or values, before anything is sent
        """
        self._check_usable()
        if self._stepping:
            raise ClusterEnvError("step_async called while a step is pending: call step_wait first")
        self._check_not_stepping()
        self._drain()
        if self._act_layout.buffered:
            layout = self._act_layout
            leaves = layout.stack(actions, self.num_envs) if per_env else layout.check_batch(actions, self.num_envs)
            for buffer, leaf in zip(self.buffers.actions, leaves):
                buffer[...] = leaf
        else:
            # Spaces without buffers (Text, Graph, ... or a Dict/Tuple holding one): one action per env, pickled.
            actions = list(actions) if per_env else self._split_batch(actions)
            if len(actions) != self.num_envs:
                raise ValueError(f"expected {self.num_envs} actions (one per env), got {len(actions)}")
            for worker, block in enumerate(self.blocks):
                self._send(worker, ("actions", {"actions": actions[block.start : block.stop]}))
            self._gather(range(self.num_workers), "sending actions")
        if self.restart_failed_workers:
            self._remember_obs()
        transport = self._transport
        for worker in range(self.num_workers):
            try:
                transport.send_step(worker)
            except (WorkerLostError, WorkerTimeoutError) as error:
                if not self._may_replace(worker):
                    raise self._fail(error)
                self._lost_in_step[worker] = error
                continue
            self._awaiting.add(worker)
        self._stepping = True

    def _split_batch(self, actions: Any) -> list:
        """A batch of a space without buffers, one action per env, as ``SyncVectorEnv`` splits it."""
        from gymnasium.vector.utils import batch_space, iterate

        if self._batched_action_space is None:
            self._batched_action_space = batch_space(self.action_space, self.num_envs)
        return list(iterate(self._batched_action_space, actions))

    def _remember_obs(self) -> None:
        if self._obs_layout.buffered:
            for kept, current in zip(self._obs_before_step, self.buffers.obs):
                np.copyto(kept, current)
        else:
            self._obs_before_step = list(self._obs)

    def step_wait(self) -> StepResult:
        """Wait for the step started by :meth:`step_async` and return its results."""
        self._check_usable()
        if not self._stepping:
            raise ClusterEnvError("step_wait called without step_async")
        try:
            payloads = self._gather(sorted(self._awaiting), "step", step=True)
            for worker in sorted(self._lost_in_step):
                payloads[worker] = self._replace_worker(worker, self._lost_in_step.pop(worker))
        finally:
            # Interrupted (Ctrl-C) with replies unread, the step stays pending and step_wait resumes it.
            self._stepping = bool(self._awaiting or self._lost_in_step)
        infos: dict[int, dict] = {}
        reset_infos: dict[int, dict] = {}
        final_obs: dict[int, Any] = {}
        for payload in payloads.values():
            if payload is None:
                continue
            infos.update(payload.get("infos", ()))
            reset_infos.update(payload.get("reset_infos", ()))
            final_obs.update(payload.get("final_obs", ()))
            self._store_pickled_obs(payload)
        if self.restart_failed_envs:
            self.restarts["envs"] += sum(RESTART_INFO_KEY in info for info in infos.values())
        buffers = self.buffers
        return StepResult(
            self._obs, buffers.rewards, buffers.terminated, buffers.truncated, infos, reset_infos, final_obs, buffers
        )

    def step(self, actions: Any, per_env: bool = False) -> StepResult:
        """:meth:`step_async` then :meth:`step_wait`."""
        self.step_async(actions, per_env)
        return self.step_wait()

    def reset(
        self,
        seeds: Sequence[int | None] | None = None,
        options: Sequence[dict | None] | None = None,
        mask: np.ndarray | None = None,
    ) -> ResetResult:
        """Reset the envs selected by ``mask`` (all by default).

        :param seeds: one seed (or ``None``) per env
        :param options: one options dict (or ``None``) per env
        :param mask: boolean array of shape ``(num_envs,)``; envs outside it keep their state and
            their observation rows
        """
        self._check_usable()
        self._check_not_stepping()
        seeds = self._per_env(seeds, "seeds")
        options = self._per_env(options, "options")
        for index, seed in enumerate(seeds):
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
                raise ValueError(f"seeds[{index}] must be an int or None, got {seed!r}")
        if mask is not None:
            mask = np.asarray(mask)
            if mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
                raise ValueError(f"mask must be a bool array of shape ({self.num_envs},), got {mask.dtype} {mask.shape}")
        self._drain()
        seeds = [None if seed is None else int(seed) for seed in seeds]
        targets = []
        for worker, block in enumerate(self.blocks):
            block_mask = None if mask is None else mask[block.start : block.stop].tolist()
            if block_mask is not None and not any(block_mask):
                continue
            payload = {
                "seeds": seeds[block.start : block.stop],
                "options": options[block.start : block.stop],
                "mask": block_mask,
            }
            self._send(worker, ("reset", payload))
            targets.append(worker)
        infos: dict[int, dict] = {}
        for payload in self._gather(targets, "reset").values():
            if payload is not None:
                infos.update(payload.get("infos", ()))
                self._store_pickled_obs(payload)
        return ResetResult(self._obs, infos)

    def _store_pickled_obs(self, payload: dict) -> None:
        for index, obs in payload.get("obs", {}).items():
            self._obs[index] = obs

    # -- worker-side inference --------------------------------------------------------------------

    def deploy(self, policy: Any, seed: int | None = None) -> None:
        """Ship ``policy`` (a torch module, see :mod:`clusterenv_core.inference`) to every worker once
        and publish its weights as version 0; afterwards :meth:`publish_weights` updates them.

        :param seed: worker ``w`` seeds its torch generator (action sampling) with ``seed + w``
        """
        from clusterenv_core.inference import WeightsRegion, flatten_weights, weights_fields

        self._check_usable()
        self._check_not_stepping()
        if not self._obs_layout.buffered or len(self._act_layout.fields) != 1:
            raise ValueError(
                "worker-side inference needs an observation space with buffers and a single-array action "
                f"space (Box, Discrete, MultiDiscrete, MultiBinary); got {self.observation_space}, {self.action_space}"
            )
        for method in ("act", "action_dist"):
            if not callable(getattr(policy, method, None)):
                raise TypeError(f"the policy must have an {method}() method (see clusterenv_core.inference)")
        try:
            policy_bytes = cloudpickle.dumps(policy, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise ValueError(f"the policy cannot be pickled: {type(error).__name__}: {error}") from error
        self._drain()
        flat = flatten_weights(policy)
        fields = weights_fields(flat.size)
        handle, memory = self._transport.share_region(fields_nbytes(fields, 1))
        self._weights = WeightsRegion(field_views(fields, 1, memory))
        self.policy_version = 0
        self._weights.write(flat, self.policy_version)
        deliver = not self._transport.shares_memory
        for worker in range(self.num_workers):
            payload = {
                "policy": policy_bytes,
                "weights_handle": handle,
                "count": flat.size,
                "seed": None if seed is None else seed + worker,
                "deliver": deliver,
            }
            self._send(worker, ("deploy", payload))
            if deliver:
                self._transport.send_arrays(worker, self._weights.arrays)
        self._gather(range(self.num_workers), "deploying the policy")
        self._delivered_version = [self.policy_version] * self.num_workers
        #: size of one copy of the weights
        self.weights_nbytes = flat.nbytes
        self._rollout_regions: dict[int, list] = {}

    def publish_weights(self, policy_or_weights: Any) -> int:
        """Publish new weights (a module like the deployed one, or a flat float32 vector) to the
        workers; returns their version. Workers pick them up at their next step (local backend) or
        with their next rollout request (other backends)."""
        from clusterenv_core.inference import flatten_weights

        if self._weights is None:
            raise ClusterEnvError("no policy deployed: call deploy first")
        if isinstance(policy_or_weights, np.ndarray):
            flat = np.asarray(policy_or_weights, dtype=np.float32).reshape(-1)
        else:
            flat = flatten_weights(policy_or_weights)
        if flat.size != self._weights.weights.size:
            raise ValueError(f"{flat.size} weights given, the deployed policy has {self._weights.weights.size}")
        self.policy_version += 1
        self._weights.write(flat, self.policy_version)
        return self.policy_version

    def rollout_async(self, n_steps: int, context: dict | None = None, timeout: float | None = None) -> None:
        """Start every worker collecting ``n_steps`` steps of all its envs with its policy copy;
        returns at once, so the learner can train while the segment is collected.

        :param context: keyword arguments for the policy's ``act`` (e.g. an exploration rate)
        :param timeout: seconds a worker may go without progress (default: the pool's ``timeout``).
            A segment may take as long as it needs: workers report progress every quarter of it.
        """
        self._check_usable()
        self._check_not_stepping()
        if self._weights is None:
            raise ClusterEnvError("no policy deployed: call deploy first")
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
            raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
        timeout = self.timeout if timeout is None else _check_timeout(timeout)
        self._drain()
        region = self._rollout_region(int(n_steps))
        for worker, block in enumerate(self.blocks):
            self._deliver_weights(worker)
            payload = {
                "n_steps": int(n_steps),
                "context": dict(context or {}),
                "handle": region.handle,
                "block": block,
                "num_envs": self.num_envs,
                "report_every": timeout / 4,
            }
            self._send(worker, ("rollout", payload))
        self._rollout_pending = region
        self._rollout_timeout = timeout

    def rollout_wait(self, timeout: float | None = None) -> Rollout:
        """Wait for the segment started by :meth:`rollout_async`.

        :param timeout: seconds a worker may go without progress (default: the one given to
            :meth:`rollout_async`); a worker that stops stepping raises ``WorkerTimeoutError``
        """
        self._check_usable()
        region = self._rollout_pending
        if region is None:
            raise ClusterEnvError("rollout_wait called without rollout_async")
        timeout = self._rollout_timeout if timeout is None else _check_timeout(timeout)

        def receive_segment(worker: int) -> None:
            block = self.blocks[worker]
            self._transport.recv_arrays(worker, [array[block.start : block.stop] for array in region.all], timeout)

        try:
            payloads = self._gather(sorted(self._awaiting), "rollout", timeout=timeout, on_reply=receive_segment)
        finally:
            if not self._awaiting:  # interrupted with replies unread, the rollout stays pending
                self._rollout_pending = None
        n_steps = region.rewards.shape[1]
        infos: list[dict[int, dict]] = [{} for _ in range(n_steps)]
        reset_infos: list[dict[int, dict]] = [{} for _ in range(n_steps)]
        pickled_final_obs: dict[tuple[int, int], Any] = {}
        for payload in payloads.values():
            for step, parts in (payload or {}).get("steps", {}).items():
                infos[step].update(parts.get("infos", ()))
                reset_infos[step].update(parts.get("reset_infos", ()))
                pickled_final_obs.update(((step, index), obs) for index, obs in parts.get("final_obs", {}).items())
        if self.restart_failed_envs:
            self.restarts["envs"] += sum(RESTART_INFO_KEY in info for step in infos for info in step.values())
        obs_layout = self._obs_layout
        return Rollout(
            obs=time_major(obs_layout, region.obs),
            actions=time_major(self._act_layout, region.actions),
            rewards=region.rewards.T,
            terminated=region.terminated.T,
            truncated=region.truncated.T,
            log_probs=region.log_probs.T,
            values=region.values.T,
            versions=region.versions.T,
            last_obs=obs_layout.batch(region.last_obs),
            infos=infos,
            reset_infos=reset_infos,
            pickled_final_obs=pickled_final_obs,
            _final_obs=[array.swapaxes(0, 1) for array in region.final_obs],
            _obs_layout=obs_layout,
        )

    def rollout(self, n_steps: int, context: dict | None = None, timeout: float | None = None) -> Rollout:
        """:meth:`rollout_async` then :meth:`rollout_wait`."""
        self.rollout_async(n_steps, context, timeout)
        return self.rollout_wait()

    def _rollout_region(self, n_steps: int) -> RolloutArrays:
        """One of two regions per segment length, alternating, so a segment can be collected while
        the previous one is still being read."""
        slots = self._rollout_regions.setdefault(n_steps, [])  # the most recently used first
        if len(slots) < 2:
            fields = rollout_fields(self.batch_spec, n_steps)
            handle, memory = self._transport.share_region(fields_nbytes(fields, self.num_envs))
            region = RolloutArrays(field_views(fields, self.num_envs, memory), self._obs_layout, self._act_layout)
            region.handle = handle
            slots.insert(0, region)
            return region
        slots.reverse()
        return slots[0]

    def _deliver_weights(self, worker: int) -> None:
        if self._transport.shares_memory or self._delivered_version[worker] == self.policy_version:
            return
        self._send(worker, ("weights", None))
        self._transport.send_arrays(worker, self._weights.arrays)
        self._gather([worker], "delivering weights")
        self._delivered_version[worker] = self.policy_version

    # -- per-env access ---------------------------------------------------------------------------

    def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        indices: Iterable[int] | None = None,
        require_callable: bool = False,
    ) -> list:
        """Call method ``name`` of each selected env (looked up through its wrappers) with ``args``
        and ``kwargs`` and return the results in the order of ``indices``; a non-callable attribute
        is returned as is unless ``require_callable``.

        The env's arguments are explicit parameters, so they may use any names (``indices`` too).
        """
        payload = {"name": name, "args": tuple(args), "kwargs": dict(kwargs or {}), "require_callable": require_callable}
        return self._per_worker("call", payload, indices, f"call {name}")

    def get_attr(self, name: str, indices: Iterable[int] | None = None) -> list:
        """Attribute ``name`` of each selected env, looked up through its wrappers."""
        return self._per_worker("get_attr", {"name": name}, indices, f"get_attr {name}")

    def set_attr(
        self, name: str, values: Sequence[Any], indices: Iterable[int] | None = None, through_wrappers: bool = False
    ) -> None:
        """Set attribute ``name`` of each selected env to the matching entry of ``values``."""
        indices = self._indices(indices)
        if len(values) != len(indices):
            raise ValueError(f"set_attr: {len(values)} values for {len(indices)} envs")
        by_index = dict(zip(indices, values))
        self._per_worker(
            "set_attr",
            {"name": name, "through_wrappers": through_wrappers},
            indices,
            f"set_attr {name}",
            per_row=lambda worker_indices: {"values": [by_index[i] for i in worker_indices]},
        )

    def env_is_wrapped(self, wrapper_class: type, indices: Iterable[int] | None = None) -> list[bool]:
        """Whether each selected env has a wrapper of ``wrapper_class`` in its wrapper stack."""
        return self._per_worker("is_wrapped", {"wrapper_class": wrapper_class}, indices, "env_is_wrapped")

    def _per_worker(
        self, op: str, payload: dict, indices: Iterable[int] | None, what: str, per_row: Callable | None = None
    ) -> list:
        self._check_usable()
        self._check_not_stepping()
        indices = self._indices(indices)
        self._drain()
        by_worker: dict[int, list[int]] = {}
        for index in indices:
            by_worker.setdefault(int(self.worker_of[index]), []).append(index)
        for worker, worker_indices in by_worker.items():
            start = self.blocks[worker].start
            message = dict(payload, rows=[i - start for i in worker_indices])
            if per_row is not None:
                message.update(per_row(worker_indices))
            self._send(worker, (op, message))
        replies = self._gather(list(by_worker), what)
        results: dict[int, Any] = {}
        for worker, worker_indices in by_worker.items():
            if replies[worker] is not None:
                results.update(zip(worker_indices, replies[worker]))
        return [results.get(index) for index in indices]

    def _indices(self, indices: Iterable[int] | int | None) -> list[int]:
        if indices is None:
            return list(range(self.num_envs))
        if isinstance(indices, (int, np.integer)):
            indices = [indices]
        result = []
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                raise TypeError(f"env indices must be ints, got {index!r}")
            if not -self.num_envs <= index < self.num_envs:
                raise IndexError(f"env index {index} out of range for {self.num_envs} envs")
            result.append(int(index) % self.num_envs)
        return result

    def _per_env(self, values: Sequence | None, what: str) -> list:
        if values is None:
            return [None] * self.num_envs
        values = list(values)
        if len(values) != self.num_envs:
            raise ValueError(f"{what}: expected {self.num_envs} values (one per env), got {len(values)}")
        return values

    # -- messaging --------------------------------------------------------------------------------

    def _send(self, worker: int, message: tuple) -> None:
        try:
            self._transport.send(worker, message)
        except ClusterEnvError as error:
            raise self._fail(error)
        self._awaiting.add(worker)

    def _gather(
        self,
        workers: Iterable[int],
        what: str,
        step: bool = False,
        timeout: float | None = None,
        on_reply: Callable[[int], None] | None = None,
    ) -> dict[int, Any]:
        """Every listed worker's reply payload; the first remote error is raised once all have answered.

        ``on_reply(worker)`` runs after each successful reply (to receive arrays that follow it).
        """
        recv = self._transport.recv_step if step else self._transport.recv
        timeout = self.timeout if timeout is None else timeout
        payloads: dict[int, Any] = {}
        first_error: EnvError | None = None
        for worker in workers:
            try:
                status, payload = _reply(recv, worker, timeout)
            except (WorkerLostError, WorkerTimeoutError) as error:
                if not (step and self._may_replace(worker)):
                    raise self._fail(error)
                self._awaiting.discard(worker)
                self._lost_in_step[worker] = error
                continue
            self._awaiting.discard(worker)
            if status == "error":
                if first_error is None:
                    error_class = EnvAttributeError if payload["type"] == "builtins.AttributeError" else EnvError
                    first_error = error_class(
                        payload["env_index"],
                        worker,
                        payload["operation"] if payload["operation"] != "step" else what,
                        payload["type"],
                        payload["message"],
                        payload["traceback"],
                    )
            else:
                payloads[worker] = payload
                if on_reply is not None:
                    on_reply(worker)
        if first_error is not None:
            raise first_error
        return payloads

    def _may_replace(self, worker: int) -> bool:
        return self.restart_failed_workers and self._worker_restarts[worker] < self.max_restarts

    def _replace_worker(self, worker: int, error: ClusterEnvError) -> dict:
        """Start a new worker for a lost one's envs and end their interrupted episodes as truncated.

        Returns the step payload of the block. The episodes' last observations are those from
        before the step. In ``same_step`` mode the new envs are reset now (unseeded); in
        ``next_step`` mode they reset at their next step; in ``disabled`` mode the caller resets them.
        """
        try:
            self._transport.restart(worker, self.timeout)
        except NotImplementedError:
            raise self._fail(error) from None
        self._worker_restarts[worker] += 1
        self.restarts["workers"] += 1
        self._send(worker, ("init", dict(self._init_payloads[worker], restarted=True)))
        start_timeout = max(self.timeout, _START_TIMEOUT)
        self._gather([worker], "recreating the envs of a lost worker", timeout=start_timeout)
        block = self.blocks[worker]
        self._send(worker, ("attach", {"spec": self.batch_spec, "block": block}))
        self._gather([worker], "attaching buffers", timeout=start_timeout)

        layout, rows = self._obs_layout, slice(block.start, block.stop)
        if layout.buffered:
            previous = {i: layout.read(self._obs_before_step, i) for i in block}
        else:
            previous = {i: self._obs_before_step[i] for i in block}
        reason = (
            f"worker {worker} was replaced (restart {self._worker_restarts[worker]} of {self.max_restarts}) "
            f"after: {error}"
        )
        payload: dict[str, dict] = {"infos": {i: {RESTART_INFO_KEY: reason} for i in block}}
        if self.autoreset_mode == "same_step":
            payload["final_obs"] = previous
            self._send(worker, ("reset", {"seeds": [None] * len(block), "options": [None] * len(block), "mask": None}))
            reset = self._gather([worker], "resetting the envs of a lost worker")[worker] or {}
            payload["reset_infos"] = reset.get("infos", {})
            if "obs" in reset:
                payload["obs"] = reset["obs"]
        elif layout.buffered:
            for kept, current in zip(self._obs_before_step, self.buffers.obs):
                current[rows] = kept[rows]
        else:
            payload["obs"] = previous
        self.buffers.rewards[rows] = 0.0
        self.buffers.terminated[rows] = False
        self.buffers.truncated[rows] = True
        return payload

    def _drain(self) -> None:
        """Read replies left unread by an interrupted call, so requests and replies stay paired."""
        for worker in sorted(self._awaiting):
            try:
                _reply(self._transport.recv, worker, self.timeout)
            except (WorkerLostError, WorkerTimeoutError) as error:
                raise self._fail(error)
            self._awaiting.discard(worker)
        self._stepping = False

    def _fail(self, error: ClusterEnvError) -> ClusterEnvError:
        """Remember that the pool is unusable; returns ``error`` for raising."""
        if self._failure is None:
            self._failure = error
        return error

    def _check_usable(self) -> None:
        if self._closed:
            raise ClusterEnvError("the pool is closed")
        if self._failure is not None:
            raise ClusterEnvError(f"the pool is unusable after an earlier failure: {self._failure}") from self._failure

    def _check_not_stepping(self) -> None:
        if self._stepping:
            raise ClusterEnvError("a step is pending: call step_wait first")
        if self._rollout_pending is not None:
            raise ClusterEnvError("a rollout is pending: call rollout_wait first")

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop every worker and free every resource; idempotent, also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        self._stepping = False
        self._finalizer()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _pickle_factories(env_fns: list, block: range) -> list[bytes]:
    pickled = []
    for index in block:
        try:
            pickled.append(cloudpickle.dumps(env_fns[index], protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as error:
            raise ValueError(
                f"env_fns[{index}] cannot be pickled ({type(error).__name__}: {error}); "
                "env factories must be picklable to reach the workers"
            ) from error
    return pickled


def _reply(recv: Callable[[int, float], Any], worker: int, timeout: float) -> tuple[str, Any]:
    """The worker's next reply, read past its progress reports (each restarts the ``timeout``)."""
    status, payload = recv(worker, timeout)
    while status == PROGRESS:
        status, payload = recv(worker, timeout)
    return status, payload


def _shutdown(transport: Transport, awaiting: set[int]) -> None:
    """Ask every worker to close its envs and exit, then make sure they have.

    Kept apart from the pool so that it can run as the pool's finalizer at interpreter exit.
    """
    asked = []
    for worker in range(transport.num_workers):
        if worker in transport.failed:
            continue
        try:
            if worker in awaiting:  # a pending reply first, so the close reply is the next one
                _reply(transport.recv, worker, _CLOSE_TIMEOUT)
                awaiting.discard(worker)
            transport.send(worker, ("close", None))
            asked.append(worker)
        except ClusterEnvError:
            awaiting.discard(worker)
    for worker in asked:
        try:
            transport.recv(worker, _CLOSE_TIMEOUT)
        except ClusterEnvError:
            pass
    awaiting.clear()
    transport.close(_CLOSE_TIMEOUT)
