"""The wire protocol between the learner's pool and its workers, defined once.

The learner sends one message at a time to a worker and reads its reply before the next (the pool
may leave a reply unread only to read it later, in order; and it asks a worker that is collecting a
rollout segment to close without waiting for the segment, which the worker then ends early). A
message is one of the request types below, or the bare :data:`STEP`, which backends send without
pickling anything: the action rows are already in the shared buffers or travel as one buffer
message.

A reply is ``(OK, result)``, ``(ERROR, ErrorDetails)``, or, during a long operation (a rollout
segment), any number of interim ``(PROGRESS, steps_done)`` before the final one. What else travels
after a reply is declared per request type, so that backends move it without knowing any
operation (arrays that follow a request, policy weights where memory is not shared, are sent by the
request's caller with ``Transport.send_arrays`` and received by its handler):

- ``REPLY_ROWS``: an ``OK`` reply is followed by the worker's result rows (observations, rewards,
  flags): ``WorkerConnection.send_rows`` / ``Transport.recv_rows``.
- ``REPLY_ARRAYS``: an ``OK`` reply is followed by arrays of a region (the worker's rows of a
  rollout segment): ``WorkerConnection.send_arrays`` / ``Transport.recv_arrays``.

Adding an operation means a request type here, a handler in :mod:`clusterenv_core.worker.serving` and its
use in the pool; backends stay as they are.
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
import sys
import traceback
import types
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

STEP = "step"
"""The step request: every env of the block steps with its action row."""

OK = "ok"
ERROR = "error"
PROGRESS = "progress"
"""Status of an interim reply: the worker is still working (and how far it got). Waits on it
restart their timeout, so a timeout bounds the time without progress, not the whole operation."""

AUTORESET_MODES = ("same_step", "next_step", "disabled")

RESTART_INFO_KEY = "clusterenv_restart"
"""Info key of a step whose episode was cut short because its env or worker was replaced; the value says why."""


class Request:
    """Base of the request types: what the backends may ask of one."""

    REPLY_ROWS: ClassVar[bool] = False
    REPLY_ARRAYS: ClassVar[bool] = False
    #: answering may mean importing large modules (torch): the pool waits for the reply at least as
    #: long as for a starting worker, whatever its own timeout
    IMPORTS: ClassVar[bool] = False
    #: a request that comes in while the worker still answers this one ends it early: the reply
    #: covers what was done so far (the pool sends one only to close, and drops that reply)
    ENDED_BY_NEXT_REQUEST: ClassVar[bool] = False


# Request types. Env positions (``slots``) count from the worker's first env, 0 to block size - 1.


@dataclass(frozen=True)
class Init(Request):
    """Build the block's envs; the reply is :class:`BlockDescription`."""

    # The block's env factories: its distinct factory objects pickled together, so that what they
    # share (a factory given for several envs, an array they close over) travels and is unpickled
    # once, as the learner holds it once; and the factory of each env of the block.
    env_fns: bytes  # cloudpickled list of the block's distinct factories, in the order of first use
    env_factories: list[int]  # per env of the block: its factory in that list
    first_index: int  # global index of the block's first env
    worker: int  # the worker's index: how a node agent names itself in the infos of its replacements
    autoreset_mode: str
    max_env_restarts: int  # how often one env that raises in step may be rebuilt (0: never)
    restarted: bool  # the block replaces a lost worker's
    env_restarts: list[int]  # replacements of each env of the block so far (a budget carried over)
    interpreter: Any  # the learner's import path, module files, warning filters (interpreter.LearnerInterpreter)
    registry: list  # the learner's env registry (clusterenv_core.registry.ShippedSpec)
    processes: int  # local processes the worker steps its block on (>1: a node agent, node_agent.py)
    # A node agent's: how often each of its local processes may be replaced when lost in a step
    # (restart_failed_workers; None: not replaced, the loss is the agent's error).
    max_process_restarts: int | None
    timeout: float  # the pool's: how long a node agent waits for its local processes (node_agent.agent_allowance)


@dataclass(frozen=True)
class Attach(Request):
    """Map the batch buffers laid out by ``spec``; ``block`` holds the worker's global env indices."""

    spec: Any  # clusterenv_core.buffers.BatchSpec
    block: range


@dataclass(frozen=True)
class Actions(Request):
    """The next step's actions of a space without buffers, one object per env of the block."""

    actions: list


@dataclass(frozen=True)
class ActionDtypes(Request):
    """From the next step on, give envs their actions in ``dtypes`` (one per action field): the
    learner's batches changed dtype, and envs get the dtype of the batch, as DummyVecEnv and
    SyncVectorEnv hand actions on."""

    dtypes: tuple


RESET_KEYWORDS = ("seed", "options")
"""The keywords a :class:`Reset` passes to each env's ``reset``."""


