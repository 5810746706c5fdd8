"""Placement and the SPMD learner: each device its own data (cleanba PR#17), arrays where the layout says
(jax#14184), gradients averaged, accumulation and memory."""

import re
import signal
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sebulba.devices import Placement
from sebulba.learner import Bookkeeping, LearnerState
from sebulba.networks import RunningMoments
from sebulba.ppo_envpool import Agent, Args, Minibatch, make_update_fn, normalize_advantages, prepare_transitions
from sebulba.rollouts import Rollout, rollout_shapes

FRESH = dict(obs_moments=RunningMoments.create(()), return_moments=RunningMoments.create(()))  # normalisers off


def make_rollout(num_steps, num_envs, reward, obs_dim=3, seed=0):
    rng = np.random.default_rng(seed)
    shape = (num_steps + 1, num_envs)
    return Rollout(obs=rng.normal(size=shape + (obs_dim,)).astype(np.float32),
                   actions=rng.integers(0, 2, shape).astype(np.int32), logprobs=np.full(shape, np.log(0.5), np.float32),
                   values=np.zeros(shape, np.float32), rewards=np.full(shape, reward, np.float32),
                   terminated=np.zeros(shape, bool), truncated=np.zeros(shape, bool), versions=np.zeros(shape, np.int32),
                   discounted_returns=np.zeros(shape, np.float32))


def shard_advantages(placement, batch):
    """The learner's per-device view: GAE then per-device normalisation (one minibatch per device)."""

    def per_device(rollout):
        t = prepare_transitions(rollout, 0.99, 0.95)
        return t.advantages, normalize_advantages(t.advantages, t.mask)

    fn = jax.shard_map(per_device, mesh=placement.mesh, in_specs=P(None, "learner"), out_specs=P(None, "learner"))
    return jax.jit(fn)(batch)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_learner_device_sees_its_own_data(threads):
    devices = jax.devices()
    placement = Placement([devices[0]], devices[1:3])
    # Each thread's first half of envs lands on learner 1, the second half on learner 2.
    n = 4
    per_thread = []
    for k in range(threads):
        r_pos, r_neg = make_rollout(8, n // 2, +1.0), make_rollout(8, n // 2, -1.0)
        per_thread.append(Rollout(*[np.concatenate([a, b], axis=1) for a, b in zip(r_pos, r_neg)]))
    batch = placement.to_learners(per_thread)
    raw, normalised = shard_advantages(placement, batch)
    half = threads * n // 2
    np.testing.assert_allclose(raw[:, half:], -raw[:, :half], atol=1e-6)
    np.testing.assert_allclose(normalised[:, half:], -normalised[:, :half], atol=1e-5)
    assert not np.allclose(normalised[:, half:], normalised[:, :half])


def test_arrays_live_where_the_layout_says():
    devices = jax.devices()
    assert len(devices) == 4
    placement = Placement([devices[0]], devices[1:3])
    params = {"w": jnp.ones((3, 2))}
    assert placement.to_actors(params)[devices[0]]["w"].devices() == {devices[0]}
    two_actor_devices = Placement(devices[:2], devices[2:4]).to_actors(params)
    assert {d: p["w"].devices() for d, p in two_actor_devices.items()} == {d: {d} for d in devices[:2]}
    batch = placement.to_learners([make_rollout(4, 6, 1.0)])
    for field in batch:
        shards = sorted(field.addressable_shards, key=lambda s: s.device.id)
        assert [s.device for s in shards] == devices[1:3]
        assert [s.data.shape[1] for s in shards] == [3, 3]  # env axis split evenly
        np.testing.assert_array_equal(np.concatenate([np.asarray(s.data) for s in shards], axis=1), np.asarray(field))


def test_update_keeps_params_replicated_and_learns_a_bandit():
    """A one-step bandit: action 1 pays +1, action 0 pays 0. A few updates must raise pi(1)."""
    devices = jax.devices()
    placement = Placement([devices[0]], devices[1:4])
    args = Args(num_minibatches=2, update_epochs=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                clip_coef=0.2, ent_coef=0.0, norm_adv=True, hiddens=(16,))
    agent = Agent(num_actions=2, channels=(), hiddens=(16,), pixels=False)
    params = agent.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(args.learning_rate))
    state = jax.device_put(LearnerState.create(apply_fn=None, params=params, **FRESH, tx=tx), placement.replicated)
    update = make_update_fn(args, agent, placement.mesh)
    rng = np.random.default_rng(0)
    obs = np.ones((1, 1, 3), np.float32)
    p1 = lambda params: float(jax.nn.softmax(agent.apply(params, obs[0])[0])[0, 1])
    before = p1(params)
    for i in range(5):
        rollout = make_rollout(4, 6, 0.0, seed=i)
        actions = rng.integers(0, 2, rollout.actions.shape).astype(np.int32)
        logits = np.asarray(agent.apply(jax.device_get(state.params), obs[0])[0])[0]
        logp = jax.nn.log_softmax(logits)
        rollout = rollout._replace(obs=np.broadcast_to(obs, rollout.obs.shape).copy(), actions=actions,
                                   logprobs=np.asarray(logp)[actions].astype(np.float32),
                                   rewards=np.concatenate([np.zeros((1, 6)), actions[:-1]]).astype(np.float32))
        state, metrics = update(state, placement.to_learners([rollout]), jax.random.PRNGKey(i))
        assert set(metrics) == {"policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"}
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.sharding.is_fully_replicated and leaf.sharding.device_set == set(devices[1:4])
    assert p1(jax.device_get(state.params)) > before + 0.05


