"""Asynchronous batches: EnvPool's ``send``/``recv`` over a pool, so fast workers never wait for slow ones.

A synchronous step waits for the slowest block. Here each worker steps its block as soon as every
env of the block has its action, and replies on its own; :meth:`AsyncBatches.recv` returns the
first ``batch_size`` envs whose results are in (oldest first, then by env id), and
:meth:`AsyncBatches.send` gives actions to exactly the envs it names, which must be envs ``recv``
returned. Episodes reset as in gymnasium's ``next_step`` mode (EnvPool's behaviour): the action
that follows a finished episode is ignored and the env returns its reset observation with reward
0. Workers and messages are those of synchronous steps: the action rows go in one message per
worker, the result rows come back in the pool's buffers; :meth:`recv` copies the rows it returns
into buffers made once.

Use it through :meth:`EnvPool.async_batches <clusterenv_core.pool.EnvPool.async_batches>`, or
``clusterenv_cleanrl.ClusterEnvPool`` for EnvPool's own interface.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.channel import PoolState, WorkerChannel
from clusterenv_core.checks import check_int, check_names, is_int
from clusterenv_core.errors import ClusterEnvError, EnvError
from clusterenv_core.results import BatchResult, ResetResult

if TYPE_CHECKING:
    from clusterenv_core.restarts import WorkerRestarts


def _check_batch_size_fits_blocks(batch_size: int, block_sizes: list[int]) -> None:
    """Refuse a batch size that can leave the pool waiting for ever.

    A block steps once all its envs have actions, and results come in whole blocks. A batch that
    takes part of a block can strand the rest of it: too few envs are ready to fill a batch, and
    the block cannot step without the ones left. Safe are all the envs, a divisor of every block
    (no batch spans two blocks), and a multiple of the block when the blocks are equal (batches
    take whole blocks).
    """
    num_envs = sum(block_sizes)
    equal = len(set(block_sizes)) == 1
    if batch_size == num_envs or all(size % batch_size == 0 for size in block_sizes):
        return
    if equal and batch_size % block_sizes[0] == 0:
        return
    divisors = [d for d in range(1, min(block_sizes) + 1) if all(size % d == 0 for size in block_sizes)]
    multiples = list(range(block_sizes[0], num_envs + 1, block_sizes[0])) if equal else [num_envs]
    fitting = sorted(set(divisors + multiples))
    raise ValueError(
        f"batch_size={batch_size} does not fit the workers' blocks of {block_sizes} envs: a block steps only "
        f"once all its envs have actions, so a batch that splits blocks can leave envs that no batch returns "
        f"and the pool waiting for ever; use one of {fitting} (or change num_workers)"
    )


class AsyncBatches:
    """Asynchronous stepping of a pool's envs in batches of ``batch_size``; made by
    :meth:`EnvPool.async_batches <clusterenv_core.pool.EnvPool.async_batches>`.

    :param channel: the messaging of a pool whose spaces have buffers (no Text/Graph/Sequence or
        custom spaces), with no step pending
    :param batch_size: how many envs each :meth:`recv` returns: a divisor of every worker's block,
        a multiple of the block when the blocks are equal (which keeps every worker busy), or all the
        envs; others are refused, as they could leave envs that no batch returns (a block steps
        once all its envs have actions)
    :param autoreset_mode: the pool's: it must be ``"next_step"``
    :param reset_pool: the pool's ``reset``
    :param restarts: the pool's worker replacements (``restart_failed_workers``), if on
    """

    def __init__(
        self,
        channel: WorkerChannel,
        batch_size: int,
        autoreset_mode: str,
        reset_pool: Callable[..., ResetResult],
        restarts: WorkerRestarts | None = None,
    ) -> None:
        batch_size = check_int("batch_size", batch_size, minimum=1)
        if batch_size > channel.num_envs:
            raise ValueError(f"batch_size must be at most num_envs={channel.num_envs}, got {batch_size}")
        _check_batch_size_fits_blocks(batch_size, [len(block) for block in channel.blocks])
        if autoreset_mode != "next_step":
            raise ValueError(
                f"asynchronous batches reset episodes in the next step: make the pool with "
                f"autoreset_mode='next_step' (it has {autoreset_mode!r})"
            )
        buffers = channel.buffers
        assert buffers is not None  # the pool shares them before anything can make batches
        if not (buffers.obs_layout.buffered and buffers.act_layout.buffered):
            spec = channel.batch_spec
            raise ValueError(
                "asynchronous batches need observation and action spaces that fit in buffers "
                f"(got {spec.observation_space} and {spec.action_space})"
            )
        channel.check_usable()
        channel.check_idle()
        self.channel = channel
        self._buffers = buffers
        self._reset_pool = reset_pool
        self._restarts = restarts
        self.batch_size = batch_size
        num_envs = channel.num_envs
        self._ready: deque[int] = deque()  # envs whose results are in and not yet returned, oldest first
        self._returned = np.zeros(num_envs, dtype=bool)  # returned by recv, waiting for their action
        self._has_action = np.zeros(num_envs, dtype=bool)  # sent an action, their block not stepping yet
        self._stepping: list[int] = []  # workers stepping, in the order they started
        self._started_at: dict[int, float] = {}  # when each stepping worker started
        self._infos: dict[int, dict] = {}  # step infos of the ready envs
        self._started = False
        # What recv returns: rows gathered into buffers allocated once.
        self._obs_rows = [np.empty((batch_size, *array.shape[1:]), dtype=array.dtype) for array in buffers.obs]
        self._obs = buffers.obs_layout.batch(self._obs_rows)
        self._rewards = np.empty(batch_size, dtype=buffers.rewards.dtype)
        self._terminated = np.empty(batch_size, dtype=bool)
        self._truncated = np.empty(batch_size, dtype=bool)
        self._env_ids = np.empty(batch_size, dtype=np.int64)
        self._worker_of = np.repeat(np.arange(channel.num_workers), [len(block) for block in channel.blocks])

    @property
    def stepping(self) -> bool:
        """Whether some worker is stepping (the pool's other calls wait until none is)."""
        return bool(self._stepping)

    def reset(
        self,
        seeds: list[int | None] | None = None,
        options: list[dict | None] | None = None,
        omit_if_none: Sequence[str] = (),
    ) -> None:
        """Reset every env (with the pool's :meth:`~clusterenv_core.pool.EnvPool.reset` arguments);
        afterwards every env is ready for :meth:`recv`, in env order, and results not yet returned
        are dropped. No worker may be stepping."""
        if self._stepping:
            raise ClusterEnvError("reset while envs are stepping: recv their results first")
        result = self._reset_pool(seeds, options, omit_if_none=omit_if_none)
        self._returned[:] = False
        self._has_action[:] = False
        self._ready = deque(range(self.channel.num_envs))
        self._infos = {index: info for index, info in result.infos.items()}
        self._started = True

    def reset_envs(self, env_ids: Any, omit_if_none: Sequence[str] = ()) -> tuple[Any, dict[int, dict]]:
        """Reset the envs ``env_ids``, which :meth:`recv` returned and have no action yet (their
        workers are idle, whatever the others do); returns their reset observations (new arrays,
        in the order of ``env_ids``) and non-empty infos. They still wait for their actions.

        :param env_ids: the envs to reset
        :param omit_if_none: as for :meth:`~clusterenv_core.pool.EnvPool.reset`: the envs get
            ``reset(seed=None, options=None)`` less the keywords named here
        """
        channel = self.channel
        channel.check_usable()
        env_ids = self._check_env_ids(env_ids)
        omit_if_none = check_names("omit_if_none", omit_if_none, protocol.RESET_KEYWORDS)
        mask = np.zeros(channel.num_envs, dtype=bool)
        mask[env_ids] = True
        workers = self._workers_of(env_ids)
        channel.drain(keep_steps=True)  # replies an interrupted call left unread come first
        for worker in workers:
            block = channel.blocks[worker]
            size = len(block)
            block_mask = mask[block.start : block.stop].tolist()
            channel.send(worker, protocol.Reset([None] * size, [None] * size, block_mask, omit_if_none))
        infos: dict[int, dict] = {}
        for parts in channel.gather(workers, "reset").values():
            if parts is not None:
                infos.update(parts.get("infos", ()))
        buffers = self._buffers
        obs = buffers.obs_layout.batch([np.take(array, env_ids, axis=0) for array in buffers.obs])
        return obs, infos

    def send(self, actions: Any, env_ids: Any) -> None:
        """Give ``actions`` (a batch over ``env_ids``, as the pool's ``step_async`` takes for all envs)
        to the envs ``env_ids``, which :meth:`recv` returned and have no action yet; each worker
        whose envs all have their actions starts stepping.

        :raises ValueError: an env id out of range, repeated, or of an env that is not waiting for
            an action; actions of the wrong shape or values. Nothing is sent then.
        """
        channel = self.channel
        channel.check_usable()
        env_ids = self._check_env_ids(env_ids)
        buffers = self._buffers
        leaves = buffers.act_layout.check_batch(actions, len(env_ids))
        for buffer, leaf in zip(buffers.actions, leaves):
            buffer[env_ids] = leaf
        channel.drain(keep_steps=True)  # replies an interrupted call left unread come first
        self._returned[env_ids] = False
        self._has_action[env_ids] = True
        for worker in self._workers_of(env_ids):
            block = channel.blocks[worker]
            if self._has_action[block.start : block.stop].all():
                self._start(worker)

    def _workers_of(self, env_ids: np.ndarray) -> list[int]:
        """The workers holding ``env_ids``, ascending (a set: cheaper than np.unique for a batch)."""
        return sorted(set(self._worker_of[env_ids].tolist()))

    def _check_env_ids(self, env_ids: Any) -> np.ndarray:
        ids = np.asarray(env_ids)
        if ids.ndim != 1 or ids.size == 0 or not (np.issubdtype(ids.dtype, np.integer) or all(map(is_int, ids))):
            raise ValueError(f"env_ids must be a non-empty 1-d sequence of ints, got {env_ids!r}")
        ids = ids.astype(np.int64, copy=False)
        num_envs = self.channel.num_envs
        if ids.min() < 0 or ids.max() >= num_envs:
            outside = ids[(ids < 0) | (ids >= num_envs)]
            raise ValueError(f"env id {int(outside[0])} is out of range: the pool has envs 0..{num_envs - 1}")
        listed = ids.tolist()
        if len(set(listed)) != len(listed):  # a set: cheaper than np.unique for batch-sized arrays
            seen: set[int] = set()
            for env in listed:
                if env in seen:
                    raise ValueError(f"env id {env} is given more than once")
                seen.add(env)
        waiting = self._returned[ids]
        if not waiting.all():
            env = int(ids[~waiting][0])
            why = (
                "has its action already"
                if self._has_action[env]
                else "has not been returned by recv since its last action"
            )
            raise ValueError(f"env {env} {why}: send actions only to the envs recv returned")
        return ids

    def _start(self, worker: int) -> None:
        channel = self.channel
        block = channel.blocks[worker]
        self._has_action[block.start : block.stop] = False
        if self._restarts is not None:
            self._restarts.remember_step_start(block)
        # Envs get their actions in the space's dtypes, as EnvPool converts them to its own.
        channel.set_action_dtypes(channel.space_action_dtypes, [worker], step=True)
        if not self._stepping:
            channel.begin(PoolState.BATCHES)
        self._stepping.append(worker)
        self._started_at[worker] = time.monotonic()
        # A worker lost while told the dtypes is not sent the step: replaced as a worker lost in its step.
        channel.send_steps([worker])

    def _stopped(self, worker: int) -> None:
        """``worker`` stepped (or failed): the pool is idle once no worker steps."""
        self._stepping.remove(worker)
        if not self._stepping:
            self.channel.end()

    def recv(self) -> BatchResult:
        """Wait until ``batch_size`` envs have results (no wait when enough are in) and return those
        that came first: env ids ascending, their observations, rewards, terminations, truncations
        and non-empty infos. Arrays are views of buffers reused by the next ``recv``.

        :raises ClusterEnvError: before waiting, when the envs that can still come are too few
            (some returned envs have no action yet)
        :raises EnvError: an env failed in its step; its worker's envs are returned to the caller's
            side (waiting for actions, their rows undefined), the pool stays usable
        """
        channel = self.channel
        channel.check_usable()
        if not self._started:
            raise ClusterEnvError("recv before reset: call reset first")
        self._finish_replacements()
        self._time_out_overdue()
        while len(self._ready) < self.batch_size:
            coming = sum(len(channel.blocks[worker]) for worker in self._stepping)
            if len(self._ready) + coming < self.batch_size:
                waiting = np.flatnonzero(self._returned | self._has_action).tolist()
                raise ClusterEnvError(
                    f"recv cannot return {self.batch_size} envs: {len(self._ready)} are ready and {coming} "
                    f"stepping; envs {waiting} wait for actions (send them first)"
                )
            # Up to when the oldest step exceeds the timeout: a stuck worker is found even while
            # the others keep the batches full.
            oldest = min(self._started_at[worker] for worker in self._stepping)
            deadline = oldest + channel.reply_wait(None)
            ready = channel.wait_steps(list(self._stepping), max(deadline - time.monotonic(), 0.0))
            if ready:
                self._receive(ready)
            else:
                self._time_out_overdue()
        count = self.batch_size
        env_ids = self._env_ids
        env_ids[:] = sorted(self._ready.popleft() for _ in range(count))
        buffers = self._buffers
        for rows, array in zip(self._obs_rows, buffers.obs):
            np.take(array, env_ids, axis=0, out=rows)
        np.take(buffers.rewards, env_ids, out=self._rewards)
        np.take(buffers.terminated, env_ids, out=self._terminated)
        np.take(buffers.truncated, env_ids, out=self._truncated)
        self._returned[env_ids] = True
        infos = {}
        for env in env_ids.tolist():
            info = self._infos.pop(env, None)
            if info:
                infos[env] = info
        return BatchResult(env_ids, self._obs, self._rewards, self._terminated, self._truncated, infos)

    def _time_out_overdue(self) -> None:
        """A worker stepping for longer than its reply may take (the timeout; a node agent's is
        longer, see ``WorkerChannel.reply_wait``), with no reply in, timed out."""
        timeout = self.channel.reply_wait(None)
        now = time.monotonic()
        for worker in [worker for worker in self._stepping if now - self._started_at[worker] > timeout]:
            # A reply in is read; else the read raises the backend's timeout error, its time being past
            # (naming the worker's process and envs), and the worker is replaced or the pool fails.
            self._receive([worker])

    def _receive(self, workers: list[int]) -> None:
        """Read the step replies of ``workers``; their envs become ready, oldest step first."""
        channel = self.channel
        for worker in workers:
            block = channel.blocks[worker]
            try:
                results = channel.gather([worker], "step", step=True)
            except EnvError:
                self._stopped(worker)
                self._returned[block.start : block.stop] = True
                raise
            if worker in results:  # else lost, and replaced below
                self._stopped(worker)
                parts = results[worker] or {}
                self._infos.update(parts.get("infos", ()))
                self._ready.extend(block)
            self._finish_replacements()

    def _finish_replacements(self) -> None:
        """Replace the lost workers (also after a replacement interrupted by Ctrl-C): their envs
        become ready with the step their replacement ends. Until then they count as stepping."""
        if self._restarts is None or not self.channel.lost:
            return
        for worker, parts in self._restarts.replace_lost().items():
            self._stopped(worker)
            self._infos.update((parts or {}).get("infos", ()))
            self._ready.extend(self.channel.blocks[worker])
