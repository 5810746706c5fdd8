"""Rollout assembly: EnvPool returns env ids in any order, so each env has its own time axis.

`Rollout` is what an actor thread hands to the learner (host arrays, num_steps + 1 rows per
env); `RolloutAssembler` writes every `recv` batch into per-env trajectories, emits complete
rollouts in order, and keeps the raw return and length of every finished game.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax
import numpy as np


class Rollout(NamedTuple):
    """num_steps + 1 rows per env. Row t holds what `recv` returned for obs_t and the action
    taken on it; row num_steps is also row 0 of the env's next rollout.

    obs [T+1, N, *obs], or for dictionary observations (MiniGrid) a dict of such arrays;
    actions [T+1, N] int32 or [T+1, N, A] float32 (Box: as sampled, before clipping to the
    bounds); logprobs, values [T+1, N] float32 (behaviour policy); rewards
    [T+1, N] float32 (training reward received *with* obs_t, i.e. of transition t-1);
    terminated, truncated [T+1, N] bool (obs_t ended its episode); versions [T+1, N] int32
    (params version that chose actions[t]); discounted_returns [T+1, N] float32 (discounted
    sum of the episode's training rewards up to obs_t: --norm-reward's statistic).
    """

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    versions: np.ndarray
    discounted_returns: np.ndarray


def obs_storage(space):
    """(shape, dtype) in which a rollout stores one observation of `space`: float64 as float32,
    a Discrete value as an int32 scalar; for a Dict space ({key: shape}, {key: dtype})."""
    if type(space).__name__ == "Dict":
        parts = {key: obs_storage(sub) for key, sub in space.spaces.items()}
        return {k: shape for k, (shape, _) in parts.items()}, {k: dtype for k, (_, dtype) in parts.items()}
    if type(space).__name__ == "Discrete":
        return (), np.dtype(np.int32)
    return tuple(space.shape), np.dtype(np.float32 if space.dtype == np.float64 else space.dtype)


def zeros_obs(space, batch: int):
    """`batch` zero observations of `space` as stored (`obs_storage`): [batch, *obs], or a dict of such."""
    shape, dtype = obs_storage(space)
    if isinstance(shape, dict):
        return {k: np.zeros((batch, *shape[k]), dtype[k]) for k in shape}
    return np.zeros((batch, *shape), dtype)


def rollout_shapes(num_steps: int, num_envs: int, spec, sharding) -> Rollout:
    """A Rollout of jax.ShapeDtypeStruct ([num_steps + 1, num_envs, ...], placed by `sharding`) for
    the env spec's spaces: the learner's input as the actors assemble it, for compiling ahead of
    time (`.lower`). Observations as stored (`obs_storage`)."""
    actions = spec.action_space
    continuous = type(actions).__name__ == "Box"

    def shape(extra, dtype):
        return jax.ShapeDtypeStruct((num_steps + 1, num_envs, *extra), dtype, sharding=sharding)
    obs_shape, obs_dtype = obs_storage(spec.observation_space)
    obs = ({k: shape(obs_shape[k], obs_dtype[k]) for k in obs_shape} if isinstance(obs_shape, dict)
           else shape(obs_shape, obs_dtype))
    return Rollout(obs,
                   shape(actions.shape, np.float32 if continuous else np.int32), *[shape((), np.float32)] * 3,
                   shape((), bool), shape((), bool), shape((), np.int32), shape((), np.float32))


class RolloutAssembler:
    """Writes each `recv` batch into per-env trajectories and emits complete rollouts.

    Tracks the raw (unclipped) return and length of every real game: a game ends on
    truncation, or on termination with no lives left (with --episodic-life a life loss
    terminates the training episode but not the game). Envs that EnvPool runs ahead write
    into the next rollout's buffer, never into another env's time axis.
    """

    max_pending = 8  # rollouts one env may run ahead of the slowest before we call it starvation

    def __init__(self, num_envs: int, num_steps: int, obs_shape, obs_dtype, clip_rewards: bool, episodic_life: bool,
                 first_rollout: int = 0, action_shape=(), action_dtype=np.int32, gamma: float = 0.99):
        self.num_envs, self.num_steps = num_envs, num_steps
        self.obs_shape, self.obs_dtype = obs_shape, obs_dtype  # dicts of them for dictionary observations
        self.action_shape, self.action_dtype = tuple(action_shape), action_dtype
        self.clip_rewards, self.episodic_life, self.gamma = clip_rewards, episodic_life, gamma
        self.discounted_return = np.zeros(num_envs, np.float32)
        self.generation = np.full(num_envs, first_rollout, np.int64)  # rollout index each env is writing
        self.row = np.zeros(num_envs, np.int64)  # next row in that rollout
        self.buffers: dict[int, Rollout] = {}
        self.rows_done: dict[int, int] = collections.Counter()  # envs that wrote their last row
        self.emitted = first_rollout  # index of the next rollout to complete (= rollouts emitted, on resume too)
        self.game_return = np.zeros(num_envs, np.float64)
        self.game_length = np.zeros(num_envs, np.int64)
        self.prev_done = np.ones(num_envs, bool)  # the first obs after reset carries no reward
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []

    def _buffer(self, generation: int) -> Rollout:
        if generation not in self.buffers:
            if len(self.buffers) >= self.max_pending:
                raise RuntimeError(f"EnvPool ran some envs {self.max_pending} rollouts ahead of others; "
                                   "env stepping is starved - use fewer envs per thread or a larger --async-batch-size")
            shape = (self.num_steps + 1, self.num_envs)
            obs = ({k: np.zeros(shape + tuple(s), self.obs_dtype[k]) for k, s in self.obs_shape.items()}
                   if isinstance(self.obs_shape, dict) else np.zeros(shape + tuple(self.obs_shape), self.obs_dtype))
            self.buffers[generation] = Rollout(
                obs, np.zeros(shape + self.action_shape, self.action_dtype),
                np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                np.zeros(shape, bool), np.zeros(shape, bool), np.zeros(shape, np.int32), np.zeros(shape, np.float32))
        return self.buffers[generation]

    def action_generation(self, env_id):
        """Rollout index of the transition each env's next action starts ([B] int64): the last
        row of rollout g is row 0 of rollout g + 1, and its action belongs to g + 1."""
        return self.generation[env_id] + (self.row[env_id] == self.num_steps)

    def min_params_version(self, env_id, max_policy_lag: int, floor: int = 0) -> int:
        """The oldest params version that may choose the next actions of envs `env_id`: an action
        that starts a transition of rollout g must come from params >= g - max_policy_lag, yet
        never from one that needs this thread's own unfinished rollout (that would deadlock);
        and at least `floor` (--deterministic: the pool's first rollout)."""
        return max(min(int(self.action_generation(env_id).max()) - max_policy_lag, self.emitted), floor)

    def late_first_rows(self, env_id, max_policy_lag: int, version: int):
        """Before `add`: ([B] bool, version) - the rows of this batch that end rollout g - 1 and so
        also start rollout g, whose action, chosen with `version`, is older than g - max_policy_lag
        allows, and the version they need. With --max-policy-lag 0 it exists only once rollout
        g - 1 is handed over: the actor chooses those actions again then (`restart_rows`)."""
        generation = self.action_generation(env_id)
        late = (self.row[env_id] == self.num_steps) & (generation - max_policy_lag > version)
        return late, int(generation[late].max()) - max_policy_lag if late.any() else version

    def restart_rows(self, env_id, actions, logprobs, values, version: int):
        """After `add`: row 0 of the rollouts that envs `env_id` just started holds the action chosen
        again for it ([B] arrays as in `add`); row T of the rollout they finished keeps the first."""
        generations = self.generation[env_id]
        for g in np.unique(generations):
            sel, buffer = generations == g, self.buffers[int(g)]
            envs = env_id[sel]
            buffer.actions[0, envs], buffer.logprobs[0, envs], buffer.values[0, envs] = actions[sel], logprobs[sel], values[sel]
            buffer.versions[0, envs] = version

    def add(self, env_id, obs, reward, terminated, truncated, lives, actions, logprobs, values, version: int):
        """Record one batch (all [B] arrays, `reward` raw; `obs` [B, *obs] or a dict of such). Returns the rollouts completed by it,
        each as (Rollout, episode returns, episode lengths) for games that ended since the last one."""
        done = terminated | truncated
        counts = ~self.prev_done[env_id]
        self.game_return[env_id] += np.where(counts, reward, 0.0)
        self.game_length[env_id] += counts
        game_over = truncated | (terminated & ((lives == 0) if self.episodic_life and lives is not None else True))
        for e in env_id[game_over]:
            self.episode_returns.append(float(self.game_return[e]))
            self.episode_lengths.append(int(self.game_length[e]))
        self.game_return[env_id[game_over]] = 0.0
        self.game_length[env_id[game_over]] = 0
        train_reward = np.clip(reward, -1.0, 1.0) if self.clip_rewards else reward
        continues = ~self.prev_done[env_id]  # an episode's first obs starts a new discounted return
        self.discounted_return[env_id] = self.gamma * continues * self.discounted_return[env_id] + train_reward
        self.prev_done[env_id] = done
        fields = Rollout(obs, actions, logprobs, values, train_reward, terminated, truncated, version,
                         self.discounted_return[env_id])

        generations, rows = self.generation[env_id], self.row[env_id]
        for g in np.unique(generations):
            sel = generations == g
            self._write(self._buffer(int(g)), rows[sel], env_id[sel], fields, sel)
            last = sel & (rows == self.num_steps)
            if last.any():  # the last row of rollout g is row 0 of rollout g + 1
                self._write(self._buffer(int(g) + 1), np.zeros(int(last.sum()), np.int64), env_id[last], fields, last)
                self.rows_done[int(g)] += int(last.sum())
        self.row[env_id] += 1
        wrapped = env_id[self.row[env_id] > self.num_steps]
        self.generation[wrapped] += 1
        self.row[wrapped] = 1

        completed = []
        while self.rows_done.get(self.emitted, 0) == self.num_envs:
            del self.rows_done[self.emitted]
            completed.append((self.buffers.pop(self.emitted), self.episode_returns, self.episode_lengths))
            self.episode_returns, self.episode_lengths = [], []
            self.emitted += 1
        return completed

    @staticmethod
    def _write(buffer: Rollout, rows, env_ids, fields: Rollout, sel):
        for array, value in zip(jax.tree.leaves(buffer), jax.tree.leaves(fields)):  # a dict obs: each of its arrays
            array[rows, env_ids] = value[sel] if np.ndim(value) else value
