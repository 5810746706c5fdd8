"""SAC (sebulba/sac_envpool.py): the tanh-Gaussian log-probability, the soft target, the three
losses and the Polyak update against NumPy; the exact replay ratio; the configuration checks;
and, marked slow, runs of the real script (learning, a failing thread, a stop signal with
resume, --deterministic resume, actors of different speeds)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba.sac_envpool as sac
from sebulba.config import ConfigError
from sebulba.networks import TanhGaussian, env_action, log_prob, make_policy_fn, sample_action, tanh_gaussian_sample


def numpy_tanh_gaussian_logprob(u, mean, log_std):
    """log pi(tanh(u)) in float64: the Gaussian density of u and the change of variables a = tanh(u)."""
    std = np.exp(log_std)
    gaussian = -0.5 * ((u - mean) / std) ** 2 - log_std - 0.5 * np.log(2 * np.pi)
    return np.sum(gaussian - np.log(1 - np.tanh(u) ** 2), axis=-1)


def test_tanh_gaussian_log_prob_with_its_log_determinant_matches_numpy():
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(64, 3)).astype(np.float32)
    log_std = rng.uniform(-2, 0.5, size=(64, 3)).astype(np.float32)
    key = jax.random.PRNGKey(1)
    action, logp = tanh_gaussian_sample(TanhGaussian(mean, log_std), key)
    u = mean.astype(np.float64) + np.exp(log_std) * np.asarray(jax.random.normal(key, mean.shape), np.float64)
    np.testing.assert_allclose(action, np.tanh(u), atol=1e-6)
    np.testing.assert_allclose(logp, numpy_tanh_gaussian_logprob(u, mean, log_std), rtol=1e-4, atol=1e-4)
    # Read back from the squashed action (what actors record): the same, away from the bounds.
    inside = np.all(np.abs(u) < 3, axis=-1)
    np.testing.assert_allclose(np.asarray(log_prob(TanhGaussian(mean, log_std), action))[inside],
                               np.asarray(logp)[inside], rtol=1e-3, atol=1e-3)


def test_tanh_gaussian_log_prob_stays_finite_where_the_squash_saturates():
    # u = 20: 1 - tanh(u)^2 is 0 in float32, so log(1 - a^2) would be -inf; the stable form is exact.
    mean, log_std = jnp.full((1, 2), 20.0), jnp.full((1, 2), -110.0)  # and a collapsed std (rsl_rl PR#190)
    action, logp = tanh_gaussian_sample(TanhGaussian(mean, log_std), jax.random.PRNGKey(0))
    assert np.isfinite(logp).all() and np.all(np.abs(action) <= 1)
    grads = jax.grad(lambda m: tanh_gaussian_sample(TanhGaussian(m, log_std), jax.random.PRNGKey(0))[1].sum())(mean)
    assert np.isfinite(grads).all()
    # log_std is read at its floor, -20; u = 20 + e^-20 eps is 20 in float32.
    eps = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 2)), np.float64)
    log_det = 2 * (np.log(2) - 20.0 - np.log1p(np.exp(-40.0)))  # log(1 - tanh(20)^2) in float64, by its own formula
    expected = np.sum(-0.5 * eps**2 + 20.0 - 0.5 * np.log(2 * np.pi) - log_det)
    np.testing.assert_allclose(logp[0], expected, rtol=1e-5)


def test_the_mean_action_is_tanh_of_the_mean_mapped_onto_the_bounds():
    dist = TanhGaussian(jnp.array([[0.0, 10.0, -0.5]]), jnp.zeros((1, 3)))
    a = sample_action(dist, jax.random.PRNGKey(0), greedy=True)
    np.testing.assert_allclose(a, np.tanh([[0.0, 10.0, -0.5]]), rtol=1e-6)
    low, high = np.array([-2.0, 0.0, -1.0]), np.array([2.0, 4.0, 3.0])
    np.testing.assert_allclose(env_action(dist, jnp.array([[0.0, 1.0, -1.0]]), (low, high)), [[0.0, 4.0, -1.0]])


def test_soft_target_by_hand_termination_and_truncation():
    # r = [1, 1], next Q (twins) = [[3, 5], [4, 2]] -> min [3, 2]; log pi' = [-1, 0.5]; alpha 0.2; gamma 0.9.
    reward, next_q, next_logp = jnp.array([1.0, 1.0]), jnp.array([[3.0, 5.0], [4.0, 2.0]]), jnp.array([-1.0, 0.5])
    truncated_or_running = sac.soft_q_target(reward, jnp.array([0.0, 0.0]), next_q, next_logp, 0.2, 0.9)
    np.testing.assert_allclose(truncated_or_running, [1 + 0.9 * (3 + 0.2), 1 + 0.9 * (2 - 0.1)], rtol=1e-6)
    terminated = sac.soft_q_target(reward, jnp.array([1.0, 0.0]), next_q, next_logp, 0.2, 0.9)
    np.testing.assert_allclose(terminated, [1.0, 1 + 0.9 * 1.9], rtol=1e-6)  # no bootstrap after termination


def test_critic_actor_and_temperature_losses_match_numpy():
    rng = np.random.default_rng(2)
    q, target = rng.normal(size=(2, 16)).astype(np.float32), rng.normal(size=16).astype(np.float32)
    loss, per_critic = sac.critic_loss(jnp.asarray(q), jnp.asarray(target))
    expected = ((q - target) ** 2).mean(axis=1)
    np.testing.assert_allclose(per_critic, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, expected.sum(), rtol=1e-5)
    logp, alpha = rng.normal(size=16).astype(np.float32), 0.3
    np.testing.assert_allclose(sac.actor_loss(jnp.asarray(q), jnp.asarray(logp), alpha),
                               np.mean(alpha * logp - q.min(axis=0)), rtol=1e-5)
    log_alpha, target_entropy = np.float32(-0.7), -3.0
    np.testing.assert_allclose(sac.temperature_loss(log_alpha, jnp.asarray(logp), target_entropy),
                               np.mean(-np.exp(log_alpha) * (logp + target_entropy)), rtol=1e-5)
    # Its gradient raises alpha when the entropy -log pi is below the target (log pi + target > 0).
    low_entropy = jnp.full(16, 5.0)
    assert jax.grad(sac.temperature_loss)(jnp.float32(0.0), low_entropy, target_entropy) < 0
    assert jax.grad(sac.temperature_loss, argnums=1)(jnp.float32(0.0), low_entropy, target_entropy).sum() == 0


def test_polyak_update():
    target, online = {"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, -2.0])}
    np.testing.assert_allclose(sac.polyak(target, online, 0.005)["w"], [1.01, 1.98], rtol=1e-6)
    np.testing.assert_allclose(sac.polyak(target, online, 1.0)["w"], [3.0, -2.0])


@pytest.mark.parametrize("env_steps, starts, ratio, expected", [
    (5_000, 5_000, 1.0, 0), (5_001, 5_000, 1.0, 1), (1_000_000, 5_000, 1.0, 995_000),
    (100, 0, 0.29, 29),  # 0.29 x 100 is 28.999... in binary floating point
    (70, 0, 0.1, 7), (1_000_000, 5_000, 0.1, 99_500), (3, 0, 0.5, 1), (10, 20, 4.0, 0)])
def test_gradient_steps_due_is_exact(env_steps, starts, ratio, expected):
    assert sac.gradient_steps_due(env_steps, starts, ratio) == expected


def test_per_update_steps_add_up_to_the_ratio_whatever_the_batch():
    for batch in (7, 128, 1000):
        steps = [sac.gradient_steps_due((u + 1) * batch, 900, 0.3) - sac.gradient_steps_due(u * batch, 900, 0.3)
                 for u in range(50)]
        assert sum(steps) == max(0, (3 * (50 * batch - 900)) // 10) and min(steps) >= 0


PENDULUM = ["--env-id", "Pendulum-v1", "--local-num-envs", "4", "--num-steps", "8", "--total-timesteps", "3200",
            "--learning-starts", "256", "--buffer-size", "4096", "--hiddens", "32", "32", "--minibatch-size", "64"]


def args(*extra):
    import tyro
    return tyro.cli(sac.Args, args=[*PENDULUM, *extra])


@pytest.mark.parametrize("flags, message", [
    (["--env-id", "CartPole-v1"], "SAC needs continuous \\(Box\\) actions"),
    (["--replay-ratio", "0"], "--replay-ratio=0.0 must be positive"),
    (["--replay-ratio", "-1"], "--replay-ratio=-1.0 must be positive"),
    (["--learning-starts", "3200"], "--learning-starts=3200 is not before the end of the run \\(3200 env steps\\)"),
    (["--learner-device-ids", "1", "2", "3", "--minibatch-size", "64", "--local-num-envs", "3"],
     "--minibatch-size=64 does not split over 3 learner devices; use 63 or 66"),
    (["--buffer-size", "16"], "--buffer-size=16 holds 16 transitions per learner device, fewer than one update "
                              "inserts there \\(32\\); use at least 32"),
    (["--tau", "0"], "--tau=0.0 must be in \\(0, 1\\]")])
def test_bad_configuration_is_one_line_before_anything_starts(flags, message):
    with pytest.raises(ConfigError, match=message):
        sac.resolve(args(*flags))


def test_the_setup_splits_the_minibatch_and_the_buffer_over_the_learners():
    setup = sac.resolve(args("--learner-device-ids", "1", "2", "--learning-starts", "100"))
    assert (setup.minibatch_per_device, setup.capacity_per_device, setup.batch_size) == (32, 2048, 32)
    assert setup.random_rollouts == 4  # rollouts 0-3 start before env step 100: uniform actions


def test_the_actor_is_what_evaluation_runs():
    agent, spec = sac.make_agent(args())
    params = sac.init_params(agent, spec, jax.random.PRNGKey(0))
    policy = make_policy_fn(agent, spec.action_space, greedy=True)
    action, sent, _, value, _ = policy((params, None), np.ones((5, 3), np.float32), jax.random.PRNGKey(0))
    assert action.shape == (5, 1) and np.all(np.abs(action) < 1) and np.all(value == 0)
    np.testing.assert_allclose(sent, 2.0 * np.asarray(action), rtol=1e-6)  # Pendulum's bounds are [-2, 2]
