"""Worker-side inference: a copy of the policy on every worker, fed by versioned flat weights.

The policy is shipped once (cloudpickled module). After that, weights travel as one flat float32
vector with a version number in a small region: the local backend shares the region, so a worker
picks up new weights at its next step; other backends copy the region to each worker. Reads and
writes follow a sequence lock, so a worker never loads half-written weights; a worker kept waiting
by a write asks now and then whether the learner lives (one killed mid-write never ends it), and
ends when it is gone.

A deployable policy is a ``torch.nn.Module`` with ``act`` (run here, on the workers) and
``action_dist`` (for AAPS on the learner), as :class:`clusterenv_core.policy.DeployablePolicy`
says, and optionally ``numpy_actor(rng)``: ``None``, or a callable ``(obs, **context) -> dict`` of
numpy arrays that does what ``act`` does without torch, on the numpy observations, drawing from
``rng`` (the worker's seeded ``numpy.random.Generator``); a worker then calls it instead of
``act``. For small policies torch's fixed cost per operation is most of ``act``, and more so on a
worker, where the env steps between two calls evict torch's code from the caches (SB3's
``MlpPolicy`` on 8 HalfCheetah observations: 850 µs of CPU a call inside a rollout, 370 µs in a
loop of calls alone; in numpy 265 and 150 µs).

torch is imported here only inside functions, so the core imports without it.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterenv_core.buffers import Field

_SEQUENCE, _VERSION = 0, 1
_YIELDS = 100  # waits for a write that only yield the core: a write of small weights ends within them
_NAP_SECONDS = 0.0005  # then naps: with more processes than cores, a spinning reader delays the writer
_WRITER_CHECK_SECONDS = 0.25  # how often a reader waiting for a write asks whether the writer still lives


class LearnerGone(Exception):
    """The learner ended in the middle of a weights write: a worker waiting for the write to finish
    would wait for ever, so it ends as it does when its connection to the learner closes."""


def weight_tensors(module: Any) -> list:
    """The floating-point parameters and buffers of ``module``, in ``state_dict`` order."""
    return [t for t in module.state_dict(keep_vars=True).values() if t.dtype.is_floating_point]


def same_state(state: dict, other: dict) -> bool:
    """Whether two state dicts hold the same tensors, bit for bit."""
    import torch

    return state.keys() == other.keys() and all(torch.equal(value, other[name]) for name, value in state.items())


def flatten_weights(module: Any) -> np.ndarray:
    """All weights of ``module`` as one float32 vector."""
    import torch

    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in weight_tensors(module)]).cpu().numpy()


def load_weights(module: Any, flat: np.ndarray) -> None:
    """Copy a vector made by :func:`flatten_weights` into ``module``."""
    import torch

    tensors = weight_tensors(module)
    expected = sum(tensor.numel() for tensor in tensors)
    if flat.size != expected:
        raise ValueError(f"weight vector has {flat.size} values, the module {expected}")
    source = torch.from_numpy(flat)
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(source[offset : offset + count].view_as(tensor))
            offset += count


def weights_fields(count: int) -> list[Field]:
    """Layout of a weights region (one row): a (sequence, version) header and the weights."""
    return [Field("weights.header", (2,), np.dtype(np.int64)), Field("weights", (count,), np.dtype(np.float32))]


class WeightsRegion:
    """Versioned weights over the arrays of :func:`weights_fields` (a sequence lock guards them).

    :param arrays: the views made from :func:`weights_fields`
    :param writer_alive: on a reader, tells whether the writer (the learner) still lives; asked
        while a write stays unfinished, since a writer killed in the middle of one never ends it
    """

    def __init__(self, arrays: dict[str, np.ndarray], writer_alive: Callable[[], bool] | None = None) -> None:
        self.header = arrays["weights.header"][0]
        self.weights = arrays["weights"][0]
        self.arrays = [arrays["weights.header"], arrays["weights"]]
        self.writer_alive = writer_alive

    @property
    def version(self) -> int:
        return int(self.header[_VERSION])

    def write(self, flat: np.ndarray, version: int) -> None:
        """Publish ``flat`` as ``version`` (learner side)."""
        self.header[_SEQUENCE] += 1  # odd: a write is in progress
        self.weights[:] = flat
        self.header[_VERSION] = version
        self.header[_SEQUENCE] += 1

    def read_newer(self, known_version: int, out: np.ndarray) -> int | None:
        """Copy the weights into ``out`` if their version differs from ``known_version``; returns the
        version copied, or ``None`` when nothing changed.

        :raises LearnerGone: a write stayed unfinished and ``writer_alive`` says the writer is gone
        """
        if int(self.header[_SEQUENCE]) % 2 == 0 and int(self.header[_VERSION]) == known_version:
            return None  # every step of a rollout asks: no more than these two reads
        waits = 0
        check_at = time.monotonic() + _WRITER_CHECK_SECONDS
        while True:
            sequence = int(self.header[_SEQUENCE])
            version = int(self.header[_VERSION])
            if sequence % 2 == 0 and version == known_version:
                return None
            if sequence % 2 == 0:
                out[:] = self.weights
                if int(self.header[_SEQUENCE]) == sequence:
                    return version
            # The learner is writing: let it finish.
            waits += 1
            time.sleep(0 if waits <= _YIELDS else _NAP_SECONDS)
            if self.writer_alive is not None and time.monotonic() >= check_at:
                if not self.writer_alive():
                    raise LearnerGone("the learner ended in the middle of a weights write")
                check_at = time.monotonic() + _WRITER_CHECK_SECONDS


class PolicyHost:
    """A worker's copy of the deployed policy.

    :param policy_bytes: the cloudpickled module
    :param weights: the weights region the learner publishes to
    :param seed: seed of the worker's torch generator and numpy generator (sampling actions), or ``None``
    """

    def __init__(self, policy_bytes: bytes, weights: WeightsRegion, seed: int | None) -> None:
        import torch

        torch.set_num_threads(1)  # several workers share the cores; one thread each
        # torch.distributions checks every argument by default: a quarter of a small policy's act()
        # (measured: 228 -> 167 µs for SB3's MlpPolicy on 8 observations); results are the same.
        torch.distributions.Distribution.set_default_validate_args(False)
        if seed is not None:
            torch.manual_seed(seed)
        self.torch = torch
        self.policy = pickle.loads(policy_bytes)
        # torch takes negative seeds too, numpy does not: the sign becomes a word of the seed.
        self.rng = np.random.default_rng(None if seed is None else [int(seed < 0), abs(seed)])
        numpy_actor = getattr(self.policy, "numpy_actor", None)
        self._numpy_act = numpy_actor(self.rng) if numpy_actor is not None else None
        self.weights = weights
        self.version = -1
        self._flat = np.empty_like(weights.weights)

    def refresh(self) -> int:
        """Load newer weights if the learner published any; returns the version in use."""
        version = self.weights.read_newer(self.version, self._flat)
        if version is not None:
            load_weights(self.policy, self._flat)
            self.version = version
        return self.version

    def act(self, obs: Any, context: dict) -> dict[str, np.ndarray]:
        """Run the policy on a batch of observations (numpy, as the buffers hold them)."""
        if self._numpy_act is not None:
            return self._numpy_act(obs, **context)
        torch = self.torch
        if isinstance(obs, dict):
            tensors = {key: torch.as_tensor(value) for key, value in obs.items()}
        else:
            tensors = torch.as_tensor(obs)
        # Inference mode: no_grad without autograd's bookkeeping (version counters, views), the same
        # kernels and results; a few µs on each of the many small operations of a policy.
        with torch.inference_mode():
            out = self.policy.act(tensors, **context)
        return {key: value.cpu().numpy() for key, value in out.items()}
