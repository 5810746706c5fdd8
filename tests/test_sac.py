"""SAC (sebulba/sac_envpool.py): the tanh-Gaussian log-probability, the soft target, the three
losses and the Polyak update against NumPy; the compiled update's wiring against SAC steps
written out; real pools' truncated and terminated transitions in the replay; the exact replay
ratio; the configuration checks; and, marked slow, runs of the real script (learning, a failing thread, a stop signal with
resume, --deterministic resume, actors of different speeds)."""

import json
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro
from jax.sharding import PartitionSpec as P
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import sebulba.runtime
import sebulba.sac_envpool as sac
from sebulba.config import ConfigError
from sebulba.devices import Placement, host
from sebulba.envs import make_envs, recv_batch
from sebulba.networks import (TanhGaussian, env_action, gaussian, log_prob, make_policy_fn, sample_action,
                              tanh_gaussian_sample)
from sebulba.rollouts import Rollout, RolloutAssembler
# The runtime tests' helpers for the script in a child process, and for two processes of one run.
from test_distributed import finish, free_port
from test_reliability import LEARNER_FAULT, run_cli, signal_at_update, start_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import evaluate  # noqa: E402


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
    return tyro.cli(sac.Args, args=[*PENDULUM, *extra])


@pytest.mark.parametrize("flags, message", [
    (["--env-id", "CartPole-v1"], "SAC needs continuous \\(Box\\) actions"),
    (["--replay-ratio", "0"], "--replay-ratio=0.0 must be positive"),
    (["--replay-ratio", "-1"], "--replay-ratio=-1.0 must be positive"),
    (["--learning-starts", "3200"], "--learning-starts=3200 is not before the end of the run \\(3200 env steps\\)"),
    (["--replay-ratio", "0.0001"], "--replay-ratio=0.0001 takes no gradient step in this run \\(2944 env steps after "
                                   "--learning-starts\\); use at least 0.00034"),
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


def test_the_networks_start_as_pytorchs_linear_layers_as_cleanrls_do():
    """CleanRL's sac_continuous_action.py keeps nn.Linear's default init: weights and biases
    uniform in ±1/sqrt(fan_in), so a std of 1/sqrt(3 fan_in) (flax's default is sqrt(3) x wider
    weights and zero biases)."""
    agent, spec = sac.make_agent(args("--hiddens", "256", "256"))
    actor = sac.init_params(agent, spec, jax.random.PRNGKey(0))["params"]
    critic = sac.Critic((256, 256)).init(jax.random.PRNGKey(1), np.zeros((1, 3), np.float32),
                                         np.zeros((1, 1), np.float32))["params"]
    layers = [(actor[f"Dense_{i}"], fan_in) for i, fan_in in enumerate((3, 256, 256, 256))]
    layers += [(jax.tree.map(lambda x: x[0], critic["VmapQNetwork_0"][f"Dense_{i}"]), fan_in)
               for i, fan_in in enumerate((4, 256, 256))]
    for layer, fan_in in layers:
        bound = 1 / np.sqrt(fan_in)
        for name in ("kernel", "bias"):
            values = np.asarray(layer[name])
            assert np.all(np.abs(values) <= bound), (name, fan_in)
            assert values.size < 100 or np.abs(values).max() > 0.9 * bound, (name, fan_in)  # uniform, not narrower
        kernel = np.asarray(layer["kernel"])
        if kernel.size > 1000:
            assert np.std(kernel) == pytest.approx(bound / np.sqrt(3), rel=0.05)


# ---------------------------------------------------------------------------
# The real script on Pendulum-v1 (3-dimensional observations, one action in [-2, 2]).

SMALL = [*PENDULUM, "--hiddens", "32", "32", "--log-frequency", "10", "--total-timesteps", "1600"]  # 50 updates


@pytest.mark.slow
def test_sac_learns_pendulum_and_evaluate_plays_the_mean_and_sampled_actions(capsys):
    """Pendulum-v1, --deterministic, seed 1, 6,016 env steps (1,024 of them random) and 5,016
    gradient steps with 64-64 networks, about 20 s on 2 cores: random play scores about -1,200
    to -1,500 a game; measured here about -126 in the final evaluation (4 games), about -210
    with evaluate.py's other start states. The threshold of -400 leaves room for other CPUs'
    numerics and for the start states."""
    args = tyro.cli(sac.Args, args=[*PENDULUM, "--total-timesteps", "6016", "--learning-starts", "1000",
                                    "--buffer-size", "10000", "--hiddens", "64", "64", "--minibatch-size", "256",
                                    "--deterministic", "--run-name", "pendulum", "--log-frequency", "50",
                                    "--eval-episodes", "4"])
    summary = sac.main(args)
    assert summary["gradient_steps"] == 6016 - 1000
    assert summary["final_eval"]["episodic_return_mean"] >= -400, summary["final_eval"]
    config = json.loads(Path("runs/pendulum/config.json").read_text())
    assert config["script"] == "sebulba.sac_envpool"
    hidden = {"norm_obs", "norm_reward", "atari_protocol", "episodic_life", "read_mission"}  # not flags of SAC's
    assert not hidden & set(config["args"]) and {"policy_lr", "q_lr", "seed"} <= set(config["args"])
    assert "success_rate" not in summary["final_eval"]  # Pendulum defines no success
    capsys.readouterr()
    for greedy in (["--greedy"], []):
        result = evaluate.main(["runs/pendulum", "--episodes", "4", "--json", *greedy])
        assert result["return_mean"] >= -400, (greedy, result)
    module, *_ = evaluate.load(Path("runs/pendulum"), None)
    assert module is sac


class Slowed:
    """An EnvPool pool whose recv takes `delay_s` longer: a slower actor."""

    def __init__(self, pool, delay_s):
        self.pool, self.delay_s = pool, delay_s

    def recv(self):
        time.sleep(self.delay_s)
        return self.pool.recv()

    def __getattr__(self, name):
        return getattr(self.pool, name)


@pytest.mark.slow
@pytest.mark.parametrize("ratio, delay_s, expected", [(4.0, 0.0, 4 * 1344), (0.3, 0.02, 403)],
                         ids=["learner-bound", "actor-bound"])
def test_the_replay_ratio_is_exact_whatever_the_actors_speed(ratio, delay_s, expected, monkeypatch):
    """Fast actors and a learner with 4 gradient steps per env step (the actors wait on the
    queue), then slowed actors (20 ms a recv) and 0.3 (the learner waits): the gradient steps
    are the ratio times the env steps after --learning-starts exactly, 4 x 1,344 and
    floor(0.3 x 1,344) = 403, whichever side waits."""
    real = sebulba.runtime.make_envs
    monkeypatch.setattr(sebulba.runtime, "make_envs", lambda *a, **k: Slowed(real(*a, **k), delay_s))
    args = tyro.cli(sac.Args, args=[*SMALL, "--replay-ratio", str(ratio), "--num-actor-threads", "2",
                                    "--run-name", f"ratio{ratio}"])
    summary = sac.main(args)
    assert summary["gradient_steps"] == expected
    events = EventAccumulator(str(Path(summary["run_dir"]))).Reload()
    assert events.Scalars("replay/replay_ratio_total")[-1].value == pytest.approx(expected / (1600 - 256))
    steps = [e.value for e in events.Scalars("replay/gradient_steps_total")]
    assert steps == sorted(steps) and steps[-1] == expected
    assert events.Scalars("replay/size")[-1].value <= 1600 and events.Scalars("replay/fill")[-1].value <= 1


@pytest.mark.slow
def test_a_stopped_deterministic_run_resumes_with_its_buffer_into_the_same_run(capsys):
    """An uninterrupted --deterministic run and one stopped by SIGTERM between checkpoints and
    resumed end with bit-identical params: the buffer, the critics, their targets, the
    temperature and the step counters come back from the checkpoint. Without the buffer
    (--no-save-buffer) the resumed run says it refills it, and skips those gradient steps."""
    small = [*SMALL, "--total-timesteps", "960"]  # 30 updates of 32 env steps
    flags = [*small, "--deterministic", "--checkpoint-interval", "10", "--learner-device-ids", "1", "2",
             "--log-frequency", "1"]
    first = sac.main(tyro.cli(sac.Args, args=[*flags, "--run-name", "first"]))
    assert first["gradient_steps"] == 960 - 256

    proc = start_run([*flags, "--run-name", "stopped"], "sac_envpool")
    returncode, output = signal_at_update(proc, 15, signal.SIGTERM)
    assert returncode == 143, output
    assert "resumes from update 10" in output
    out, _ = run_cli([*flags, "--run-name", "stopped"], script="sac_envpool")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout and "update 10," in out.stdout
    done = json.loads(Path("runs/stopped/summary.json").read_text())
    assert done["params_sha256"] == first["params_sha256"] and done["gradient_steps"] == first["gradient_steps"]

    # Without the buffer in the checkpoint: 20 of the run's 30 updates, then the rest.
    flags = [*small, "--no-save-buffer", "--run-name", "bufferless", "--checkpoint-interval", "0"]
    sac.main(tyro.cli(sac.Args, args=[*flags, "--total-timesteps", "640"]))
    capsys.readouterr()
    summary = sac.main(tyro.cli(sac.Args, args=flags))
    assert "refilling it until env step 896 (--learning-starts 256)" in capsys.readouterr().out
    assert summary["gradient_steps"] == 960 - 256 - 256  # the refill's 256 env steps took no gradient step
    assert sorted(p.name for p in Path("runs/bufferless/checkpoints/30").iterdir() if p.is_dir()) == ["meta", "state"]


@pytest.mark.slow
def test_a_failing_learner_ends_the_run_with_its_traceback():
    out, seconds = run_cli([*SMALL, "--total-timesteps", "100000", "--run-name", "fault"], LEARNER_FAULT,
                           script="sac_envpool")
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.count("Traceback") == 1 and "RuntimeError: injected learner fault" in out.stderr
    assert seconds < 60


@pytest.mark.slow
def test_two_processes_share_one_learner_mesh_and_its_replay():
    flags = [*SMALL, "--replay-ratio", "0.25", "--actor-device-ids", "0", "--learner-device-ids", "1",
             "--run-name", "two", "--distributed",
             "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    procs = [start_run([*flags, "--process-id", str(i)], "sac_envpool") for i in range(2)]
    outputs = finish(procs)
    for code, out in outputs:
        assert code == 0, out[-3000:]
    summary = json.loads(Path("runs/two/summary.json").read_text())
    assert summary["global_step"] == 1600 and summary["gradient_steps"] == (1600 - 256) // 4  # over both processes
    assert "2 process(es)" in outputs[0][1] and "2 process(es)" not in outputs[1][1]  # process 0 alone reports
    config = json.loads(Path("runs/two/config.json").read_text())
    assert config["derived"]["num_processes"] == 2 and config["derived"]["capacity_per_device"] == 2048


@pytest.mark.slow  # compiles programs (or starts processes): not the fast tier's math and bookkeeping
def test_a_buffer_that_does_not_fit_is_refused_before_any_thread(monkeypatch, tmp_path):
    """The memory check compiles the update with the buffer among its arguments: with 100 MiB
    free, a 4M-transition Pendulum buffer (33 bytes each: 132 MB) is refused in one line (a 10k
    one runs: the Pendulum test)."""
    import sebulba.learner
    import sebulba.threads

    monkeypatch.setattr(sebulba.learner.psutil, "virtual_memory", lambda: SimpleNamespace(available=100 * 2**20))
    started = []
    monkeypatch.setattr(sebulba.threads.Supervisor, "add", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError, match=r"^the learner needs 0\.1 GiB .* more than the 0\.1 GiB a run may use: .*; "
                                          r"lower --buffer-size \(the replay takes 0\.1 GiB per learner device\)$"):
        sac.main(args("--buffer-size", "4000000"))
    assert not started and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------
# The compiled update's wiring, step by step, against a SAC step written out here (CleanRL's
# sac_continuous_action.py order): a swapped obs/next_obs, online params where the targets
# belong, a missing actor or temperature step or a wrong Polyak update changes the result.

def reference_actor(theta, obs):
    """(mean, log_std) of the Actor's params, written out: one ReLU layer, then the log-std head
    (Dense_1, tanh-squashed into [LOG_STD_MIN, LOG_STD_MAX]) and the mean head (Dense_2)."""
    p = theta["params"]
    h = jax.nn.relu(obs @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    log_std = jnp.tanh(h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])
    log_std = sac.LOG_STD_MIN + 0.5 * (sac.LOG_STD_MAX - sac.LOG_STD_MIN) * (log_std + 1.0)
    return h @ p["Dense_2"]["kernel"] + p["Dense_2"]["bias"], log_std


def reference_q(phi, obs, action):
    """Q [2, B] of the twin critics' params, written out."""
    p = phi["params"]["VmapQNetwork_0"]
    x = jnp.concatenate([obs, action], axis=-1)
    h = jax.nn.relu(jnp.einsum("bi,kih->kbh", x, p["Dense_0"]["kernel"]) + p["Dense_0"]["bias"][:, None])
    return (jnp.einsum("kbh,kho->kbo", h, p["Dense_1"]["kernel"]) + p["Dense_1"]["bias"][:, None])[..., 0]


def noiseless_sample(theta, obs):
    """a = tanh(mean) and its log-probability with the reparameterisation noise at 0, from the actor written out."""
    return noiseless_sample_of(reference_actor(theta, obs))


class NumpyAdam:
    """optax.adam's defaults (b1 0.9, b2 0.999, eps 1e-8) in NumPy, float64."""

    def __init__(self, params, lr):
        self.lr, self.t = lr, 0
        self.m = jax.tree.map(lambda p: np.zeros(np.shape(p)), params)
        self.v = jax.tree.map(lambda p: np.zeros(np.shape(p)), params)

    def step(self, params, grads):
        self.t += 1
        self.m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * np.asarray(g, np.float64), self.m, grads)
        self.v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * np.asarray(g, np.float64) ** 2, self.v, grads)
        return jax.tree.map(lambda p, m, v: p - self.lr * (m / (1 - 0.9 ** self.t))
                            / (np.sqrt(v / (1 - 0.999 ** self.t)) + 1e-8), params, self.m, self.v)


def test_the_compiled_update_wires_its_pieces_as_a_sac_step_written_out(monkeypatch):
    """Four gradient steps of the compiled update (one learner device) on a replay whose every
    slot holds the same transition (s, a, r, s'), so sampling cannot matter, with the actor's
    noise at 0 (the sampler patched), against the same four steps written out here: the soft
    target from s' through the current actor and the *target* critics, the critics' step, every
    --policy-frequency steps that many actor steps each followed by a temperature step on the
    updated actor's log-probs, and a Polyak update of the targets every step."""
    monkeypatch.setattr(sac, "tanh_gaussian_sample", lambda policy, key: noiseless_sample_of(policy))
    args = sac.Args(env_id="Pendulum-v1", hiddens=(8,), local_num_envs=2, num_steps=1, num_actor_threads=1,
                    minibatch_size=4, buffer_size=2, learning_starts=0, total_timesteps=2, gamma=0.9, tau=0.3,
                    policy_frequency=2, target_network_frequency=1, policy_lr=0.01, q_lr=0.02)
    setup = sac.resolve(args)
    placement = Placement(jax.devices()[:1], jax.devices()[:1])
    agent, spec = sac.make_agent(args)
    state, _ = sac.make_train_state(args, setup, sac.init_params(agent, spec, jax.random.PRNGKey(0)), placement)
    s, s_next = np.array([[0.3, -0.8, 0.5]], np.float32), np.array([[0.9, 0.4, -1.2]], np.float32)
    action, reward = np.array([[0.25]], np.float32), 0.7
    rollout = Rollout(obs=np.repeat(np.stack([s, s_next]), 2, axis=1), actions=np.full((2, 2, 1), 0.25, np.float32),
                      logprobs=None, values=None, rewards=np.array([[0, 0], [reward, reward]], np.float32),
                      terminated=np.zeros((2, 2), bool), truncated=np.zeros((2, 2), bool), versions=None,
                      discounted_returns=None)
    buffer = sac.replay.create(sac.replay_example(spec), setup.capacity_per_device, placement.mesh)
    update = sac.make_update_fn(args, setup, agent, placement.mesh)
    new, buffer, metrics = update(state, buffer, placement.to_learners([rollout]), jax.random.PRNGKey(3), 4)
    assert int(buffer.size[0]) == 2  # two envs, one transition each, the same one

    on_host = lambda tree: jax.tree.map(lambda x: np.asarray(host(x), np.float64), tree)  # noqa: E731
    theta, phi, phi_target, log_alpha = on_host(state.params), on_host(state.critic.params), on_host(
        state.target_params), 0.0
    actor_adam, critic_adam, alpha_adam = NumpyAdam(theta, 0.01), NumpyAdam(phi, 0.02), NumpyAdam(log_alpha, 0.02)
    f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)  # noqa: E731
    actor_steps, losses = 0, {"q1_loss": [], "q2_loss": [], "actor_loss": [], "alpha_loss": []}
    for step in range(4):
        a_next, logp_next = noiseless_sample(f32(theta), s_next)  # s' feeds the target's actor ...
        y = reward + 0.9 * (jnp.min(reference_q(f32(phi_target), s_next, a_next), axis=0)  # ... and the targets
                            - np.exp(log_alpha) * logp_next)
        critic_grads = jax.grad(lambda p: jnp.sum(jnp.mean((reference_q(p, s, action) - y) ** 2, axis=1)))(f32(phi))
        for i, q in enumerate(np.mean((np.asarray(reference_q(f32(phi), s, action)) - np.asarray(y)) ** 2, axis=1)):
            losses[f"q{i + 1}_loss"].append(q)
        phi = critic_adam.step(phi, critic_grads)
        if step % 2 == 0:
            for _ in range(2):
                def actor_loss(p):
                    a, logp = noiseless_sample(p, s)
                    return jnp.mean(np.exp(log_alpha) * logp - jnp.min(reference_q(f32(phi), s, a), axis=0))
                losses["actor_loss"].append(float(actor_loss(f32(theta))))
                theta = actor_adam.step(theta, jax.grad(actor_loss)(f32(theta)))
                logp = np.asarray(noiseless_sample(f32(theta), s)[1], np.float64)  # the updated actor's
                losses["alpha_loss"].append(np.mean(-np.exp(log_alpha) * (logp + (-1.0))))
                log_alpha = alpha_adam.step(log_alpha, losses["alpha_loss"][-1])  # d/d log_alpha: the loss itself
                actor_steps += 1
        phi_target = jax.tree.map(lambda t, o: 0.3 * o + 0.7 * t, phi_target, phi)

    assert (int(new.critic.step), int(new.step), int(new.temperature.step), actor_steps) == (4, 4, 4, 4)
    for got, want in ((new.critic.params, phi), (new.target_params, phi_target), (new.params, theta)):
        jax.tree.map(lambda g, w: np.testing.assert_allclose(host(g), w, rtol=2e-4, atol=2e-6), got, want)
    np.testing.assert_allclose(host(new.temperature.params["log_alpha"]), log_alpha, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(metrics["alpha"], np.exp(log_alpha), rtol=2e-4)
    for name, values in losses.items():  # the means the update reports, each over its own steps
        np.testing.assert_allclose(metrics[name], np.mean(values), rtol=2e-4, atol=1e-6, err_msg=name)


def noiseless_sample_of(policy):
    """The script's sampler with the noise at 0 (patched into the update; the test's actor uses it too):
    (tanh(mean), its log-probability by the change of variables, written out)."""
    mean, log_std = gaussian(policy)
    return jnp.tanh(mean), jnp.sum(-log_std - 0.5 * np.log(2 * np.pi) - jnp.log(1 - jnp.tanh(mean) ** 2), axis=-1)


def pendulum_step(obs, u):
    """Pendulum-v1's dynamics (gymnasium's, which EnvPool implements): the observation after
    torque u from observation [cos th, sin th, thdot]."""
    th, thdot = np.arctan2(obs[..., 1], obs[..., 0]), obs[..., 2]
    thdot = np.clip(thdot + (3 * 10.0 / 2 * np.sin(th) + 3.0 * np.clip(u, -2, 2)) * 0.05, -8, 8)
    th = th + thdot * 0.05
    return np.stack([np.cos(th), np.sin(th), thdot], axis=-1)


def replay_of_a_real_pool(env_id, max_episode_steps, num_steps=16, num_envs=4):
    """Random actions on a real async EnvPool pool through the actors' path (recv, the
    RolloutAssembler, send) into a replay shard, as SAC's learner inserts rollouts; returns the
    rollouts, the stored transitions and their count."""
    pool = make_envs(env_id, num_envs, num_envs // 2, seed=5, num_threads=1, max_episode_steps=max_episode_steps)
    dim = pool.action_space.shape[0]
    assembler = RolloutAssembler(num_envs, num_steps, pool.observation_space.shape, np.float32, clip_rewards=False,
                                 episodic_life=False, action_shape=(dim,), action_dtype=np.float32)
    rng, rollouts = np.random.default_rng(0), []
    pool.async_reset()
    while len(rollouts) < 2:
        env_id_, obs, reward, terminated, truncated, _ = recv_batch(pool, num_envs // 2)
        actions = rng.uniform(pool.action_space.low, pool.action_space.high, (len(env_id_), dim)).astype(np.float32)
        zeros = np.zeros(len(env_id_), np.float32)
        rollouts += [r for r, *_ in assembler.add(env_id_, obs, reward, terminated, truncated, None, actions, zeros,
                                                  zeros, 0)]
        pool.send(actions, env_id_)
    pool.close()
    placement = Placement(jax.devices()[:1], jax.devices()[:1])
    example = sac.replay_example(SimpleNamespace(observation_space=pool.observation_space, action_space=pool.action_space))
    buffer = sac.replay.create(example, 2 * num_steps * num_envs, placement.mesh)
    for rollout in rollouts:
        batch = placement.to_learners([sac.learner_batch(rollout)])
        buffer = jax.jit(jax.shard_map(lambda b, x: sac.replay.insert(b, *sac.replay.rollout_transitions(
            x.obs, x.actions, x.rewards, x.terminated, x.truncated)), mesh=placement.mesh,
            in_specs=(P("learner"), P(None, "learner")), out_specs=P("learner")))(buffer, batch)
    size = int(buffer.size[0])
    return rollouts, jax.tree.map(lambda x: np.asarray(x)[:size], buffer.data), size


def test_a_real_pools_truncated_transitions_store_the_final_observation_not_the_reset():
    """Pendulum-v1 truncated every 5 steps: every stored transition, the truncated ones included,
    has the next observation that Pendulum's dynamics give from its observation and action (the
    reset observation EnvPool returns a step later never appears as one), none is terminal, and
    the auto-reset steps are not stored."""
    rollouts, stored, size = replay_of_a_real_pool("Pendulum-v1", max_episode_steps=5)
    truncations = sum(int(r.truncated[1:].sum()) for r in rollouts)
    auto_resets = sum(int((r.terminated[:-1] | r.truncated[:-1]).sum()) for r in rollouts)
    assert truncations >= 8 and size == 2 * 16 * 4 - auto_resets
    np.testing.assert_allclose(stored.next_obs, pendulum_step(stored.obs, stored.action[:, 0]), atol=2e-4)
    assert not stored.terminated.any()


def test_a_real_pools_terminated_transitions_are_stored_terminal_with_their_final_observation():
    """Hopper-v4 under random actions falls within a few dozen steps: its terminated transitions
    reach the replay marked terminal with the observation it fell on (never the next episode's
    first), and the soft target does not bootstrap from them."""
    rollouts, stored, _ = replay_of_a_real_pool("Hopper-v4", max_episode_steps=1000, num_steps=32)
    ends = [(r, t, e) for r in rollouts for t, e in zip(*np.nonzero(r.terminated[1:]))]
    assert ends and int(stored.terminated.sum()) == len(ends)
    for rollout, t, e in ends:
        row = np.nonzero((stored.obs == rollout.obs[t, e]).all(axis=1))[0]
        assert len(row) == 1 and stored.terminated[row[0]]
        np.testing.assert_array_equal(stored.next_obs[row[0]], rollout.obs[t + 1, e])  # the fall, as EnvPool gave it
        if t + 2 < rollout.obs.shape[0]:  # the next row is the reset: a different episode's first observation
            assert not np.array_equal(rollout.obs[t + 2, e], rollout.obs[t + 1, e])
    target = sac.soft_q_target(jnp.asarray(stored.reward), jnp.asarray(stored.terminated, jnp.float32),
                               jnp.full((2, len(stored.reward)), 100.0), jnp.zeros(len(stored.reward)), 0.2, 0.99)
    np.testing.assert_allclose(np.asarray(target)[stored.terminated], stored.reward[stored.terminated], rtol=1e-6)
