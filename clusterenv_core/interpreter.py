"""What makes a worker's interpreter the learner's twin.

User code is written for the learner's process: its interpreter flags (``-W``, ``-X dev``, ``-O``,
...), its import path, the files its modules come from and its warning filters. A worker is another
interpreter, started (or forked from the fork server) before it knows what it will run. This module
carries the learner's over:

- :func:`child_command`: how a transport starts a module of ClusterEnv's in a child interpreter
  with the learner's flags and import path, from its first line (as ``multiprocessing`` passes its
  flags to the children it spawns);
- :class:`LearnerInterpreter`: the learner's import path, the files of the user's modules that the
  env factories name, and its warning filters, sent with every worker's
  :class:`~clusterenv_core.protocol.Init` and adopted by :meth:`LearnerInterpreter.adopt` on the
  worker before anything of the user's is unpickled. That covers every backend, MPI ranks that
  ``mpiexec`` started with flags of the user's choice included.

Standard library only: the local backend's bootstrap runs before the worker imports anything else.
"""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
import sysconfig
import warnings
from dataclasses import dataclass


def interpreter_flags(python: str) -> list[str]:
    """The command-line options that give the interpreter ``python`` this one's settings, when it is
    this interpreter: ``-O``, ``-B``, ``-I``/``-E``/``-s``, ``-W ...``, ``-X dev`` and the other
    ``-X`` options that ``sys`` records (what ``multiprocessing`` passes to the interpreters it
    spawns). Another interpreter gets none: its options may differ."""
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return []
    return [flag for flag in subprocess._args_from_interpreter_flags() if flag != "-P"]


