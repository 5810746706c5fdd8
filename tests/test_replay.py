"""The replay buffer on the learner mesh (sebulba/replay.py): transitions from rollout rows,
insertion and circular overwrite, masked rows never stored, each device's shard holding its
own env slice, uniform sampling over what is stored, and a checkpoint round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sebulba import replay
from sebulba.checkpoints import Checkpointer
from sebulba.devices import Placement
from sebulba.rollouts import Rollout

EXAMPLE = replay.Transition(jax.ShapeDtypeStruct((2,), np.float32), jax.ShapeDtypeStruct((1,), np.float32),
                            jax.ShapeDtypeStruct((), np.float32), jax.ShapeDtypeStruct((), bool),
                            jax.ShapeDtypeStruct((2,), np.float32))


def programs(placement: Placement, batch: int = 1):
    """(insert, sample) over `placement`'s learner mesh, as a script's shard_map calls them."""
    mesh = placement.mesh

    def insert(buffer, rows):  # rows: (obs, actions, rewards, terminated, truncated) [T+1, n, ...] per device
        return replay.insert(buffer, *replay.rollout_transitions(*rows))

    def sample(buffer, key):
        return replay.sample(buffer, key, batch)

    insert = jax.jit(jax.shard_map(insert, mesh=mesh, in_specs=(P("learner"), P(None, "learner")),
                                   out_specs=P("learner")))
    sample = jax.jit(jax.shard_map(sample, mesh=mesh, in_specs=(P("learner"), P()), out_specs=P("learner")))
    return insert, sample


def rows(num_steps, num_envs, first=0, ends=()):
    """Host rollout rows whose obs identify (env, step): obs[t, e] = (e, first + t); reward = the
    obs's step; `ends` lists (t, e, "terminated" | "truncated")."""
    t, e = np.meshgrid(np.arange(num_steps + 1) + first, np.arange(num_envs), indexing="ij")
    obs = np.stack([e, t], axis=-1).astype(np.float32)
    terminated, truncated = np.zeros((2, num_steps + 1, num_envs), bool)
    for step, env, how in ends:
        (terminated if how == "terminated" else truncated)[step, env] = True
    return obs, t[..., None].astype(np.float32), t.astype(np.float32), terminated, truncated


def test_transition_t_takes_the_reward_and_end_received_with_the_next_observation():
    obs, actions, rewards, terminated, truncated = rows(3, 1, ends=[(1, 0, "terminated")])
    transitions, valid = replay.rollout_transitions(obs, actions, rewards, terminated, truncated)
    np.testing.assert_array_equal(transitions.obs[:, 1], [0, 1, 2])
    np.testing.assert_array_equal(transitions.next_obs[:, 1], [1, 2, 3])
    np.testing.assert_array_equal(transitions.reward, [1, 2, 3])
    np.testing.assert_array_equal(transitions.terminated, [True, False, False])
    # obs_1 ended its episode: the step from it is EnvPool's auto-reset (action ignored), never stored.
    np.testing.assert_array_equal(valid, [True, False, True])


def test_a_truncated_transition_keeps_its_final_observation_and_is_not_terminal():
    obs, actions, rewards, terminated, truncated = rows(2, 1, ends=[(1, 0, "truncated")])
    transitions, valid = replay.rollout_transitions(obs, actions, rewards, terminated, truncated)
    assert not transitions.terminated[0] and valid[0] and not valid[1]
    np.testing.assert_array_equal(transitions.next_obs[0], obs[1, 0])  # bootstraps from its final observation


def test_insert_skips_masked_rows_and_overwrites_the_oldest_once_full():
    placement = Placement(jax.devices()[:1], jax.devices()[:1])
    insert, sample = programs(placement)
    buffer = replay.create(EXAMPLE, 5, placement.mesh)
    buffer = insert(buffer, rows(3, 1, ends=[(1, 0, "terminated")]))  # transitions at steps 0, 2 (1 is masked)
    np.testing.assert_array_equal(buffer.data.obs[:3, 1], [0, 2, 0])
    assert (int(buffer.size[0]), int(buffer.cursor[0])) == (2, 2)
    buffer = insert(buffer, rows(3, 1, first=10))  # steps 10, 11, 12: slots 2, 3, 4
    buffer = insert(buffer, rows(3, 1, first=20))  # 20, 21, 22 overwrite the oldest: slots 0, 1, 2
    np.testing.assert_array_equal(buffer.data.obs[:, 1], [20, 21, 22, 11, 12])
    np.testing.assert_array_equal(buffer.data.reward, [21, 22, 23, 12, 13])
    assert (int(buffer.size[0]), int(buffer.cursor[0])) == (5, 3)


