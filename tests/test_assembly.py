"""Rollout assembly per env id, episode accounting and masking (envpool#259, #312, #299, envpool PR#53,
cleanrl#562)."""

import importlib
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fake_envpool import ScriptedPool, drive_actor
from sebulba.envs import env_segments
from sebulba.networks import RunningMoments, make_policy_fn
from sebulba.ppo_envpool import Agent, normalize_advantages, prepare_transitions
from sebulba.rollouts import RolloutAssembler
from sebulba.threads import ParamsSlot


def round_robin(num_envs, batch_size, n):
    order = np.arange(num_envs)
    return [np.roll(order, -i * batch_size)[:batch_size] for i in range(n)]


def test_recv_send_alternate_and_an_empty_batch_fails_at_once():
    batches = round_robin(4, 2, 20) + [np.array([], np.int32)]
    pool = ScriptedPool(batches, num_envs=4)
    rollouts, error = drive_actor(pool, batch_size=2, num_steps=4, num_rollouts=10)
    assert pool.calls == 21  # 20 steps ran without a recv/recv error, then the empty batch
    assert error is not None and "returned 0 envs" in str(error)
    assert len(rollouts) == 2  # 10 rows per env: rollouts need 5, then 4 more rows
    for rollout, *_ in rollouts:
        assert rollout.obs.shape == (5, 4, 3)
        assert (rollout.obs[:, :, 0] == np.arange(4)).all()  # every row written, each by its own env


def test_out_of_order_ids_stay_on_their_own_env():
    ids = [[3, 1], [0, 2], [1, 3], [2, 0], [3, 1], [0, 2], [1, 3], [2, 0]]
    steps = {e: [(100.0 * e + k, False, False, 1) for k in range(10)] for e in range(4)}
    pool = ScriptedPool(ids, num_envs=4, steps=steps)
    rollouts, error = drive_actor(pool, batch_size=2, num_steps=3, num_rollouts=1)
    assert error is None and len(rollouts) == 1
    rollout = rollouts[0][0]
    for e in range(4):
        np.testing.assert_array_equal(rollout.rewards[:, e], 100.0 * e + np.arange(4))  # own rewards, own order
        np.testing.assert_array_equal(rollout.obs[:, e, 1], np.arange(4))
        np.testing.assert_array_equal(rollout.actions[:, e], pool.actions_received[e][:4])  # actions went to e


def test_duplicate_ids_are_an_error():
    pool = ScriptedPool([[1, 1]], num_envs=4)
    _, error = drive_actor(pool, batch_size=2, num_steps=3, num_rollouts=1)
    assert error is not None and "duplicate env ids" in str(error)


def feed(assembler, env, steps):
    """Feed one env's (reward, terminated, truncated, lives) steps; returns the completed rollouts."""
    out = []
    for reward, term, trunc, lives in steps:
        out += assembler.add(np.array([env]), np.zeros((1, 1)), np.array([reward], np.float32), np.array([term]),
                             np.array([trunc]), np.array([lives]), np.zeros(1, np.int32), np.zeros(1), np.zeros(1), 0)
    return out


def test_games_split_at_truncation_with_episodic_life():
    a = RolloutAssembler(1, 100, (1,), np.float32, clip_rewards=True, episodic_life=True)
    reset = (0.0, False, False, 3)
    game_a = [reset, (2.0, False, False, 3), (3.0, True, False, 2), reset, (0.0, False, True, 2)]  # time limit
    game_b = [reset, (4.0, True, False, 2), reset, (6.0, True, False, 1), reset, (0.0, True, False, 0)]
    feed(a, 0, game_a + game_b)
    assert a.episode_returns == [5.0, 10.0]
    assert a.episode_lengths == [3, 3]


def test_raw_return_logged_clipped_reward_trained():
    a = RolloutAssembler(1, 5, (1,), np.float32, clip_rewards=True, episodic_life=False)
    steps = [(0.0, False, False, 1)] + [(r, False, False, 1) for r in [0, 5, 0, 10]] + [(-3.0, True, False, 0)]
    (rollout, returns, lengths), = feed(a, 0, steps)
    assert returns == [12.0] and lengths == [5]
    np.testing.assert_array_equal(rollout.rewards[1:, 0], [0, 1, 0, 1, -1])


def test_auto_reset_step_is_masked_and_done_step_advantage_is_r_minus_v():
    a = RolloutAssembler(1, 5, (1,), np.float32, clip_rewards=False, episodic_life=False)
    values = [0.5, 0.7, 0.9, 0.4, 0.3, 0.2]
    steps = [(0.0, False, False, 1), (1.0, False, False, 1), (1.0, False, False, 1), (2.0, True, False, 1),
             (0.0, False, False, 1), (1.0, False, False, 1)]  # done at the 3rd step, then EnvPool's reset step
    out = []
    for (reward, term, trunc, _), v in zip(steps, values):
        out += a.add(np.array([0]), np.zeros((1, 1)), np.array([reward], np.float32), np.array([term]),
                     np.array([trunc]), None, np.zeros(1, np.int32), np.zeros(1), np.array([v]), 0)
    (rollout, *_), = out
    t = prepare_transitions(jax.tree.map(jnp.asarray, rollout), gamma=0.99, gae_lambda=0.95)
    np.testing.assert_array_equal(t.mask[:, 0], [1, 1, 1, 0, 1])
    np.testing.assert_allclose(t.advantages[2, 0], 2.0 - 0.9, atol=1e-6)  # r - V(s), nothing bootstrapped
    # The masked step has no weight in the advantage statistics: moving its advantage changes nothing.
    moved = t.advantages.at[3, 0].set(1e6)
    np.testing.assert_allclose(normalize_advantages(t.advantages, t.mask) * t.mask,
                               normalize_advantages(moved, t.mask) * t.mask, atol=1e-5)