def test_gradients_are_averaged_over_learner_devices_not_summed():
    """Two devices holding the same data must take the same SGD step as one device with it."""
    devices = jax.devices()
    args = Args(num_minibatches=1, update_epochs=1, hiddens=(8,))
    agent = Agent(num_actions=2, channels=(), hiddens=(8,), pixels=False)
    params = agent.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
    rollout = make_rollout(5, 2, 1.0, seed=3)
    rollout = rollout._replace(values=np.random.default_rng(0).normal(size=rollout.values.shape).astype(np.float32))
    new_params = []
    for learners in ([devices[1]], devices[1:3]):
        placement = Placement([devices[0]], learners)
        state = jax.device_put(LearnerState.create(apply_fn=None, params=params, **FRESH, tx=optax.sgd(0.1)), placement.replicated)
        per_thread = [rollout] * len(learners)  # each learner device gets an identical copy
        batch = placement.to_learners([Rollout(*[np.concatenate(f, axis=1) for f in zip(*per_thread)])])
        state, _ = make_update_fn(args, agent, placement.mesh)(state, batch, jax.random.PRNGKey(0))
        new_params.append(jax.device_get(state.params))
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), new_params[0], params)
    assert max(jax.tree.leaves(moved)) > 1e-4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), new_params[0], new_params[1])


def accumulation_setup(n_acc: int, agent, obs_shape, obs_dtype, num_steps=8, num_envs=4, norm_adv=False, learners=1):
    devices = jax.devices()
    placement = Placement([devices[0]], devices[1:1 + learners])
    args = Args(num_minibatches=2, update_epochs=2, gradient_accumulation_steps=n_acc, norm_adv=norm_adv)
    params = agent.init(jax.random.PRNGKey(0), jnp.zeros((1, *obs_shape), obs_dtype))
    state = jax.device_put(LearnerState.create(apply_fn=None, params=params, **FRESH, tx=optax.sgd(0.1)),
                           placement.replicated)
    return placement, state, make_update_fn(args, agent, placement.mesh)


