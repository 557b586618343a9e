"""SB3 PPO whose environments run on MPI worker ranks across the nodes of a Slurm job.

Rank 0 runs this script and learns; every other rank is a worker. Launched by
``train_sb3_mpi.sbatch`` (MPMD: the other ranks run ``python -m clusterenv_core.worker mpi``), or
by hand::

    mpiexec -n 1 python train_sb3_mpi.py : -n 8 python -m clusterenv_core.worker   # MPMD
    mpiexec -n 9 python train_sb3_mpi.py                                               # SPMD

Settings come from environment variables (defaults in brackets): ``ENV_ID`` [CartPole-v1],
``PROCESSES_PER_WORKER`` [1; more makes each worker rank a node agent stepping its envs on that
many local processes], ``NUM_ENVS`` [8 per worker process], ``TOTAL_TIMESTEPS`` [200000],
``N_STEPS`` [128 per env and rollout], ``SEED`` [0], ``OUTPUT_DIR`` [runs].
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI  # under mpiexec/srun: tells how many worker ranks this job has

from clusterenv_sb3 import ClusterVecEnv


def main() -> None:
    num_workers = MPI.COMM_WORLD.Get_size() - 1
    if num_workers < 1:
        raise SystemExit("launch with mpiexec or srun and at least 2 ranks (see train_sb3_mpi.sbatch)")
    env_id = os.environ.get("ENV_ID", "CartPole-v1")
    processes_per_worker = int(os.environ.get("PROCESSES_PER_WORKER", 1))
    num_envs = int(os.environ.get("NUM_ENVS", 8 * num_workers * processes_per_worker))
    total_timesteps = int(os.environ.get("TOTAL_TIMESTEPS", 200_000))
    n_steps = int(os.environ.get("N_STEPS", 128))
    seed = int(os.environ.get("SEED", 0))
    output_dir = os.environ.get("OUTPUT_DIR", "runs")

    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    # In an SPMD launch every rank runs this line; on ranks above 0 it turns the process into a
    # worker that serves rank 0 and exits when the env is closed. Nothing above it may need rank 0.
    started = time.perf_counter()
    env = make_vec_env(
        env_id,
        n_envs=num_envs,
        seed=seed,
        vec_env_cls=ClusterVecEnv,
        vec_env_kwargs={"backend": "mpi", "num_workers": num_workers, "processes_per_worker": processes_per_worker},
    )
    hosts = sorted(set(env.pool._transport.hosts))
    print(
        f"{num_envs} x {env_id} on {num_workers} worker ranks ({num_envs // num_workers}-{-(-num_envs // num_workers)} "
        f"envs each, on {processes_per_worker} process(es) each) on {len(hosts)} host(s) {', '.join(hosts)}; "
        f"learner on {MPI.Get_processor_name()}; "
        f"started in {time.perf_counter() - started:.1f} s",
        flush=True,
    )

    model = PPO("MlpPolicy", env, n_steps=n_steps, batch_size=min(n_steps * num_envs, 4096), seed=seed, verbose=1)
    started = time.perf_counter()
    model.learn(total_timesteps=total_timesteps)
    elapsed = time.perf_counter() - started
    print(f"{model.num_timesteps} steps in {elapsed:.1f} s: {model.num_timesteps / elapsed:.0f} env steps/s", flush=True)
    # Monitor (added by make_vec_env) records every finished episode; SB3 keeps the last 100.
    returns = [episode["r"] for episode in model.ep_info_buffer]
    if returns:
        print(f"final mean return: {sum(returns) / len(returns):.1f} over {len(returns)} episodes", flush=True)

    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f"ppo_{env_id}_{os.environ.get('SLURM_JOB_ID', 'local')}")
    model.save(path)
    print(f"saved {path}.zip", flush=True)
    env.close()  # the worker ranks finalize and wait for this rank to finish


if __name__ == "__main__":
    main()
