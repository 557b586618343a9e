"""The learner-side pool: batched reset and step over environments that live on workers.

:class:`EnvPool` is what the SB3 and CleanRL adapters are built on. It hands out views of its
preallocated buffers (callers copy what they keep) and raises the errors of
:mod:`clusterenv_core.errors` for anything that goes wrong remotely; it never waits without a
timeout. Worker-side inference (a policy copy on each worker, rollout segments) is
:class:`~clusterenv_core.actors.WorkerActors`, made by :meth:`EnvPool.deploy`; replacing lost
workers is :class:`~clusterenv_core.restarts.WorkerRestarts`.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core import protocol, registry
from clusterenv_core.actors import DeprecatedPoolMethods
from clusterenv_core.buffers import BatchSpec
from clusterenv_core.checks import check_bool, check_indices, check_int, check_names, check_seconds, per_env_values
from clusterenv_core.errors import (
    ENV_ERROR_CLASSES,
    CloseTimeoutWarning,
    ClusterEnvError,
    EnvError,
    WorkerLostError,
    WorkerTimeoutError,
    user_stacklevel,
)
from clusterenv_core.interpreter import LearnerInterpreter
from clusterenv_core.learner_threads import warn_if_torch_threads_contend
from clusterenv_core.protocol import AUTORESET_MODES, ERROR, OK, PROGRESS
from clusterenv_core.results import ResetResult, StepResult
from clusterenv_core.spaces import common_spaces, delivered_dtype
from clusterenv_core.transports import Transport, make_transport
from clusterenv_core.transports.base import RequestNotSent, ctrl_c_held

if TYPE_CHECKING:
    from clusterenv_core.actors import WorkerActors
    from clusterenv_core.batches import AsyncBatches
    from clusterenv_core.restarts import WorkerRestarts

DEFAULT_TIMEOUT = 60.0
# Starting a worker (interpreter, imports, env construction) may take longer than a step may.
START_TIMEOUT = 60.0
_CLOSE_TIMEOUT = 5.0

#: The keywords of :class:`EnvPool` that the adapters take as theirs too (:meth:`EnvPool.from_options`).
POOL_OPTIONS = ("backend", "num_workers", "timeout", "restart_failed_envs", "restart_failed_workers", "max_restarts")


def _blocks(num_envs: int, num_workers: int) -> list[range]:
    """Contiguous blocks of env indices, the first ``num_envs % num_workers`` one env larger."""
    size, extra = divmod(num_envs, num_workers)
    blocks, start = [], 0
    for worker in range(num_workers):
        stop = start + size + (worker < extra)
        blocks.append(range(start, stop))
        start = stop
    return blocks


class NotCopyable:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling with a ``TypeError`` that says why: what
    holds a pool holds worker processes, which a copy could neither take along nor safely share
    (closing one would stop the other's workers)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"this {name} cannot be copied or pickled: its envs live in worker processes, which a copy could "
            f"neither take along nor safely share; build another {name} from the env factories instead"
        )


class EnvPool(NotCopyable, DeprecatedPoolMethods):
    """Environments on worker processes, stepped in parallel in contiguous blocks.

    :param env_fns: picklable callables that each build one environment (closures and classes
        from ``__main__`` work: they are serialized with cloudpickle); env ids registered in this
        process reach the workers too (see :mod:`clusterenv_core.registry`)
    :param backend: ``"local"`` (processes on this machine) or ``"mpi"``
    :param num_workers: number of workers (default: the worker ranks of an MPI launch, else
        ``min(len(env_fns), os.cpu_count())``)
    :param timeout: seconds any single wait for a worker may last before
        :class:`~clusterenv_core.errors.WorkerTimeoutError`; a worker that dies is reported sooner
    :param autoreset_mode: ``"same_step"``, ``"next_step"`` or ``"disabled"``
        (see :mod:`clusterenv_core.worker`)
    :param restart_failed_envs: replace an env that raises in ``step`` by a new one from its factory
        instead of raising :class:`~clusterenv_core.errors.EnvError`
    :param restart_failed_workers: replace a worker that dies or times out during a step or a
        rollout segment by a new one (local backend) instead of raising
        :class:`~clusterenv_core.errors.WorkerLostError`
    :param max_restarts: how many times one env, or one worker, may be replaced; the next failure
        raises its error
    :param backend_options: keyword arguments of the backend's transport
    :param observation_spaces_fit: ``fit(space, first)``, whether an env's observation space may
        stand with the first env's (default: equality). Observations live in buffers laid out by the
        first env's space, so a looser test must still require its dtype and shape: gymnasium's
        ``is_space_dtype_shape_equiv``, for ``SyncVectorEnv``'s ``observation_mode="different"``.
        :attr:`observation_spaces` holds each env's.

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
        backend_options: dict[str, Any] | None = None,
        observation_spaces_fit: Callable[[Any, Any], bool] | None = None,
    ) -> None:
        _refuse_a_pool_built_by_a_worker_import()
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
        #: how many envs and workers were replaced so far
        self.restarts = {"envs": 0, "workers": 0}
        #: how often each env was replaced so far
        self.env_restarts = [0] * num_envs
        #: the global env indices of each worker's block
        self.blocks = _blocks(num_envs, num_workers)
        #: the worker of each env index
        self.worker_of = np.repeat(np.arange(num_workers), [len(block) for block in self.blocks])
        #: the policy copies on the workers, once :meth:`deploy` made them
        self.actors: WorkerActors | None = None
        #: asynchronous stepping, once :meth:`async_batches` started it
        self.batches: AsyncBatches | None = None
        # Serialize before anything starts, so an unpicklable factory or env spec fails here, named.
        pickled_blocks, env_factories = _pickle_factories(env_fns, self.blocks)
        worker_modules = protocol.modules_named(pickled_blocks)
        shipped_registry = registry.snapshot()
        learner_interpreter = LearnerInterpreter.capture(worker_modules)
        # Kept while restarts may need them (a replaced worker gets its block's again), else dropped
        # once sent: they hold a pickle of every distinct factory.
        self._init_requests: list[protocol.Init] | None = [
            protocol.Init(
                env_fns=pickled_blocks[worker],
                env_factories=env_factories[worker],
                first_index=block.start,
                autoreset_mode=autoreset_mode,
                max_env_restarts=max_restarts if self.restart_failed_envs else 0,
                restarted=False,
                env_restarts=[0] * len(block),
                interpreter=learner_interpreter,
                registry=shipped_registry,
            )
            for worker, block in enumerate(self.blocks)
        ]

        self._transport: Transport = transport
        # Per worker whose reply is still unread: the type of its request (None: a step).
        self._awaiting: dict[int, type | None] = {}
        # Per worker whose unread reply is followed by arrays (REPLY_ARRAYS): the arrays they go into.
        self._reply_arrays: dict[int, list] = {}
        self._failure: ClusterEnvError | None = None
        self._stepping = False
        self._wait_interrupted = False  # step_wait was interrupted with replies unread
        # Per worker, a reply read and not yet reported (request type, status, result): by _gather or
        # _drain until all the replies they wait for are in (_report_replies). Ctrl-C that cuts a wait
        # short leaves them here, for the wait that resumes it or the next call's drain to report.
        self._read_replies: dict[int, tuple[type | None, str, Any]] = {}
        self._batched_action_space = None  # built on first use, for spaces without buffers
        self._restarter: WorkerRestarts | None = None  # with restart_failed_workers, once started
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _shutdown, transport, self._awaiting, self._reply_arrays, self.timeout, os.getpid()
        )
        transport.exit_hook = self._finalizer
        transport.blocks = tuple(self.blocks)
        transport.worker_modules = tuple(worker_modules)
        try:
            transport.start(num_workers, timeout)
            start_timeout = max(timeout, START_TIMEOUT)
            for worker in range(num_workers):
                self._send(worker, self._init_requests[worker])
            descriptions = self._gather(range(num_workers), "creating the envs", timeout=start_timeout)
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
            self.buffers = transport.share_buffers(self.batch_spec, self.blocks)
            self._attach(range(num_workers), start_timeout)
            self._obs_layout = self.buffers.obs_layout
            self._act_layout = self.buffers.act_layout
            # Envs get their actions in the dtypes of the last batch (see spaces.delivered_dtype): the
            # dtypes each worker reads actions in (None while unknown: Ctrl-C while it is told), and
            # those of the last batch of a synchronous step they were set for.
            self._space_action_dtypes = [field.dtype for field in self._act_layout.fields]
            self._worker_action_dtypes: list[list | None] = [self._space_action_dtypes] * num_workers
            self._batch_dtypes: list | None = self._space_action_dtypes
            # Batched observations: views of the buffers, or per-env values for spaces without buffers.
            self._obs: Any = (
                self._obs_layout.batch(self.buffers.obs) if self._obs_layout.buffered else [None] * num_envs
            )
            if self.restart_failed_workers:
                from clusterenv_core.restarts import WorkerRestarts

                self._restarter = WorkerRestarts(self)
            else:
                self._init_requests = None
        except BaseException:
            self.close()
            raise
        warn_if_torch_threads_contend(self.workers_on_this_host)

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

    def _attach(self, workers: Iterable[int], timeout: float) -> None:
        for worker in workers:
            self._send(worker, protocol.Attach(self.batch_spec, self.blocks[worker]))
        self._gather(workers, "attaching buffers", timeout=timeout)

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
        if (
            self._stepping
            or self._awaiting
            or self._read_replies
            or self.actors is not None
            or self.batches is not None
        ):
            # Something may be pending, interrupted or left to report: the careful checks (skipped on
            # the plain path).
            if self._stepping and not self._wait_interrupted:
                raise ClusterEnvError("step_async called while a step is pending: call step_wait first")
            self._check_not_stepping()
            self._drain()
        if self._act_layout.buffered:
            layout = self._act_layout
            leaves = layout.stack(actions, self.num_envs) if per_env else layout.check_batch(actions, self.num_envs)
            batch_dtypes = [leaf.dtype for leaf in leaves]
            if batch_dtypes != self._batch_dtypes:
                self._batch_dtypes = None
                dtypes = [delivered_dtype(f.dtype, b) for f, b in zip(layout.fields, batch_dtypes)]
                self._set_action_dtypes(dtypes, step=True)
                self._batch_dtypes = batch_dtypes
            for buffer, leaf in zip(self.buffers.actions, leaves):
                buffer[...] = leaf
        else:
            # Spaces without buffers (Text, Graph, ... or a Dict/Tuple holding one): one action per env, pickled.
            actions = list(actions) if per_env else self._split_batch(actions)
            if len(actions) != self.num_envs:
                raise ValueError(f"expected {self.num_envs} actions (one per env), got {len(actions)}")
            for worker, block in enumerate(self.blocks):
                self._send(worker, protocol.Actions(actions[block.start : block.stop]))
            self._gather(range(self.num_workers), "sending actions")
        if self._restarter is not None:
            self._restarter.remember_step_start()
        transport = self._transport
        lost = self._restarter.lost if self._restarter is not None else {}
        for worker in range(self.num_workers):
            if worker in lost:  # lost while told the dtypes: step_wait replaces it
                continue
            self._awaiting[worker] = None  # before the send, as in _send
            try:
                transport.send_step(worker)
            except (WorkerLostError, WorkerTimeoutError) as error:
                del self._awaiting[worker]
                self._lost_in_step(worker, error)
        self._stepping = True

    def _set_action_dtypes(
        self, dtypes: list[np.dtype], workers: Iterable[int] | None = None, step: bool = False
    ) -> None:
        """Have ``workers`` (all by default) give envs their actions in ``dtypes``, one per action
        field; only the workers that read them in others are told.

        :param step: they are told for a step about to start: a worker lost meanwhile is, as in the
            step, left to be replaced (:meth:`_lost_in_step`), and its replacement is told ``dtypes``
        """
        known = self._worker_action_dtypes
        told = [worker for worker in (range(self.num_workers) if workers is None else workers) if known[worker] != dtypes]
        if not told:
            return
        if workers is not None:
            self._batch_dtypes = None  # the synchronous step's workers may read in others now
        request = protocol.ActionDtypes(tuple(dtypes))
        for worker in told:
            known[worker] = None
            self._send(worker, request, step=step)
        answering = [worker for worker in told if worker in self._awaiting]  # not those lost at the send
        self._gather(answering, "setting the dtypes of actions", step=step)
        for worker in told:  # a lost one's replacement is told them as it takes over (WorkerRestarts._take_over)
            known[worker] = dtypes

    def _split_batch(self, actions: Any) -> list:
        """A batch of a space without buffers, one action per env, as ``SyncVectorEnv`` splits it."""
        from gymnasium.vector.utils import batch_space, iterate

        if self._batched_action_space is None:
            self._batched_action_space = batch_space(self.action_space, self.num_envs)
        return list(iterate(self._batched_action_space, actions))

    def step_wait(self) -> StepResult:
        """Wait for the step started by :meth:`step_async` and return its results."""
        self._check_usable()
        if not self._stepping:
            raise ClusterEnvError("step_wait called without step_async")
        restarter = self._restarter
        try:
            # The last worker is the last to get its step and, with no spin, the last to finish: waiting
            # for it first finds the others' replies in, one wake-up instead of one per worker.
            stepping = sorted(self._awaiting, reverse=True)
            if self._read_replies:  # read before Ctrl-C cut an earlier wait for this step short
                stepping = sorted({*self._awaiting, *self._read_replies}, reverse=True)
            if restarter is not None:  # after an interrupted replacement: its requests are not steps
                stepping = [worker for worker in stepping if worker not in restarter.lost]
            results = self._gather(stepping, "step", step=True)
            if restarter is not None:
                results.update(restarter.replace_lost())
        finally:
            # Interrupted (Ctrl-C) with replies unread, the step stays pending: step_wait resumes it,
            # and any other call first finishes it (see _check_not_stepping).
            self._stepping = bool(self._awaiting or self._read_replies or (restarter is not None and restarter.lost))
            self._wait_interrupted = self._stepping
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
        """
        self._check_usable()
        self._check_not_stepping()
        seeds = per_env_values(seeds, self.num_envs, "seeds")
        options = per_env_values(options, self.num_envs, "options")
        omit_if_none = check_names("omit_if_none", omit_if_none, protocol.RESET_KEYWORDS)
        if mask is not None:
            mask = np.asarray(mask)
            if mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
                raise ValueError(f"mask must be a bool array of shape ({self.num_envs},), got {mask.dtype} {mask.shape}")
        self._drain()
        targets = []
        for worker, block in enumerate(self.blocks):
            block_mask = None if mask is None else mask[block.start : block.stop].tolist()
            if block_mask is not None and not any(block_mask):
                continue
            block_seeds, block_options = seeds[block.start : block.stop], options[block.start : block.stop]
            self._send(worker, protocol.Reset(block_seeds, block_options, block_mask, omit_if_none))
            targets.append(worker)
        infos: dict[int, dict] = {}
        for parts in self._gather(targets, "reset").values():
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

        :param seed: worker ``w`` seeds its torch and numpy generators (action sampling) with ``seed + w``
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

        self.actors = WorkerActors(self, policy, seed)
        return self.actors

    def preload(self, modules: Sequence[str]) -> None:
        """Have every worker import ``modules`` now, in the background; returns at once.

        For work whose first use would otherwise wait for imports on the workers: starting torch
        takes them a second or more, which a policy deployed later would pay. The next call on the
        pool waits for the imports to end. A module that fails to import is not reported here: the
        call that needs it fails with the reason.

        :param modules: names of importable modules (``"torch"``)
        """
        self._check_usable()
        self._check_not_stepping()
        if self.batches is not None:
            raise ClusterEnvError("preload before async_batches: asynchronous steps do not wait for earlier replies")
        modules = tuple(modules)
        for name in modules:
            if not isinstance(name, str):
                raise TypeError(f"modules must be module names, got {name!r}")
        self._drain()
        request = protocol.Preload(modules)
        for worker in range(self.num_workers):
            self._send(worker, request)

    # -- asynchronous batches ---------------------------------------------------------------------

    def async_batches(self, batch_size: int) -> AsyncBatches:
        """EnvPool-style asynchronous stepping: :class:`~clusterenv_core.batches.AsyncBatches` whose
        ``recv`` returns the first ``batch_size`` envs with results and whose ``send`` steps exactly
        the envs it names (also kept as :attr:`batches`). Needs ``autoreset_mode="next_step"``. The
        pool's own calls work while no worker is stepping."""
        from clusterenv_core.batches import AsyncBatches

        return AsyncBatches(self, batch_size)

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
        return self._per_worker(lambda slots, values: protocol.IsWrapped(wrapper_class, slots), indices, "env_is_wrapped")

    def _per_worker(
        self,
        make_request: Callable[[list[int], list], protocol.Request],
        indices: Iterable[int] | None,
        what: str,
        values: Sequence[Any] | None = None,
    ) -> list:
        """Ask each worker holding a selected env: ``make_request(slots, values)`` with the envs'
        slots in its block (and their entries of ``values``); the results in the order of ``indices``."""
        self._check_usable()
        self._check_not_stepping()
        indices = check_indices(indices, self.num_envs)
        if values is not None and len(values) != len(indices):
            raise ValueError(f"{what}: {len(values)} values for {len(indices)} envs")
        self._drain()
        # Positions in indices, by worker: an env listed twice is asked twice, in order, as
        # DummyVecEnv's loop over the indices asks it.
        by_worker: dict[int, list[int]] = {}
        for position, index in enumerate(indices):
            by_worker.setdefault(int(self.worker_of[index]), []).append(position)
        for worker, positions in by_worker.items():
            start = self.blocks[worker].start
            slots = [indices[position] - start for position in positions]
            worker_values = [None if values is None else values[position] for position in positions]
            self._send(worker, make_request(slots, worker_values))
        results_by_worker = self._gather(list(by_worker), what)
        results: list[Any] = [None] * len(indices)
        for worker, positions in by_worker.items():
            if results_by_worker[worker] is not None:
                for position, result in zip(positions, results_by_worker[worker]):
                    results[position] = result
        return results

    # -- messaging (also used by WorkerActors and WorkerRestarts) ----------------------------------

    def _send(
        self, worker: int, request: protocol.Request, reply_arrays: list | None = None, step: bool = False
    ) -> None:
        """Send ``request`` to ``worker``; its reply is read by :meth:`_gather` or :meth:`_drain`.

        :param reply_arrays: for a request whose reply is followed by arrays (``REPLY_ARRAYS``), the
            arrays (views of a region) they are received into, whoever reads the reply
        :param step: the request prepares a step: a lost worker is handled as in the step
            (:meth:`_lost_in_step`), and nothing is awaited from it
        """
        # Awaited before it is sent: Ctrl-C while it is written may raise once it is out (sendall
        # runs signal handlers after writing), and its reply must still be read as this request's.
        self._awaiting[worker] = type(request)
        if reply_arrays is not None:
            self._reply_arrays[worker] = reply_arrays
        try:
            self._transport.send(worker, request)
        except ClusterEnvError as error:
            self._not_awaiting(worker)
            if step and isinstance(error, (WorkerLostError, WorkerTimeoutError)):
                self._lost_in_step(worker, error)
                return
            raise self._fail(error)
        except RequestNotSent:
            self._not_awaiting(worker)
            raise
        except KeyboardInterrupt:
            raise
        except BaseException:  # it could not be pickled: nothing was sent
            self._not_awaiting(worker)
            raise

    def _not_awaiting(self, worker: int) -> None:
        self._awaiting.pop(worker, None)
        self._reply_arrays.pop(worker, None)

    def _gather(
        self,
        workers: Iterable[int],
        what: str,
        step: bool = False,
        timeout: float | None = None,
        on_reply: Callable[[int, Any], None] | None = None,
    ) -> dict[int, Any]:
        """Every listed worker's reply result, once all have answered (see :meth:`_report_replies`:
        the envs the replies say were replaced are counted, and the remote error of the
        lowest-numbered worker, the first env, is raised). A reply read before Ctrl-C cut an earlier
        wait short is kept (:attr:`_read_replies`) and not read again.

        Rows and arrays that follow a reply (see :mod:`clusterenv_core.protocol`) land in the
        buffers and in the arrays given to :meth:`_send` first. ``on_reply(worker, result)`` runs
        after each successful reply, also when another worker's error is raised (who took a deployed
        policy).
        """
        transport = self._transport
        timeout = self.timeout if timeout is None else timeout
        workers = list(workers)
        awaiting, reply_arrays, read = self._awaiting, self._reply_arrays, self._read_replies
        for worker in workers:
            if worker in read:
                continue
            request_type = awaiting.get(worker)
            try:
                _read_reply(
                    transport,
                    worker,
                    request_type,
                    _reply_timeout(request_type, timeout),
                    reply_arrays.get(worker),
                    self._keep_reply,
                )
            except (WorkerLostError, WorkerTimeoutError) as error:
                if not step:
                    raise self._fail(error)
                awaiting.pop(worker, None)
                self._lost_in_step(worker, error)
        return self._report_replies(workers, what, on_reply)

    def _keep_reply(self, worker: int, request_type: type | None, status: str, result: Any) -> None:
        """Keep a reply just read in :attr:`_read_replies`, for :meth:`_report_replies`; it no longer
        counts as awaited. :func:`_read_reply` calls it as soon as the reply is in."""
        # Kept before it counts as read (CPython runs signal handlers at calls and loop jumps):
        # Ctrl-C at the calls below leaves the reply kept, not lost.
        self._read_replies[worker] = (request_type, status, result)
        self._awaiting.pop(worker, None)
        self._reply_arrays.pop(worker, None)

    def _lost_in_step(self, worker: int, error: ClusterEnvError) -> None:
        """A worker lost during a step: replaced when the step completes, if it may be, else fatal."""
        if self._restarter is None or not self._restarter.may_replace(worker):
            raise self._fail(error)
        self._restarter.lost[worker] = error

    def _drain(self, keep_steps: bool = False) -> None:
        """Read replies left unread by an interrupted call, so requests and replies stay paired
        (``keep_steps``: not those of steps, which asynchronous batches still wait for). Their
        results are dropped, but a step or segment whose request went out before Ctrl-C did run on
        its worker, so they are reported as :meth:`_gather` reports them once all are read (see
        :meth:`_report_replies`), also after Ctrl-C cut a drain short, with the replies an
        interrupted call had read."""
        read = self._read_replies
        for worker in sorted(self._awaiting):
            request_type = self._awaiting[worker]
            if (keep_steps and request_type is None) or worker in read:
                continue
            timeout = _reply_timeout(request_type, self.timeout)
            try:
                _read_reply(
                    self._transport, worker, request_type, timeout, self._reply_arrays.get(worker), self._keep_reply
                )
            except (WorkerLostError, WorkerTimeoutError) as error:
                raise self._fail(error)
        if not keep_steps:
            self._stepping = False
        if read:
            # Not the replies of steps that asynchronous batches still wait for (keep_steps).
            drained = [worker for worker, reply in read.items() if not (keep_steps and reply[0] is None)]
            self._report_replies(drained, None)

    def _report_replies(
        self, workers: list[int], what: str | None, on_reply: Callable[[int, Any], None] | None = None
    ) -> dict[int, Any]:
        """Report the replies of ``workers`` kept in :attr:`_read_replies`: count the envs they say
        were replaced, return each successful one's result, and raise the remote error of the
        lowest-numbered worker (its worker lives on; the env may be left broken).

        Each reply is reported once, also when Ctrl-C cuts this short: nothing changes until the
        lines that take the replies out and count the envs, which make no call and run no loop, so
        Ctrl-C cannot land among them.

        :param what: how a failed step is named; ``None`` for replies that :meth:`_drain` read, of
            calls that Ctrl-C cut short: their results are dropped, their errors say so, and a
            preload's error is left to the call that needs the module
        """
        read = self._read_replies
        results: dict[int, Any] = {}
        first_error: EnvError | None = None
        replaced: list[int] = []
        reported: set[int] = set()
        for worker in workers:
            if worker not in read:  # lost in a step: replaced once the step's replies are in
                continue
            reported.add(worker)
            request_type, status, result = read[worker]
            replaced.extend(_replaced_envs(request_type, status, result))
            if status != ERROR:
                results[worker] = result
            elif first_error is None or worker < first_error.worker_index:
                if what is not None:
                    first_error = _remote_error(worker, result, what)
                elif request_type is not protocol.Preload:
                    named = "rollout" if request_type is protocol.Rollout else "step"
                    first_error = _remote_error(worker, result, named, sent_before_ctrl_c=True)
        remaining = {}
        if len(read) > len(reported):
            remaining = {worker: reply for worker, reply in read.items() if worker not in reported}
        if replaced:  # counted in all and per env: an env's budget of max_restarts follows it to new workers
            env_restarts = list(self.env_restarts)
            for index in replaced:
                env_restarts[index] += 1
            replaced_total = self.restarts["envs"] + len(replaced)
        self._read_replies = remaining
        if replaced:
            self.restarts["envs"] = replaced_total
            self.env_restarts[:] = env_restarts
        if on_reply is not None:
            for worker in results:
                on_reply(worker, results[worker])
        if first_error is not None:
            raise first_error
        return results

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
        """Raise if a step, asynchronous steps or a rollout are pending. A step or rollout whose wait
        was interrupted (Ctrl-C) is finished instead and its results dropped: after an interrupt, the
        envs stand stepped and usable, as DummyVecEnv's and SyncVectorEnv's do."""
        if self._stepping and self._wait_interrupted:
            self.step_wait()
        if self.actors is not None and self.actors.wait_interrupted:
            self.actors.rollout_wait()
        if self._stepping:
            raise ClusterEnvError("a step is pending: call step_wait first")
        if self.batches is not None and self.batches.stepping:
            raise ClusterEnvError("asynchronous steps are pending: recv their results first")
        if self.actors is not None and self.actors.pending:
            raise ClusterEnvError("a rollout is pending: call rollout_wait first")

    # -- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def worker_pids(self) -> list[int]:
        """The process id of each worker (an MPI rank's on its own host): to watch CPU or memory."""
        return self._transport.worker_pids()

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
        self._stepping = False
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
            error = self._finalizer()
        if error is not None:
            raise error

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _refuse_a_pool_built_by_a_worker_import() -> None:
    """Raise ``RuntimeError`` if a worker of this process is importing a module that builds a pool.

    Workers import the modules of what the learner sends them: of the env factories, the entry
    points of registered ids, a deployed policy. A module that builds a pool when imported, not
    under ``if __name__ == "__main__":``, would have every worker start workers of its own, which
    import it in turn: processes without end. multiprocessing refuses the same mistake while its
    children start; this refuses it before anything starts, and the worker reports the error as it
    reports any other of unpickling a factory or creating an env.

    Refused is a pool constructed while the import system runs a module's body below a worker's
    serving loop, both recognized by their frames on the stack (a few dozen to walk). A pool that
    an env builds when it is created or stepped (an env that distributes sub-envs of its own) is no
    import's and is allowed, as is one a module builds as the learner imports it.
    """
    worker_module = sys.modules.get("clusterenv_core.worker.serving")
    if worker_module is None:
        return  # no worker in this process
    serving = (worker_module.Worker.serve.__code__, worker_module.Worker.handle.__code__)
    importing = None  # the innermost module whose import is running
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in serving:
        caller = frame.f_back
        # The import system runs a module's body from a frame of its own (importlib._bootstrap).
        if (
            importing is None
            and frame.f_code.co_name == "<module>"
            and caller is not None
            and caller.f_globals.get("__name__", "").startswith("importlib._bootstrap")
        ):
            importing = frame.f_globals.get("__name__")
        frame = caller
    if frame is None or importing is None:
        return
    raise RuntimeError(
        f"a pool is being constructed while a worker imports the module {importing!r}: that module builds "
        "a pool when it is imported, so every worker that imports it (to unpickle an env factory defined "
        "there, say) would start workers of its own, which import it again, without end. Construct the "
        f'pool in {importing!r} under `if __name__ == "__main__":` (or in a function that the script '
        "calls), so that importing the module only defines what the workers need"
    )


