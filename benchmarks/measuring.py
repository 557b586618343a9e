"""How the benchmarks in this directory measure and record a run.

A benchmark steps each of its cases (vectorizers, layouts, backends) with actions drawn before
timing (:func:`random_actions`, :func:`time_steps`: steps/s and the learner's and workers' CPU),
often each in a fresh interpreter running the script itself (:func:`measure_in_new_process`,
:func:`measure_if_asked`), in rounds interleaved over the cases as the shared machine's speed drifts
(:func:`measure_rounds`); it reports the median round (:func:`median_round`) and writes JSON with
the command and the machine (:func:`command`, :func:`machine`, :func:`write_json`).

The scripts import it as ``measuring`` (a script's directory is first on ``sys.path``). It imports
numpy and the standard library only: a measuring process loads what its script loads.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

MEASURE = "--measure"  # the argument that makes a script measure one case (followed by its arguments, JSON)
RESULT = "RESULT "  # starts the line of a measurement's result in the measuring process's output

Case = TypeVar("Case")
Result = TypeVar("Result")


def random_actions(action_space: Any, num_envs: int, count: int) -> list[np.ndarray]:
    """``count`` batches of one random action per env, the space seeded with 0: drawn before any
    timing, and the same in every run.

    :param action_space: a gymnasium space of one env's actions
    :param num_envs: the actions in a batch
    :param count: the batches
    """
    action_space.seed(0)
    return [np.stack([action_space.sample() for _ in range(num_envs)]) for _ in range(count)]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, its threads included (Linux ``/proc``, in clock
    ticks); 0 for a process that is gone.

    :param pid: the process
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Timing:
    """Vector steps timed by :func:`time_steps`.

    :param steps: vector steps taken
    :param num_envs: envs in each (env steps = ``steps * num_envs``)
    :param seconds: wall time they took
    :param cpu_seconds: this (the learner's) process's CPU time meanwhile (``time.process_time()``:
        all its threads)
    :param worker_cpu_seconds: each worker process's CPU time meanwhile
    """

    steps: int
    num_envs: int
    seconds: float
    cpu_seconds: float
    worker_cpu_seconds: list[float]

    @property
    def steps_per_s(self) -> float:
        """Env steps per second."""
        return self.steps * self.num_envs / self.seconds

    @property
    def step_us(self) -> float:
        """Wall time of one vector step, in microseconds."""
        return self.seconds / self.steps * 1e6

    @property
    def learner_us(self) -> float:
        """The learner's CPU time per vector step, in microseconds."""
        return self.cpu_seconds / self.steps * 1e6

    @property
    def worker_busy(self) -> list[float]:
        """Each worker's CPU seconds per wall second."""
        return [cpu / self.seconds for cpu in self.worker_cpu_seconds]

    def as_dict(self) -> dict[str, float]:
        """``steps``, ``steps_per_s``, ``step_us`` and ``learner_us``."""
        return {
            "steps": self.steps,
            "steps_per_s": self.steps_per_s,
            "step_us": self.step_us,
            "learner_us": self.learner_us,
        }


def time_steps(
    step: Callable[[Any], object],
    actions: Sequence[Any],
    seconds: float,
    *,
    warmup: int,
    chunk: int,
    worker_pids: Sequence[int] = (),
) -> Timing:
    """Take ``warmup`` vector steps, then time vector steps in chunks of ``chunk`` (the clock is
    read between chunks) until ``seconds`` have passed, cycling through ``actions``.

    :param step: takes one vector step, given a batch of actions
    :param actions: batches of one action per env (:func:`random_actions`)
    :param seconds: the time to step for (the last chunk ends after it)
    :param warmup: untimed steps first
    :param chunk: steps between two readings of the clock
    :param worker_pids: the worker processes whose CPU time to take too
    """
    for index in range(warmup):
        step(actions[index % len(actions)])
    worker_cpu = [process_cpu_seconds(pid) for pid in worker_pids]
    steps = 0
    cpu_started, started = time.process_time(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        for index in range(chunk):
            step(actions[(steps + index) % len(actions)])
        steps += chunk
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    worker_cpu = [process_cpu_seconds(pid) - before for pid, before in zip(worker_pids, worker_cpu)]
    return Timing(steps, len(actions[0]), elapsed, cpu, worker_cpu)


def measure_in_new_process(script: str, arguments: list, timeout: float) -> dict:
    """Measure one case in a fresh interpreter, as a training script holds one vectorizer for its
    whole run: ``script`` runs with :data:`MEASURE` and ``arguments``, and :func:`measure_if_asked`
    there prints the result on a line of its own (the libraries it loads may print to stdout too,
    as MPI's UCX does across hosts).

    :param script: the benchmark script (``__file__``)
    :param arguments: the arguments of its measuring function (JSON-serializable)
    :param timeout: seconds the process may take
    :raises RuntimeError: the process failed or printed no result (with the end of its stderr)
    """
    command = [sys.executable, os.path.abspath(script), MEASURE, json.dumps(arguments)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    results = [line for line in finished.stdout.splitlines() if line.startswith(RESULT)]
    if finished.returncode != 0 or not results:
        raise RuntimeError(
            f"measuring {json.dumps(arguments)} failed (exit status {finished.returncode}):\n{finished.stderr[-3000:]}"
        )
    return json.loads(results[-1][len(RESULT) :])


def print_result(result: dict) -> None:
    """Print ``result`` on a line of its own that starts with :data:`RESULT`.

    :param result: a measurement (JSON-serializable)
    """
    print(RESULT + json.dumps(result), flush=True)


def measure_if_asked(measure: Callable[..., dict]) -> bool:
    """In a process :func:`measure_in_new_process` started, call ``measure`` with the arguments it
    was given and print the result (:func:`print_result`); elsewhere do nothing.

    :param measure: the script's measuring function
    :return: whether this process measured (then the script has nothing more to do)
    """
    if sys.argv[1:2] != [MEASURE]:
        return False
    print_result(measure(*json.loads(sys.argv[2])))
    return True


def measure_rounds(
    cases: Sequence[Case],
    rounds: int,
    measure: Callable[[Case], Result],
    *,
    rotate: bool = False,
    progress: Callable[[int, Case, Result], object] | None = None,
) -> list[list[Result]]:
    """Measure every case ``rounds`` times, all cases in each round before the next: a slow spell
    of the machine then hits every case alike.

    :param cases: what to measure
    :param rounds: measurements of each case
    :param measure: measures one case
    :param rotate: start round ``r`` at case ``r``, so that no case always runs first or after the
        same one
    :param progress: called after each measurement with the round's index, the case and its result
    :return: per case, in the order of ``cases``, its results in the order of the rounds
    """
    measured: list[list[Result]] = [[] for _ in cases]
    for number in range(rounds):
        shift = number % len(cases) if rotate else 0
        for index in [*range(shift, len(cases)), *range(shift)]:
            result = measure(cases[index])
            measured[index].append(result)
            if progress is not None:
                progress(number, cases[index], result)
    return measured


def median_round(results: Sequence[dict], key: str) -> dict:
    """The result whose ``key`` is the median (of an even count, the higher of the middle two): one
    round as measured, not a mix of rounds.

    :param results: one case's results, one per round
    :param key: what to take the median of
    """
    return sorted(results, key=lambda result: result[key])[len(results) // 2]


def command() -> str:
    """The command that ran this script, as the docs cite it: ``python benchmarks/<script> <arguments>``."""
    return " ".join(["python", f"benchmarks/{os.path.basename(sys.argv[0])}", *sys.argv[1:]])


def machine(*packages: str) -> dict[str, Any]:
    """The machine a run measured: ``cpus``, ``platform``, ``python``, and each package's version.

    :param packages: distributions whose versions to record (such as ``"ray"``)
    """
    versions = {package: importlib.metadata.version(package) for package in packages}
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(), **versions}


def write_json(path: str | os.PathLike, record: dict) -> None:
    """Write ``record`` as indented JSON, its directory made; the file is replaced in one step, so a
    run stopped while writing leaves the previous file whole.

    :param path: the file
    :param record: what to write
    """
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as file:
        json.dump(record, file, indent=2)
        file.write("\n")
    os.replace(path + ".tmp", path)
