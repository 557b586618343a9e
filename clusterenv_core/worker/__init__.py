"""The worker program: a process (or MPI rank) that owns a block of environments and serves the learner.

``python -m clusterenv_core.worker [<backend> [backend arguments]]`` runs :mod:`~.__main__`, which
hands over to :mod:`~.launch`; the local backend starts its workers that way (or forks them from its
fork server, which hands over to :mod:`~.launch` too), and MPI jobs start it as the worker program
of an MPMD launch. This ``__init__`` imports nothing, so that the program starts on the standard
library alone and can still end an MPI job whose dependencies fail to import.

Modules, one concept each, each importing only modules after it: :mod:`~.launch` (the program's
entry and exit), :mod:`~.serving` (:class:`~.serving.Worker`: the serving loop and one handler per
request type), :mod:`~.rollout_collection` (a rollout segment collected with the worker's policy
copy), :mod:`~.env_block` (:class:`~.env_block.EnvBlock`: the envs, their index spaces and
autoreset modes) and :mod:`~.remote_failure` (a failure with the env it happened in, and its error
reply).
"""