def _pickle_factories(env_fns: list, blocks: list[range]) -> tuple[list[bytes], list[list[int]]]:
    """Per block, the factory fields of its :class:`~clusterenv_core.protocol.Init`: the block's
    distinct factory objects pickled together, and the factory of each of its envs.

    Equal pickles are held once: ``[make] * n``, where ``make`` closes over a large array (a terrain,
    a dataset), costs one pickle however many blocks and envs.

    :raises ValueError: a factory cannot be pickled (its index is named)
    """
    held: dict[bytes, bytes] = {}  # one bytes object per distinct pickle
    pickled_blocks, env_factories = [], []
    for block in blocks:
        factories: dict[int, Any] = {}  # the block's distinct factory objects, by id, in order of first use
        for index in block:
            factories.setdefault(id(env_fns[index]), env_fns[index])
        try:
            data = protocol.dumps_code(list(factories.values()))
        except Exception:
            _raise_unpicklable(env_fns, block)
            raise
        pickled_blocks.append(held.setdefault(data, data))
        order = {key: position for position, key in enumerate(factories)}
        env_factories.append([order[id(env_fns[index])] for index in block])
    return pickled_blocks, env_factories


def _raise_unpicklable(env_fns: list, block: range) -> None:
    """Raise the ``ValueError`` of the first factory of ``block`` that cannot be pickled alone."""
    for index in block:
        try:
            protocol.dumps_code(env_fns[index])
        except Exception as error:
            raise ValueError(
                f"env_fns[{index}] cannot be pickled ({type(error).__name__}: {error}); "
                "env factories must be picklable to reach the workers"
            ) from error


