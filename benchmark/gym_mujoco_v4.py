"""Run one of CleanRL 1.2.0's gym-era scripts on gymnasium's MuJoCo v4 tasks, the tasks ours runs.

    .venv-peers/bin/python benchmark/gym_mujoco_v4.py cleanrl.sac_continuous_action --env-id Hopper-v4 --seed 1

CleanRL's last PyPI release (1.2.0) ships `sac_continuous_action.py` on gym 0.23.1 (reset returns the
observation, step returns (obs, reward, done, info), vector infos a list of dicts), whose registry has
MuJoCo's v2 and v3 tasks only, through mujoco-py, which pip cannot install without MuJoCo 2.1's binaries;
its default `--env-id Hopper-v4` does not exist there. This launcher registers the v4 tasks in gym 0.23.1,
each backed by gymnasium's own v4 class (the mujoco bindings, as EnvPool's v4), behind gym's TimeLimit of
1,000 steps, so a truncation carries gym's `info["TimeLimit.truncated"]` exactly as the script and its
replay buffer (stable-baselines3 1.2.0, `handle_timeout_termination=True`) expect. Then it runs the named
module as `__main__` with the remaining arguments: the script's code is the registry's, unchanged.
"""

from __future__ import annotations

import runpy
import sys

import gym
import gymnasium
import numpy as np

TASKS = ("Hopper-v4", "HalfCheetah-v4", "Walker2d-v4", "Ant-v4")
MAX_EPISODE_STEPS = 1000


def box(space) -> gym.spaces.Box:
    return gym.spaces.Box(low=space.low, high=space.high, dtype=space.dtype)


class OldApi(gym.Env):
    """gymnasium's v4 task (without its own time limit) behind gym 0.23.1's API: `seed(s)` seeds the
    next reset; `step` returns done = terminated (gym's TimeLimit adds the truncation)."""

    metadata = {"render_modes": []}

    def __init__(self, env_id: str):
        self.env = gymnasium.make(env_id).unwrapped
        self.observation_space = box(self.env.observation_space)
        self.action_space = box(self.env.action_space)
        self._seed = None

    def seed(self, seed=None):
        self._seed = seed
        return [seed]

    def reset(self, *, seed=None, return_info=False, options=None):
        seed = self._seed if seed is None else seed
        self._seed = None
        obs, info = self.env.reset(seed=seed, options=options)
        obs = np.asarray(obs, np.float32)
        return (obs, info) if return_info else obs

    def step(self, action):
        obs, reward, terminated, _, info = self.env.step(action)
        return np.asarray(obs, np.float32), float(reward), bool(terminated), info

    def close(self):
        self.env.close()


for task in TASKS:
    gym.register(id=task, entry_point=OldApi, kwargs={"env_id": task}, max_episode_steps=MAX_EPISODE_STEPS)

if __name__ == "__main__":
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