@pytest.mark.parametrize("norm_adv", [False, True])
@pytest.mark.parametrize("learners", [1, 2])
def test_gradient_accumulation_takes_the_same_step(norm_adv, learners):
    """--gradient-accumulation-steps 4 takes the step of 1, with --norm-adv and with auto-reset
    steps masked unevenly over the microbatches (--norm-adv's statistics and the masked means are
    the minibatch's, not each microbatch's), on one learner device or two; the logged losses too.
    (1 is the one-program update of an MLP, lax.scan over the steps; 4 is driven from Python.)"""
    agent = Agent(num_actions=2, channels=(), hiddens=(8,), pixels=False)
    rng = np.random.default_rng(1)
    rollout = make_rollout(8, 4, 1.0, seed=5)
    rollout = rollout._replace(values=rng.normal(size=rollout.values.shape).astype(np.float32),
                               rewards=rng.normal(size=rollout.rewards.shape).astype(np.float32),
                               terminated=rng.random(rollout.terminated.shape) < 0.2)  # masks ~1 transition in 5
    results = []
    for n_acc in (1, 4):
        placement, state, update = accumulation_setup(n_acc, agent, (3,), np.float32, norm_adv=norm_adv,
                                                      learners=learners)
        assert ("scanned" in update.programs) == (n_acc == 1)  # an MLP's whole update is one program
        state, metrics = update(state, placement.to_learners([rollout]), jax.random.PRNGKey(0))
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (params_1, metrics_1), (params_4, metrics_4) = results
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), params_1, agent.init(jax.random.PRNGKey(0), jnp.zeros((1, 3))))
    assert max(jax.tree.leaves(moved)) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params_1, params_4)
    for name in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"):
        np.testing.assert_allclose(metrics_1[name], metrics_4[name], rtol=1e-5, atol=1e-7)


def lowered(setup, program: str, num_minibatches: int, minibatch: int, obs_shape, obs_dtype):
    """One of the update's programs lowered for a rollout of that many minibatches ([T+1, minibatch] frames)."""
    placement, state, update = setup
    sharded, replicated, learner = placement.env_sharded, placement.replicated, NamedSharding(placement.mesh, P("learner"))
    obs = jax.ShapeDtypeStruct((num_minibatches + 1, minibatch, *obs_shape), obs_dtype, sharding=sharded)
    data = Minibatch(None, *[jax.ShapeDtypeStruct((num_minibatches * minibatch,), dtype, sharding=learner)
                             for dtype in (np.int32, np.float32, np.float32, np.float32, np.float32)])
    perm = jax.ShapeDtypeStruct((num_minibatches, minibatch), np.int32, sharding=sharded)
    index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
    return update.programs[program].lower(state, state.params, obs, data, perm, index, index)