def _reply_timeout(request_type: type | None, timeout: float) -> float:
    """How long to wait for the reply to a request of ``request_type``: at least as long as for a
    starting worker where answering may mean importing large modules."""
    return max(timeout, START_TIMEOUT) if request_type is not None and request_type.IMPORTS else timeout


def _replaced_envs(request_type: type | None, status: str, result: Any) -> list[int]:
    """The envs that a worker's reply to a request of ``request_type`` (``None``: a step) says were
    replaced (``restart_failed_envs``): an error reply's, a step's, a rollout segment's."""
    if status == ERROR:
        return list(result.env_restarts)
    if result is None:
        return []
    if request_type is None:
        return list(result.get("env_restarts", ()))
    if request_type is protocol.Rollout:
        return [index for parts in result.get("steps", {}).values() for index in parts.get("env_restarts", ())]
    return []


def _remote_error(worker: int, details: protocol.ErrorDetails, what: str, sent_before_ctrl_c: bool = False) -> EnvError:
    """The learner's exception for a worker's error reply (``what`` names a failed step).

    :param sent_before_ctrl_c: the request went out before Ctrl-C cut its call short, and a later
        call read the reply (:meth:`EnvPool._drain`): the error says so
    """
    error_class = ENV_ERROR_CLASSES.get(details.exc_type, EnvError)
    operation = details.operation if details.operation != "step" else what
    if sent_before_ctrl_c:
        operation += " sent before Ctrl-C"
    return error_class(details.env_index, worker, operation, details.exc_type, details.message, details.traceback)