@dataclass(frozen=True)
class Reset(Request):
    """Reset the envs selected by ``mask`` (all when ``None``) with ``env.reset(seed=..., options=...)``,
    leaving out the keywords named in ``omit_if_none`` where their value is ``None``: the baselines
    differ in what they pass (SB3's vec envs pass ``options`` only when set, gymnasium 0.29's
    ``SyncVectorEnv`` neither keyword when ``None``), and the caller chooses. The reply's result is
    a :class:`StepParts` dict (infos, pickled observations) or ``None``."""

    REPLY_ROWS: ClassVar[bool] = True

    seeds: list
    options: list
    mask: list[bool] | None
    omit_if_none: tuple[str, ...]  # some of RESET_KEYWORDS


@dataclass(frozen=True)
class Preload(Request):
    """Import ``modules`` now, before a request that needs them (a deployed policy needs torch)."""

    IMPORTS: ClassVar[bool] = True

    modules: tuple[str, ...]


@dataclass(frozen=True)
class Deploy(Request):
    """Load the cloudpickled ``policy`` and map its weights region."""

    IMPORTS: ClassVar[bool] = True

    policy: bytes
    weights_handle: Any
    count: int  # number of weights
    seed: int | None  # of the worker's torch and numpy generators
    deliver: bool  # the weights follow as arrays


@dataclass(frozen=True)
class Weights(Request):
    """New weights follow as arrays (backends that do not share memory)."""


@dataclass(frozen=True)
class Rollout(Request):
    """Collect ``n_steps`` steps of every env with the deployed policy into the region ``handle``;
    the result is ``{"seconds": <how long the worker took>}`` and, when any step returned more
    than the buffers hold, ``"steps": {t: StepParts}``; a node agent's also names the local
    processes it replaced in the segment (``"process_restarts"``) and their envs, whose part was
    collected anew (``"restarted_envs"``); the segment's rows follow."""

    REPLY_ROWS: ClassVar[bool] = True  # the observations after the segment
    REPLY_ARRAYS: ClassVar[bool] = True  # the worker's rows of the segment region
    ENDED_BY_NEXT_REQUEST: ClassVar[bool] = True  # close() waits one step, not a whole segment

    n_steps: int
    context: dict
    handle: Any
    block: range
    num_envs: int
    report_every: float  # seconds between PROGRESS replies
    timeout: float  # seconds a worker may go without progress (a node agent's local processes too)


@dataclass(frozen=True)
class Call(Request):
    """Call (or get, if not callable) attribute ``name`` of the envs at ``slots``; one result each.
    With ``through_wrappers`` the name is looked up with ``get_wrapper_attr`` (gymnasium 1.x, SB3),
    else with ``getattr`` (gymnasium 0.29's ``SyncVectorEnv``, whose wrappers refuse private names)."""

    name: str
    args: tuple
    kwargs: dict
    slots: list[int]
    require_callable: bool
    through_wrappers: bool


@dataclass(frozen=True)
class GetAttr(Request):
    name: str
    slots: list[int]
    through_wrappers: bool


@dataclass(frozen=True)
class SetAttr(Request):
    name: str
    values: list
    slots: list[int]
    through_wrappers: bool


@dataclass(frozen=True)
class IsWrapped(Request):
    wrapper_class: type
    slots: list[int]


@dataclass(frozen=True)
class Close(Request):
    """Close the envs and exit after replying; a ``(PROGRESS, env_index)`` reply comes before each
    env's ``close()``."""


# Replies.


class BlockDescription(NamedTuple):
    """What a worker reports once its envs exist."""

    spaces: list  # (observation_space, action_space) of each env
    metadata: dict
    render_mode: str | None
    spec: Any


class ErrorDetails(NamedTuple):
    """A failure on a worker, by the env it happened in."""

    env_index: int | None
    operation: str
    exc_type: str  # qualified name of the exception's type
    message: str
    traceback: str
    env_restarts: tuple[int, ...] = ()  # envs replaced in the same step before the failure


# The result of a step or reset (and of each rollout step) names what could not go through the
# buffers, each part only when not empty: "infos", "reset_infos", "final_obs" (final observations
# that do not fit the buffers) and "obs" (observations of spaces without buffers), each a dict by
# global env index; "env_restarts", the list of the envs replaced (restart_failed_envs); and a node
# agent's "process_restarts", the local processes it replaced (restart_failed_workers), which the
# learner counts as replaced workers (a segment's result names them once, beside its "steps").
StepParts = dict

OK_NONE = (OK, None)


# numpy scalars (the values of MuJoCo's infos, among others) pickle through numpy's own reduce at
# about 2 µs each: 58 µs for one step of 8 HalfCheetah infos, 3.5 ms for a 64-step rollout segment.
# Rebuilt from their Python value they cost a third of that, and come back as the same type with the
# same value: integers and float64 hold theirs exactly, float16/float32 widen to a double exactly.
_SCALAR_VALUES: dict[type, type] = {np.bool_: bool, np.float16: float, np.float32: float, np.float64: float}
_SCALAR_VALUES.update(dict.fromkeys(
    (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64), int
))


