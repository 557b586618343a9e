"""CleanRL adapter: ``ClusterVectorEnv`` is gymnasium's ``SyncVectorEnv`` with its environments on ClusterEnv workers.

In a CleanRL script, replace ``gym.vector.SyncVectorEnv([...])`` with ``ClusterVectorEnv([...])``;
the results are the same, the environments step in parallel on workers (local processes or MPI
ranks). Both gymnasium 1.x and gymnasium 0.29 (which CleanRL pins) are supported, each with its own
``SyncVectorEnv`` semantics. ``ClusterEnvPool`` (``make_gymnasium``) is EnvPool's asynchronous
``send``/``recv`` interface over the same workers. Failures on workers raise the errors exported here.
"""

from clusterenv_core.errors import (
    ClusterEnvError,
    EnvAttributeError,
    EnvError,
    EnvTypeError,
    EnvValueError,
    WorkerLostError,
    WorkerTimeoutError,
)
from clusterenv_cleanrl.envpool_api import ClusterEnvPool, make_gymnasium
from clusterenv_cleanrl.vector_env import ClusterVectorEnv
from clusterenv_cleanrl.rollouts import (
    DeployableAgent,
    DeployableQNetwork,
    DeployableSACActor,
    DeployableTD3Actor,
    Episode,
    PPOBatch,
    Transition,
    WorkerRollouts,
    add_to_replay_buffer,
    episodic_returns,
    ppo_batch,
    replay_transitions,
)

__all__ = [
    "ClusterEnvError",
    "ClusterEnvPool",
    "ClusterVectorEnv",
    "DeployableAgent",
    "DeployableQNetwork",
    "DeployableSACActor",
    "DeployableTD3Actor",
    "Episode",
    "PPOBatch",
    "Transition",
    "WorkerRollouts",
    "add_to_replay_buffer",
    "episodic_returns",
    "make_gymnasium",
    "ppo_batch",
    "replay_transitions",
    "EnvAttributeError",
    "EnvError",
    "EnvTypeError",
    "EnvValueError",
    "WorkerLostError",
    "WorkerTimeoutError",
]
