"""Replay on the learner mesh, for off-policy scripts: one-step transitions taken from the
rollouts the actors already produce, stored in a circular buffer sharded over the learner
devices the way rollouts are (each device holds the transitions of its own env slice), and
sampled on each device from its own shard.

It knows nothing of the algorithm: SAC (sebulba/sac_envpool.py) and a DQN-family script use
the same `Transition`s. `rollout_transitions`, `insert` and `sample` are per-device functions,
called inside the script's `jax.shard_map` over the learner axis; `create` makes the empty,
sharded buffer. Docs: docs/sac_envpool.md#the-replay-buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class Transition(NamedTuple):
    """One-step transitions [M, ...]: (s_t, a_t) -> r_{t+1}, s_{t+1}.

    obs, next_obs [M, *obs] as stored in rollouts (float32 for vector tasks); action [M, *action]
    as the behaviour policy chose it (before any mapping to the env's bounds); reward [M]
    float32, the training reward received with next_obs; terminated [M] bool: the episode ended
    by termination at next_obs, so s_{t+1} is worth 0. A truncated transition (time limit) is
    stored with terminated False and next_obs its final observation, so it bootstraps.
    """

    obs: Any
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    next_obs: Any


class ReplayState(NamedTuple):
    """The buffer. Globally each leaf of `data` is [D * C, ...] sharded over the D learner
    devices (P("learner")), so each device holds C slots; `cursor` and `size` are [D] int32 (one
    per device: [1] inside shard_map). Slots 0 .. size - 1 of a device hold transitions; the
    next one is written at `cursor` (circular: once size = C the oldest is overwritten)."""

    data: Transition
    cursor: jax.Array
    size: jax.Array

    @property
    def capacity(self) -> int:
        """Slots per device (inside shard_map), or in all (outside)."""
        return jax.tree.leaves(self.data)[0].shape[0]


def rollout_transitions(obs, actions, rewards, terminated, truncated) -> tuple[Transition, jax.Array]:
    """The T x n transitions of rollout rows [T+1, n, ...] (sebulba.rollouts.Rollout's layout:
    row t holds obs_t, the action taken on it, and the reward and episode end received *with*
    obs_t), flattened time-major to [T * n], and which of them are real: (Transition, valid
    [T * n] bool).

    Transition t is (obs_t, action_t) -> (rewards[t+1], terminated[t+1], obs_{t+1}). It is not
    valid when obs_t itself ended an episode (terminated or truncated): that step is EnvPool's
    auto-reset, whose action is ignored and whose next observation starts a new episode
    (cleanrl#562, envpool#194); it must never be stored.
    """
    chex.assert_rank([rewards, terminated, truncated], 2)
    chex.assert_equal_shape([rewards, terminated, truncated])

    def rows(x, start, stop):  # [T+1, n, ...] -> rows start..stop-1 flattened to [T * n, ...]
        x = x[start:stop]
        return x.reshape((-1,) + x.shape[2:])

    steps = rewards.shape[0]
    transitions = Transition(jax.tree.map(lambda x: rows(x, 0, steps - 1), obs), rows(actions, 0, steps - 1),
                             rows(rewards, 1, steps).astype(jnp.float32), rows(terminated, 1, steps),
                             jax.tree.map(lambda x: rows(x, 1, steps), obs))
    return transitions, ~rows(terminated | truncated, 0, steps - 1)


def create(example: Transition, capacity_per_device: int, mesh: Mesh, axis: str = "learner") -> ReplayState:
    """An empty buffer of `capacity_per_device` slots on every device of `mesh`, zeros,
    sharded over `axis`. `example` gives one transition's shapes and dtypes (arrays or
    jax.ShapeDtypeStruct, without a batch axis). Works with several processes (each process
    allocates the shards of its own devices)."""
    devices = mesh.shape[axis]
    sharded = NamedSharding(mesh, P(axis))

    def zeros():
        data = jax.tree.map(lambda x: jnp.zeros((devices * capacity_per_device, *x.shape), x.dtype), example)
        return ReplayState(data, jnp.zeros(devices, jnp.int32), jnp.zeros(devices, jnp.int32))

    return jax.jit(zeros, out_shardings=sharded)()


def insert(replay: ReplayState, transitions: Transition, valid) -> ReplayState:
    """Per device: write the `valid` rows of `transitions` [M, ...] into the next slots, in row
    order, wrapping around; the other rows are dropped (never written, so never sampled).

    Requires M <= capacity (two rows would share a slot); `resolve` in each script checks the
    sizes before the run starts.
    """
    capacity, rows = replay.capacity, valid.shape[0]
    chex.assert_shape(valid, (rows,))
    if rows > capacity:
        raise ValueError(f"{rows} transitions per insert do not fit in {capacity} slots per device")
    cursor, size = replay.cursor[0], replay.size[0]
    offsets = jnp.cumsum(valid) - 1  # the k-th valid row goes to cursor + k
    slots = jnp.where(valid, (cursor + offsets) % capacity, capacity)  # out of range: dropped
    data = jax.tree.map(lambda buffer, x: buffer.at[slots].set(x.astype(buffer.dtype), mode="drop"),
                        replay.data, transitions)
    added = jnp.sum(valid, dtype=jnp.int32)
    return ReplayState(data, ((cursor + added) % capacity)[None], jnp.minimum(size + added, capacity)[None])


def sample(replay: ReplayState, key, batch: int, axis: str = "learner") -> Transition:
    """Per device: `batch` transitions drawn uniformly, with replacement, from the slots this
    device has filled (0 .. size - 1; never an unwritten one). The key is folded with the
    device's index on `axis`, so each device draws its own rows. Needs size >= 1: the learner
    samples only once learning has started (after --learning-starts env steps)."""
    key = jax.random.fold_in(key, jax.lax.axis_index(axis))
    index = jax.random.randint(key, (batch,), 0, jnp.maximum(replay.size[0], 1))
    return jax.tree.map(lambda x: x[index], replay.data)


def transition_bytes(example: Transition) -> int:
    """Bytes one stored transition takes (obs and next_obs both stored)."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(example)))
