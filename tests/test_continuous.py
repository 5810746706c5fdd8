"""Box actions and the MuJoCo preset: Gaussian policy pieces against hand-computed values and
rlax, observation and reward normalisation statistics, and Hopper-v4 learning on a small budget."""

import json
import math
import queue
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import envpool
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rlax
import tyro
from jax.sharding import PartitionSpec as P

import sebulba.impala_envpool as impala
import sebulba.ppo_envpool as ppo
from sebulba.config import normalization
from sebulba.devices import Placement
from sebulba.envs import make_envs, make_spec
from sebulba.networks import RunningMoments, entropy, log_prob, make_policy_fn, sample_action
from sebulba.ppo_envpool import Agent, Minibatch, ppo_loss, prepare_transitions
from sebulba.rollouts import Rollout, RolloutAssembler
from sebulba.threads import ParamsSlot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import evaluate

LOG_2PI = math.log(2 * math.pi)


@pytest.mark.filterwarnings("ignore:Rlax gaussian_diagonal will be deprecated")
def test_gaussian_log_prob_and_entropy_by_hand_and_against_rlax():
    mean, log_std = jnp.array([[0.0, 1.0]]), jnp.array([[0.0, math.log(2.0)]])
    action = jnp.array([[1.0, 0.0]])
    # z = (1 - 0) / 1 = 1 and (0 - 1) / 2 = -0.5: -0.5 (1 + 0.25) - log 2 - log 2pi
    assert float(log_prob((mean, log_std), action)[0]) == pytest.approx(-0.625 - math.log(2.0) - LOG_2PI, abs=1e-6)
    assert float(entropy((mean, log_std))[0]) == pytest.approx(math.log(2.0) + 1.0 + LOG_2PI, abs=1e-6)
    rng = np.random.default_rng(0)
    mu, sigma, a = (rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3))
    sigma = np.exp(sigma)
    oracle = rlax.gaussian_diagonal()
    np.testing.assert_allclose(log_prob((mu, np.log(sigma)), a), oracle.logprob(a, mu, sigma), rtol=1e-5)
    np.testing.assert_allclose(entropy((mu, np.log(sigma))), oracle.entropy(mu, sigma), rtol=1e-5)
    # Categorical: same helpers, any leading shape (IMPALA calls them on [T, n, A]).
    logits = jnp.log(jnp.array([[[0.2, 0.8]], [[0.5, 0.5]]]))
    np.testing.assert_allclose(log_prob(logits, jnp.array([[1], [0]])), np.log([[0.8], [0.5]]), rtol=1e-6)
    np.testing.assert_allclose(entropy(logits)[1, 0], math.log(2), rtol=1e-6)


def test_ppo_loss_with_a_gaussian_policy_by_hand():
    # New policy N(0, 1) in one dimension, action 0.5: log pi = -0.125 - 0.5 log 2pi. The behaviour
    # log-prob is log pi - log 1.5, so the ratio is 1.5 and clip 0.2 caps it at 1.2.
    new_logp = -0.125 - 0.5 * LOG_2PI
    mb = Minibatch(obs=jnp.zeros((1, 1)), actions=jnp.array([[0.5]]), logprobs=jnp.array([new_logp - math.log(1.5)]),
                   advantages=jnp.array([1.0]), returns=jnp.array([2.0]), mask=jnp.ones(1))
    apply = lambda params, obs: ((jnp.zeros((1, 1)), jnp.zeros((1, 1))), jnp.array([1.0]))
    loss, m = ppo_loss(None, apply, mb, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, norm_adv=False)
    assert float(m["policy_loss"]) == pytest.approx(-1.2, abs=1e-6)  # max(-1 * 1.5, -1 * 1.2)
    assert float(m["value_loss"]) == pytest.approx(0.5, abs=1e-6)  # 0.5 (1 - 2)^2
    assert float(m["entropy"]) == pytest.approx(0.5 * (1 + LOG_2PI), abs=1e-6)
    assert float(m["clipfrac"]) == 1.0
    assert float(loss) == pytest.approx(-1.2 - 0.01 * 0.5 * (1 + LOG_2PI) + 0.25, abs=1e-6)