SCALAR_TYPES = tuple(_SCALAR_VALUES)  # the numpy scalar types that pickle by value


def _reduce_scalar(value: np.generic) -> tuple:
    scalar_type = type(value)
    return scalar_type, (_SCALAR_VALUES[scalar_type](value),)


class _Pickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, **dict.fromkeys(_SCALAR_VALUES, _reduce_scalar)}


def dumps(obj: Any) -> bytes:
    """Pickle (numpy scalars by value, see above), falling back to :func:`dumps_code` for closures,
    lambdas and anything that refers to the running script (a class or function the user's script
    defines, passed in reset options, ``set_attr`` or ``call``)."""
    if type(obj) is tuple and len(obj) == 2 and obj[1] is None:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # (OK, None): no pickler to set up
    try:
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        data = buffer.getvalue()
    except Exception:
        return dumps_code(obj)
    # Plain pickle refers to a class or function of the running script by name, which a worker, whose
    # __main__ is not the script, cannot resolve. Two scans of the bytes: 0.8 µs for a HalfCheetah
    # reply (a generator over the names took 1.3); a string that merely holds a name costs only speed.
    if b"__main__" in data or b"__mp_main__" in data:
        return dumps_code(obj)
    return data


class Unreadable(NamedTuple):
    """A message that arrived whole but cannot be unpickled where it arrived (it holds an object of a
    module that process cannot import). It has the shape of an error reply, so a learner reads it
    as the worker's error, and a worker answers with it; either way the stream keeps its place and
    the worker lives on."""

    status: str
    details: ErrorDetails


def loads(data: Any, receiver: str) -> Any:
    """Unpickle a message, or return :class:`Unreadable` if ``receiver`` ("the learner", "the
    worker") cannot."""
    try:
        return pickle.loads(data)
    except Exception as error:
        details = ErrorDetails(
            env_index=None,
            operation="unpickling a message",
            exc_type="pickle.UnpicklingError",  # not the cause's type: an AttributeError here is no missing attribute
            message=f"{receiver} cannot unpickle the message ({type(error).__name__}: {error}); what travels "
            "between the learner and its workers must unpickle on both sides, its classes importable there",
            traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)),
        )
        return Unreadable(ERROR, details)


def dumps_code(obj: Any) -> bytes:
    """Cloudpickle what carries code to the workers: env factories, registry specs, policies.

    Workers cannot import the learner's script, so cloudpickle sends what its ``__main__`` defines
    by value. A learner that runs in a ``multiprocessing`` spawn or forkserver child (a pool of
    training runs, say) has its script as ``__mp_main__``, which cloudpickle would send by
    reference, to workers that have no such module: that module goes by value too. Code sent by
    value keeps the file it came from (cloudpickle names it ``<dynamic-code>``), so that warnings
    and tracebacks from it name the script's file and line, and show its source, as in the learner.
    """
    import cloudpickle

    script = sys.modules.get("__mp_main__")
    if script is not None and script.__name__ == "__mp_main__":
        cloudpickle.register_pickle_by_value(script)
    with io.BytesIO() as file:
        _code_pickler(cloudpickle.Pickler)(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return file.getvalue()


@functools.cache
def _code_pickler(base: type) -> type:
    """A subclass of cloudpickle's pickler (``base``) that keeps the file name of code objects."""

    class CodePickler(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._copies: dict[int, types.CodeType] = {}  # the copies pickled by cloudpickle, by id

        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is types.CodeType and id(obj) not in self._copies:
                # A copy: pickle's memo holds it apart from ``obj``, which becomes the named one.
                copy = obj.replace()
                self._copies[id(copy)] = copy
                return _code_in_file, (copy, obj.co_filename)
            return super().reducer_override(obj)

    return CodePickler


def _code_in_file(code: types.CodeType, filename: str) -> types.CodeType:
    return code.replace(co_filename=filename)


# Modules every process has (or that a pickle names for its own machinery): nothing to import ahead.
_NOT_WORTH_IMPORTING = {"__main__", "__mp_main__", "builtins", "copyreg", "_codecs", "cloudpickle"}


def modules_named(pickles: list[bytes]) -> list[str]:
    """The modules that unpickling ``pickles`` imports, as far as this process knows them: the
    pickles' strings that name a module this process has imported (a class or function pickled by
    reference names its module that way)."""
    import pickletools

    named: dict[str, None] = {}  # ordered: imports run in the order the pickles name them
    for data in dict.fromkeys(pickles):  # copies of one factory's pickle alike: each read once
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL":
                argument = argument.split(" ")[0]
            elif not isinstance(argument, str) or "UNICODE" not in opcode.name:
                continue
            if argument in sys.modules and argument.split(".")[0] not in _NOT_WORTH_IMPORTING:
                named[argument] = None
    return list(named)
