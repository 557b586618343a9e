"""The learner-side pool: batched reset and step over environments that live on workers.

:class:`EnvPool` is what the SB3 and CleanRL adapters are built on. It hands out views of its
preallocated buffers (callers copy what they keep) and raises the errors of
:mod:`clusterenv_core.errors` for anything that goes wrong remotely; it never waits without a
timeout. Worker-side inference (a policy copy on each worker, rollout segments) is
:class:`~clusterenv_core.actors.WorkerActors`, made by :meth:`EnvPool.deploy`; asynchronous batches
are :class:`~clusterenv_core.batches.AsyncBatches`; replacing lost workers is
:class:`~clusterenv_core.restarts.WorkerRestarts`. All of them talk to the workers through the pool's
one :class:`~clusterenv_core.channel.WorkerChannel`, which also holds the pool's state.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core import checks, protocol, registry
from clusterenv_core.buffers import BatchSpec
from clusterenv_core.channel import PoolState, WorkerChannel
from clusterenv_core.checks import check_bool, check_indices, check_int, check_names, check_seconds, per_env_values
from clusterenv_core.errors import ClusterEnvError
from clusterenv_core.factories import contiguous_blocks, pickle_factories, refuse_a_pool_built_by_a_worker_import
from clusterenv_core.interpreter import LearnerInterpreter
from clusterenv_core.learner_threads import warn_if_torch_threads_contend
from clusterenv_core.node_agent import AgentBlock, agent_allowance
from clusterenv_core.not_copyable import NotCopyable
from clusterenv_core.protocol import AUTORESET_MODES
from clusterenv_core.replies import START_TIMEOUT
from clusterenv_core.results import ResetResult, StepResult
from clusterenv_core.spaces import common_spaces
from clusterenv_core.transports import WorkerNames, make_transport

if TYPE_CHECKING:
    from gymnasium import Space

    from clusterenv_core.actors import WorkerActors
    from clusterenv_core.batches import AsyncBatches
    from clusterenv_core.restarts import WorkerRestarts

DEFAULT_TIMEOUT = 60.0

#: The keywords of :class:`EnvPool` that the adapters take as theirs too (:meth:`EnvPool.from_options`).
POOL_OPTIONS = (
    "backend",
    "num_workers",
    "timeout",
    "restart_failed_envs",
    "restart_failed_workers",
    "max_restarts",
    "processes_per_worker",
)


class EnvPool(NotCopyable):
    """Environments on worker processes, stepped in parallel in contiguous blocks.

    :param env_fns: picklable callables that each build one environment (closures and classes
        from ``__main__`` work: they are serialized with cloudpickle); env ids registered in this
        process reach the workers too (see :mod:`clusterenv_core.registry`)
    :param backend: ``"local"`` (processes on this machine), ``"mpi"`` or ``"ray"`` (docs/ray.md)
    :param num_workers: number of workers (default: the worker ranks of an MPI launch, a Ray actor per
        node with CPUs (``"ray"``), else
        ``min(len(env_fns), os.cpu_count())``)
    :param timeout: seconds an env may take in a step (or a call, a reset; in a rollout segment,
        without progress) before it is reported as stuck: a
        :class:`~clusterenv_core.errors.WorkerTimeoutError` naming its worker, which ``close()``
        ends. With ``processes_per_worker`` > 1, the node agent reports (or replaces) its stuck local
        process after that time, and the learner waits for an agent longer
        (:func:`~clusterenv_core.node_agent.agent_allowance`), in case the agent is stuck itself. A
        worker that dies is reported sooner
    :param autoreset_mode: ``"same_step"``, ``"next_step"`` or ``"disabled"``
        (see :mod:`clusterenv_core.worker`)
    :param restart_failed_envs: replace an env that raises in ``step`` by a new one from its factory
        instead of raising :class:`~clusterenv_core.errors.EnvError`
    :param restart_failed_workers: replace a worker that dies or times out during a step or a
        rollout segment by a new one (local and Ray backends) instead of raising
        :class:`~clusterenv_core.errors.WorkerLostError`. With ``processes_per_worker`` > 1, a node
        agent replaces a local process of its own lost in a step (on any backend), and the learner
        replaces a lost agent as any worker, the new agent starting its local processes anew
    :param max_restarts: how many times one env, or one worker, may be replaced; the next failure
        raises its error. With node agents it counts per process, as on a pool of that many
        workers: each agent, and each local process of an agent (a lost agent's replacement gives
        its local processes a new budget, its envs keep theirs)
    :param processes_per_worker: each worker (an MPI rank, a local worker process) steps its block on
        this many local processes (a node agent, :mod:`clusterenv_core.node_agent`), answering
        once per request for the block; at most the envs of the smallest block. Not with
        ``inline_worker`` (``ValueError``), which steps a block in the learner's process, not on local
        processes of its own. ``None``: when ``num_workers`` is not given either, the backend's own
        (Ray: the CPUs of its smallest node with CPUs, so that each node's actor uses its node's
        cores), at most the envs of the smallest block; else 1
    :param backend_options: keyword arguments of the backend's transport
    :param carried_env_restarts: the envs replace those of a lost worker (the pool of a node agent
        that replaces a lost one): how often each was replaced so far, a budget they carry over; in
        ``next_step`` mode they reset at their next step, as a replaced worker's envs do. ``None``:
        new envs
    :param observation_spaces_fit: ``fit(space, first)``, whether an env's observation space may
        stand with the first env's (default: equality). Observations live in buffers laid out by the
        first env's space, so a looser test must still require its dtype and shape: gymnasium's
        ``is_space_dtype_shape_equiv``, for ``SyncVectorEnv``'s ``observation_mode="different"``.
        :attr:`observation_spaces` holds each env's.
    :param worker_names: how error messages and restart reasons name the workers and envs (the pool
        of a node agent names its workers as the agent's local processes, its envs by the learner's
        indices); default: ``worker 3``, envs from 0

    A pool cannot be copied or pickled (``TypeError``): its envs live in its worker processes.

    A replaced env or worker ends its interrupted episodes as truncated, with the reason under the
    info key :data:`~clusterenv_core.protocol.RESTART_INFO_KEY`; :attr:`restarts` counts them (and
    :attr:`env_restarts` each env's). An env whose automatic reset raised keeps the step that ended
    its episode. Both are
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
        processes_per_worker: int | None = None,
        backend_options: dict[str, Any] | None = None,
        carried_env_restarts: Sequence[int] | None = None,
        observation_spaces_fit: Callable[[Any, Any], bool] | None = None,
        worker_names: WorkerNames = WorkerNames(),
    ) -> None:
        refuse_a_pool_built_by_a_worker_import()
        env_fns = list(env_fns)
        num_envs = len(env_fns)
        if num_envs == 0:
            raise ValueError("env_fns is empty: at least one environment factory is needed")
        for index, env_fn in enumerate(env_fns):
            if not callable(env_fn):
                raise TypeError(f"env_fns[{index}] is not callable: {env_fn!r}")
        timeout = check_seconds("timeout", timeout)
        if autoreset_mode not in AUTORESET_MODES:
            raise ValueError(f"autoreset_mode must be one of {AUTORESET_MODES}, got {autoreset_mode!r}")
        max_restarts = check_int("max_restarts", max_restarts, minimum=0)
        restart_failed_envs = check_bool("restart_failed_envs", restart_failed_envs)
        restart_failed_workers = check_bool("restart_failed_workers", restart_failed_workers)
        # Constructing a transport starts nothing; it may know how many workers there are (MPI ranks).
        transport = make_transport(backend, **(backend_options or {}))
        layout_by_backend = num_workers is None
        if num_workers is None:
            num_workers = transport.default_num_workers() or min(num_envs, os.cpu_count() or 1)
        num_workers = check_int("num_workers", num_workers)
        if not 1 <= num_workers <= num_envs:
            raise ValueError(f"num_workers must be between 1 and num_envs={num_envs}, got {num_workers}")

        self.num_envs = num_envs
        self.num_workers = num_workers
        self.timeout = timeout
        self.autoreset_mode = autoreset_mode
        self.backend = backend
        self.restart_failed_envs = restart_failed_envs
        self.restart_failed_workers = restart_failed_workers
        self.max_restarts = max_restarts
        #: the global env indices of each worker's block
        self.blocks = contiguous_blocks(num_envs, num_workers)
        smallest_block = min(len(block) for block in self.blocks)
        if processes_per_worker is None:
            offered = transport.default_processes_per_worker() if layout_by_backend else None
            processes_per_worker = min(offered or 1, smallest_block)
        self.processes_per_worker = checks.check_processes_per_worker(
            processes_per_worker, smallest_block, transport.has_inline_worker
        )
        carried = [0] * num_envs if carried_env_restarts is None else list(carried_env_restarts)
        if len(carried) != num_envs:
            raise ValueError(f"carried_env_restarts: expected {num_envs} counts (one per env), got {len(carried)}")
        #: the worker of each env index
        self.worker_of = np.repeat(np.arange(num_workers), [len(block) for block in self.blocks])
        #: asynchronous stepping, once :meth:`async_batches` started it
        self.batches: AsyncBatches | None = None
        # Serialize before anything starts, so an unpicklable factory or env spec fails here, named.
        pickled_blocks, env_factories = pickle_factories(env_fns, self.blocks)
        worker_modules = protocol.modules_named(pickled_blocks)
        shipped_registry = registry.snapshot()
        learner_interpreter = LearnerInterpreter.capture(worker_modules)
        # Kept by the WorkerRestarts while restarts may need them (a replaced worker gets its block's
        # again), else dropped once sent: they hold a pickle of every distinct factory.
        init_requests = [
            protocol.Init(
                env_fns=pickled_blocks[worker],
                env_factories=env_factories[worker],
                first_index=block.start,
                worker=worker,
                autoreset_mode=autoreset_mode,
                max_env_restarts=max_restarts if self.restart_failed_envs else 0,
                restarted=carried_env_restarts is not None,
                env_restarts=carried[block.start : block.stop],
                interpreter=learner_interpreter,
                registry=shipped_registry,
                processes=self.processes_per_worker,
                max_process_restarts=max_restarts if restart_failed_workers else None,
                timeout=timeout,
            )
            for worker, block in enumerate(self.blocks)
        ]

        self._transport = transport
        allowance = None
        if self.processes_per_worker > 1:
            allowance = functools.partial(agent_allowance, replaces_processes=restart_failed_workers)
        channel = WorkerChannel(
            transport, self.blocks, timeout, max_restarts if restart_failed_workers else None, allowance
        )
        channel.env_restarts[:] = carried
        self._channel = channel
        self._batched_action_space: Space | None = None  # built on first use, for spaces without buffers
        self._restarts: WorkerRestarts | None = None  # with restart_failed_workers, once started
        self._closed = False
        transport.worker_modules = tuple(worker_modules)
        transport.names = worker_names
        # What makes a node agent's block, for workers the transport serves from here: an MPI SPMD rank
        # turning worker within this call, a Ray actor (node agents run pools of this class).
        transport.agent_block = functools.partial(AgentBlock, make_pool=EnvPool)
        try:
            transport.start(num_workers, timeout)
            start_timeout = max(timeout, START_TIMEOUT)
            for worker in range(num_workers):
                channel.send(worker, init_requests[worker])
            descriptions = channel.gather(range(num_workers), "creating the envs", timeout=start_timeout)
            per_env_spaces = [pair for worker in range(num_workers) for pair in descriptions[worker].spaces]
            self.observation_space, self.action_space = common_spaces(per_env_spaces, observation_spaces_fit)
            #: each env's observation space (all equal to :attr:`observation_space` unless
            #: ``observation_spaces_fit`` let them differ)
            self.observation_spaces = [observation_space for observation_space, _ in per_env_spaces]
            first = descriptions[0]
            self.metadata: dict = first.metadata
            self.render_mode: str | None = first.render_mode
            self.spec = first.spec
            self.batch_spec = BatchSpec(num_envs, self.observation_space, self.action_space)
            self.buffers = channel.share_buffers(self.batch_spec)
            channel.attach(range(num_workers), start_timeout)
            self._obs_layout = self.buffers.obs_layout
            self._act_layout = self.buffers.act_layout
            # Batched observations: views of the buffers, or per-env values for spaces without buffers.
            self._obs: Any = (
                self._obs_layout.batch(self.buffers.obs) if self._obs_layout.buffered else [None] * num_envs
            )
            if self.restart_failed_workers:
                from clusterenv_core.restarts import WorkerRestarts

                self._restarts = WorkerRestarts(channel, autoreset_mode, init_requests, lambda: self._obs)
        except BaseException:
            self.close()
            raise
        warn_if_torch_threads_contend(self.workers_on_this_host * self.processes_per_worker)  # an agent's cores too

    @property
    def restarts(self) -> dict[str, int]:
        """How many envs and workers were replaced so far."""
        return self._channel.restarts

    @property
    def env_restarts(self) -> list[int]:
        """How often each env was replaced so far."""
        return self._channel.env_restarts

    @property
    def actors(self) -> WorkerActors | None:
        """The policy copies on the workers, once :meth:`deploy` made them."""
        return self._channel.deployed

    @classmethod
    def make(cls, env_id: str, num_envs: int, make_kwargs: dict | None = None, **pool_kwargs: Any) -> EnvPool:
        """A pool of ``num_envs`` copies of ``gymnasium.make(env_id, **make_kwargs)``."""
        num_envs = check_int("num_envs", num_envs, minimum=1)
        import gymnasium

        env_fn = functools.partial(gymnasium.make, env_id, **(make_kwargs or {}))
        return cls([env_fn] * num_envs, **pool_kwargs)

    @classmethod
    def from_options(
        cls,
        env_fns: Sequence[Callable[[], Any]],
        autoreset_mode: str,
        observation_spaces_fit: Callable[[Any, Any], bool] | None = None,
        **options: Any,
    ) -> EnvPool:
        """A pool from an adapter's keywords: those of :data:`POOL_OPTIONS` are the pool's, any other
        is an option of the backend, given as a keyword (``ClusterVecEnv(env_fns, fork_server=False)``)
        or in ``backend_options`` (``ClusterVecEnv(env_fns, backend_options={"fork_server": False})``),
        as :class:`EnvPool` takes them."""
        pool_kwargs = {name: options.pop(name) for name in POOL_OPTIONS if name in options}
        # The backend's options may also come as the pool takes them, in one dict.
        backend_options = dict(options.pop("backend_options", None) or {})
        twice = sorted(set(backend_options) & set(options))
        if twice:
            raise TypeError(f"backend option(s) {', '.join(twice)} given both as keywords and in backend_options")
        options.update(backend_options)
        return cls(
            env_fns,
            autoreset_mode=autoreset_mode,
            backend_options=options,
            observation_spaces_fit=observation_spaces_fit,
            **pool_kwargs,
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
        channel = self._channel
        channel.check_usable()
        if channel.state is not PoolState.IDLE or channel.unsettled:
            # Something may be pending, interrupted or left to report: the careful checks (skipped on
            # the plain path).
            if channel.state is PoolState.STEP and not channel.interrupted:
                raise ClusterEnvError("step_async called while a step is pending: call step_wait first")
            channel.check_idle()
            channel.drain()
        if self._act_layout.buffered:
            layout = self._act_layout
            leaves = layout.stack(actions, self.num_envs) if per_env else layout.check_batch(actions, self.num_envs)
            channel.set_batch_dtypes([leaf.dtype for leaf in leaves])
            for buffer, leaf in zip(self.buffers.actions, leaves):
                buffer[...] = leaf
        else:
            # Spaces without buffers (Text, Graph, ... or a Dict/Tuple holding one): one action per env, pickled.
            actions = list(actions) if per_env else self._split_batch(actions)
            if len(actions) != self.num_envs:
                raise ValueError(f"expected {self.num_envs} actions (one per env), got {len(actions)}")
            for worker, block in enumerate(self.blocks):
                channel.send(worker, protocol.Actions(actions[block.start : block.stop]))
            channel.gather(range(self.num_workers), "sending actions")
        if self._restarts is not None:
            self._restarts.remember_step_start()
        channel.send_steps(range(self.num_workers))
        channel.begin(PoolState.STEP, self.step_wait)

    def _split_batch(self, actions: Any) -> list:
        """A batch of a space without buffers, one action per env, as ``SyncVectorEnv`` splits it."""
        from gymnasium.vector.utils import batch_space, iterate

        if self._batched_action_space is None:
            self._batched_action_space = batch_space(self.action_space, self.num_envs)
        return list(iterate(self._batched_action_space, actions))

    def step_wait(self) -> StepResult:
        """Wait for the step started by :meth:`step_async` and return its results."""
        channel = self._channel
        channel.check_usable()
        if channel.state is not PoolState.STEP:
            raise ClusterEnvError("step_wait called without step_async")
        try:
            # The last worker is the last to get its step and, with no spin, the last to finish: waiting
            # for it first finds the others' replies in, one wake-up instead of one per worker. With
            # the replies read before Ctrl-C cut an earlier wait for this step short; not those of
            # workers lost (their replacements' requests are no steps).
            results = channel.gather(channel.answering(reverse=True), "step", step=True)
            if self._restarts is not None:
                results.update(self._restarts.replace_lost())
        finally:
            # Interrupted (Ctrl-C) with replies unread, the step stays pending: step_wait resumes it,
            # and any other call first finishes it (see WorkerChannel.check_idle).
            channel.settle_wait()
        infos: dict[int, dict] = {}
        reset_infos: dict[int, dict] = {}
        final_obs: dict[int, Any] = {}
        for parts in results.values():
            if parts is None:
                continue
            infos.update(parts.get("infos", ()))
            reset_infos.update(parts.get("reset_infos", ()))
            final_obs.update(parts.get("final_obs", ()))
            self._store_pickled_obs(parts)
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
        omit_if_none: Sequence[str] = (),
    ) -> ResetResult:
        """Reset the envs selected by ``mask`` (all by default): each env's ``reset`` gets ``seed=`` and
        ``options=``, each left out where it is ``None`` if ``omit_if_none`` names it.

        :param seeds: one seed (or ``None``) per env, passed to its ``reset`` as given: what a seed
            may be is the env's to decide, as under ``DummyVecEnv`` and ``SyncVectorEnv`` (gymnasium's
            own envs take a Python int of at least 0)
        :param options: one options dict (or ``None``) per env
        :param mask: boolean array of shape ``(num_envs,)``; envs outside it keep their state and
            their observation rows
        :param omit_if_none: some of ``"seed"`` and ``"options"``: the keywords to leave out where
            their value is ``None``, so that an env whose ``reset`` lacks them works as under the
            vector env the caller stands in for (gymnasium 1.x's ``SyncVectorEnv`` passes both
            always, gymnasium 0.29's neither when ``None``, SB3's ``DummyVecEnv`` ``options`` only
            when set)

        With ``restart_failed_workers``, a worker whose replacement had to run outside its place
        (Ray: a lost node's actor, no node then having room for its bundle) moves back first when
        its place has room again and this reset covers all its envs.
        """
        self._channel.check_usable()
        self._channel.check_idle()
        seeds = per_env_values(seeds, self.num_envs, "seeds")
        options = per_env_values(options, self.num_envs, "options")
        omit_if_none = check_names("omit_if_none", omit_if_none, protocol.RESET_KEYWORDS)
        if mask is not None:
            mask = np.asarray(mask)
            if mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
                raise ValueError(
                    f"mask must be a bool array of shape ({self.num_envs},), got {mask.dtype} {mask.shape}"
                )
        self._channel.drain()
        if self._restarts is not None:  # a reset boundary: workers a lost node displaced return to their place
            whole = [w for w, block in enumerate(self.blocks) if mask is None or mask[block.start : block.stop].all()]
            self._restarts.move_back(whole)
        targets = []
        for worker, block in enumerate(self.blocks):
            block_mask = None if mask is None else mask[block.start : block.stop].tolist()
            if block_mask is not None and not any(block_mask):
                continue
            block_seeds, block_options = seeds[block.start : block.stop], options[block.start : block.stop]
            self._channel.send(worker, protocol.Reset(block_seeds, block_options, block_mask, omit_if_none))
            targets.append(worker)
        infos: dict[int, dict] = {}
        for parts in self._channel.gather(targets, "reset").values():
            if parts is not None:
                infos.update(parts.get("infos", ()))
                self._store_pickled_obs(parts)
        return ResetResult(self._obs, infos)

    def _store_pickled_obs(self, parts: dict) -> None:
        for index, obs in parts.get("obs", {}).items():
            self._obs[index] = obs

    # -- worker-side inference --------------------------------------------------------------------

    def deploy(self, policy: Any, seed: int | None = None) -> WorkerActors:
        """Ship ``policy`` (a torch module, see :mod:`clusterenv_core.inference`) to every worker and
        return the :class:`~clusterenv_core.actors.WorkerActors` that feed it weights and collect
        rollouts with it (also kept as :attr:`actors`). Deploying again replaces the policy; a deploy
        that fails once sent to the workers leaves none (:attr:`actors` is ``None``, and the previous
        ``WorkerActors`` refuse to act), so no rollout mixes two policies.

        :param seed: worker ``w`` seeds its torch and numpy generators (action sampling) with ``seed + w``;
            with ``processes_per_worker=P``, local process ``p`` of worker ``w`` with ``seed + w * P + p``,
            so that where the blocks coincide W agents of P processes act as W * P flat workers
        :raises ValueError: a worker runs in the learner's process (the local backend's ``inline_worker``),
            or ``seed + w`` is no torch seed for some worker ``w`` (see :class:`~clusterenv_core.actors.WorkerActors`
            for the rest)
        """
        from clusterenv_core.actors import WorkerActors

        if self._transport.has_inline_worker:
            # A policy copy sets torch's threads and seed for its whole process: the learner's, there.
            raise ValueError(
                "worker-side inference needs every worker in a process of its own, and this pool steps "
                "a block in the learner's process (inline_worker=True): build the env without it"
            )

        return WorkerActors(self._channel, policy, seed, self._restarts, self.processes_per_worker)

    def preload(self, modules: Sequence[str]) -> None:
        """Have every worker import ``modules`` now, in the background; returns at once.

        For work whose first use would otherwise wait for imports on the workers: starting torch
        takes them a second or more, which a policy deployed later would pay. The next call on the
        pool waits for the imports to end. A module that fails to import is not reported here: the
        call that needs it fails with the reason.

        :param modules: names of importable modules (``"torch"``)
        """
        self._channel.check_usable()
        self._channel.check_idle()
        if self.batches is not None:
            raise ClusterEnvError("preload before async_batches: asynchronous steps do not wait for earlier replies")
        modules = tuple(modules)
        for name in modules:
            if not isinstance(name, str):
                raise TypeError(f"modules must be module names, got {name!r}")
        self._channel.drain()
        request = protocol.Preload(modules)
        for worker in range(self.num_workers):
            self._channel.send(worker, request)

    # -- asynchronous batches ---------------------------------------------------------------------

    def async_batches(self, batch_size: int) -> AsyncBatches:
        """EnvPool-style asynchronous stepping: :class:`~clusterenv_core.batches.AsyncBatches` whose
        ``recv`` returns the first ``batch_size`` envs with results and whose ``send`` steps exactly
        the envs it names (also kept as :attr:`batches`). Needs ``autoreset_mode="next_step"``. The
        pool's own calls work while no worker is stepping."""
        from clusterenv_core.batches import AsyncBatches

        self.batches = AsyncBatches(self._channel, batch_size, self.autoreset_mode, self.reset, self._restarts)
        return self.batches

    # -- per-env access ---------------------------------------------------------------------------

    def call(
        self,
        name: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        indices: Iterable[int] | None = None,
        require_callable: bool = False,
        through_wrappers: bool = True,
    ) -> list:
        """Call method ``name`` of each selected env with ``args`` and ``kwargs`` and return the
        results in the order of ``indices``; a non-callable attribute is returned as is unless
        ``require_callable``.

        The env's arguments are explicit parameters, so they may use any names (``indices`` too).

        :param through_wrappers: look ``name`` up with the env's ``get_wrapper_attr`` (gymnasium 1.x,
            SB3); ``False``: with ``getattr`` (gymnasium 0.29's ``SyncVectorEnv``)
        """
        args, kwargs = tuple(args), dict(kwargs or {})
        return self._per_worker(
            lambda slots, values: protocol.Call(name, args, kwargs, slots, require_callable, through_wrappers),
            indices,
            f"call {name}",
        )

    def get_attr(self, name: str, indices: Iterable[int] | None = None, through_wrappers: bool = True) -> list:
        """Attribute ``name`` of each selected env (``through_wrappers``: as for :meth:`call`)."""
        return self._per_worker(
            lambda slots, values: protocol.GetAttr(name, slots, through_wrappers), indices, f"get_attr {name}"
        )

    def set_attr(
        self, name: str, values: Sequence[Any], indices: Iterable[int] | None = None, through_wrappers: bool = False
    ) -> None:
        """Set attribute ``name`` of each selected env to the matching entry of ``values``."""
        self._per_worker(
            lambda slots, block_values: protocol.SetAttr(name, block_values, slots, through_wrappers),
            indices,
            f"set_attr {name}",
            values=values,
        )

    def env_is_wrapped(self, wrapper_class: type, indices: Iterable[int] | None = None) -> list[bool]:
        """Whether each selected env has a wrapper of ``wrapper_class`` in its wrapper stack."""
        return self._per_worker(
            lambda slots, values: protocol.IsWrapped(wrapper_class, slots), indices, "env_is_wrapped"
        )

    def _per_worker(
        self,
        make_request: Callable[[list[int], list], protocol.Request],
        indices: Iterable[int] | None,
        what: str,
        values: Sequence[Any] | None = None,
    ) -> list:
        """Ask each worker holding a selected env: ``make_request(slots, values)`` with the envs'
        slots in its block (and their entries of ``values``); the results in the order of ``indices``."""
        self._channel.check_usable()
        self._channel.check_idle()
        indices = check_indices(indices, self.num_envs)
        if values is not None and len(values) != len(indices):
            raise ValueError(f"{what}: {len(values)} values for {len(indices)} envs")
        self._channel.drain()
        # Positions in indices, by worker: an env listed twice is asked twice, in order, as
        # DummyVecEnv's loop over the indices asks it.
        by_worker: dict[int, list[int]] = {}
        for position, index in enumerate(indices):
            by_worker.setdefault(int(self.worker_of[index]), []).append(position)
        for worker, positions in by_worker.items():
            start = self.blocks[worker].start
            slots = [indices[position] - start for position in positions]
            worker_values = [None if values is None else values[position] for position in positions]
            self._channel.send(worker, make_request(slots, worker_values))
        results_by_worker = self._channel.gather(list(by_worker), what)
        results: list[Any] = [None] * len(indices)
        for worker, positions in by_worker.items():
            if results_by_worker[worker] is not None:
                for position, result in zip(positions, results_by_worker[worker]):
                    results[position] = result
        return results

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def worker_pids(self) -> list[int]:
        """The process id of each worker (an MPI rank's on its own host): to watch CPU or memory."""
        return self._transport.worker_pids()

    @property
    def worker_replacements(self) -> list[dict[str, Any]]:
        """Which envs were rebuilt where: each replacement of a lost worker so far (``worker``, its
        ``envs``, where the ``lost`` one and its ``replacement`` ran, ``seconds`` to start it), on
        backends that record it (Ray); empty on the others."""
        return self._transport.replacements()

    @property
    def workers_on_this_host(self) -> int:
        """How many workers share the learner's machine (the local backend's all; MPI ranks on other
        hosts do not count): the cores they take while they step or collect are not the learner's."""
        return self._transport.workers_on_this_host()

    def close(self) -> None:
        """Stop every worker and free every resource; idempotent, also runs at interpreter exit.

        If envs raised in their own ``close()``, the first one's :class:`EnvError` is raised once
        everything is released, as ``DummyVecEnv.close()`` lets it through.
        """
        if self._closed:
            return
        self._closed = True
        try:
            # The pool's views of the shared memory go first, or the transport could not unmap it: it
            # would stay, memory and descriptor, as long as the pool object (a model's env, say).
            if hasattr(self, "buffers"):
                self.buffers.release()
                self._obs = None
            if self.actors is not None:
                self.actors.release()
        finally:
            # Also after Ctrl-C above: the pool counts as closed from the start, so a second close()
            # would not end the workers.
            error = self._channel.close()
        if error is not None:
            raise error

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
