"""The worker loop: owns a contiguous block of environments and executes the learner's commands.

It is backend-agnostic: a :class:`~clusterenv_core.transports.base.WorkerConnection` brings the
messages, and results are written into the batch buffers the connection maps. Run as
``python -m clusterenv_core.worker [<backend> [backend arguments]]`` (see :mod:`clusterenv_core.launch`);
the local backend starts it that way, and MPI jobs start it as the worker program of an MPMD launch.

Autoreset modes (what a step does for an env whose episode ended):

- ``same_step``: reset it in the same step; the step's observation is the reset observation and the
  last one is a *final observation* (SB3's ``DummyVecEnv``, gymnasium 0.29, gymnasium 1.x SAME_STEP).
- ``next_step``: the following step resets it instead of stepping (gymnasium 1.x NEXT_STEP).
- ``disabled``: never reset automatically (gymnasium 1.x DISABLED).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # The worker program. Everything it needs is imported inside the launch guard, so that a worker
    # whose dependencies fail to import still ends an MPI job instead of leaving it waiting.
    from clusterenv_core.launch import run_worker_program

    sys.exit(run_worker_program(sys.argv[1:]))

import pickle
import time
import traceback
from typing import Any, Callable

import numpy as np

from clusterenv_core import registry
from clusterenv_core.protocol import PROGRESS, RESTART_INFO_KEY, STEP
from clusterenv_core.transports.base import WorkerConnection


class RemoteFailure(Exception):
    """Raised inside the worker to report a failure with the env it happened in."""

    def __init__(self, row: int | None, operation: str, error: BaseException) -> None:
        super().__init__(operation)
        self.row = row
        self.operation = operation
        self.error = error

    def reply(self, first_index: int) -> tuple:
        error = self.error
        return (
            "error",
            {
                "env_index": None if self.row is None else first_index + self.row,
                "operation": self.operation,
                "type": f"{type(error).__module__}.{type(error).__qualname__}",
                "message": str(error),
                "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
            },
        )


class EnvBlock:
    """The environments of one worker and the operations the learner can ask of them.

    :param env_fns: factories of this block's environments
    :param first_index: global index of the first of them
    :param autoreset_mode: one of :data:`~clusterenv_core.protocol.AUTORESET_MODES`
    :param max_env_restarts: how many times one env that raises in ``step`` may be replaced by a
        new one from its factory (0: never; the error goes to the learner)
    :param restarted: this block replaces a lost worker's; in ``next_step`` mode its envs reset at
        their next step
    """

    def __init__(
        self, env_fns: list, first_index: int, autoreset_mode: str, max_env_restarts: int = 0, restarted: bool = False
    ) -> None:
        self.env_fns = env_fns
        self.first_index = first_index
        self.autoreset_mode = autoreset_mode
        self.max_env_restarts = max_env_restarts
        self.env_restarts = [0] * len(env_fns)
        self.envs = [self._make_env(row) for row in range(len(env_fns))]
        # next_step mode: envs to reset at their next step.
        self.needs_reset = np.full(len(self.envs), restarted and autoreset_mode == "next_step")
        self.pending_actions: list | None = None  # actions of spaces without buffers, sent before the step
        self.last_pickled_obs: list = [None] * len(self.envs)  # observations of spaces without buffers
        self.buffers = None
        self.row0 = 0
        self.host = None  # the deployed policy copy, for rollouts
        self.rollout_regions: dict = {}

    def _make_env(self, row: int) -> Any:
        try:
            return self.env_fns[row]()
        except Exception as error:
            raise RemoteFailure(row, "creating the env", error) from error

    def describe(self) -> dict:
        """Spaces of every env and the metadata of the first, for the learner to check and lay out buffers."""
        first = self.envs[0]
        return {
            "spaces": [(env.observation_space, env.action_space) for env in self.envs],
            "metadata": first.metadata,
            "render_mode": first.render_mode,
            "spec": first.spec,
        }

    def attach(self, buffers, row0: int) -> None:
        self.buffers = buffers
        self.row0 = row0
        self.obs_layout = buffers.obs_layout
        self.final_layout = buffers.final_obs_layout
        self.write_obs = buffers.obs_layout.writer(buffers.obs)
        self.read_obs = buffers.obs_layout.reader(buffers.obs)
        self.write_final_obs = buffers.final_obs_layout.writer(buffers.final_obs)
        if buffers.act_layout.buffered:
            self.read_action = buffers.act_layout.reader(buffers.actions)
        else:
            self.read_action = lambda row: self.pending_actions[row - self.row0]
        self.rows = slice(row0, row0 + len(self.envs))

    def step(self) -> dict | None:
        """Step every env with its action row; returns what could not go through the buffers."""
        same_step, next_step = self.autoreset_mode == "same_step", self.autoreset_mode == "next_step"
        buffered_obs, buffered_final = self.obs_layout.buffered, self.final_layout.buffered
        write_obs, read_action = self.write_obs, self.read_action
        rewards, terminations, truncations = [], [], []
        infos: dict[int, dict] = {}
        reset_infos: dict[int, dict] = {}
        final_obs: dict[int, Any] = {}
        pickled_obs: dict[int, Any] = {}
        row = self.row0
        for j, env in enumerate(self.envs):
            index = self.first_index + j
            try:
                if next_step and self.needs_reset[j]:
                    obs, info = env.reset()
                    reward, term, trunc = 0.0, False, False
                else:
                    obs, reward, term, trunc, info = env.step(read_action(row))
                if term or trunc:
                    if same_step:
                        if buffered_final and self.final_layout.conforms(obs):
                            self.write_final_obs(row, obs)
                        else:
                            final_obs[index] = obs
                        obs, reset_info = env.reset()
                        if reset_info:
                            reset_infos[index] = reset_info
                    elif next_step:
                        self.needs_reset[j] = True
                elif next_step:
                    self.needs_reset[j] = False
            except Exception as error:
                if self.env_restarts[j] >= self.max_env_restarts:
                    raise RemoteFailure(j, "step", error) from error
                obs, reward, term, trunc, info = self._replace_env(j, error, final_obs, reset_infos)
            if buffered_obs:
                write_obs(row, obs)
            else:
                pickled_obs[index] = self.last_pickled_obs[j] = obs
            rewards.append(reward)
            terminations.append(term)
            truncations.append(trunc)
            if info:
                infos[index] = info
            row += 1
        # One conversion per block instead of one numpy item assignment per env.
        buffers = self.buffers
        buffers.rewards[self.rows] = rewards
        buffers.terminated[self.rows] = terminations
        buffers.truncated[self.rows] = truncations
        return _payload(infos=infos, reset_infos=reset_infos, final_obs=final_obs, obs=pickled_obs)

    def _replace_env(self, j: int, error: Exception, final_obs: dict, reset_infos: dict) -> tuple:
        """Swap a raising env for a new one; the interrupted episode ends truncated.

        The episode's last observation is the one from before the failed step. In ``same_step``
        mode the new env is reset now; otherwise it resets at its next step (``next_step``) or
        when the caller resets it (``disabled``).
        """
        self.env_restarts[j] += 1
        row, index = self.row0 + j, self.first_index + j
        previous_obs = self.read_obs(row) if self.obs_layout.buffered else self.last_pickled_obs[j]
        try:
            self.envs[j].close()
        except Exception:
            pass  # the env is already broken; its replacement matters, not its last words
        self.envs[j] = self._make_env(j)
        reason = (
            f"env {index} raised {type(error).__name__}: {error}; "
            f"replaced by a new env (restart {self.env_restarts[j]} of {self.max_env_restarts})"
        )
        obs = previous_obs
        if self.autoreset_mode == "same_step":
            final_obs[index] = previous_obs
            try:
                obs, reset_info = self.envs[j].reset()
            except Exception as reset_error:
                raise RemoteFailure(j, "reset of a replaced env", reset_error) from reset_error
            if reset_info:
                reset_infos[index] = reset_info
        else:
            self.needs_reset[j] = self.autoreset_mode == "next_step"
        return obs, 0.0, False, True, {RESTART_INFO_KEY: reason}

    def reset(self, seeds: list, options: list, mask: list[bool] | None) -> dict | None:
        """Reset the envs selected by ``mask`` (all when ``None``) with their seeds and options."""
        infos: dict[int, dict] = {}
        pickled_obs: dict[int, Any] = {}
        for j, env in enumerate(self.envs):
            if mask is not None and not mask[j]:
                continue
            try:
                obs, info = env.reset(seed=seeds[j], options=options[j])
            except Exception as error:
                raise RemoteFailure(j, "reset", error) from error
            self.needs_reset[j] = False
            index = self.first_index + j
            if self.obs_layout.buffered:
                self.write_obs(self.row0 + j, obs)
            else:
                pickled_obs[index] = self.last_pickled_obs[j] = obs
            if info:
                infos[index] = info
        return _payload(infos=infos, obs=pickled_obs)

    def rollout(
        self, n_steps: int, context: dict, host, arrays, report: Callable[[int], None], report_every: float
    ) -> dict | None:
        """Run ``n_steps`` steps of every env, acting with the local policy copy, into ``arrays``
        (a :class:`~clusterenv_core.rollout.RolloutArrays` whose rows start at ``arrays.row0``).

        Each step goes through :meth:`step`, so autoreset, restarts and infos behave as in a
        learner-driven step; returns the non-empty step payloads by step index. ``report(steps)``
        runs after a step when ``report_every`` seconds passed since the start or the last report.
        """
        next_report = time.monotonic() + report_every
        buffers, rows = self.buffers, self.rows
        segment = slice(arrays.row0, arrays.row0 + len(self.envs))
        (actions,) = buffers.actions  # deploy checked that the action space is one field
        payloads: dict[int, dict] = {}
        for t in range(n_steps):
            version = host.refresh()
            current = [array[rows] for array in buffers.obs]
            for kept, now in zip(arrays.obs, current):
                kept[segment, t] = now
            try:
                out = host.act(self.obs_layout.batch(current), context)
            except Exception as error:
                raise RemoteFailure(None, "policy act", error) from error
            actions[rows] = out.get("env_actions", out["actions"])
            arrays.actions[0][segment, t] = out["actions"]
            for name in ("log_probs", "values"):
                if name in out:
                    getattr(arrays, name)[segment, t] = out[name].reshape(-1)
            payload = self.step()
            for name in ("rewards", "terminated", "truncated"):
                getattr(arrays, name)[segment, t] = getattr(buffers, name)[rows]
            for kept, final in zip(arrays.final_obs, buffers.final_obs):
                kept[segment, t] = final[rows]
            arrays.versions[segment, t] = version
            if payload:
                payloads[t] = payload
            if t + 1 < n_steps and time.monotonic() >= next_report:
                report(t + 1)
                next_report = time.monotonic() + report_every
        for kept, now in zip(arrays.last_obs, buffers.obs):
            kept[segment] = now[rows]
        return {"steps": payloads} if payloads else None

    def call(self, name: str, args: tuple, kwargs: dict, rows: list[int], require_callable: bool) -> list:
        """Look ``name`` up through the wrappers of each selected env; call it if callable.

        With ``require_callable`` (SB3's ``env_method``) a non-callable attribute is an error.
        """
        results = []
        for j in rows:
            try:
                attribute = _get_wrapper_attr(self.envs[j], name)
                if callable(attribute):
                    results.append(attribute(*args, **kwargs))
                elif require_callable:
                    raise TypeError(f"attribute {name!r} of the env is not callable")
                else:
                    results.append(attribute)
            except Exception as error:
                raise RemoteFailure(j, f"call {name}", error) from error
        return results

    def get_attr(self, name: str, rows: list[int]) -> list:
        results = []
        for j in rows:
            try:
                results.append(_get_wrapper_attr(self.envs[j], name))
            except Exception as error:
                raise RemoteFailure(j, f"get_attr {name}", error) from error
        return results

    def set_attr(self, name: str, values: list, rows: list[int], through_wrappers: bool) -> None:
        """Set ``name`` on each selected env: on the outer wrapper (SB3, gymnasium 0.29) or, with
        ``through_wrappers``, on the wrapper that already defines it (gymnasium 1.x ``set_wrapper_attr``)."""
        for j, value in zip(rows, values):
            env = self.envs[j]
            try:
                if through_wrappers and hasattr(env, "set_wrapper_attr"):
                    env.set_wrapper_attr(name, value)
                else:
                    setattr(env, name, value)
            except Exception as error:
                raise RemoteFailure(j, f"set_attr {name}", error) from error

    def is_wrapped(self, wrapper_class: type, rows: list[int]) -> list[bool]:
        results = []
        for j in rows:
            env = self.envs[j]
            found = False
            while hasattr(env, "env"):
                if isinstance(env, wrapper_class):
                    found = True
                    break
                env = env.env
            results.append(found)
        return results

    def close(self) -> None:
        errors = []
        for j, env in enumerate(self.envs):
            try:
                env.close()
            except Exception as error:
                errors.append(RemoteFailure(j, "close", error))
        self.envs = []
        if errors:
            raise errors[0]


def _get_wrapper_attr(env: Any, name: str) -> Any:
    # gymnasium >= 0.29 resolves attributes through the wrapper stack with get_wrapper_attr.
    if hasattr(env, "get_wrapper_attr"):
        return env.get_wrapper_attr(name)
    return getattr(env, name)


def _payload(**parts: dict) -> dict | None:
    """Only the non-empty parts, or ``None`` when there is nothing to send."""
    kept = {key: value for key, value in parts.items() if value}
    return kept or None


def serve(connection: WorkerConnection) -> int:
    """Run the worker loop until the learner says ``close`` or goes away; returns the exit code."""
    block: EnvBlock | None = None
    try:
        while True:
            message = connection.recv()
            if message is None:  # learner gone
                return 0
            if message == STEP:
                try:
                    connection.send_step(("ok", block.step()))
                except RemoteFailure as failure:
                    connection.send_step(failure.reply(block.first_index))
                continue
            op, payload = message
            if op == "close":
                reply: tuple = ("ok", None)
                if block is not None:
                    try:
                        block.close()
                    except RemoteFailure as failure:
                        reply = failure.reply(block.first_index)
                connection.send(reply)
                return 0
            try:
                if op == "init":
                    block = _create_block(payload)
                    result = block.describe()
                else:
                    result = _control(block, op, payload, connection)
                reply = ("ok", result)
            except RemoteFailure as failure:
                reply = failure.reply(payload["first_index"] if block is None else block.first_index)
            except Exception as error:  # a bug or a bad message: report it rather than die silently
                reply = RemoteFailure(None, op, error).reply(0)
            connection.send(reply)
            if op == "rollout" and reply[0] == "ok":
                arrays = _rollout_arrays(block, payload, connection)
                connection.send_arrays([array[arrays.row0 : arrays.row0 + len(block.envs)] for array in arrays.all])
    finally:
        if block is not None:
            try:
                block.close()
            except RemoteFailure:
                pass
        connection.close()


def _create_block(payload: dict) -> EnvBlock:
    # The learner's import path, so factories pickled by reference find their modules.
    sys.path.extend(path for path in payload["sys_path"] if path not in sys.path)
    registry.install(payload["registry"])
    env_fns = []
    for row, pickled in enumerate(payload["env_fns"]):
        try:
            env_fns.append(pickle.loads(pickled))
        except Exception as error:
            raise RemoteFailure(row, "unpickling the env factory", error) from error
    return EnvBlock(
        env_fns,
        payload["first_index"],
        payload["autoreset_mode"],
        payload["max_env_restarts"],
        payload["restarted"],
    )


def _deploy(block: EnvBlock, payload: dict, connection: WorkerConnection) -> None:
    from clusterenv_core.inference import PolicyHost, WeightsRegion, weights_fields

    views, _ = connection.map_region(payload["weights_handle"], weights_fields(payload["count"]), 1, range(1))
    weights = WeightsRegion(views)
    if payload["deliver"]:
        connection.recv_arrays(weights.arrays)
    try:
        block.host = PolicyHost(payload["policy"], weights, payload["seed"])
    except Exception as error:
        raise RemoteFailure(None, "deploying the policy", error) from error
    block.rollout_regions = {}


def _rollout_arrays(block: EnvBlock, payload: dict, connection: WorkerConnection):
    """The segment region the learner named, mapped on first use."""
    from clusterenv_core.rollout import RolloutArrays, rollout_fields

    handle = payload["handle"]
    key = repr(handle)
    if key not in block.rollout_regions:
        fields = rollout_fields(block.buffers.spec, payload["n_steps"])
        views, row0 = connection.map_region(handle, fields, payload["num_envs"], payload["block"])
        arrays = RolloutArrays(views, block.obs_layout, block.buffers.act_layout)
        arrays.row0 = row0
        block.rollout_regions[key] = arrays
    return block.rollout_regions[key]


def _control(block: EnvBlock, op: str, payload: dict, connection: WorkerConnection) -> Any:
    if op == "attach":
        buffers, row0 = connection.attach(payload["spec"], payload["block"])
        block.attach(buffers, row0)
        return None
    if op == "actions":
        block.pending_actions = payload["actions"]
        return None
    if op == "reset":
        return block.reset(payload["seeds"], payload["options"], payload["mask"])
    if op == "deploy":
        return _deploy(block, payload, connection)
    if op == "weights":  # backends without shared memory deliver weights as a message
        connection.recv_arrays(block.host.weights.arrays)
        return None
    if op == "rollout":
        arrays = _rollout_arrays(block, payload, connection)

        def report(steps: int) -> None:
            connection.send((PROGRESS, steps))

        return block.rollout(
            payload["n_steps"], payload["context"], block.host, arrays, report, payload["report_every"]
        )
    if op == "call":
        return block.call(payload["name"], payload["args"], payload["kwargs"], payload["rows"], payload["require_callable"])
    if op == "get_attr":
        return block.get_attr(payload["name"], payload["rows"])
    if op == "set_attr":
        return block.set_attr(payload["name"], payload["values"], payload["rows"], payload["through_wrappers"])
    if op == "is_wrapped":
        return block.is_wrapped(payload["wrapper_class"], payload["rows"])
    raise ValueError(f"unknown command {op!r}")