def test_actions_are_clipped_when_sent_but_the_loss_sees_the_sample():
    space = envpool.make_spec("InvertedPendulum-v4").action_space  # Box(-3, 3, (1,))
    agent = Agent(1, (), (), pixels=False, continuous=True)  # no hidden layer: mean = obs @ W + b
    params = agent.init(jax.random.PRNGKey(0), jnp.zeros((1, 2)))
    params = jax.tree.map(jnp.zeros_like, params)
    params["params"]["Dense_0"]["bias"] = jnp.array([5.0])  # mean 5, std 1, outside the bounds
    obs = np.zeros((4, 2), np.float32)
    action, env_action, logp, _, _ = make_policy_fn(agent, space, greedy=True)((params, None), obs,
                                                                                jax.random.PRNGKey(0))
    np.testing.assert_allclose(action, 5.0)
    np.testing.assert_allclose(env_action, 3.0)
    np.testing.assert_allclose(logp, -0.5 * LOG_2PI, rtol=1e-6)  # log N(5; 5, 1): of the sample, not of 3
    action, env_action, logp, _, _ = make_policy_fn(agent, space)((params, None), obs, jax.random.PRNGKey(0))
    assert np.all(np.abs(env_action) <= 3.0) and np.all(action > 2.0)
    np.testing.assert_allclose(env_action, np.clip(action, -3, 3))
    np.testing.assert_allclose(logp, log_prob(agent.apply(params, obs)[0], action), rtol=1e-6)
    draws = sample_action((jnp.zeros((20000, 1)), jnp.full((20000, 1), math.log(0.5))), jax.random.PRNGKey(1))
    assert float(draws.std()) == pytest.approx(0.5, rel=0.03)


def test_a_collapsed_log_std_gives_no_nan():
    """A learned log-std of -110 (std underflows float32 to 0; rsl_rl PR#190): the actor's sample,
    its log-prob, the entropy, the PPO loss and its gradient stay finite, and so do the params
    after an Adam step."""
    agent = Agent(6, (), (8,), pixels=False, continuous=True)  # HalfCheetah's 6 action dimensions
    params = jax.jit(agent.init)(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
    params["params"]["log_std"] = jnp.full((6,), -110.0)
    obs = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    action, _, logp, _, _ = make_policy_fn(agent, envpool.make_spec("HalfCheetah-v4").action_space)(
        (params, None), obs, jax.random.PRNGKey(1))
    policy, _ = agent.apply(params, obs)
    assert np.isfinite(action).all() and np.isfinite(logp).all() and np.isfinite(entropy(policy)).all()
    assert np.isfinite(log_prob(policy, policy[0])).all()  # the action at the mean itself: 0 / 0 without the floor
    mb = Minibatch(obs=jnp.asarray(obs), actions=jnp.asarray(action), logprobs=jnp.asarray(logp),
                   advantages=jnp.linspace(-1, 1, 16), returns=jnp.zeros(16), mask=jnp.ones(16))
    (loss, _), grads = jax.jit(lambda p: jax.value_and_grad(ppo_loss, has_aux=True)(p, agent.apply, mb, 0.2, 0.01, 0.5,
                                                                                   True))(params)
    assert np.isfinite(float(loss)) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    tx = optax.adam(3e-4)
    updates, _ = tx.update(grads, tx.init(params))
    assert all(np.isfinite(p).all() for p in jax.tree.leaves(optax.apply_updates(params, updates)))


def test_running_moments_over_two_learner_devices_match_numpy():
    placement = Placement([jax.devices()[0]], jax.devices()[1:3])
    update = jax.jit(jax.shard_map(lambda m, x: m.update(x, "learner"), mesh=placement.mesh,
                                   in_specs=(P(), P(None, "learner")), out_specs=P()))
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(5, 4, 3)).astype(np.float32) for _ in range(3)]  # [T, envs, obs]
    moments = RunningMoments.create((3,))
    for x in batches:
        moments = update(moments, jax.device_put(x, placement.env_sharded))
    seen = np.concatenate([x.reshape(-1, 3) for x in batches])
    assert float(moments.count) == pytest.approx(60, abs=1e-3)
    np.testing.assert_allclose(moments.mean, seen.mean(0), rtol=1e-4)
    np.testing.assert_allclose(moments.var, seen.var(0), rtol=1e-3)
    np.testing.assert_allclose(moments.normalize(jnp.array([[3.0, 1e6, -1e6]]))[0, 1:], [10.0, -10.0])


