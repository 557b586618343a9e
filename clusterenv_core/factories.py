"""The env factories on their way to the workers: pickled before anything starts, once per block,
and never by a worker's import that would build a pool of its own.
"""

from __future__ import annotations

import sys
from typing import Any

from clusterenv_core import protocol


def refuse_a_pool_built_by_a_worker_import() -> None:
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


def contiguous_blocks(num_envs: int, num_workers: int) -> list[range]:
    """Contiguous blocks of env indices, the first ``num_envs % num_workers`` one env larger."""
    size, extra = divmod(num_envs, num_workers)
    blocks, start = [], 0
    for worker in range(num_workers):
        stop = start + size + (worker < extra)
        blocks.append(range(start, stop))
        start = stop
    return blocks


def pickle_factories(env_fns: list, blocks: list[range]) -> tuple[list[bytes], list[list[int]]]:
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