def test_envs_running_ahead_write_into_the_next_rollout():
    a = RolloutAssembler(2, 2, (1,), np.float32, clip_rewards=False, episodic_life=False)
    step = lambda env, r: a.add(np.array([env]), np.array([[r]]), np.array([r], np.float32), np.array([False]),
                                np.array([False]), None, np.zeros(1, np.int32), np.zeros(1), np.zeros(1), 0)
    out = []
    for r in range(6):  # env 0 runs two rollouts ahead
        out += step(0, r)
    assert out == []
    for r in range(3):
        out += step(1, 10 + r)
    assert len(out) == 1  # rollout 0 is complete; env 0's rows of rollouts 1 and 2 wait for env 1
    first = out[0][0]
    np.testing.assert_array_equal(first.obs[:, 0, 0], [0, 1, 2])
    np.testing.assert_array_equal(first.obs[:, 1, 0], [10, 11, 12])
    for r in range(3, 5):
        out += step(1, 10 + r)
    second = out[1][0]
    np.testing.assert_array_equal(second.obs[:, 0, 0], [2, 3, 4])  # its row 0 is the last row of rollout 0
    np.testing.assert_array_equal(second.obs[:, 1, 0], [12, 13, 14])


@pytest.mark.parametrize("max_policy_lag, script", [(0, "ppo_envpool"), (1, "ppo_envpool"), (2, "ppo_envpool"),
                                                    (0, "impala_envpool"), (1, "impala_envpool")])
def test_policy_lag_stays_within_the_bound_and_zero_means_synchronous(max_policy_lag, script):
    """The real actor loop against a learner thread that publishes version u + 1 (params of its
    own) after taking rollout u: the lag of every transition (u - version that chose it) obeys
    the bound; with 0 the actor steps no env for rollout g until version g exists; every
    recorded action is the one the env received, and every recorded log-probability and value
    the one of the params version its row records (with 0, row 0 chosen again: `restart_rows`)."""
    module = importlib.import_module(f"sebulba.{script}")
    num_envs, num_steps, num_rollouts = 2, 3, 4
    pool = ScriptedPool([[0, 1]] * 100, num_envs)
    agent = Agent(num_actions=3, channels=(), hiddens=(8,), pixels=False)
    device, moments = jax.devices()[0], RunningMoments.create(())
    versions = [agent.init(jax.random.PRNGKey(v), jnp.zeros((1, 3))) for v in range(num_rollouts + 1)]
    slot = ParamsSlot()
    slot.publish(0, {device: (versions[0], moments)})
    rollouts: queue.Queue = queue.Queue(maxsize=1)
    lags, recvs_at_publish, taken = [], [], []

    def learner():
        for update in range(num_rollouts):
            rollout, *_ = rollouts.get(timeout=10)
            taken.append(rollout)
            lags.append(update - rollout.versions[:-1])
            time.sleep(0.05)  # an update takes time; a synchronous actor must wait it out
            recvs_at_publish.append(pool.calls)
            slot.publish(update + 1, {device: (versions[update + 1], moments)})

    thread = threading.Thread(target=learner)
    thread.start()
    assembler = RolloutAssembler(num_envs, num_steps, (3,), np.float32, clip_rewards=False, episodic_life=False)
    module.run_actor(pool, make_policy_fn(agent), device, jax.random.PRNGKey(1), slot, rollouts, assembler,
                     num_rollouts, module.Args(stall_timeout_s=5, max_policy_lag=max_policy_lag), num_envs,
                     threading.Event(), "actor")
    thread.join(timeout=10)
    lags = np.stack(lags)  # [update, step, env]
    assert lags.max() <= max_policy_lag
    for g, rollout in enumerate(taken):  # rows 0..T-1 of rollout g are the env's actions g*T .. g*T+T-1
        for e in range(num_envs):
            np.testing.assert_array_equal(rollout.actions[:-1, e], pool.actions_received[e][g * num_steps:][:num_steps])
            for t in range(num_steps + 1):
                logits, value = agent.apply(versions[rollout.versions[t, e]], rollout.obs[t, e][None], moments)
                np.testing.assert_allclose(rollout.logprobs[t, e],
                                           jax.nn.log_softmax(logits)[0, rollout.actions[t, e]], atol=1e-5)
                if script == "ppo_envpool":  # IMPALA's learner recomputes the values; its actor records none
                    np.testing.assert_allclose(rollout.values[t, e], value[0], atol=1e-5)
    if max_policy_lag == 0:
        # Row 0's action is chosen again once the update of the rollout it ends is published, as a
        # synchronous loop does: rollout g takes recvs g*T+1 .. (g+1)*T+1, and during update g no
        # action is in flight (the actor waits before its send).
        assert (lags == 0).all()
        assert recvs_at_publish[:-1] == [(g + 1) * num_steps + 1 for g in range(num_rollouts - 1)]
        assert all((rollout.versions[0] == g).all() for g, rollout in enumerate(taken))


def test_deterministic_env_segments_restart_at_every_checkpoint_interval():
    assert env_segments(0, 10, True, 4) == [(0, 4), (4, 8), (8, 10)]
    assert env_segments(8, 10, True, 4) == [(8, 10)]
    assert env_segments(6, 13, True, 4) == [(6, 8), (8, 12), (12, 13)]  # resumed from a non-boundary (a longer run)
    assert env_segments(0, 10, False, 4) == [(0, 10)]