def test_discounted_returns_restart_with_each_episode_and_scale_the_rewards():
    # One env, gamma 0.5, rewards 1, 1, 1 (the third ends the episode), then the reset obs, then 2.
    a = RolloutAssembler(1, 5, (1,), np.float32, clip_rewards=False, episodic_life=False, gamma=0.5)
    i, z = np.array([0]), np.zeros(1)
    for reward, done in [(0, False), (1, False), (1, False), (1, True), (0, False), (2, False)]:
        out = a.add(i, np.zeros((1, 1), np.float32), np.array([reward], np.float32), np.array([done]),
                    np.array([False]), None, np.array([0], np.int32), z, z, 0)
    np.testing.assert_allclose(out[0][0].discounted_returns[:, 0], [0, 1, 1.5, 1.75, 0, 2])
    rollout = jax.tree.map(jnp.asarray, out[0][0])
    moments = RunningMoments(jnp.float32(0.0), jnp.float32(4.0), jnp.float32(10.0))  # return std 2
    scaled = prepare_transitions(rollout, 0.5, 1.0, moments)
    plain = prepare_transitions(rollout, 0.5, 1.0)
    np.testing.assert_allclose(scaled.returns - rollout.values[:-1], (plain.returns - rollout.values[:-1]) / 2,
                               rtol=1e-5)
    huge = prepare_transitions(rollout, 0.5, 1.0, moments._replace(var=jnp.float32(1e-6)))
    assert float(jnp.max(huge.advantages)) <= 10.0 * (1 + 0.5 + 0.25) + 1e-4  # rewards clipped to 10


# The MuJoCo preset (docs/ppo_envpool.md): CleanRL's ppo_continuous_action.py settings over 8 envs x 256 steps.
PRESET = ["--local-num-envs", "8", "--num-steps", "256", "--num-actor-threads", "1", "--hiddens", "64", "64",
          "--num-minibatches", "32", "--update-epochs", "10", "--learning-rate", "3e-4", "--clip-coef", "0.2",
          "--ent-coef", "0.0", "--async-batch-size", "8"]


@pytest.mark.slow
def test_hopper_learns_on_a_small_budget_and_evaluate_uses_the_saved_statistics(capsys):
    """Hopper-v4 with the MuJoCo preset, --deterministic, seed 1, 40 updates = 81,920 env steps
    (about 25 s on 2 cores): a random policy scores about 20 (25 after 5 updates); measured
    here 348 at the end, final evaluation 372, greedy evaluation 384-388. The threshold of 200
    leaves room for other CPUs' numerics. Observation normalisation and reward scaling are on
    by default for MuJoCo."""
    args = tyro.cli(ppo.Args, args=["--env-id", "Hopper-v4", *PRESET, "--total-timesteps", "81920", "--deterministic",
                                    "--seed", "1", "--run-name", "hopper", "--log-frequency", "20",
                                    "--eval-episodes", "4"])
    assert normalization(args.env_id, args.norm_obs, args.norm_reward) == (True, True)
    summary = ppo.main(args)
    assert summary["episodic_return_mean"] >= 200, summary
    assert summary["final_eval"]["episodic_return_mean"] >= 200, summary["final_eval"]
    run = Path("runs/hopper")
    capsys.readouterr()
    result = evaluate.main([str(run), "--episodes", "4", "--greedy", "--json"])
    assert result["return_mean"] >= 200
    # The statistics travel in the checkpoint, and the policy reads observations through them: on
    # typical states (the running mean, and one std either side) the same params act otherwise
    # without them. (A comparison of returns instead, 4 games each, was met by chance or not.)
    module, saved_args, agent, spec, (params, moments), _ = evaluate.load(run, None)
    assert float(moments.count) == pytest.approx(81920, rel=0.01) and moments.mean.shape == (11,)
    states = moments.mean + np.array([[0.0], [1.0], [-1.0]]) * np.sqrt(moments.var)
    acting = agent.apply(params, states, moments)[0][0]
    blind = agent.apply(params, states, RunningMoments.create((11,)))[0][0]
    assert np.abs(np.asarray(acting) - np.asarray(blind)).max() > 0.1
    assert json.loads((run / "config.json").read_text())["args"]["norm_obs"] is None  # auto, resolved per task


@pytest.mark.slow
def test_impala_acts_on_box_actions(capsys):
    summary = impala.main(tyro.cli(impala.Args, args=[
        "--env-id", "InvertedPendulum-v4", "--local-num-envs", "4", "--num-steps", "16", "--num-actor-threads", "1",
        "--hiddens", "16", "--total-timesteps", str(4 * 16 * 3), "--eval-episodes", "2", "--run-name", "impala-box"]))
    assert summary["updates"] == 3 and summary["final_eval"]["episodic_length_mean"] > 0
    assert np.isfinite(summary["episodic_return_mean"])


