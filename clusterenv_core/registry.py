"""The learner's gymnasium env registry, rebuilt on every worker.

Workers are fresh interpreters: an id the learner registered -- in its script (``gym.register``
with a class from ``__main__`` or a ``"module:attr"`` string), or by importing an env package such
as ``ale_py`` -- does not exist there, so ``gym.make(id)`` inside an env factory would fail. The
pool therefore ships a snapshot of the learner's registry in every worker's init message, and the
worker, before it builds any env:

1. imports the env packages the learner had imported whose ids it lacks, so that packages which
   register on import do so as they did in the learner (no "Overriding environment" warnings when
   a factory imports them later);
2. installs every learner spec it still lacks or holds differently, exactly as the learner holds it
   (entry point, kwargs, ``max_episode_steps``, wrappers, ...).

Specs travel with cloudpickle, each on its own: entry points defined in the learner's script go by
value, everything else by reference. A spec that cannot be pickled is a ``ValueError`` naming its
id at construction; one that cannot be rebuilt on a worker (its module is missing there) becomes a
spec whose ``gym.make`` raises that reason, so only a pool that uses it fails, and says why.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys
from typing import Any, NamedTuple

from clusterenv_core.protocol import dumps_code

_MAIN = "__main__"


class ShippedSpec(NamedTuple):
    """One learner spec on its way to the workers."""

    env_id: str
    spec: bytes  # cloudpickled EnvSpec
    package: str | None  # top-level package of its entry point, imported in the learner
    main_attribute: bytes | None  # (name, object) of a "__main__:name" entry point, cloudpickled


def snapshot() -> list[ShippedSpec]:
    """The learner's registry, ready to ship.

    :raises ValueError: a registered spec cannot be pickled (its id and the reason are named)
    """
    import gymnasium

    shipped = []
    for env_id, spec in list(gymnasium.registry.items()):
        try:
            pickled = dumps_code(spec)
            main_attribute = _main_attribute(spec)
        except Exception as error:
            raise ValueError(
                f"the env id {env_id!r} registered in this process cannot be shipped to the workers: its spec "
                f"cannot be pickled ({type(error).__name__}: {error}). Register it with a picklable entry point "
                f"and kwargs, or remove it with gymnasium.registry.pop({env_id!r}) if this pool does not use it"
            ) from error
        shipped.append(ShippedSpec(env_id, pickled, _imported_package(spec), main_attribute))
    return shipped


def install(shipped: list[ShippedSpec]) -> None:
    """Make this process's registry hold the learner's specs (worker side)."""
    import gymnasium

    registry = gymnasium.registry
    missing = [item for item in shipped if item.env_id not in registry]
    for package in sorted({item.package for item in missing if item.package and item.package not in sys.modules}):
        try:
            importlib.import_module(package)
        except Exception:
            pass  # the spec is installed regardless; gym.make then reports the import error itself
    for item in shipped:
        try:
            spec = pickle.loads(item.spec)
            if item.main_attribute is not None:
                spec = _provide_main_attribute(spec, *pickle.loads(item.main_attribute))
        except Exception as error:
            if item.env_id not in registry:
                registry[item.env_id] = _unavailable_spec(item.env_id, error)
            continue
        if not _same(registry.get(item.env_id), spec):
            # What gym.register does after its checks, without its warning: the learner's spec wins.
            registry[item.env_id] = spec


def _main_attribute(spec: Any) -> bytes | None:
    """For a ``"__main__:name"`` entry point, the object it names in the learner, pickled."""
    entry_point = spec.entry_point
    if not isinstance(entry_point, str) or ":" not in entry_point:
        return None
    module, name = entry_point.split(":", 1)
    if module != _MAIN or not hasattr(sys.modules[_MAIN], name):
        return None
    return dumps_code((name, getattr(sys.modules[_MAIN], name)))


def _provide_main_attribute(spec: Any, name: str, value: Any) -> Any:
    """Make ``"__main__:name"`` resolve here as in the learner.

    The worker's ``__main__`` gets the attribute. A ``__main__`` that has it already is either the
    user's script (an SPMD MPI rank runs it too: its own definition serves) or the worker program,
    whose names must stay its own: then the spec gets the object as its entry point instead.
    """
    main = sys.modules[_MAIN]
    if not hasattr(main, name):
        setattr(main, name, value)
        return spec
    main_spec = getattr(main, "__spec__", None)
    if main_spec is not None and main_spec.name == "clusterenv_core.worker.__main__":
        return dataclasses.replace(spec, entry_point=value)
    return spec


def _imported_package(spec: Any) -> str | None:
    """The top-level package of the spec's entry point, if the learner has imported it."""
    entry_point = spec.entry_point if spec.entry_point is not None else getattr(spec, "vector_entry_point", None)
    if isinstance(entry_point, str):
        module = entry_point.split(":")[0]
    else:
        module = getattr(entry_point, "__module__", None) or ""
    package = module.split(".")[0]
    if not package or package == _MAIN or package not in sys.modules:
        return None
    return package


def _same(installed: Any, spec: Any) -> bool:
    if installed is None:
        return False
    try:
        return bool(installed == spec)
    except Exception:  # kwargs holding arrays, or objects whose comparison raises
        return False


def _unavailable_spec(env_id: str, error: BaseException) -> Any:
    from gymnasium.envs.registration import EnvSpec

    reason = f"{type(error).__name__}: {error}"
    return EnvSpec(id=env_id, entry_point=_Unavailable(env_id, reason))


class _Unavailable:
    """Entry point of a learner spec that could not be rebuilt here: making it raises why."""

    def __init__(self, env_id: str, reason: str) -> None:
        self.env_id = env_id
        self.reason = reason

    def __call__(self, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"the env id {self.env_id!r} is registered in the learner, but its spec could not be rebuilt on this "
            f"worker: {self.reason}"
        )
