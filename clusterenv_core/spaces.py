"""How Gymnasium spaces map onto fixed-size numpy buffers.

A :class:`SpaceLayout` turns a single-env space into named *fields*, each a ``(num_envs, *shape)``
array of one dtype, so a batch of observations or actions can live in preallocated (shared)
memory: ``Box``, ``Discrete``, ``MultiDiscrete`` and ``MultiBinary`` are one field each, ``Dict``
and ``Tuple`` of those are one field per leaf. Any other space (``Graph``, ``Sequence``, ``Text``,
custom spaces) has no fields and travels pickled instead; ``layout.buffered`` tells which.

The batched structure matches gymnasium's ``create_empty_array``: an array for a leaf, a ``dict``
for a ``Dict`` space and a ``tuple`` for a ``Tuple`` space.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from gymnasium import spaces

from clusterenv_core.errors import SpaceMismatchError

LEAF_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)

#: The mapping type of gymnasium's own Dict values (``OrderedDict`` on 0.29, ``dict`` on 1.x), in
#: which ``SyncVectorEnv``'s ``iterate`` hands Dict actions to the envs.
GYMNASIUM_DICT: type = type(spaces.Dict({}).spaces)


@dataclass(frozen=True)
class Field:
    """One buffer: ``shape`` and ``dtype`` of a single env's value."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def _leaf_shape(space: spaces.Space) -> tuple[int, ...]:
    return () if isinstance(space, spaces.Discrete) else tuple(space.shape)