def _read_reply(
    transport: Transport,
    worker: int,
    request_type: type | None,
    timeout: float,
    arrays: list | None = None,
    keep: Callable[[int, type | None, str, Any], None] | None = None,
) -> None:
    """Read the worker's reply to a request of ``request_type`` (``None``: a step) past its progress
    reports (each restarts the ``timeout``), with the result rows and arrays that follow it.

    Once a reply followed by rows or arrays is read, they are received and the reply kept with
    Ctrl-C held (:func:`~clusterenv_core.transports.base.ctrl_c_held`), which is delivered right
    after: Ctrl-C in their receive (MPI waits for their messages, milliseconds for a large segment)
    would lose the reply and leave them unreceived, for a later receive to take. Other replies,
    steps' among them, are kept at once, with nothing held.

    :param arrays: where the arrays that follow the reply of a ``REPLY_ARRAYS`` request go (the
        arrays given to ``EnvPool._send``); left unreceived, they would stay queued in the
        transport, and a large one keeps the worker from reading its next request (MPI)
    :param keep: ``keep(worker, request_type, status, result)`` stores the reply as read
        (``EnvPool._keep_reply``), before Ctrl-C can take effect where it is held
    """
    recv = transport.recv_step if request_type is None else transport.recv
    status, result = recv(worker, timeout)
    while status == PROGRESS:
        status, result = recv(worker, timeout)
    if status == OK and request_type is not None and (request_type.REPLY_ROWS or request_type.REPLY_ARRAYS):
        with ctrl_c_held():
            if request_type.REPLY_ROWS:
                transport.recv_rows(worker, timeout)
            if request_type.REPLY_ARRAYS:
                transport.recv_arrays(worker, arrays, timeout)
            if keep is not None:
                keep(worker, request_type, status, result)
    elif keep is not None:
        keep(worker, request_type, status, result)


