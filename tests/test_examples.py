"""The example scripts run end to end (a few thousand steps each) and print their results.

Each runs as a user would start it, in a fresh interpreter, from a scratch directory (CleanRL's
scripts write TensorBoard logs under ``runs/``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tyro")

pytestmark = pytest.mark.slow  # each runs an example's training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

QUICK_RUNS = {
    "sb3_ppo_cartpole": ["sb3_ppo_cartpole.py", "--timesteps", "1024"],
    "sb3_ppo_aaps": ["sb3_ppo_aaps.py", "--timesteps", "2048", "--kl-threshold", "0.001"],
    "cleanrl_ppo": ["cleanrl/ppo.py", "--total-timesteps", "2048", "--eval-episodes", "1"],
    "cleanrl_ppo_async": ["cleanrl/ppo_async.py", "--total-timesteps", "4096", "--eval-episodes", "1"],
    "cleanrl_sac_aaps": [
        "cleanrl/sac_continuous_action_aaps.py", "--total-timesteps", "640", "--learning-starts", "320", "--sync", "aaps",
        "--eval-episodes", "1", "--track-dir", "None",
    ],
    "cleanrl_td3_aaps": [
        "cleanrl/td3_continuous_action_aaps.py", "--total-timesteps", "640", "--learning-starts", "320", "--sync", "aaps",
        "--eval-episodes", "1", "--track-dir", "None",
    ],
    "cleanrl_ppo_aaps": [
        "cleanrl/ppo_aaps.py", "--total-timesteps", "4096", "--eval-episodes", "1", "--sync", "aaps",
        "--kl-threshold", "0.001", "--overlap", "--sync-every", "minibatch",
    ],
    "cleanrl_ppo_aaps_behaviour_ratio": [
        "cleanrl/ppo_aaps.py", "--total-timesteps", "2048", "--eval-episodes", "1", "--ppo-ratio", "behaviour",
    ],
    "cleanrl_dqn": [
        "cleanrl/dqn.py", "--total-timesteps", "1500", "--learning-starts", "500", "--buffer-size", "2000",
        "--eval-episodes", "1",
    ],
    "cleanrl_dqn_aaps": [
        "cleanrl/dqn_aaps.py", "--total-timesteps", "1500", "--learning-starts", "500", "--buffer-size", "2000",
        "--eval-episodes", "1", "--sync", "aaps",
    ],
    # Breakout: an untrained policy ends a game within a few hundred steps (FIRE on every life).
    "sb3_ppo_atari": [
        "sb3_ppo_atari.py", "--env-id", "BreakoutNoFrameskip-v4", "--timesteps", "1024", "--n-envs", "4",
        "--eval-episodes", "1",
    ],
    "sb3_sac_mujoco": ["sb3_sac_mujoco.py", "--timesteps", "500", "--learning-starts", "300", "--eval-episodes", "1"],
    "cleanrl_ppo_atari": ["cleanrl/ppo_atari.py", "--total-timesteps", "512", "--num-envs", "4", "--num-steps", "64"],
    "cleanrl_ppo_continuous_action": ["cleanrl/ppo_continuous_action.py", "--total-timesteps", "4096", "--eval-episodes", "1"],
}

# Examples on Atari or MuJoCo need those packages (the `atari` and `mujoco` extras).
NEEDS = {
    "sb3_ppo_atari": "ale_py",
    "cleanrl_ppo_atari": "ale_py",
    "sb3_sac_mujoco": "mujoco",
    "cleanrl_ppo_continuous_action": "mujoco",
}

EXPECTED_OUTPUT = {
    "sb3_ppo_cartpole": ["mean return over 20 episodes"],
    "sb3_ppo_aaps": ["syncs ", "greedy policy, mean return over 10 episodes"],
    "cleanrl_ppo": ["greedy policy, mean return over 1 episodes"],
    "cleanrl_ppo_async": ["trained 4096 steps", "greedy policy, mean return over 1 episodes"],
    "cleanrl_sac_aaps": ["trained 640 steps", "syncs ", "deterministic policy, mean return over 1 episodes"],
    "cleanrl_td3_aaps": ["trained 640 steps", "syncs ", "deterministic policy, mean return over 1 episodes"],
    "cleanrl_ppo_aaps": ["syncs ", "greedy policy, mean return over 1 episodes"],
    "cleanrl_ppo_aaps_behaviour_ratio": ["syncs ", "greedy policy, mean return over 1 episodes"],
    "cleanrl_dqn": ["greedy policy, mean return over 1 episodes"],
    "cleanrl_dqn_aaps": ["syncs ", "greedy policy, mean return over 1 episodes"],
    "sb3_ppo_atari": ["trained 1024 steps", "mean score over 1 games"],
    "sb3_sac_mujoco": ["trained 500 steps", "mean return over 1 episodes"],
    "cleanrl_ppo_atari": ["trained 512 steps", "mean score of the last"],
    "cleanrl_ppo_continuous_action": ["trained 4096 steps", "deterministic policy, mean return over 1 episodes"],
}


@pytest.mark.parametrize("name", sorted(QUICK_RUNS))
def test_example_runs(name, tmp_path):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    script, *args = QUICK_RUNS[name]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for expected in EXPECTED_OUTPUT[name]:
        assert expected in done.stdout, f"{script} did not print {expected!r}:\n{done.stdout[-3000:]}"
