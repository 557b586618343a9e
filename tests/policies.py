"""A small deployable policy and a sequential reference rollout (imports torch; workers unpickle it)."""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
import torch

from clusterenv_core.policy import Bernoulli, Categorical

D = torch.distributions


class LinearPolicy(torch.nn.Module):
    """A linear policy over CartPole observations, greedy or sampling."""

    def __init__(self, greedy: bool = True) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.greedy = greedy

    def act(self, obs):
        logits = self.linear(obs)
        dist = D.Categorical(logits=logits)
        actions = logits.argmax(-1) if self.greedy else dist.sample()
        return {"actions": actions, "log_probs": dist.log_prob(actions), "values": logits.sum(-1)}

    def action_dist(self, obs):
        return Categorical(self.linear(obs))


class ConstantPolicy(LinearPolicy):
    """Always picks ``action`` (greedy, whatever the observation).

    :param refused_by: pids of processes where the policy fails to unpickle (workers that cannot take it)
    """

    def __init__(self, action: int, refused_by: tuple[int, ...] = ()) -> None:
        super().__init__(greedy=True)
        self.refused_by = refused_by
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.copy_(torch.nn.functional.one_hot(torch.tensor(action), 2).float())

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if os.getpid() in self.refused_by:
            raise RuntimeError("this worker cannot take the policy")


class BernoulliPolicy(torch.nn.Module):
    """Presses every button of a 3-button MultiBinary space (float32 actions, as SB3's PPO samples them)."""

    def __init__(self, obs_size: int = 2) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(obs_size, 3)

    def act(self, obs):
        dist = D.Bernoulli(logits=self.linear(obs) * 0 + 10.0)
        actions = torch.ones_like(dist.logits)
        return {"actions": actions, "log_probs": dist.log_prob(actions).sum(-1)}

    def action_dist(self, obs):
        return Bernoulli(self.linear(obs))


class NumpyLinearPolicy(LinearPolicy):
    """:class:`LinearPolicy` sampling, with a numpy actor that samples from the worker's generator;
    its torch ``act`` marks its actions (-1), so a rollout shows which one ran."""

    def __init__(self) -> None:
        super().__init__(greedy=False)

    def act(self, obs):
        out = super().act(obs)
        return {**out, "actions": torch.full_like(out["actions"], -1)}

    def numpy_actor(self, rng):
        weight, bias = self.linear.weight.detach().numpy(), self.linear.bias.detach().numpy()

        def act(obs):
            logits = obs.astype(np.float32) @ weight.T + bias
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            actions = (rng.random(len(obs)) * probs.sum(-1) >= probs[:, 0]).astype(np.int64)
            return {"actions": actions, "log_probs": np.log(probs[np.arange(len(obs)), actions] / probs.sum(-1))}

        return act


def reference_rollout(policy, seeds, n_steps):
    """The rollout a pool must collect, stepped sequentially in this process (same_step autoreset)."""
    envs = [gym.make("CartPole-v1") for _ in seeds]
    obs = np.stack([env.reset(seed=seed)[0] for env, seed in zip(envs, seeds)])
    steps = []
    for _ in range(n_steps):
        with torch.no_grad():
            actions = policy.act(torch.as_tensor(obs))["actions"].numpy()
        step = {"obs": obs.copy(), "actions": actions, "rewards": [], "done": [], "final": {}}
        for i, env in enumerate(envs):
            o, r, term, trunc, _ = env.step(actions[i])
            step["rewards"].append(r)
            step["done"].append(term or trunc)
            if term or trunc:
                step["final"][i] = o
                o, _ = env.reset()
            obs[i] = o
        steps.append(step)
    return steps, obs


def assert_rollout_matches(rollout, expected, last_obs) -> None:
    """A pool's rollout equals the sequential reference step for step."""
    for t, step in enumerate(expected):
        np.testing.assert_array_equal(rollout.obs[t], step["obs"])
        np.testing.assert_array_equal(rollout.actions[t], step["actions"])
        assert rollout.rewards[t].tolist() == step["rewards"]
        assert (rollout.terminated[t] | rollout.truncated[t]).tolist() == step["done"]
        for i, final in step["final"].items():
            np.testing.assert_array_equal(rollout.final_observation(t, i), final)
    np.testing.assert_array_equal(rollout.last_obs, last_obs)
