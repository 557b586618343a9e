"""The worker: owns a contiguous block of environments and serves the learner's requests.

It is backend-agnostic: a :class:`~clusterenv_core.transports.base.WorkerConnection` brings the
requests of :mod:`clusterenv_core.protocol`, and results are written into the batch buffers the
connection maps. :data:`HANDLERS` maps each request type to its handler; the step is the one fast
path beside it. Run as ``python -m clusterenv_core.worker [<backend> [backend arguments]]`` (see
:mod:`clusterenv_core.launch`); the local backend starts it that way, and MPI jobs start it as the
worker program of an MPMD launch.

Three index spaces meet here: an env's *index* counts over the whole pool, its *slot* over this
block (0 for the block's first env), and its *row* over the buffers the connection mapped (the
local backend maps every env's rows, so row = block start + slot; MPI maps the block's only).

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
    from clusterenv_core.launch import end_worker_program, run_worker_program

    end_worker_program(run_worker_program(sys.argv[1:]))

import importlib
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterenv_core import protocol, registry
from clusterenv_core.env_output import checked_env, checked_reset, checked_step, unpicklable_part
from clusterenv_core.errors import InvalidEnvOutput
from clusterenv_core.inference import LearnerGone
from clusterenv_core.protocol import ERROR, OK, OK_NONE, PROGRESS, RESTART_INFO_KEY, ErrorDetails
from clusterenv_core.spaces import delivered_dtype
from clusterenv_core.transports.base import WorkerConnection

# How often a worker collecting a segment looks for a request from the learner (a close): a system
# call or MPI probe, so not after every step of a fast env.
_REQUEST_LOOK_EVERY = 0.01


class RemoteFailure(Exception):
    """Raised inside the worker to report a failure with the env it happened in.

    :param slot: the env's slot in the block, or ``None`` for the worker as a whole
    """

    def __init__(self, slot: int | None, operation: str, error: BaseException) -> None:
        super().__init__(operation)
        self.slot = slot
        self.operation = operation
        self.error = error

    def reply(self, first_index: int, env_restarts: list[int] | None = None) -> tuple:
        """The error reply; ``env_restarts``: the envs replaced in the request before it failed."""
        error = self.error
        return (
            ERROR,
            ErrorDetails(
                env_index=None if self.slot is None else first_index + self.slot,
                operation=self.operation,
                exc_type=f"{type(error).__module__}.{type(error).__qualname__}",
                message=_message_of(error),
                traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)),
                env_restarts=tuple(env_restarts or ()),
            ),
        )


def _message_of(error: BaseException) -> str:
    try:
        return str(error)
    except Exception as str_error:  # an exception's own __str__ may fail; the worker must not
        return f"<str() of the {type(error).__name__} failed: {type(str_error).__name__}: {str_error}>"


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
        self,
        env_fns: list,
        first_index: int,
        autoreset_mode: str,
        max_env_restarts: int = 0,
        restarted: bool = False,
        env_restarts: list[int] | None = None,
    ) -> None:
        self.env_fns = env_fns
        self.first_index = first_index
        self.autoreset_mode = autoreset_mode
        self.max_env_restarts = max_env_restarts
        # Replacements of each env so far, also by earlier workers of this block.
        self.env_restarts = list(env_restarts) if env_restarts else [0] * len(env_fns)
        self.replaced: list[int] = []  # env indices replaced in the current step
        self.replaced_in_segment: list[int] = []  # and in the current rollout segment
        self.envs = [self._make_env(slot) for slot in range(len(env_fns))]
        # next_step mode: envs to reset at their next step.
        self.needs_reset = np.full(len(self.envs), restarted and autoreset_mode == "next_step")
        self.pending_actions: list | None = None  # actions of spaces without buffers, sent before the step
        self.last_pickled_obs: list = [None] * len(self.envs)  # observations of spaces without buffers
        # Set by attach(): the buffers, the row of slot 0 in them, and fast accessors.
        self.buffers: Any = None
        self.row0 = 0
        self.rows = slice(0, 0)
        self.obs_layout: Any = None
        self.final_layout: Any = None
        self.write_obs: Callable[[int, Any], None] | None = None
        self.read_obs: Callable[[int], Any] | None = None
        self.write_final_obs: Callable[[int, Any], None] | None = None
        self.read_action: Callable[[int], Any] | None = None

    def _make_env(self, slot: int) -> Any:
        try:
            return checked_env(self.env_fns[slot]())
        except BaseException as error:
            raise RemoteFailure(slot, "creating the env", error) from error

    def describe(self) -> protocol.BlockDescription:
        """Spaces of every env and the metadata of the first, for the learner to check and lay out buffers."""
        first = self.envs[0]
        spaces = [(env.observation_space, env.action_space) for env in self.envs]
        return protocol.BlockDescription(spaces, first.metadata, first.render_mode, first.spec)

    def attach(self, buffers: Any, row0: int) -> None:
        self.buffers = buffers
        self.row0 = row0
        self.rows = slice(row0, row0 + len(self.envs))
        self.obs_layout = buffers.obs_layout
        self.final_layout = buffers.final_obs_layout
        self.write_obs = buffers.obs_layout.writer(buffers.obs)
        self.read_obs = buffers.obs_layout.reader(buffers.obs)
        self.write_final_obs = buffers.final_obs_layout.writer(buffers.final_obs)
        if buffers.act_layout.buffered:
            self.set_action_dtypes([field.dtype for field in buffers.act_layout.fields])
        else:
            self.read_action = lambda row: self.pending_actions[row - self.row0]

    def set_action_dtypes(self, dtypes: list[np.dtype]) -> None:
        """Give envs their actions in ``dtypes``, one per action field (the buffers' are wider)."""
        self.read_action = self.buffers.act_layout.reader(self.buffers.actions, list(dtypes))

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
        self.replaced = []
        row = self.row0
        for slot, env in enumerate(self.envs):
            index = self.first_index + slot
            # Whatever the env does or returns, a failure here is the env's (an EnvError on the learner,
            # or a replaced env): its output is checked where it is used anyway, at no cost when good.
            try:
                if next_step and self.needs_reset[slot]:
                    obs, info = self._reset_or_replace(slot)
                    reward, term, trunc = 0.0, False, False
                else:
                    obs, reward, term, trunc, info = checked_step(env.step(read_action(row)))
                if term or trunc:
                    if same_step:
                        final = obs
                        obs, reset_info = self._reset_or_replace(slot)
                        if RESTART_INFO_KEY in reset_info:  # said where a raising step says it
                            info = {**info, RESTART_INFO_KEY: reset_info.pop(RESTART_INFO_KEY)}
                        # Stored after the reset: DummyVecEnv, SubprocVecEnv and SyncVectorEnv keep the
                        # env's own object, so an env that resets its observation array in place
                        # resets their final observation too.
                        if buffered_final and self.final_layout.conforms(final):
                            self.write_final_obs(row, final)
                        else:
                            final_obs[index] = final
                        if reset_info or type(reset_info) is not dict:
                            reset_infos[index] = reset_info
                    elif next_step:
                        self.needs_reset[slot] = True
                elif next_step:
                    self.needs_reset[slot] = False
                if buffered_obs:
                    try:
                        write_obs(row, obs)
                    except Exception as error:
                        raise self._obs_error(obs, error) from error
            except RemoteFailure:
                raise  # a replacement that failed in turn
            except BaseException as error:
                if self.env_restarts[slot] >= self.max_env_restarts:
                    raise RemoteFailure(slot, "step", error) from error
                reset_infos.pop(index, None)  # of a reset that failed half-way, if any
                obs, reward, term, trunc, info = self._replace_env(slot, error, final_obs, reset_infos)
                if buffered_obs:
                    try:
                        write_obs(row, obs)
                    except Exception as write_error:
                        raise RemoteFailure(slot, "reset of a replaced env", self._obs_error(obs, write_error)) from error
            if not buffered_obs:
                pickled_obs[index] = self.last_pickled_obs[slot] = obs
            rewards.append(reward)
            terminations.append(term)
            truncations.append(trunc)
            # Empty plain dicts stay behind (the learner makes them); an empty OrderedDict, say, comes
            # as the env's own object, as DummyVecEnv hands it on.
            if info or type(info) is not dict:
                infos[index] = info
            row += 1
        # One conversion per block instead of one numpy item assignment per env.
        buffers = self.buffers
        buffers.rewards[self.rows] = rewards
        buffers.terminated[self.rows] = terminations
        buffers.truncated[self.rows] = truncations
        return _parts(infos=infos, reset_infos=reset_infos, final_obs=final_obs, obs=pickled_obs, env_restarts=self.replaced)

    def _obs_error(self, obs: Any, error: Exception) -> InvalidEnvOutput:
        layout = self.obs_layout
        problem = layout.mismatch(obs) or f"{type(error).__name__}: {error}"
        return InvalidEnvOutput(f"the observation does not fit the observation space {layout.space}: {problem}")

    def _replace_env(self, slot: int, error: BaseException, final_obs: dict, reset_infos: dict) -> tuple:
        """Swap a raising env for a new one; the interrupted episode ends truncated.

        The episode's last observation is the one from before the failed step. In ``same_step``
        mode the new env is reset now; otherwise it resets at its next step (``next_step``) or
        when the caller resets it (``disabled``).
        """
        row, index = self.row0 + slot, self.first_index + slot
        previous_obs = self.read_obs(row) if self.obs_layout.buffered else self.last_pickled_obs[slot]
        reason = self._rebuild(slot, error)
        obs = previous_obs
        if self.autoreset_mode == "same_step":
            final_obs[index] = previous_obs
            try:
                obs, reset_info = checked_reset(self.envs[slot].reset())
            except BaseException as reset_error:
                raise RemoteFailure(slot, "reset of a replaced env", reset_error) from reset_error
            if reset_info or type(reset_info) is not dict:
                reset_infos[index] = reset_info
        else:
            self.needs_reset[slot] = self.autoreset_mode == "next_step"
        return obs, 0.0, False, True, {RESTART_INFO_KEY: reason}

    def _reset_or_replace(self, slot: int) -> tuple[Any, dict]:
        """The automatic reset of env ``slot`` after its episode ended. If the reset raises and the
        env may be replaced, the new env's reset is returned instead, with the reason under
        ``RESTART_INFO_KEY`` of its info: the episode that ended keeps its last step."""
        try:
            return checked_reset(self.envs[slot].reset())
        except BaseException as error:
            if self.env_restarts[slot] >= self.max_env_restarts:
                raise
            reason = self._rebuild(slot, error)
        try:
            obs, info = checked_reset(self.envs[slot].reset())
        except BaseException as reset_error:
            raise RemoteFailure(slot, "reset of a replaced env", reset_error) from reset_error
        return obs, {**info, RESTART_INFO_KEY: reason}

    def _rebuild(self, slot: int, error: BaseException) -> str:
        """Replace env ``slot``, which raised ``error``, by a new one from its factory; returns why."""
        self.env_restarts[slot] += 1
        index = self.first_index + slot
        try:
            self.envs[slot].close()
        except BaseException:
            pass  # the env is already broken; its replacement matters, not its last words
        self.envs[slot] = self._make_env(slot)
        self.replaced.append(index)
        self.replaced_in_segment.append(index)
        return (
            f"env {index} raised {type(error).__name__}: {error}; "
            f"replaced by a new env (restart {self.env_restarts[slot]} of {self.max_env_restarts})"
        )

    def reset(self, seeds: list, options: list, mask: list[bool] | None, omit_if_none: tuple[str, ...]) -> dict | None:
        """Reset the envs selected by ``mask`` (all when ``None``) with their seeds and options; their
        rows then say reward 0, neither terminated nor truncated, as after the reset step of
        ``next_step`` mode.

        :param seeds: one seed (or ``None``) per env of the block
        :param options: one options dict (or ``None``) per env of the block
        :param mask: one bool per env of the block, or ``None`` for all
        :param omit_if_none: the keywords (``"seed"``, ``"options"``) not passed to ``reset`` where
            their value is ``None``
        """
        buffers = self.buffers
        infos: dict[int, dict] = {}
        pickled_obs: dict[int, Any] = {}
        for slot, env in enumerate(self.envs):
            if mask is not None and not mask[slot]:
                continue
            keywords = {"seed": seeds[slot], "options": options[slot]}
            for name in omit_if_none:
                if keywords[name] is None:
                    del keywords[name]
            try:
                obs, info = checked_reset(env.reset(**keywords))
                if self.obs_layout.buffered:
                    try:
                        self.write_obs(self.row0 + slot, obs)
                    except Exception as error:
                        raise self._obs_error(obs, error) from error
            except BaseException as error:
                raise RemoteFailure(slot, "reset", error) from error
            self.needs_reset[slot] = False
            # Where memory is not shared (MPI) the block's rows go back with the reply: the ended
            # step's reward and flags would overwrite the learner's rows of a fresh episode.
            row = self.row0 + slot
            buffers.rewards[row] = 0.0
            buffers.terminated[row] = False
            buffers.truncated[row] = False
            index = self.first_index + slot
            if not self.obs_layout.buffered:
                pickled_obs[index] = self.last_pickled_obs[slot] = obs
            if info or type(info) is not dict:
                infos[index] = info
        return _parts(infos=infos, obs=pickled_obs)

    def rollout(
        self,
        n_steps: int,
        context: dict,
        host,
        arrays,
        report: Callable[[int], None],
        report_every: float,
        request_waiting: Callable[[], bool],
    ) -> dict:
        """Run ``n_steps`` steps of every env, acting with the local policy copy, into ``arrays``
        (a :class:`~clusterenv_core.rollout.RolloutArrays` whose rows start at ``arrays.row0``).

        Each step goes through :meth:`step`, so autoreset, restarts and infos behave as in a
        learner-driven step; returns the seconds the segment took (``"seconds"``) and the
        non-empty step results by step index (``"steps"``, when there are any). ``report(steps)``
        runs after a step when ``report_every`` seconds passed since the start or the last report.
        The segment ends early, after the step in progress, once ``request_waiting()`` (asked every
        ``_REQUEST_LOOK_EVERY`` seconds) says the learner sent a request: it only does so to close.
        """
        started = time.perf_counter()
        next_report = time.monotonic() + report_every
        next_look = time.monotonic() + _REQUEST_LOOK_EVERY
        buffers, rows = self.buffers, self.rows
        segment = slice(arrays.row0, arrays.row0 + len(self.envs))
        (actions,) = buffers.actions  # deploying checked that the action space is one field
        (field,) = buffers.act_layout.fields
        learner_reader = self.read_action
        self.replaced_in_segment = []
        steps: dict[int, dict] = {}
        try:
            for t in range(n_steps):
                version = host.refresh()
                current = [array[rows] for array in buffers.obs]
                for kept, now in zip(arrays.obs, current):
                    kept[segment, t] = now
                try:
                    out = host.act(self.obs_layout.batch(current), context)
                except Exception as error:
                    raise RemoteFailure(None, "policy act", error) from error
                env_actions = out.get("env_actions", out["actions"])
                if t == 0:  # envs get the policy's dtype, as from SB3's and CleanRL's own loops
                    self.set_action_dtypes([delivered_dtype(field.dtype, np.asarray(env_actions).dtype)])
                actions[rows] = env_actions
                arrays.actions[0][segment, t] = out["actions"]
                for name in ("log_probs", "values"):
                    if name in out:
                        getattr(arrays, name)[segment, t] = out[name].reshape(-1)
                parts = self.step()
                for name in ("rewards", "terminated", "truncated"):
                    getattr(arrays, name)[segment, t] = getattr(buffers, name)[rows]
                for kept, final in zip(arrays.final_obs, buffers.final_obs):
                    kept[segment, t] = final[rows]
                arrays.versions[segment, t] = version
                if parts:
                    steps[t] = parts
                if t + 1 < n_steps:
                    clock = time.monotonic()
                    if clock >= next_look:
                        if request_waiting():
                            break
                        next_look = clock + _REQUEST_LOOK_EVERY
                    if clock >= next_report:
                        report(t + 1)
                        next_report = time.monotonic() + report_every
        finally:
            self.read_action = learner_reader  # learner-driven steps read in the dtypes the learner set
        for kept, now in zip(arrays.last_obs, buffers.obs):
            kept[segment] = now[rows]
        result: dict[str, Any] = {"seconds": time.perf_counter() - started}
        if steps:
            result["steps"] = steps
        return result

    def call(
        self, name: str, args: tuple, kwargs: dict, slots: list[int], require_callable: bool, through_wrappers: bool
    ) -> list:
        """Look ``name`` up in each selected env (through its wrappers, or with ``getattr``); call it
        if callable.

        With ``require_callable`` (SB3's ``env_method``) a non-callable attribute is an error.
        """
        results = []
        for slot in slots:
            try:
                attribute = _attribute(self.envs[slot], name, through_wrappers)
                if callable(attribute):
                    results.append(attribute(*args, **kwargs))
                elif require_callable:
                    raise TypeError(f"attribute {name!r} of the env is not callable")
                else:
                    results.append(attribute)
            except BaseException as error:
                raise RemoteFailure(slot, f"call {name}", error) from error
        return results

    def get_attr(self, name: str, slots: list[int], through_wrappers: bool) -> list:
        results = []
        for slot in slots:
            try:
                results.append(_attribute(self.envs[slot], name, through_wrappers))
            except BaseException as error:
                raise RemoteFailure(slot, f"get_attr {name}", error) from error
        return results

    def set_attr(self, name: str, values: list, slots: list[int], through_wrappers: bool) -> None:
        """Set ``name`` on each selected env: on the outer wrapper (SB3, gymnasium 0.29) or, with
        ``through_wrappers``, on the wrapper that already defines it (gymnasium 1.x ``set_wrapper_attr``)."""
        for slot, value in zip(slots, values):
            env = self.envs[slot]
            try:
                if through_wrappers and hasattr(env, "set_wrapper_attr"):
                    env.set_wrapper_attr(name, value)
                else:
                    setattr(env, name, value)
            except BaseException as error:
                raise RemoteFailure(slot, f"set_attr {name}", error) from error

    def is_wrapped(self, wrapper_class: type, slots: list[int]) -> list[bool]:
        results = []
        for slot in slots:
            env = self.envs[slot]
            found = False
            while hasattr(env, "env"):
                if isinstance(env, wrapper_class):
                    found = True
                    break
                env = env.env
            results.append(found)
        return results

    def close(self, starting: Callable[[int], None] | None = None) -> None:
        """Close every env, the first error raised once all were closed.

        :param starting: called with each env's index before its ``close()``
        """
        errors = []
        for slot, env in enumerate(self.envs):
            if starting is not None:
                starting(self.first_index + slot)
            try:
                env.close()
            except BaseException as error:
                errors.append(RemoteFailure(slot, "close", error))
        self.envs = []
        if errors:
            raise errors[0]


def _attribute(env: Any, name: str, through_wrappers: bool) -> Any:
    # gymnasium >= 0.29 resolves attributes through the wrapper stack with get_wrapper_attr.
    if through_wrappers and hasattr(env, "get_wrapper_attr"):
        return env.get_wrapper_attr(name)
    return getattr(env, name)


def _parts(**parts: dict) -> dict | None:
    """Only the non-empty parts (a :data:`~clusterenv_core.protocol.StepParts`), or ``None``."""
    kept = {key: value for key, value in parts.items() if value}
    return kept or None


class Worker:
    """One worker process's state: its connection, and its block of envs once created.

    :param connection: the worker side of the backend
    """

    def __init__(self, connection: WorkerConnection) -> None:
        self.connection = connection
        self.block: EnvBlock | None = None
        self.first_index = 0  # global index of the block's first env
        self.host = None  # the deployed policy copy (clusterenv_core.inference.PolicyHost)
        self.rollout_regions: dict[str, Any] = {}  # mapped segment regions, by handle

    def serve(self) -> int:
        """Answer requests until the learner says close or goes away; returns the exit code."""
        connection = self.connection
        while True:
            request = connection.recv()
            try:
                if request is None or self.handle(request):  # learner gone, or told to close
                    return 0
            except LearnerGone:  # noticed while collecting a rollout
                return 0

    def handle(self, request: Any) -> bool:
        """Answer one request through the connection; returns whether it was the last (close)."""
        connection = self.connection
        if type(request) is str:  # STEP, the fast path
            try:
                parts = self.block.step()
                reply = OK_NONE if parts is None else (OK, parts)
            except RemoteFailure as failure:
                reply = failure.reply(self.first_index, self.block.replaced)
            self._send_reply(connection.send_step, reply, "step")
            return False
        if type(request) is protocol.Unreadable:  # already shaped as the error reply it gets
            connection.send(request)
            return False
        arrays = None
        try:
            handler = HANDLERS.get(type(request))
            if handler is None:
                raise ValueError(f"unknown request {request!r}")
            result = handler(self, request)
            if request.REPLY_ARRAYS:
                result, arrays = result
            reply = (OK, result)
        except RemoteFailure as failure:
            # A failed segment's reply still says which envs were replaced in it, to be counted.
            replaced = self.block.replaced_in_segment if isinstance(request, protocol.Rollout) else None
            reply = failure.reply(self.first_index, replaced)
        except LearnerGone:
            raise  # nobody to reply to
        except Exception as error:  # a bug or a bad message: report it rather than die silently
            reply = RemoteFailure(None, type(request).__name__, error).reply(0)
        reply = self._send_reply(connection.send, reply, *self._reply_parts(request))
        if reply[0] == OK:
            if request.REPLY_ROWS:
                connection.send_rows()
            if arrays is not None:
                connection.send_arrays(arrays)
        return isinstance(request, protocol.Close)

    def _reply_parts(self, request: protocol.Request) -> tuple[str, list[int] | None, str]:
        """How errors name ``request`` (the operation), and for per-env results, the env of each
        item and what the items are."""
        if isinstance(request, protocol.Call):
            return f"call {request.name}", [self.first_index + slot for slot in request.slots], f"result of {request.name!r}"
        if isinstance(request, protocol.GetAttr):
            return f"get_attr {request.name}", [self.first_index + slot for slot in request.slots], f"attribute {request.name!r}"
        return type(request).__name__.lower(), None, ""

    def _send_reply(
        self, send: Callable[[tuple], None], reply: tuple, operation: str, indices: list[int] | None = None, label: str = ""
    ) -> tuple:
        """Send ``reply``; returns what was sent. Backends pickle before sending anything, so a reply
        that cannot be pickled becomes an error reply naming the env and the info key, attribute or
        method responsible (``indices``: the env of each item of a per-env result, ``label`` what
        the items are)."""
        try:
            send(reply)
        except Exception as error:
            index, what = unpicklable_part(reply[1], indices, label)
            slot = None if index is None else index - self.first_index
            failure = InvalidEnvOutput(f"{what} cannot be pickled to reach the learner ({type(error).__name__}: {error})")
            reply = RemoteFailure(slot, operation, failure).reply(self.first_index)
            send(reply)
        return reply

    def shutdown(self) -> None:
        """Close whatever envs are left and the connection, however serving ended."""
        if self.block is not None:
            try:
                self.block.close()
            except RemoteFailure:
                pass
        self.connection.close()

    # -- handlers, one per request type ------------------------------------------------------------

    def init(self, request: protocol.Init) -> protocol.BlockDescription:
        # The learner's import path, module files and warning filters, so that factories pickled by
        # reference find the learner's modules and envs warn as they would there; then its env
        # registry, so that ids registered there build here.
        self.first_index = request.first_index
        try:
            request.interpreter.adopt()
        except Exception as error:
            raise RemoteFailure(None, "taking over the learner's import path and warning filters", error) from error
        registry.install(request.registry)
        try:
            factories = pickle.loads(request.env_fns)
        except Exception as error:
            # One factory for the whole block: it is that of the block's first env.
            slot = 0 if max(request.env_factories) == 0 else None
            raise RemoteFailure(slot, "unpickling the env factory", error) from error
        env_fns = [factories[factory] for factory in request.env_factories]
        self.block = EnvBlock(
            env_fns,
            request.first_index,
            request.autoreset_mode,
            request.max_env_restarts,
            request.restarted,
            request.env_restarts,
        )
        return self.block.describe()

    def attach(self, request: protocol.Attach) -> None:
        buffers, row0 = self.connection.attach(request.spec, request.block)
        self.block.attach(buffers, row0)

    def actions(self, request: protocol.Actions) -> None:
        self.block.pending_actions = request.actions

    def action_dtypes(self, request: protocol.ActionDtypes) -> None:
        self.block.set_action_dtypes(request.dtypes)

    def reset(self, request: protocol.Reset) -> dict | None:
        return self.block.reset(request.seeds, request.options, request.mask, request.omit_if_none)

    def preload(self, request: protocol.Preload) -> None:
        for name in request.modules:
            importlib.import_module(name)

    def deploy(self, request: protocol.Deploy) -> None:
        from clusterenv_core.inference import PolicyHost, WeightsRegion, weights_fields

        views, _ = self.connection.map_region(request.weights_handle, weights_fields(request.count), 1, range(1))
        weights = WeightsRegion(views, writer_alive=self.connection.learner_alive)
        if request.deliver:
            self.connection.recv_arrays(weights.arrays)
        try:
            self.host = PolicyHost(request.policy, weights, request.seed)
        except Exception as error:
            raise RemoteFailure(None, "deploying the policy", error) from error
        self.rollout_regions = {}

    def weights(self, request: protocol.Weights) -> None:
        self.connection.recv_arrays(self.host.weights.arrays)

    def rollout(self, request: protocol.Rollout) -> tuple[dict, list[np.ndarray]]:
        arrays = self._segment_region(request)

        def report(steps: int) -> None:
            self.connection.send((PROGRESS, steps))

        result = self.block.rollout(
            request.n_steps, request.context, self.host, arrays, report, request.report_every, self.connection.request_waiting
        )
        mine = slice(arrays.row0, arrays.row0 + len(self.block.envs))
        return result, [array[mine] for array in arrays.all]

    def _segment_region(self, request: protocol.Rollout):
        """The segment region the learner named, mapped on first use."""
        from clusterenv_core.rollout import RolloutArrays, rollout_fields

        key = repr(request.handle)
        if key not in self.rollout_regions:
            buffers = self.block.buffers
            fields = rollout_fields(buffers.spec, request.n_steps)
            views, row0 = self.connection.map_region(request.handle, fields, request.num_envs, request.block)
            self.rollout_regions[key] = RolloutArrays(views, buffers.obs_layout, buffers.act_layout, row0=row0)
        return self.rollout_regions[key]

    def call(self, request: protocol.Call) -> list:
        return self.block.call(
            request.name, request.args, request.kwargs, request.slots, request.require_callable, request.through_wrappers
        )

    def get_attr(self, request: protocol.GetAttr) -> list:
        return self.block.get_attr(request.name, request.slots, request.through_wrappers)

    def set_attr(self, request: protocol.SetAttr) -> None:
        self.block.set_attr(request.name, request.values, request.slots, request.through_wrappers)

    def is_wrapped(self, request: protocol.IsWrapped) -> list[bool]:
        return self.block.is_wrapped(request.wrapper_class, request.slots)

    def close(self, request: protocol.Close) -> None:
        block, self.block = self.block, None
        if block is not None:
            # Which env is closing, so that a close() that hangs can be named at the learner.
            block.close(lambda index: self.connection.send((PROGRESS, index)))


HANDLERS: dict[type, Callable[[Worker, Any], Any]] = {
    protocol.Init: Worker.init,
    protocol.Attach: Worker.attach,
    protocol.Actions: Worker.actions,
    protocol.ActionDtypes: Worker.action_dtypes,
    protocol.Reset: Worker.reset,
    protocol.Preload: Worker.preload,
    protocol.Deploy: Worker.deploy,
    protocol.Weights: Worker.weights,
    protocol.Rollout: Worker.rollout,
    protocol.Call: Worker.call,
    protocol.GetAttr: Worker.get_attr,
    protocol.SetAttr: Worker.set_attr,
    protocol.IsWrapped: Worker.is_wrapped,
    protocol.Close: Worker.close,
}


def serve(connection: WorkerConnection) -> int:
    """Run a worker on ``connection`` until the learner says close or goes away; returns the exit code."""
    worker = Worker(connection)
    try:
        return worker.serve()
    finally:
        worker.shutdown()