def working_memory(*args) -> int:
    """XLA's compiled temporary bytes of `lowered(*args)`."""
    return lowered(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # compiles programs (or starts processes): not the fast tier's math and bookkeeping
def test_gradient_accumulation_holds_one_microbatch_of_activations():
    """The promise of --gradient-accumulation-steps: less memory. Each microbatch is a program of
    its own, so a conv net's working memory shrinks with the microbatch (unrolled inside one
    program, XLA kept every microbatch's activations: no saving at all)."""
    agent = Agent(num_actions=4, channels=(4, 8), hiddens=(32,), pixels=True)
    obs_shape, minibatch = (84, 84, 4), 64
    whole = working_memory(accumulation_setup(1, agent, obs_shape, np.uint8), "step", 2, minibatch, obs_shape, np.uint8)
    accumulating = accumulation_setup(4, agent, obs_shape, np.uint8)
    for program in ("gradient", "step"):
        micro = working_memory(accumulating, program, 2, minibatch, obs_shape, np.uint8)
        assert micro < 0.4 * whole, (program, micro, whole)


def test_frames_stay_uint8_until_the_network():
    """The learner's programs take the rollout's uint8 frames and gather each microbatch's rows
    from them: the only float frames are one microbatch's (no float copy of the rollout)."""
    agent = Agent(num_actions=4, channels=(4,), hiddens=(16,), pixels=True)
    text = lowered(accumulation_setup(4, agent, (84, 84, 4), np.uint8), "gradient", 2, 64, (84, 84, 4), np.uint8).as_text()
    assert re.search(r"tensor<\d+x64x84x84x4xui8>", text)  # the rollout's frames, [T+1, envs, ...], as received
    shapes = [tuple(map(int, dims.split("x"))) for dims in re.findall(r"tensor<([\dx]+)xf32>", text)]
    float_frames = [shape[0] for shape in shapes if len(shape) == 4 and np.prod(shape[1:]) == 84 * 84 * 4]
    assert float_frames and max(float_frames) == 64 // 4, float_frames  # one 16-frame microbatch (any layout)


def test_nature_cnn_is_mnih_et_al_2015():
    """--atari-encoder nature is the paper's network, layer by layer: its parameter count worked
    out by hand, and its output equal to the three convolutions and the dense layer written with
    lax on the same params. The default stays the IMPALA ResNet under its old name, so checkpoints
    written before the flag existed still load."""
    import sebulba.ppo_envpool as ppo
    from sebulba.networks import NatureEncoder

    encoder, rng = NatureEncoder((512,)), np.random.default_rng(0)
    frames = rng.integers(0, 256, (2, 4, 84, 84), dtype=np.uint8)
    # The module's own parameter shapes, filled from numpy (flax's orthogonal init of the
    # 3,136 x 512 kernel costs seconds of compilation and is not what is tested here).
    shapes = jax.eval_shape(encoder.init, jax.random.PRNGKey(0), frames)["params"]
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32) * 0.05, shapes)
    by_hand = (8 * 8 * 4 * 32 + 32) + (4 * 4 * 32 * 64 + 64) + (3 * 3 * 64 * 64 + 64) + (7 * 7 * 64 * 512 + 512)
    assert by_hand == 1_684_128
    assert sum(x.size for x in jax.tree.leaves(params)) == by_hand

    x = jnp.transpose(frames, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
    for i, stride in enumerate((4, 2, 1)):
        conv = params[f"Conv_{i}"]
        x = jax.nn.relu(jax.lax.conv_general_dilated(x, conv["kernel"], (stride, stride), "VALID",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + conv["bias"])
    assert x.shape == (2, 7, 7, 64)
    expected = jax.nn.relu(x.reshape(2, -1) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    np.testing.assert_allclose(encoder.apply({"params": params}, frames), expected, rtol=1e-5, atol=1e-5)

    def encoder_names(**flags):
        agent, spec = ppo.make_agent(ppo.Args(env_id="Breakout-v5", channels=(4,), hiddens=(16,), **flags))
        shapes = jax.eval_shape(lambda: ppo.init_params(agent, spec, jax.random.PRNGKey(0)))
        return [k for k in shapes["params"] if "Encoder" in k]

    assert encoder_names() == ["ImpalaEncoder_0"]
    assert encoder_names(atari_encoder="nature") == ["NatureEncoder_0"]



@pytest.mark.parametrize("size, stride, shape", [(8, 4, (2, 84, 84, 4)), (4, 2, (2, 20, 20, 32)), (3, 1, (2, 9, 9, 64))])
def test_the_cpu_convolution_as_a_matmul_is_flaxs_conv(size, stride, shape):
    """ValidConv (the Nature CNN's layers; on the CPU a matmul over patches) has nn.Conv's parameters
    (names, shapes, initial values: checkpoints load either way), its output and its gradients."""
    from sebulba.networks import ValidConv

    x = jnp.asarray(np.random.default_rng(size).standard_normal(shape, np.float32))
    init = nn.initializers.orthogonal(np.sqrt(2))
    ours, flax_conv = ValidConv(16, size, stride, kernel_init=init), nn.Conv(16, (size, size), (stride, stride),
                                                                              padding="VALID", kernel_init=init)
    params = ours.init(jax.random.PRNGKey(0), x)
    jax.tree.map(np.testing.assert_array_equal, params, flax_conv.init(jax.random.PRNGKey(0), x))
    params = jax.tree.map(lambda p: p + 0.1, params)  # a non-zero bias too

    def loss(module):
        return lambda params, x: jnp.sum(jnp.sin(module.apply(params, x)))

    np.testing.assert_allclose(ours.apply(params, x), flax_conv.apply(params, x), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(jax.grad(loss(ours), argnums=(0, 1))(params, x)),
                         jax.tree.leaves(jax.grad(loss(flax_conv), argnums=(0, 1))(params, x))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

LEARNER_FLAGS = dict(env_id="CartPole-v1", total_timesteps=1024, local_num_envs=8, num_steps=16, num_actor_threads=1,
                     hiddens=(64, 64), eval_episodes=0, learner_device_ids=[1, 2])


def small_learner():
    """(args, setup, agent, placement, state, rollout shapes) of PPO at LEARNER_FLAGS' sizes on learner devices 1, 2."""
    import sebulba.ppo_envpool as ppo

    args = ppo.Args(**LEARNER_FLAGS)
    setup = ppo.resolve(args)
    agent, spec = ppo.make_agent(args)
    placement = Placement([jax.devices()[0]], jax.devices()[1:3])
    state, _ = ppo.make_train_state(args, setup, ppo.init_params(agent, spec, jax.random.PRNGKey(0)), placement)
    return args, setup, agent, placement, state, rollout_shapes(16, 8, spec, placement.env_sharded)


@pytest.mark.slow  # compiles programs (or starts processes): not the fast tier's math and bookkeeping
def test_a_learner_that_cannot_fit_is_refused_before_any_thread(monkeypatch, tmp_path):
    import sebulba.impala_envpool as impala
    import sebulba.learner
    import sebulba.ppo_envpool as ppo
    import sebulba.ppo_lstm_envpool as lstm
    import sebulba.threads
    from sebulba.config import ConfigError

    free = {}
    monkeypatch.setattr(sebulba.learner.psutil, "virtual_memory", lambda: SimpleNamespace(available=free["bytes"]))
    started = []
    monkeypatch.setattr(sebulba.threads.Supervisor, "add", lambda *a, **k: started.append(a))
    remedies = {ppo: r"no --gradient-accumulation-steps fits \(the rollout and the state take 0\.0 GiB per learner "
                     r"device whatever the microbatch\): ",
                impala: "", lstm: r"raise --num-minibatches .*"}
    for module, remedy in remedies.items():  # each names only flags its script has
        free["bytes"] = 1 << 10  # 1 KiB: less than two devices' programs and the host's rollouts
        with pytest.raises(ConfigError, match=r"^the learner needs 0\.0 GiB \(0\.0 GiB for the gradient program on "
                                              r"each of 2 learner device\(s\), 0\.0 GiB of rollouts on the host\), "
                                              r"more than the 0\.0 GiB a run may use: 80 % of the 0\.0 GiB the host "
                                              r"has free \(the rest is for XLA's allocator, the env pools and the "
                                              r"transfers\); " + remedy + r"lower --local-num-envs or --num-steps"):
            module.main(module.Args(**LEARNER_FLAGS))
        assert not started and not (tmp_path / "runs").exists()  # nothing left behind: no run directory
    # The figure it compares: XLA's working memory and arguments of the gradient program, per device.
    args, setup, agent, placement, state, rollout = small_learner()
    compiled = ppo.compile_gradient_step(ppo.make_update_fn(args, agent, placement.mesh), args, state, rollout)
    analysis = compiled.memory_analysis()
    free["bytes"] = 1 << 40
    assert sebulba.learner.check_learner_memory(compiled, placement, rollout, 16, "lower x") == (
        analysis.temp_size_in_bytes + analysis.argument_size_in_bytes) > 0


def test_gradient_accumulation_none_takes_the_fewest_microbatches_that_fit(monkeypatch, capsys):
    """--gradient-accumulation-steps None: 1 when it fits, else the fewest that fit, said on the
    console; a number given that does not fit is refused with the count that does."""
    import sebulba.learner
    import sebulba.ppo_envpool as ppo
    from sebulba.config import ConfigError

    args, setup, agent, placement, state, rollout = small_learner()
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(sebulba.learner.psutil, "virtual_memory", lambda: SimpleNamespace(available=free["bytes"]))

    def total(count):  # what the run needs with `count` microbatches, as the script measures it
        counted = ppo.Args(**LEARNER_FLAGS, gradient_accumulation_steps=count)
        compiled = ppo.compile_gradient_step(ppo.make_update_fn(counted, agent, placement.mesh), counted, state, rollout)
        return sebulba.learner.learner_memory(compiled, placement, rollout, 2 * 8).total

    fit = lambda count: ppo.fit_gradient_accumulation(ppo.Args(**LEARNER_FLAGS, gradient_accumulation_steps=count),
                                                      setup, agent, state, rollout, placement)[0]
    assert (fit(None), fit(1)) == (1, 1) and capsys.readouterr().out == ""
    whole, halves = total(1), total(2)
    assert halves < whole
    free["bytes"] = int((whole + halves) / 2 / 0.8)  # 80 % of it lies between the two
    assert fit(None) == 2
    assert capsys.readouterr().out == (
        "--gradient-accumulation-steps None takes 2 microbatches of 8 transitions per minibatch, 0.0 GiB in all, the "
        "same gradient; "
        f"with 1, the learner needs {whole / 2**30:.1f} GiB (0.0 GiB for the gradient program on each of 2 learner "
        "device(s), 0.0 GiB of rollouts on the host), more than the 0.0 GiB a run may use: 80 % of the 0.0 GiB the "
        "host has free (the rest is for XLA's allocator, the env pools and the transfers)\n")
    with pytest.raises(ConfigError, match=r"^the learner needs .*; use --gradient-accumulation-steps 2, the fewest that "
                                          r"fit \(2 microbatches of 8 transitions per minibatch, 0\.0 GiB in all, the "
                                          r"same gradient\), or lower --local-num-envs or --num-steps$"):
        fit(1)
    assert fit(4) == 4  # a number that fits is kept
    assert ppo.fit_gradient_accumulation(args, setup, agent, state, rollout, placement, recorded=4)[0] == 4


@pytest.mark.parametrize("done, latest, line", [
    (20, 20, "--deterministic: stopped at update 20, which has a periodic checkpoint; the same command resumes from it "
             "exactly"),
    (23, 20, "--deterministic: no checkpoint at update 23; the same command resumes from update 20 and redoes updates "
             "21..23 exactly"),
    (3, None, "--deterministic: no checkpoint at update 3; the same command resumes from the start and redoes updates "
              "1..3 exactly"),
    (0, None, "--deterministic: stopped before the first update; the same command starts the run anew"),
])
def test_a_stopped_deterministic_run_says_where_it_resumes(done, latest, line, capsys):
    """A stop signal that lands on a periodic checkpoint leaves that checkpoint to resume from;
    between checkpoints the updates since the last one are redone (EnvPool cannot save env state)."""
    manager = SimpleNamespace(latest_step=lambda: latest, directory=Path("runs/r/checkpoints"))
    run = SimpleNamespace(stopped_by=signal.SIGINT, flags=SimpleNamespace(deterministic=True),
                          checkpointer=SimpleNamespace(manager=manager), setup=SimpleNamespace(process_id=0),
                          summary={"updates": done}, make_evaluator=None)
    books = Bookkeeping.__new__(Bookkeeping)  # finish reads only the run
    books.run = run
    books.finish(SimpleNamespace(params={}), None)
    assert capsys.readouterr().out == line + "\n"
    assert run.summary["checkpoint"] == (None if latest is None else f"runs/r/checkpoints/{latest}")
    assert run.summary["interrupted_by"] == "SIGINT"
