"""SB3's ecosystem on ClusterVecEnv: sb3-contrib's algorithms and RL Zoo's training script train to
exactly the parameters they reach on DummyVecEnv."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

pytest.importorskip("sb3_contrib")

import torch  # noqa: E402
from sb3_contrib import ARS, QRDQN, TQC, TRPO, CrossQ, MaskablePPO, RecurrentPPO  # noqa: E402
from sb3_contrib.common.envs import InvalidActionEnvDiscrete  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402

from clusterenv_sb3 import ClusterVecEnv  # noqa: E402

pytestmark = pytest.mark.slow  # each trains

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SeededMaskEnv(InvalidActionEnvDiscrete):
    """sb3-contrib's masked test env, drawing its invalid actions from the env's own generator (the
    original draws them from numpy's global one, which differs from process to process)."""

    def _choose_next_state(self) -> None:
        self.state = self.action_space.sample()
        others = [action for action in self.possible_actions if action != self.state]
        self.invalid_actions = self.action_space.np_random.choice(others, self.n_invalid_actions, replace=False).tolist()


def make_masked_env() -> SeededMaskEnv:
    return SeededMaskEnv(dim=10, n_invalid_actions=3)


# algorithm, policy, env, envs, env steps, algorithm keywords
CASES = {
    "RecurrentPPO": (RecurrentPPO, "MlpLstmPolicy", "CartPole-v1", 4, 256, {"n_steps": 32, "batch_size": 64}),
    "TRPO": (TRPO, "MlpPolicy", "CartPole-v1", 4, 256, {"n_steps": 32, "batch_size": 64}),
    "MaskablePPO": (MaskablePPO, "MlpPolicy", make_masked_env, 4, 256, {"n_steps": 32, "batch_size": 64}),
    "QRDQN": (QRDQN, "MlpPolicy", "CartPole-v1", 4, 300, {"learning_starts": 100}),
    "TQC": (TQC, "MlpPolicy", "Pendulum-v1", 2, 200, {"learning_starts": 100}),
    # CrossQ's default critic is 1024 wide (43 s for this test here): a small one runs the same code (7 s).
    "CrossQ": (CrossQ, "MlpPolicy", "Pendulum-v1", 2, 200, {"learning_starts": 100, "policy_kwargs": {"net_arch": [64, 64]}}),
    "ARS": (ARS, "LinearPolicy", "Pendulum-v1", 1, 1000, {"n_delta": 2}),
}


def trained_parameters(name: str, vec_env_cls: type) -> torch.Tensor:
    algorithm, policy, env, n_envs, steps, kwargs = CASES[name]
    venv = make_vec_env(env, n_envs=n_envs, seed=0, vec_env_cls=vec_env_cls)
    try:
        model = algorithm(policy, venv, seed=0, **kwargs)
        model.learn(steps)
    finally:
        venv.close()
    return torch.nn.utils.parameters_to_vector(model.policy.parameters()).detach()


@pytest.mark.parametrize("name", list(CASES))
def test_sb3_contrib_algorithm_trains_as_on_dummy_vec_env(name):
    torch.set_num_threads(1)
    expected = trained_parameters(name, DummyVecEnv)
    assert torch.equal(trained_parameters(name, ClusterVecEnv), expected)


def test_rl_zoo_train_script_trains_as_on_dummy_vec_env(tmp_path, monkeypatch):
    pytest.importorskip("rl_zoo3")
    from rl_zoo3.exp_manager import ExperimentManager
    from stable_baselines3 import PPO

    torch.set_num_threads(1)
    arguments = ["--algo", "ppo", "--env", "CartPole-v1", "-n", "2048", "--seed", "0", "--eval-freq", "1024", "--eval-episodes", "2"]
    # RL Zoo as it comes, in a fresh interpreter: DummyVecEnv.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "rl_zoo3.train", *arguments, "-f", str(tmp_path / "zoo")]
    subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=300, stdout=subprocess.DEVNULL)
    # The example, here, counting the ClusterVecEnvs it builds (training and evaluation envs).
    built = []
    original_init = ClusterVecEnv.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(ClusterVecEnv, "__init__", counting_init)
    monkeypatch.setattr(ExperimentManager, "default_vec_env_cls", None)
    monkeypatch.setattr(sys, "argv", ["rl_zoo_train.py", *arguments, "-f", str(tmp_path / "cluster")])
    monkeypatch.chdir(tmp_path)
    try:
        runpy.run_path(os.path.join(ROOT, "examples", "rl_zoo_train.py"), run_name="__main__")
    finally:
        for venv in built:  # RL Zoo leaves its evaluation env open
            venv.close()
    assert len(built) == 2
    parameters = {}
    for name in ("zoo", "cluster"):
        model = PPO.load(tmp_path / name / "ppo" / "CartPole-v1_1" / "CartPole-v1.zip")
        parameters[name] = torch.nn.utils.parameters_to_vector(model.policy.parameters())
    assert torch.equal(parameters["cluster"], parameters["zoo"])
