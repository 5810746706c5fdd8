"""GAE, advantage normalisation and the PPO loss against hand-computed values and rlax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

from sebulba.ppo_envpool import Minibatch, compute_gae, masked_mean, normalize_advantages, ppo_loss, prepare_transitions
from sebulba.rollouts import Rollout


def gae(rewards, values, terminated, truncated, gamma, lam):
    col = lambda x, dtype=jnp.float32: jnp.asarray(x, dtype)[:, None]
    adv, ret = compute_gae(col(rewards), col(values), col(terminated, bool), col(truncated, bool), gamma, lam)
    return np.asarray(adv[:, 0]), np.asarray(ret[:, 0])


@pytest.mark.parametrize("how, expected", [("terminated", [-0.1, -1.0, 0.8]), ("truncated", [1.52, 0.8, 0.8])])
def test_termination_and_truncation_differ(how, expected):
    # gamma 0.9, lambda 1, rewards [1, 1, 1], V = 2 everywhere, the episode ends after the 2nd step.
    ended = [False, True, False]
    term = ended if how == "terminated" else [False] * 3
    trunc = ended if how == "truncated" else [False] * 3
    adv, _ = gae([1, 1, 1], [2, 2, 2, 2], term, trunc, 0.9, 1.0)
    np.testing.assert_allclose(adv, expected, atol=1e-6)


def test_value_targets_are_advantages_plus_values():
    adv, ret = gae([1, 0], [0, 0, 0], [False] * 2, [False] * 2, 1.0, 1.0)
    np.testing.assert_allclose(adv, [1, 0])
    np.testing.assert_allclose(ret, [1, 0])
    adv, ret = gae([1, 0, 2], [0.5, -1, 3, 1], [False, True, False], [False] * 3, 0.97, 0.9)
    np.testing.assert_allclose(ret, adv + np.array([0.5, -1, 3]), atol=1e-6)


def test_gae_matches_rlax_on_random_sequences_with_terminations():
    rng = np.random.default_rng(0)
    T, B = 32, 5
    rewards = rng.normal(size=(T, B)).astype(np.float32)
    values = rng.normal(size=(T + 1, B)).astype(np.float32)
    terminated = rng.random((T, B)) < 0.1
    gamma, lam = 0.99, 0.95
    adv, _ = compute_gae(rewards, values, terminated, np.zeros_like(terminated), gamma, lam)
    discounts = gamma * (1 - terminated.astype(np.float32))
    expected = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(1, 1, None, 1), out_axes=1)(
        rewards, discounts, lam, values)
    np.testing.assert_allclose(adv, expected, atol=1e-5)


def test_gae_truncation_bootstraps_but_cuts_the_trace():
    # A truncation at t=1 must equal two independent sequences: [0, 1] bootstrapped from V[2], and [2].
    rng = np.random.default_rng(1)
    r = rng.normal(size=3).astype(np.float32)
    v = rng.normal(size=4).astype(np.float32)
    adv, _ = gae(r, v, [False] * 3, [False, True, False], 0.9, 0.8)
    first, _ = gae(r[:2], v[:3], [False] * 2, [False] * 2, 0.9, 0.8)
    second, _ = gae(r[2:], v[2:], [False], [False], 0.9, 0.8)
    np.testing.assert_allclose(adv, np.concatenate([first, second]), atol=1e-6)


def k14_rollout(rows=slice(None)):
    """One env, rewards 0: episode A's observations t0, t1 and its final observation (truncated),
    V = 1 on all three; then episode B's t2, t3 and the next one, V = 100. Row 2 -> row 3 is
    EnvPool's auto-reset step. `rows` cuts out one episode's rows."""
    values = np.array([1, 1, 1, 100, 100, 100], np.float32)[:, None]
    truncated = np.array([0, 0, 1, 0, 0, 0], bool)[:, None]
    zeros = np.zeros_like(values)
    rollout = Rollout(obs=np.zeros((6, 1, 1), np.float32), actions=np.zeros((6, 1), np.int32), logprobs=zeros,
                      values=values, rewards=zeros, terminated=np.zeros_like(truncated), truncated=truncated,
                      versions=np.zeros((6, 1), np.int32), discounted_returns=zeros)
    return Rollout(*[x[rows] for x in rollout])


def test_a_truncated_step_never_sees_the_next_episodes_value():
    """pytorch/rl#4209: the advantage of the step that hits the time limit bootstraps from its own
    episode's final observation (V = 1), never from the next episode's first one (V = 100)."""
    joined = prepare_transitions(jax.tree.map(jnp.asarray, k14_rollout()), gamma=1.0, gae_lambda=1.0)
    np.testing.assert_allclose(joined.advantages[:2, 0], [0.0, 0.0])  # t0, t1 (t1 truncated): never 99
    np.testing.assert_array_equal(joined.mask[:, 0], [1, 1, 0, 1, 1])  # the auto-reset step carries nothing
    per_episode = [prepare_transitions(jax.tree.map(jnp.asarray, k14_rollout(rows)), 1.0, 1.0)
                   for rows in (slice(0, 3), slice(3, 6))]
    kept = np.asarray(joined.mask[:, 0]) == 1
    for field in ("advantages", "returns"):
        np.testing.assert_allclose(np.asarray(getattr(joined, field))[kept, 0],
                                   np.concatenate([np.asarray(getattr(t, field))[:, 0] for t in per_episode]))


def test_normalisation_ignores_masked_entries():
    adv = jnp.array([1.0, 3.0, 1000.0])
    mask = jnp.array([1.0, 1.0, 0.0])
    out = normalize_advantages(adv, mask)
    np.testing.assert_allclose(out[:2], [-1.0, 1.0], atol=1e-6)
    assert float(masked_mean(adv, jnp.zeros(3))) == 0.0


def _apply(params, obs):
    # A linear "network": logits = obs @ W, value = obs @ v.
    return obs @ params["w"], obs @ params["v"]


def test_ppo_loss_hand_computed_and_mask_removes_a_sample():
    params = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0]]), "v": jnp.array([1.0, 1.0])}
    obs = jnp.array([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    logits = obs @ params["w"]
    logp = jax.nn.log_softmax(logits)
    actions = jnp.array([0, 1, 0])
    behaviour = logp[jnp.arange(3), actions] - jnp.array([0.0, 0.5, 0.3])  # ratios 1, e^0.5, e^0.3
    mb = Minibatch(obs, actions, behaviour, jnp.array([1.0, -2.0, 7.0]), jnp.array([0.0, 1.0, 9.0]),
                   jnp.array([1.0, 1.0, 0.0]))
    loss, m = ppo_loss(params, _apply, mb, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, norm_adv=False)
    # Unmasked samples 0 and 1. Sample 0: ratio 1, A=1 -> -1. Sample 1: ratio e^0.5 > 1.2, A=-2:
    # max(2 e^0.5, 2 * 1.2) = 2 e^0.5.
    pg = (-1.0 + 2 * np.exp(0.5)) / 2
    v = 0.5 * ((1.0 - 0.0) ** 2 + (2.0 - 1.0) ** 2) / 2
    probs = jax.nn.softmax(logits)
    ent = float(-(probs * logp).sum(-1)[:2].mean())
    np.testing.assert_allclose(m["policy_loss"], pg, rtol=1e-5)
    np.testing.assert_allclose(m["value_loss"], v, rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], ent, rtol=1e-5)
    np.testing.assert_allclose(loss, pg - 0.01 * ent + 0.5 * v, rtol=1e-5)
    np.testing.assert_allclose(m["clipfrac"], 0.5)
    # The masked sample carries no gradient.
    grad = jax.grad(lambda o: ppo_loss(params, _apply, mb._replace(obs=o), 0.2, 0.01, 0.5, True)[0])(obs)
    np.testing.assert_array_equal(grad[2], 0.0)
