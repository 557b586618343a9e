"""LearnerRegions: the extra regions of a backend whose workers do not share the learner's memory.

Where workers cannot map the learner's memory (the MPI and Ray backends), a region that
:meth:`Transport.share_region <clusterenv_core.transports.base.Transport.share_region>` hands out
is plain memory of the learner's own: its contents reach the workers with ``send_arrays`` and come
back with ``recv_arrays``, and each worker holds its own copy of its rows
(``WorkerConnection.map_region``). The handle only names the region, for ``release_region``.
"""

from __future__ import annotations


class LearnerRegions:
    """The regions a transport handed out, in the learner's own memory, by handle (a number, in the
    order they were made).

    A released region's memory goes once no view of it is left (a ``Rollout`` the caller kept
    stays readable).
    """

    def __init__(self) -> None:
        self._regions: dict[int, bytearray] = {}
        self._next_handle = 0

    def share(self, nbytes: int) -> tuple[int, memoryview]:
        """A new region: its handle and its memory.

        :param nbytes: the region's size in bytes
        """
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        region = self._regions[handle] = bytearray(nbytes)
        return handle, memoryview(region)

    def release(self, handle: int) -> None:
        """Drop a region (one dropped already is ignored).

        :param handle: what :meth:`share` returned for it
        """
        self._regions.pop(handle, None)

    def release_all(self) -> None:
        """Drop every region (the transport closes)."""
        self._regions.clear()
