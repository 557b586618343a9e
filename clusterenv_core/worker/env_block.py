"""EnvBlock: the environments of one worker, and what the learner can ask of them.

The block steps, resets and closes its envs, answers calls and attribute lookups on them, replaces
an env that raises (when restarts are allowed), and writes their results into the batch buffers the
connection mapped. What an env returns is checked on the way (:mod:`clusterenv_core.env_output`).

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

from collections.abc import Callable
from typing import Any

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.env_output import checked_env, checked_reset, checked_step
from clusterenv_core.errors import InvalidEnvOutput
from clusterenv_core.protocol import RESTART_INFO_KEY
from clusterenv_core.worker.remote_failure import RemoteFailure


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
                        raise RemoteFailure(
                            slot, "reset of a replaced env", self._obs_error(obs, write_error)
                        ) from error
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
        return step_parts(
            infos=infos, reset_infos=reset_infos, final_obs=final_obs, obs=pickled_obs, env_restarts=self.replaced
        )

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
        return step_parts(infos=infos, obs=pickled_obs)

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


def step_parts(**parts: dict) -> dict | None:
    """Only the non-empty parts (a :data:`~clusterenv_core.protocol.StepParts`), or ``None``."""
    kept = {key: value for key, value in parts.items() if value}
    return kept or None