class SpaceLayout:
    """The buffer fields of a space and the conversions between values and buffer rows.

    :param space: the single-env space
    :param prefix: prefix of the field names (``"obs"``, ``"act"``, ...)
    :param dict_type: the mapping type :meth:`read` builds for ``Dict`` spaces
    """

    def __init__(self, space: spaces.Space, prefix: str, dict_type: type = dict) -> None:
        self.space = space
        self.prefix = prefix
        self.dict_type = dict_type
        self.fields: list[Field] = []
        # The tree mirrors the space: a field index at a leaf, ("dict", keys, children) or ("tuple", children).
        self._tree = self._build(space, prefix)
        self.buffered = self._tree is not None
        if len({field.name for field in self.fields}) < len(self.fields):  # keys of one repr: numbered apart
            self.fields = [replace(field, name=f"{field.name}#{i}") for i, field in enumerate(self.fields)]

    def _build(self, space: spaces.Space, name: str) -> Any:
        if isinstance(space, LEAF_SPACES):
            self.fields.append(Field(name, _leaf_shape(space), np.dtype(space.dtype)))
            return len(self.fields) - 1
        # Names are paths as the value is indexed (obs['a']['b'], obs['a.b'], obs[0]): distinct for
        # distinct leaves, as each names its buffer.
        if isinstance(space, spaces.Dict):
            children = [self._build(sub, f"{name}[{key!r}]") for key, sub in space.spaces.items()]
            return None if any(c is None for c in children) else ("dict", list(space.spaces), children)
        if isinstance(space, spaces.Tuple):
            children = [self._build(sub, f"{name}[{i}]") for i, sub in enumerate(space.spaces)]
            return None if any(c is None for c in children) else ("tuple", children)
        return None

    def writer(self, arrays: list[np.ndarray]) -> Callable[[int, Any], None]:
        """A function ``(row, value)`` storing into ``arrays`` as :meth:`write` does, with no tree walk
        and no conversion for one-field spaces when the value is already an array of the field's kind."""
        if isinstance(self._tree, int):
            array, field = arrays[self._tree], self.fields[self._tree]
            shape, dtype, setitem = field.shape, field.dtype, array.__setitem__

            def write(row: int, value: Any) -> None:
                if type(value) is np.ndarray and value.dtype is dtype and value.shape == shape:
                    setitem(row, value)
                else:
                    _store(field, array, row, value)

            return write
        return functools.partial(self.write, arrays)

    def reader(self, arrays: list[np.ndarray], dtypes: list[np.dtype] | None = None) -> Callable[[int], Any]:
        """A function ``row -> value`` equivalent to :meth:`read`, with no tree walk for one-field spaces."""
        if isinstance(self._tree, int):
            array = arrays[self._tree]
            dtype = array.dtype if dtypes is None else dtypes[self._tree]
            if array.ndim == 1:
                if dtype == array.dtype:
                    return array.__getitem__  # numpy scalars are immutable: no copy needed
                scalar = dtype.type
                return lambda row: scalar(array[row])
            if dtype == array.dtype:
                return lambda row: array[row].copy()
            return lambda row: array[row].astype(dtype)
        return functools.partial(self.read, arrays, dtypes=dtypes)

    def batch(self, arrays: list[np.ndarray]) -> Any:
        """The batched value whose leaves are ``arrays`` (one per field, in field order)."""
        return self._batch(self._tree, arrays)

    def _batch(self, node: Any, arrays: list[np.ndarray]) -> Any:
        if isinstance(node, int):
            return arrays[node]
        if node[0] == "dict":
            return {key: self._batch(child, arrays) for key, child in zip(node[1], node[2])}
        return tuple(self._batch(child, arrays) for child in node[1])

    def write(self, arrays: list[np.ndarray], row: int, value: Any) -> None:
        """Store one env's ``value`` at ``row`` of ``arrays``, as ``SyncVectorEnv`` batches it: each
        leaf of exactly its field's shape, and of a dtype that casts to the field's within its kind
        (a float64 observation of a float32 Box, as envs often return). Anything else raises
        (:meth:`mismatch` says what), where a numpy assignment would broadcast a scalar over the row
        or truncate floats into an integer field."""
        self._write(self._tree, arrays, row, value)

    def _write(self, node: Any, arrays: list[np.ndarray], row: int, value: Any) -> None:
        if isinstance(node, int):
            _store(self.fields[node], arrays[node], row, value)
        elif node[0] == "dict":
            if len(value) != len(node[1]):  # extra keys would be dropped without a word
                raise ValueError(f"{len(value)} keys where the space has {len(node[1])}")
            for key, child in zip(node[1], node[2]):
                self._write(child, arrays, row, value[key])
        else:
            if len(value) != len(node[1]):  # zip would drop extra items, or leave old ones
                raise ValueError(f"{len(value)} items where the space has {len(node[1])}")
            for child, item in zip(node[1], value):
                self._write(child, arrays, row, item)

    def mismatch(self, value: Any) -> str:
        """What in ``value`` does not fit the space: for error messages, after a write failed."""
        return self._mismatch(self._tree, value, self.prefix)

    def _mismatch(self, node: Any, value: Any, where: str) -> str:
        if isinstance(node, int):
            field = self.fields[node]
            try:
                array = np.asarray(value)
            except Exception as error:
                return f"{where}: {describe(value)} is no array ({error})"
            problem = _leaf_misfit(field, array)
            return f"{where}: {problem}" if problem else ""
        if node[0] == "dict":
            if not isinstance(value, dict):
                return f"{where}: {describe(value)} where the space has a dict with keys {node[1]}"
            missing = [key for key in node[1] if key not in value]
            extra = [key for key in value if key not in node[1]]
            if missing or extra:
                return f"{where}: keys {sorted(value)} where the space has {node[1]} (missing {missing}, extra {extra})"
            problems = (self._mismatch(child, value[key], f"{where}[{key!r}]") for key, child in zip(node[1], node[2]))
        else:
            if not isinstance(value, (tuple, list)) or len(value) != len(node[1]):
                return f"{where}: {describe(value)} where the space has a tuple of {len(node[1])}"
            problems = (self._mismatch(child, item, f"{where}[{i}]") for i, (child, item) in enumerate(zip(node[1], value)))
        return next((problem for problem in problems if problem), "")

    def read(self, arrays: list[np.ndarray], row: int, dtypes: list[np.dtype] | None = None) -> Any:
        """One env's value at ``row`` as an independent copy (numpy scalar for 0-d leaves), each
        leaf of its array's dtype or, given ``dtypes`` (one per field), of that."""
        return self._read(self._tree, arrays, row, dtypes)

    def _read(self, node: Any, arrays: list[np.ndarray], row: int, dtypes: list[np.dtype] | None) -> Any:
        if isinstance(node, int):
            value = arrays[node][row]
            if dtypes is not None and dtypes[node] != value.dtype:
                return value.astype(dtypes[node]) if isinstance(value, np.ndarray) else dtypes[node].type(value)
            return value.copy() if isinstance(value, np.ndarray) else value
        if node[0] == "dict":
            return self.dict_type((key, self._read(child, arrays, row, dtypes)) for key, child in zip(node[1], node[2]))
        return tuple(self._read(child, arrays, row, dtypes) for child in node[1])

    def conforms(self, value: Any) -> bool:
        """Whether ``value`` is stored losslessly by :meth:`write` and read back as an equal, same-typed value.

        Values that do not conform (a float64 array for a float32 Box, a Python int for a Discrete)
        are sent pickled where returning exactly what the env produced matters (final observations).
        """
        return self._conforms(self._tree, value)

    def _conforms(self, node: Any, value: Any) -> bool:
        if isinstance(node, int):
            field = self.fields[node]
            # Exact types: a subclass (a masked array, say) would read back as the plain type.
            if field.shape == ():
                return type(value) is field.dtype.type
            return type(value) is np.ndarray and value.dtype == field.dtype and value.shape == field.shape
        if node[0] == "dict":
            # A plain dict in the space's key order reads back identical; an OrderedDict or another
            # key order would not.
            return (
                type(value) is dict
                and list(value) == node[1]
                and all(self._conforms(child, value[key]) for key, child in zip(node[1], node[2]))
            )
        return (
            type(value) is tuple
            and len(value) == len(node[1])
            and all(self._conforms(child, item) for child, item in zip(node[1], value))
        )

    def check_batch(self, batch: Any, num_envs: int) -> list[np.ndarray]:
        """Validate a batch of ``num_envs`` values (e.g. actions) and return it as one array per field.

        :raises TypeError: a scalar, or a container of the wrong type, where a batch belongs
        :raises ValueError: wrong keys, lengths or shapes, or values that the field's dtype cannot
            hold (NaN or fractional values for integer spaces, out-of-range integers)
        """
        if isinstance(self._tree, int):  # one field: the batch is its array (every step goes here)
            return [_as_field_array(self.fields[self._tree], batch, num_envs)]
        leaves: list[np.ndarray] = [None] * len(self.fields)  # type: ignore[list-item]
        self._collect(self._tree, batch, leaves, num_envs)
        return leaves

    def stack(self, values: Any, num_envs: int) -> list[np.ndarray]:
        """Validate per-env values (``values[i]`` is env ``i``'s, SB3's ``DummyVecEnv`` convention)
        and return them as one array per field, as :meth:`check_batch` does for a batch.

        For a one-field space the two forms coincide, so no per-env loop runs.

        :raises TypeError: ``values`` is not a sequence
        :raises ValueError: not ``num_envs`` values, or a value of the wrong structure or shape
        """
        if isinstance(self._tree, int):
            return self.check_batch(values, num_envs)
        if isinstance(values, (dict, str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"{self.prefix}: expected a sequence of {num_envs} values (one per env), got {type(values).__name__}")
        if len(values) != num_envs:
            raise ValueError(f"{self.prefix}: expected {num_envs} values (one per env), got {len(values)}")
        columns: list[list] = [[] for _ in self.fields]
        for index in range(num_envs):
            self._split(self._tree, values[index], columns, f"{self.prefix}[{index}]")
        return [_as_field_array(field, column, num_envs) for field, column in zip(self.fields, columns)]

    def _split(self, node: Any, value: Any, columns: list[list], where: str) -> None:
        """Append the leaves of one env's ``value`` to the per-field ``columns``."""
        if isinstance(node, int):
            columns[node].append(value)
        elif node[0] == "dict":
            _check_dict(value, node[1], where)
            for key, child in zip(node[1], node[2]):
                self._split(child, value[key], columns, f"{where}[{key!r}]")
        else:
            _check_tuple(value, len(node[1]), where)
            for position, (child, item) in enumerate(zip(node[1], value)):
                self._split(child, item, columns, f"{where}[{position}]")

    def _collect(self, node: Any, batch: Any, leaves: list, num_envs: int) -> None:
        # Like SyncVectorEnv's iterate, a batch is read by the space's keys and positions: entries
        # beyond them (log-probabilities kept with the actions, say) are ignored.
        if isinstance(node, int):
            field = self.fields[node]
            leaves[node] = _as_field_array(field, batch, num_envs)
        elif node[0] == "dict":
            _check_dict(batch, node[1], self.prefix, exact=False)
            for key, child in zip(node[1], node[2]):
                self._collect(child, batch[key], leaves, num_envs)
        else:
            _check_tuple(batch, len(node[1]), f"{self.prefix} (a tuple of batches, one per subspace)", exact=False)
            for child, item in zip(node[1], batch):
                self._collect(child, item, leaves, num_envs)


def action_buffer_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of the buffer that carries actions of a field of ``dtype`` to the workers: wide
    enough to hold the values of a batch of another numeric dtype exactly, so that envs can get
    the batch's dtype (see :func:`delivered_dtype`)."""
    if dtype.kind == "f":
        return np.dtype(np.float64)
    if dtype.kind == "u" and dtype.itemsize == 8:
        return dtype
    if dtype.kind in "iu":
        return np.dtype(np.int64)
    return dtype


def delivered_dtype(dtype: np.dtype, batch_dtype: np.dtype) -> np.dtype:
    """The dtype in which envs get the actions of a field of ``dtype`` from a batch of
    ``batch_dtype`` (validated by :meth:`SpaceLayout.check_batch`): the batch's, as DummyVecEnv and
    SyncVectorEnv hand actions on, when the buffer carries its values exactly (float32 actions of
    SB3 for an int8 MultiBinary space, float64 ones for a float32 Box), else the field's."""
    if batch_dtype == dtype:
        return dtype
    kind, size = batch_dtype.kind, batch_dtype.itemsize
    if dtype.kind == "f":
        exact = kind == "f" and size <= 8 or kind in "biu" and size <= 4
    elif dtype.kind in "iu":
        exact = kind in "biuf" and size <= 8  # the batch's values are integers in the field's range
    else:
        exact = False
    return batch_dtype if exact else dtype


def _store(field: Field, array: np.ndarray, row: int, value: Any) -> None:
    """Store one leaf value at ``row`` of its field's ``array`` (see :meth:`SpaceLayout.write`)."""
    if type(value) is not np.ndarray or value.dtype != field.dtype or value.shape != field.shape:
        value = np.asarray(value)
        problem = _leaf_misfit(field, value)
        if problem:
            raise ValueError(f"{field.name}: {problem}")
    array[row] = value


def _leaf_misfit(field: Field, value: np.ndarray) -> str:
    """Why ``value`` cannot be stored in ``field`` ("" if it can): SyncVectorEnv's rule, an exact
    shape and a dtype that casts within its kind."""
    if value.shape != field.shape:
        return f"shape {value.shape} where the space has {field.shape}"
    if not np.can_cast(value.dtype, field.dtype, casting="same_kind"):
        return f"dtype {value.dtype} where the space has {field.dtype}"
    return ""


def _check_dict(value: Any, keys: list, where: str, exact: bool = True) -> None:
    """A dict with the space's ``keys``, and with no other unless ``exact`` is false."""
    if not isinstance(value, dict):
        raise TypeError(f"{where}: expected a dict with keys {keys}, got {type(value).__name__}")
    if set(value) != set(keys) if exact else not set(keys) <= set(value):
        raise ValueError(f"{where}: expected a dict with keys {keys}, got {sorted(value, key=str)}")


def _check_tuple(value: Any, length: int, where: str, exact: bool = True) -> None:
    """A tuple (or list) of ``length`` items, or of more unless ``exact`` is false."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{where}: expected a tuple of {length}, got {type(value).__name__}")
    if len(value) != length if exact else len(value) < length:
        raise ValueError(f"{where}: expected a tuple of {length}, got {len(value)}")


def _as_field_array(field: Field, batch: Any, num_envs: int) -> np.ndarray:
    array = np.asarray(batch)
    expected = (num_envs, *field.shape)
    if array.shape != expected:
        if array.ndim == 0:
            # A scalar is no batch at all, whatever num_envs is (SyncVectorEnv raises TypeError too).
            raise TypeError(f"{field.name}: expected a batch of shape {expected} (num_envs, *space shape), got a scalar")
        raise ValueError(f"{field.name}: expected shape {expected} (num_envs, *space shape), got {array.shape}")
    if field.dtype.kind in "iub":
        if array.dtype.kind == "f":
            if not np.all(np.isfinite(array)):
                raise ValueError(f"{field.name}: NaN or infinite values for an integer space")
            if not np.all(array == np.round(array)):
                raise ValueError(f"{field.name}: fractional values for an integer space")
        elif array.dtype.kind not in "iub":
            raise ValueError(f"{field.name}: dtype {array.dtype} cannot hold values of an integer space")
        if array.dtype != field.dtype and array.size:
            info = np.iinfo(field.dtype) if field.dtype.kind != "b" else None
            if info is not None and (array.min() < info.min or array.max() > info.max):
                raise ValueError(f"{field.name}: values out of range of {field.dtype}")
    elif field.dtype.kind in "fc" and array.dtype.kind not in "biufc":
        raise ValueError(f"{field.name}: dtype {array.dtype} is not numeric")
    elif field.dtype.kind == "f" and array.dtype.kind == "c":
        # Storing them would drop the imaginary parts with no more than numpy's warning.
        raise ValueError(f"{field.name}: complex values for a real space")
    return array


def common_spaces(
    per_env: list[tuple[spaces.Space, spaces.Space]], observation_spaces_fit: Callable[[Any, Any], bool] | None = None
) -> tuple[spaces.Space, spaces.Space]:
    """The ``(observation_space, action_space)`` every env shares (env 0's), or
    :class:`~clusterenv_core.errors.SpaceMismatchError` naming the first env that differs.

    :param observation_spaces_fit: ``fit(space, first)``, whether an env's observation space may
        stand with env 0's (default: equality)
    """
    observation_space, action_space = per_env[0]
    for index, (env_observation_space, env_action_space) in enumerate(per_env):
        if observation_spaces_fit is not None:
            if not observation_spaces_fit(env_observation_space, observation_space):
                raise SpaceMismatchError(
                    f"env {index} has observation space {env_observation_space}, env 0 has {observation_space}: "
                    "they do not share a dtype and shape"
                )
        elif not _equal_spaces(env_observation_space, observation_space):
            raise SpaceMismatchError(
                f"env {index} has observation space {env_observation_space}, env 0 has {observation_space}: "
                "all envs of a pool must share their spaces"
            )
        if not _equal_spaces(env_action_space, action_space):
            raise SpaceMismatchError(
                f"env {index} has action space {env_action_space}, env 0 has {action_space}: "
                "all envs of a pool must share their spaces"
            )
    return observation_space, action_space


def _equal_spaces(space: spaces.Space, other: spaces.Space) -> bool:
    """Equal, or pickled alike: a custom space that compares by identity (it defines no ``__eq__``)
    and that every env shares, as a module's constant, arrives as one copy per worker."""
    if space == other:
        return True
    try:
        return type(space) is type(other) and pickle.dumps(space) == pickle.dumps(other)
    except Exception:
        return False


def describe(value: Any) -> str:
    """A short description of a value's type and shape, for error messages."""
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {value.shape}"
    if isinstance(value, np.generic):
        return f"numpy {type(value).__name__}"
    if isinstance(value, dict):
        return f"{type(value).__name__} with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