def test_normalisation_is_on_by_default_for_mujoco_only():  # bad values: tests/test_config.py
    assert normalization("CartPole-v1", None, None) == (False, False)
    assert normalization("HalfCheetah-v4", None, False) == (True, False)


@pytest.mark.parametrize("module", [ppo, impala])
def test_the_loss_normalises_observations_with_the_statistics_that_acted(module):
    # With the params and observation statistics that chose the actions, the first loss of an
    # update must see the behaviour policy itself: ratio 1, nothing clipped. Refreshing the
    # statistics with the rollout first (as CleanRL's wrapper never does) gave approx_kl 3e-3 here.
    extra = dict(num_minibatches=1, update_epochs=1) if module is ppo else {}
    args = module.Args(env_id="InvertedPendulum-v4", local_num_envs=8, num_steps=16, num_actor_threads=1,
                       learner_device_ids=[0], hiddens=(16, 16), learning_rate=1e-9, **extra)
    setup = module.resolve(args)
    agent, spec = module.make_agent(args)
    params = module.init_params(agent, spec, jax.random.PRNGKey(0))
    placement = Placement([jax.devices()[0]], [jax.devices()[0]])
    state, _ = module.make_train_state(args, setup, params, placement)
    acted = RunningMoments(np.full(4, 1.0, np.float32), np.full(4, 4.0, np.float32), np.float32(100.0))
    state = state.replace(obs_moments=placement.replicate(acted))
    rng = np.random.default_rng(0)
    shape = (17, 8)
    obs = rng.normal(5.0, 3.0, shape + (4,)).astype(np.float32)  # far from the statistics: a refresh moves them
    actions = rng.normal(size=shape + (1,)).astype(np.float32)
    policy, values = agent.apply(params, obs.reshape(-1, 4), acted)
    logprobs = log_prob(jax.tree.map(lambda x: x.reshape(shape + (1,)), policy), actions)
    rollout = Rollout(obs, actions, np.asarray(logprobs, np.float32), np.asarray(values, np.float32).reshape(shape),
                      rng.normal(size=shape).astype(np.float32), np.zeros(shape, bool), np.zeros(shape, bool),
                      np.zeros(shape, np.int32), rng.normal(size=shape).astype(np.float32))
    state, metrics = module.make_update_fn(args, agent, placement.mesh)(state, placement.to_learners([rollout]),
                                                                         jax.random.PRNGKey(1))
    assert abs(float(metrics["approx_kl"])) < 1e-6
    if module is ppo:  # IMPALA's rho_clipfrac counts ratios above 1.0 itself: a last bit crosses it
        assert float(metrics["clipfrac"]) == 0.0
    moments = jax.tree.map(np.asarray, state.obs_moments)  # the rollout's rows 1..16 enter after the update
    assert moments.count == 100.0 + 16 * 8 and moments.mean[0] > 2.0


@pytest.mark.parametrize("module", [ppo, impala])
def test_actor_sps_counts_env_steps_not_action_dimensions(module, monkeypatch):
    # HalfCheetah's actions have 6 dimensions: counting the action array's size said 6x the env steps.
    clock = iter(range(100))  # the actor's perf_counter: 0 at the start, 1 when its rollout is done
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    spec = make_spec("HalfCheetah-v4")
    agent = module.Agent(6, (), (8,), pixels=False, continuous=True)
    params = agent.init(jax.random.PRNGKey(0), jnp.zeros((1, 17)))
    slot = ParamsSlot()
    slot.publish(0, {jax.devices()[0]: (params, RunningMoments.create(()))})
    rollouts = queue.Queue()
    assembler = RolloutAssembler(4, 8, (17,), np.float32, clip_rewards=False, episodic_life=False, action_shape=(6,),
                                 action_dtype=np.float32)
    pool = make_envs("HalfCheetah-v4", 4, 4, seed=0, num_threads=1)
    try:
        module.run_actor(pool, make_policy_fn(agent, spec.action_space), jax.devices()[0], jax.random.PRNGKey(1),
                         slot, rollouts, assembler, 1, module.Args(env_id="HalfCheetah-v4", max_policy_lag=1000), 4,
                         threading.Event(), "actor")
    finally:
        pool.close()
    rollout, _, _, stats = rollouts.get_nowait()
    assert rollout.actions.shape == (9, 4, 6) and stats["actor_sps"] == 8 * 4  # env steps in one second