def _warn_close_timeout(what: str) -> None:
    warnings.warn(f"{what}; its worker was ended", CloseTimeoutWarning, stacklevel=user_stacklevel())


def _shutdown(
    transport: Transport, awaiting: dict[int, type | None], reply_arrays: dict[int, list], timeout: float, owner: int
) -> EnvError | None:
    """Ask every worker to close its envs and exit, then make sure they have; returns the error of
    the first env whose ``close()`` raised.

    :param transport: the pool's transport
    :param awaiting: the pool's unread replies: the type of each worker's request (``None``: a step)
    :param reply_arrays: where the arrays that follow some of those replies go (a rollout's segment)
    :param timeout: the pool's timeout
    :param owner: the process id of the pool's process

    Workers collecting a rollout segment are asked to close first, and end the segment at their next
    step. Workers still busy with a request (a stuck step, say) have ``_CLOSE_TIMEOUT`` seconds to
    answer it, one deadline for all however many are stuck; the workers asked to close then have
    ``timeout`` seconds (at least as long), again one deadline for all, as closing an env may take
    a while (a video recorder finishing its file). Those that do not are killed. Kept apart from the
    pool so that it can run as the pool's finalizer at interpreter exit (which drops what it returns).
    In a process forked from the ``owner`` (a data loader's worker, say) it does nothing: the
    workers are the owner's.
    """
    if os.getpid() != owner:
        return None
    deadline = time.monotonic() + _CLOSE_TIMEOUT

    def remaining(floor: float = 0.01) -> float:  # the floor still reads replies already there
        return max(deadline - time.monotonic(), floor)

    asked: dict[int, float] = {}  # the workers asked to close, and when
    closed: set[int] = set()
    first_error = None
    interrupted = False
    try:
        # Workers collecting a segment are asked first: they end it at their next step instead of
        # running out the deadline (and being killed, which leaves an MPI process unable to spawn).
        for worker, request_type in list(awaiting.items()):
            if request_type is not None and request_type.ENDED_BY_NEXT_REQUEST and worker not in transport.failed:
                try:
                    transport.send(worker, protocol.Close())
                    asked[worker] = time.monotonic()
                except ClusterEnvError:
                    awaiting.pop(worker, None)
        for worker in range(transport.num_workers):
            if worker in transport.failed:
                continue
            try:
                # A pending reply first, so the close reply is the next one; Ctrl-C in the receive
                # of its rows or arrays waits for them (until the deadline), as in the pool's calls.
                if worker in awaiting:
                    request_type = awaiting.pop(worker)
                    try:
                        _read_reply(transport, worker, request_type, remaining(), reply_arrays.pop(worker, None))
                    except WorkerTimeoutError:
                        doing = "a step" if request_type is None else f"a {request_type.__name__} request"
                        _warn_close_timeout(f"worker {worker} was still in {doing} {_CLOSE_TIMEOUT:g} s after close() began")
                        raise
                if worker not in asked:
                    transport.send(worker, protocol.Close())
                    asked[worker] = time.monotonic()
            except ClusterEnvError:
                awaiting.pop(worker, None)
                asked.pop(worker, None)  # its pending reply never came: no close reply to wait for
        deadline = time.monotonic() + max(timeout, _CLOSE_TIMEOUT)
        for worker, asked_at in asked.items():
            closing = None  # the env whose close() the worker started last
            # A receive's timeout counts from its last contact: to the deadline from there.
            last_contact = asked_at
            try:
                status, result = transport.recv(worker, max(deadline - last_contact, 0.01))
                while status == PROGRESS:
                    closing, last_contact = result, time.monotonic()
                    status, result = transport.recv(worker, max(deadline - last_contact, 0.01))
            except WorkerTimeoutError:
                what = f"env {closing}" if closing is not None else "its envs"
                _warn_close_timeout(f"{what} on worker {worker} did not finish close() within {time.monotonic() - asked_at:.3g} s")
                continue
            except ClusterEnvError:
                continue
            closed.add(worker)
            if status == ERROR and first_error is None:
                first_error = _remote_error(worker, result, "close")
    except KeyboardInterrupt:
        interrupted = True  # Ctrl-C at a close that takes long: the workers are killed now
        raise
    finally:
        awaiting.clear()
        reply_arrays.clear()  # views of regions that the transport unmaps
        transport.close(0.0 if interrupted else remaining(floor=1.0), closed)  # a second for the closed ones to exit
    return first_error
