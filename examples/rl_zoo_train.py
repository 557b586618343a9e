"""RL Zoo's training script with its envs on ClusterEnv workers.

    python examples/rl_zoo_train.py --algo ppo --env CartPole-v1    # any `python -m rl_zoo3.train` arguments

RL Zoo builds its training and evaluation envs with ``make_vec_env(..., vec_env_cls=...)``, taking
``ExperimentManager.default_vec_env_cls`` over ``--vec-env dummy|subproc`` when it is set: setting it
is the one changed line. For ClusterEnv's options, set a partial instead, e.g.
``functools.partial(ClusterVecEnv, backend="mpi")`` with ``python examples/rl_zoo_train.py ...``,
which spawns the ranks (under ``mpiexec`` a job serves one pool, and RL Zoo builds two: training and
evaluation); leave ``num_workers`` to its default, since the evaluation env is a single env and a
pool has at most one worker per env. Hyperparameters, wrappers, frame stacking, ``VecNormalize``,
evaluation and saving stay RL Zoo's (``pip install rl_zoo3``).
"""

import torch
from rl_zoo3.exp_manager import ExperimentManager
from rl_zoo3.train import train

from clusterenv_sb3 import ClusterVecEnv

if __name__ == "__main__":
    ExperimentManager.default_vec_env_cls = ClusterVecEnv  # the one changed line
    # RL Zoo's --num-threads sets torch's threads only when given; the workers share these cores.
    torch.set_num_threads(1)
    train()