def child_command(python: str, module: str, arguments: list[str]) -> list[str]:
    """The command that runs ``python -m module *arguments`` as the learner's twin.

    With this interpreter, the child gets its flags, and its import path before its first import: a
    module of ClusterEnv's, and whatever it imports, resolves to the learner's file, and nothing
    else comes first (``python -m`` would put the working directory first, and a ``PYTHONPATH``
    entry would put a source checkout's ``tests``, ``examples``, ... before the user's; ``-I`` and
    ``-E`` ignore ``PYTHONPATH`` anyway). Another interpreter only gets the directory ClusterEnv is
    imported from in front of its own path.
    """
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        # -P: with -c, no working directory in front of the path set below (Python 3.11+).
        flags, path = [*interpreter_flags(python), *(["-P"] if sys.version_info >= (3, 11) else [])], list(sys.path)
    else:
        flags, path = [], [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    return [python, *flags, "-c", _BOOTSTRAP, module, json.dumps(path), *arguments]


# Run the module named by the first argument as `python -m` would, with the import path the second
# one gives in front of the interpreter's own.
_BOOTSTRAP = (
    "import json, runpy, sys; module, path = sys.argv[1], json.loads(sys.argv[2]); del sys.argv[1:3]; "
    "sys.path[:] = path + [entry for entry in sys.path if entry not in path]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def site_roots() -> list[str]:
    """The directories installed packages live in (site-packages, the user's), each ending in a separator."""
    return sorted({os.path.realpath(root) + os.sep for root in (*site.getsitepackages(), site.getusersitepackages())})


def _installed_roots() -> list[str]:
    """Where installed packages and the standard library live: modules from there are the same on
    every worker of this interpreter, and never worth pinning to a file."""
    stdlib = [sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    return sorted({*site_roots(), *(os.path.realpath(root) + os.sep for root in stdlib if root)})


def user_module_files(names: list[str]) -> dict[str, tuple[str, list[str] | None]]:
    """For the modules ``names`` (and their parent packages) that are the user's own, not installed:
    the file each was imported from and, for a package, its search locations."""
    roots = _installed_roots()
    files: dict[str, tuple[str, list[str] | None]] = {}
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # parents first: a worker imports them first
            module_name = ".".join(parts[:depth])
            module = sys.modules.get(module_name)
            path = getattr(module, "__file__", None)
            if module_name in files or not isinstance(path, str) or module_name.startswith("clusterenv_"):
                continue
            path = os.path.realpath(path)
            if any(path.startswith(root) for root in roots):
                continue
            search = getattr(module, "__path__", None)
            files[module_name] = (path, list(search) if search is not None else None)
    return files


@dataclass(frozen=True)
class LearnerInterpreter:
    """What a worker takes over from the learner's interpreter before it unpickles the env factories.

    :param sys_path: the learner's import path, in its order
    :param module_files: the user's modules the factories name: file and package search locations
        of each (:func:`user_module_files`)
    :param warning_filters: the learner's ``warnings.filters``, each category of an importable module
        by name (:func:`_shippable_filter`)
    :param learner_pid: the learner's process id (an inline worker runs in it, and has nothing to adopt)
    """

    sys_path: list[str]
    module_files: dict[str, tuple[str, list[str] | None]]
    warning_filters: list[tuple]
    learner_pid: int

    @classmethod
    def capture(cls, module_names: list[str]) -> LearnerInterpreter:
        """This process's, for env factories that name the modules ``module_names``."""
        filters = [_shippable_filter(entry) for entry in warnings.filters]
        return cls(list(sys.path), user_module_files(module_names), filters, os.getpid())

    def adopt(self) -> None:
        """Make this worker's interpreter resolve imports and filter warnings as the learner does."""
        if os.getpid() == self.learner_pid:
            return
        path = self.sys_path
        # The worker's own entries last: an MPI rank on another host may need them.
        sys.path[:] = path + [entry for entry in sys.path if entry not in path]
        importlib.invalidate_caches()
        for name, (file, search) in self.module_files.items():
            _pin_module(name, file, search)
        _adopt_warning_filters(self.warning_filters)


def _pin_module(name: str, file: str, search: list[str] | None) -> None:
    """Make ``import name`` give the module of the learner's ``file`` (where this host has it): drop a
    module of that name imported from elsewhere, and load it from ``file`` if the path would find
    another (the learner may have imported it from a directory no longer on its path)."""
    if not os.path.exists(file):
        return  # another host without the learner's files: its own copy is all it has
    module = sys.modules.get(name)
    if module is not None:
        loaded = getattr(module, "__file__", None)
        if isinstance(loaded, str) and os.path.realpath(loaded) == file:
            return
        for other in [other for other in sys.modules if other == name or other.startswith(name + ".")]:
            del sys.modules[other]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    if isinstance(origin, str) and os.path.realpath(origin) == file:
        return  # an import finds the learner's file
    spec = importlib.util.spec_from_file_location(name, file, submodule_search_locations=search)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]  # unpickling the factory imports it again, and reports what fails


def _shippable_filter(entry: tuple) -> tuple:
    """A filter of ``warnings.filters`` with its category by ``(module, qualified name)``, unless
    builtin or the script's: a filter must not make a worker import the module of its category
    (torch, say, whose filters a learner that imported it has)."""
    action, message, category, module, lineno = entry
    if category.__module__ not in ("builtins", "__main__", "__mp_main__"):
        category = (category.__module__, category.__qualname__)
    return action, message, category, module, lineno


class _DeferredCategoryType(type):
    """The type of a filter's category whose module this worker has not imported: a warning is of
    it if its module is imported by then and the warning's category derives from it (before that, no
    warning can be: a subclass needs its base imported). The warnings module asks ``issubclass``."""

    def __subclasscheck__(cls, subclass: type) -> bool:
        module = sys.modules.get(cls.module_name)
        if module is None:
            return False
        category = module
        for name in cls.qualified_name.split("."):
            category = getattr(category, name, None)
        return isinstance(category, type) and issubclass(subclass, category)


def _category(category: type | tuple[str, str]) -> type:
    """The category of a shipped filter: the class itself, or one that stands for it until its
    module is imported."""
    if isinstance(category, type):
        return category
    module_name, qualified_name = category
    attributes = {"module_name": module_name, "qualified_name": qualified_name}
    return _DeferredCategoryType(f"{module_name}.{qualified_name}", (Warning,), attributes)


def _adopt_warning_filters(filters: list[tuple]) -> None:
    """Replace this process's warning filters by ``filters``, entry for entry. The public API cannot
    rebuild every entry (the interpreter's own match a module by a plain string, exactly), so the
    list is replaced, and the warnings module told, as its own ``filterwarnings`` does."""
    warnings.filters[:] = [
        (action, message, _category(category), module, lineno) for action, message, category, module, lineno in filters
    ]
    warnings._filters_mutated()