def test_masked_and_unwritten_slots_are_never_sampled():
    placement = Placement(jax.devices()[:1], jax.devices()[:1])
    insert, sample = programs(placement, batch=4096)
    buffer = replay.create(EXAMPLE, 64, placement.mesh)
    # 2 envs x 4 steps, with episode ends: 8 rows of which 3 are auto-reset steps.
    buffer = insert(buffer, rows(4, 2, ends=[(1, 0, "terminated"), (2, 1, "truncated"), (3, 0, "truncated")]))
    drawn = sample(buffer, jax.random.PRNGKey(0))
    pairs = {(int(e), int(t)) for e, t in np.asarray(drawn.obs)}
    assert pairs == {(0, 0), (0, 2), (1, 0), (1, 1), (1, 3)}  # the stored ones, each seen; (0, 1) (1, 2) (0, 3) masked
    assert not (np.asarray(drawn.reward) == 0).any()  # an unwritten slot holds zeros


def test_each_learner_device_holds_exactly_its_env_slice():
    # 4 envs from each of 2 actor threads over learner devices 1 and 2: the learner's transfer puts
    # an equal part of every thread's envs on each device (K11); the replay keeps them there.
    devices = jax.devices()
    placement = Placement(devices[:1], devices[1:3])
    insert, _ = programs(placement)
    buffer = replay.create(EXAMPLE, 16, placement.mesh)
    thread_rows = []
    for thread in range(2):
        obs, actions, rewards, terminated, truncated = rows(2, 4)
        obs[..., 0] += 10 * thread  # env ids 0-3 of thread 0, 10-13 of thread 1
        thread_rows.append(Rollout(obs, actions, *[rewards] * 3, terminated, truncated, rewards, rewards))
    batch = placement.to_learners(thread_rows)
    buffer = insert(buffer, (batch.obs, batch.actions, batch.rewards, batch.terminated, batch.truncated))
    for shard in buffer.data.obs.addressable_shards:
        envs = set(np.asarray(shard.data)[: 8, 0].astype(int).tolist())
        expected = {0, 1, 10, 11} if shard.device == devices[1] else {2, 3, 12, 13}
        assert envs == expected, shard.device
    np.testing.assert_array_equal(buffer.size, [8, 8])


def test_sampling_is_uniform_over_what_is_stored():
    placement = Placement(jax.devices()[:1], jax.devices()[:1])
    insert, sample = programs(placement, batch=20_000)
    buffer = replay.create(EXAMPLE, 12, placement.mesh)
    buffer = insert(buffer, rows(10, 1))  # steps 0-9
    buffer = insert(buffer, rows(4, 1, first=10))  # 10-13: the buffer wrapped (12 slots), 0 and 1 are gone
    counts = np.bincount(np.asarray(sample(buffer, jax.random.PRNGKey(3)).obs[:, 1]).astype(int), minlength=14)
    assert counts[:2].sum() == 0
    expected = 20_000 / 12
    chi2 = float(np.sum((counts[2:] - expected) ** 2 / expected))
    assert chi2 < 31.3, counts  # chi-square, 11 degrees of freedom: p = 0.001


def test_each_device_draws_its_own_rows():
    devices = jax.devices()
    placement = Placement(devices[:1], devices[1:3])
    insert, sample = programs(placement, batch=64)
    buffer = replay.create(EXAMPLE, 32, placement.mesh)
    same = rows(16, 2)  # both devices hold identical transitions: only the keys can tell them apart
    same = (np.concatenate([same[0], same[0]], 1), *[np.concatenate([x, x], 1) for x in same[1:]])
    drawn = np.asarray(sample(insert(buffer, same), jax.random.PRNGKey(0)).reward)
    assert not np.array_equal(drawn[:64], drawn[64:])


def test_inserting_more_rows_than_slots_is_refused():
    placement = Placement(jax.devices()[:1], jax.devices()[:1])
    insert, _ = programs(placement)
    with pytest.raises(ValueError, match="do not fit in 4 slots"):
        insert(replay.create(EXAMPLE, 4, placement.mesh), rows(5, 1))


def test_a_checkpoint_round_trip_is_bit_for_bit(tmp_path):
    devices = jax.devices()
    placement = Placement(devices[:1], devices[1:3])
    insert, _ = programs(placement)
    buffer = replay.create(EXAMPLE, 8, placement.mesh)
    obs, actions, rewards, terminated, truncated = rows(3, 2, ends=[(2, 1, "terminated")])
    obs = obs + np.random.default_rng(0).normal(size=obs.shape).astype(np.float32)  # bits beyond the integers
    buffer = insert(buffer, (obs, actions, rewards, terminated, truncated))
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    state = {"step": jnp.int32(7)}
    checkpointer.save(1, state, {"update": 1}, {"replay": buffer})
    checkpointer.close()
    like = replay.create(EXAMPLE, 8, placement.mesh)
    restored = Checkpointer(tmp_path / "checkpoints").restore_item(1, "replay", like)
    for a, b in zip(jax.tree.leaves(buffer), jax.tree.leaves(restored)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert replay.transition_bytes(EXAMPLE) == (2 + 1 + 1 + 2) * 4 + 1
