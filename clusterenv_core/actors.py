"""Worker-side inference, learner side: the policy copies on a pool's workers.

:meth:`EnvPool.deploy <clusterenv_core.pool.EnvPool.deploy>` ships a policy (a torch module, see
:mod:`clusterenv_core.inference`) to every worker once and returns a :class:`WorkerActors`. It
publishes new weights as versioned flat vectors and collects rollout segments: each worker steps
its block of envs with its own copy for ``n_steps`` and writes the segment into a region the
learner reads (shared memory locally, one buffer message per worker on MPI). It talks to the
workers through the pool's :class:`~clusterenv_core.channel.WorkerChannel`, so timeouts, errors
and the pool's state are the pool's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.buffers import field_views, fields_nbytes
from clusterenv_core.channel import PoolState
from clusterenv_core.checks import check_int, check_seconds
from clusterenv_core.errors import ClusterEnvError, EnvError
from clusterenv_core.protocol import RESTART_INFO_KEY
from clusterenv_core.rollout import Rollout, RolloutArrays, rollout_fields, time_major

if TYPE_CHECKING:
    from clusterenv_core.channel import WorkerChannel
    from clusterenv_core.inference import WeightsRegion
    from clusterenv_core.restarts import WorkerRestarts

# The seeds torch.manual_seed takes (it refuses others with "Overflow when unpacking long long").
_TORCH_SEED_MIN, _TORCH_SEED_MAX = -(2**63), 2**64 - 1


class WorkerActors:
    """A policy deployed on every worker of a pool, with weights version 0; made by
    :meth:`EnvPool.deploy <clusterenv_core.pool.EnvPool.deploy>`.

    :param channel: the pool's messaging, whose workers get the policy
    :param policy: a deployable module (:class:`~clusterenv_core.policy.DeployablePolicy`: ``act`` and ``action_dist``)
    :param seed: worker ``w`` seeds its torch and numpy generators (action sampling) with ``seed + w``;
        on node agents, local process ``p`` of agent ``w`` with ``seed + w * processes_per_worker + p``,
        the seed of the flat worker it stands for
    :param restarts: the pool's worker replacements (``restart_failed_workers``), if on
    :param processes_per_worker: the local processes of each worker (node agents), which act each
        for its part of the worker's block
    :raises ValueError: the spaces have no buffers, or the action space is not one array, or the
        policy cannot be pickled, or ``seed + w`` is no torch seed for some (flat) worker ``w``
    :raises TypeError: the policy lacks ``act`` or ``action_dist``, or ``seed`` is no int
    :raises EnvError: a worker could not take the policy; then no policy is deployed on the pool
        (the pool's ``actors`` is ``None``), since the workers that took it would act with another
        policy than the rest
    """

    def __init__(
        self,
        channel: WorkerChannel,
        policy: Any,
        seed: int | None = None,
        restarts: WorkerRestarts | None = None,
        processes_per_worker: int = 1,
    ) -> None:
        from clusterenv_core.inference import WeightsRegion, flatten_weights, weight_tensors, weights_fields

        channel.check_usable()
        channel.check_idle()
        layouts = channel.buffers
        assert layouts is not None  # the pool shares them before anything can deploy
        if not layouts.obs_layout.buffered or len(layouts.act_layout.fields) != 1:
            spec = channel.batch_spec
            raise ValueError(
                "worker-side inference needs an observation space with buffers and a single-array action "
                f"space (Box, Discrete, MultiDiscrete, MultiBinary); got {spec.observation_space}, {spec.action_space}"
            )
        for method in ("act", "action_dist"):
            if not callable(getattr(policy, method, None)):
                raise TypeError(f"the policy must have an {method}() method (see clusterenv_core.inference)")
        if seed is not None:
            seed = _check_seed(seed, channel.num_workers * processes_per_worker)
        try:
            policy_bytes = protocol.dumps_code(policy)
        except Exception as error:
            raise ValueError(f"the policy cannot be pickled: {type(error).__name__}: {error}") from error
        channel.drain()
        self.channel = channel
        self._buffers = layouts
        self._restarts = restarts
        self._processes_per_worker = processes_per_worker
        self._policy_bytes = policy_bytes  # for the replacement of a worker lost during a segment
        self._regions: dict[int, list[RolloutArrays]] = {}  # by segment length, most recently used first
        self._pending: RolloutArrays | None = None  # the region of a rollout started and not waited for
        self._pending_requests: list[protocol.Rollout] = []  # its request to each worker
        self._pending_timeout = channel.timeout
        # Why each worker of the pending rollout was replaced (cleared when the next one starts).
        self._restart_reasons: dict[int, str] = {}
        flat = flatten_weights(policy)
        self._weight_shapes = [tuple(tensor.shape) for tensor in weight_tensors(policy)]
        fields = weights_fields(flat.size)
        handle, memory = channel.share_region(fields_nbytes(fields, 1))
        self._weights_handle = handle
        # The versioned weights the workers read; None once release() dropped them. No local name
        # holds them: a failed deploy's traceback keeps this frame, and would keep the region mapped.
        self.weights: WeightsRegion | None = WeightsRegion(field_views(fields, 1, memory))
        #: version of the last published weights (0: those deployed)
        self.policy_version = 0
        #: size of one copy of the weights
        self.weights_nbytes = flat.nbytes
        try:
            self._weights_region().write(flat, self.policy_version)
            self._deploy(policy_bytes, seed)
        except BaseException:
            self.release()  # a failed deploy's regions would otherwise stay as long as its traceback
            raise
        self._delivered_version = [self.policy_version] * channel.num_workers  # backends without shared memory

    def _deploy(self, policy_bytes: bytes, seed: int | None) -> None:
        """Send the policy and the weights to every worker and wait until each took it."""
        channel = self.channel
        # From the first request on, a worker may hold this policy or the previous one: the previous
        # WorkerActors must not act any more (_check_current), and none does until every worker took
        # this one. It has no use for its regions from now on.
        previous, channel.deployed = channel.deployed, None
        if previous is not None:
            previous.release()
        # An agent's local process p seeds with the agent's seed + p: as flat worker w * processes + p.
        first_seeds = range(0, channel.num_workers * self._processes_per_worker, self._processes_per_worker)
        for worker, first in enumerate(first_seeds):
            self._send_policy(worker, policy_bytes, None if seed is None else seed + first)
        took: list[int] = []
        try:
            channel.gather(
                range(channel.num_workers), "deploying the policy", on_reply=lambda worker, _: took.append(worker)
            )
        except EnvError as error:
            raise _deploy_error(error, took) from None
        channel.deployed = self

    def _send_policy(self, worker: int, policy_bytes: bytes, seed: int | None) -> None:
        """Send the policy and, to a worker that does not share the learner's memory, the weights."""
        deliver = not self.channel.shares_memory
        size = self._weights_region().weights.size
        request = protocol.Deploy(policy_bytes, self._weights_handle, size, seed, deliver)
        self.channel.send(worker, request, arrays=self._weights_region().arrays if deliver else None)

    @property
    def num_workers(self) -> int:
        return self.channel.num_workers

    @property
    def pending(self) -> bool:
        """Whether a rollout was started and not waited for."""
        return self._pending is not None

    @property
    def wait_interrupted(self) -> bool:
        """Whether Ctrl-C cut :meth:`rollout_wait` short with the segment unfinished."""
        return self._pending is not None and self.channel.interrupted

    def publish_weights(self, policy_or_weights: Any, version: int | None = None) -> int:
        """Publish new weights (a module like the deployed one, or a flat float32 vector) to the
        workers; returns their version. Workers pick them up at their next step (local backend) or
        with their next rollout request (other backends).

        :param version: the version to publish them as, above the current one (a node agent relays
            its learner's versions, some of which it may never see); default: the next one
        """
        from clusterenv_core.inference import flatten_weights, weight_tensors

        if self.channel.closed:
            raise ClusterEnvError("the pool is closed")
        self._check_current()
        weights = self._weights_region()
        if isinstance(policy_or_weights, np.ndarray):
            flat = np.asarray(policy_or_weights, dtype=np.float32).reshape(-1)
        else:
            shapes = [tuple(tensor.shape) for tensor in weight_tensors(policy_or_weights)]
            if shapes != self._weight_shapes:  # a vector of the same size would load into the wrong tensors
                raise ValueError(
                    f"the module's weights are shaped {shapes}, the deployed policy's {self._weight_shapes}: "
                    "publish a module like the deployed one"
                )
            flat = flatten_weights(policy_or_weights)
        if flat.size != weights.weights.size:
            raise ValueError(f"{flat.size} weights given, the deployed policy has {weights.weights.size}")
        if version is None:
            version = self.policy_version + 1
        elif check_int("version", version) <= self.policy_version:
            raise ValueError(f"version must be above the current {self.policy_version}, got {version}")
        self.policy_version = version
        weights.write(flat, self.policy_version)
        return self.policy_version

    def rollout_async(
        self,
        n_steps: int,
        context: dict | None = None,
        timeout: float | None = None,
        progress_every: float | None = None,
    ) -> None:
        """Start every worker collecting ``n_steps`` steps of all its envs with its policy copy;
        returns at once, so the learner can train while the segment is collected.

        :param context: keyword arguments for the policy's ``act`` (e.g. an exploration rate)
        :param timeout: seconds a worker may go without progress (default: the pool's ``timeout``).
            A segment may take as long as it needs: workers report progress every quarter of it.
        :param progress_every: seconds between the workers' progress reports instead (at most a quarter
            of ``timeout``; a node agent's local processes report often, so that it forwards them)
        """
        channel = self.channel
        channel.check_usable()
        channel.check_idle()
        self._check_current()
        n_steps = check_int("n_steps", n_steps, minimum=1)
        timeout = channel.timeout if timeout is None else check_seconds("timeout", timeout)
        report_every = timeout / 4
        if progress_every is not None:
            report_every = min(check_seconds("progress_every", progress_every), report_every)
        channel.drain()
        region = self._region(n_steps)
        requests = [
            protocol.Rollout(
                n_steps, dict(context or {}), region.handle, block, channel.num_envs, report_every, timeout
            )
            for block in channel.blocks
        ]
        for worker in range(channel.num_workers):
            self._deliver_weights(worker)
            # A worker lost from here on is replaced in rollout_wait (restart_failed_workers), else fatal.
            self._send_segment_request(worker, region, requests[worker], step=True)
        self._pending, self._pending_requests = region, requests
        self._pending_timeout = timeout
        self._restart_reasons = {}
        channel.begin(PoolState.ROLLOUT, self.rollout_wait)

    def _send_segment_request(
        self, worker: int, region: RolloutArrays, request: protocol.Rollout, step: bool = False
    ) -> None:
        block = self.channel.blocks[worker]
        arrays = [array[block.start : block.stop] for array in region.all]
        self.channel.send(worker, request, reply_arrays=arrays, step=step)

    def rollout_wait(
        self, timeout: float | None = None, on_progress: Callable[[int, Any], None] | None = None
    ) -> Rollout:
        """Wait for the segment started by :meth:`rollout_async`.

        :param timeout: seconds a worker may go without progress (default: the one given to
            :meth:`rollout_async`); a worker that stops stepping raises ``WorkerTimeoutError``
        :param on_progress: ``on_progress(worker, steps)`` runs at each progress report read while
            waiting (a node agent's: it forwards them, and looks for its learner's requests); what
            it raises cuts the wait short, as Ctrl-C does
        """
        channel = self.channel
        channel.check_usable()
        self._check_current()
        region = self._pending
        if region is None or channel.state is not PoolState.ROLLOUT:
            raise ClusterEnvError("rollout_wait called without rollout_async")
        timeout = self._pending_timeout if timeout is None else check_seconds("timeout", timeout)
        lost = channel.lost
        try:
            # With the replies read before Ctrl-C cut an earlier wait for this segment short.
            results = channel.gather(
                channel.answering(), "rollout", step=True, timeout=timeout, on_progress=on_progress
            )
            while lost:  # workers lost during the segment (restart_failed_workers): replacements collect their part
                replacing = sorted(lost)
                assert self._restarts is not None  # without restart_failed_workers a lost worker fails the pool
                self._restarts.replace_lost_in_segment(self._restart_segment)
                results.update(
                    channel.gather(replacing, "rollout", step=True, timeout=timeout, on_progress=on_progress)
                )
        finally:
            # Interrupted (Ctrl-C) with replies unread or unreported, or a lost worker not replaced
            # yet, the rollout stays pending: rollout_wait resumes it, and any other call of the pool
            # first finishes it.
            channel.settle_wait()
            if channel.state is PoolState.IDLE:
                self._pending = None
        n_steps = region.rewards.shape[1]
        infos: list[dict[int, dict]] = [{} for _ in range(n_steps)]
        reset_infos: list[dict[int, dict]] = [{} for _ in range(n_steps)]
        pickled_final_obs: dict[tuple[int, int], Any] = {}
        for result in results.values():
            for step, parts in (result or {}).get("steps", {}).items():
                infos[step].update(parts.get("infos", ()))
                reset_infos[step].update(parts.get("reset_infos", ()))
                pickled_final_obs.update(((step, index), obs) for index, obs in parts.get("final_obs", {}).items())
        # Envs of a node agent's local processes replaced in the segment (the agent's reasons are in its infos)...
        restarted_envs = [index for result in results.values() for index in (result or {}).get("restarted_envs", ())]
        # ...and of the workers replaced here.
        for worker, reason in sorted(self._restart_reasons.items()):
            for index in channel.blocks[worker]:
                restarted_envs.append(index)
                info = infos[0].get(index, {})
                said = reason if RESTART_INFO_KEY not in info else f"{reason}; then {info[RESTART_INFO_KEY]}"
                infos[0][index] = {**info, RESTART_INFO_KEY: said}
        obs_layout, act_layout = self._buffers.obs_layout, self._buffers.act_layout
        return Rollout(
            obs=time_major(obs_layout, region.obs),
            actions=time_major(act_layout, region.actions),
            rewards=region.rewards.T,
            terminated=region.terminated.T,
            truncated=region.truncated.T,
            log_probs=region.log_probs.T,
            values=region.values.T,
            versions=region.versions.T,
            last_obs=obs_layout.batch(region.last_obs),
            infos=infos,
            reset_infos=reset_infos,
            collect_seconds=max(result["seconds"] for result in results.values()),
            pickled_final_obs=pickled_final_obs,
            restarted_envs=sorted(restarted_envs),
            arrays=region,
            _final_obs=[array.swapaxes(0, 1) for array in region.final_obs],
            _obs_layout=obs_layout,
        )

    def rollout(self, n_steps: int, context: dict | None = None, timeout: float | None = None) -> Rollout:
        """:meth:`rollout_async` then :meth:`rollout_wait`."""
        self.rollout_async(n_steps, context, timeout)
        return self.rollout_wait()

    def release(self) -> None:
        """Drop the views of the weights and segment regions and free the regions: the pool is
        closing, or another deploy replaced (or failed to replace) this policy. A region with views
        still exported (a :class:`~clusterenv_core.rollout.Rollout` the caller kept) goes with them;
        see :meth:`BatchBuffers.release <clusterenv_core.buffers.BatchBuffers.release>`. Idempotent."""
        handles = [region.handle for slots in self._regions.values() for region in slots]
        if self._weights_handle is not None:
            handles.append(self._weights_handle)
        self.weights = None
        self._weights_handle = None
        self._regions = {}
        self._pending = None
        for handle in handles:
            self.channel.release_region(handle)

    def _weights_region(self) -> WeightsRegion:
        """The weights region, which :meth:`release` drops only once this policy is replaced or the pool
        closed, and every call that uses it refuses first (:meth:`_check_current`)."""
        assert self.weights is not None
        return self.weights

    def _check_current(self) -> None:
        """A later ``deploy`` replaced this policy on the workers, or some of them: acting through
        this object would collect with the other policy, and its weights would reach no worker."""
        if self.channel.deployed is not self:
            why = (
                "a later deploy() replaced it on the workers"
                if self.channel.deployed is not None
                else "a later deploy() failed once sent, so each worker holds either policy"
            )
            raise ClusterEnvError(
                f"this policy is no longer deployed on the pool: {why}; deploy it again to act with it"
            )

    def _region(self, n_steps: int) -> RolloutArrays:
        """One of two regions per segment length, alternating, so a segment can be collected while
        the previous one is still being read."""
        slots = self._regions.setdefault(n_steps, [])
        if len(slots) < 2:
            channel = self.channel
            fields = rollout_fields(channel.batch_spec, n_steps)
            handle, memory = channel.share_region(fields_nbytes(fields, channel.num_envs))
            buffers = self._buffers
            views = field_views(fields, channel.num_envs, memory)
            region = RolloutArrays(views, buffers.obs_layout, buffers.act_layout, handle=handle)
            slots.insert(0, region)
            return region
        slots.reverse()
        return slots[0]

    def deploy_on_replacement(self, worker: int) -> None:
        """Give the policy, with the current weights, to a worker that replaced a lost one
        (``restart_failed_workers``). Its copy samples unseeded, as its envs start unseeded."""
        self._send_policy(worker, self._policy_bytes, None)
        self.channel.gather([worker], "deploying the policy on a replaced worker")
        self._delivered_version[worker] = self.policy_version

    def _restart_segment(self, worker: int, reason: str) -> None:
        """Send the pending segment's request to a worker that replaced a lost one, for ``reason``."""
        self._restart_reasons[worker] = reason  # kept first: Ctrl-C after the send loses no reason
        assert self._pending is not None  # replacements are made while the segment is pending
        self._send_segment_request(worker, self._pending, self._pending_requests[worker])

    def _deliver_weights(self, worker: int) -> None:
        channel = self.channel
        if channel.shares_memory or self._delivered_version[worker] == self.policy_version:
            return
        channel.send(worker, protocol.Weights(), arrays=self._weights_region().arrays)
        channel.gather([worker], "delivering weights")
        self._delivered_version[worker] = self.policy_version


def _check_seed(seed: Any, num_workers: int) -> int:
    """``seed`` as an int such that ``seed + w`` is a torch seed for every worker ``w``."""
    seed = check_int("seed", seed)
    highest = _TORCH_SEED_MAX - (num_workers - 1)
    if not _TORCH_SEED_MIN <= seed <= highest:
        raise ValueError(
            f"seed must be in [{_TORCH_SEED_MIN}, {highest}]: worker w seeds torch with seed + w, which torch takes "
            f"in [{_TORCH_SEED_MIN}, {_TORCH_SEED_MAX}], for each of the {num_workers} workers; got {seed}"
        )
    return seed


def _deploy_error(error: EnvError, took: list[int]) -> EnvError:
    """``error``, of a worker that could not take the policy, saying what became of the others."""
    # The failing worker's own account of the failure first: a node agent's names its local process.
    if took:
        workers = ", ".join(map(str, took))
        what = f"{error.operation} (worker{'s' if len(took) > 1 else ''} {workers} took it"
    else:
        what = f"{error.operation} (no worker took it"
    what += "; no policy is deployed on the pool now, so none acts with a mix of policies: deploy again)"
    return type(error)(
        error.env_index, error.worker_index, what, error.exc_type, error.remote_message, error.remote_traceback
    )
