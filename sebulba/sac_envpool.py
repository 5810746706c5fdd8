"""Sebulba SAC on EnvPool's asynchronous API: the off-policy data path, with a replay buffer
sharded over the learner mesh.

Actor threads step EnvPool pools with `recv`/`send` on dedicated actor devices and assemble
rollouts per env id, as in every sebulba script; the SPMD learner (`jax.jit(jax.shard_map(...))`
over a `Mesh` of separate learner devices) inserts each rollout's transitions into the replay
shard of the device that holds its envs, then takes exactly `--replay-ratio` gradient steps of
Soft Actor-Critic (Haarnoja et al. 2018b, "Soft Actor-Critic Algorithms and Applications": twin
Q networks with the minimum in the target, Polyak-averaged target networks, a tanh-squashed
Gaussian policy, automatic entropy tuning, delayed policy updates) per env step it inserted,
each device sampling its own minibatch, gradients averaged with `lax.pmean`; the new actor
params go back to every actor device.

    actor device a, thread k                      learner mesh (L1..Ln)
    +-------------------------------+  rollout   +-------------------------------------+
    | envpool async (num_envs N,    |  queue     | gather one rollout per thread       |
    |   batch B <= N)               | (bounded)  | device_put, env axis split over L   |
    | recv -> policy -> send(id)    |----------->| jit(shard_map(...)): insert into    |
    | uniform actions before        |            |   each device's replay shard, then  |
    |   --learning-starts           |            |   replay_ratio x env steps SAC      |
    | per-env trajectory buffers    |            |   steps (sample, pmean gradients)   |
    | newest actor params <---------+------------| publish (version, actor params)     |
    +-------------------------------+   params   +-------------------------------------+

Usage (on a CPU-only machine missing devices become virtual CPU devices):

    python sebulba/sac_envpool.py --env-id HalfCheetah-v4 --actor-device-ids 0 --learner-device-ids 1
    python sebulba/sac_envpool.py --env-id Pendulum-v1 --total-timesteps 6016 ...  # preset: README

This file holds what changes with the algorithm, top to bottom: the hyperparameters, the
networks, the SAC losses, the actor loop, the learner update and loop, and `main`. The replay
buffer is sebulba/replay.py (it knows nothing of SAC); what every algorithm shares is imported
from sebulba/ (see docs/architecture.md). See docs/sac_envpool.md for the flags, the logged
metrics and the presets.
"""

from __future__ import annotations

import dataclasses
import fractions
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # Ctrl-C while the libraries load: exit quietly (run_cli takes the signal back)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if not __package__:  # run as a file: import the shared modules from this checkout (installed or not), and
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # keep sebulba/config.py etc. off the top level

from sebulba import config, replay
from sebulba.config import (Cluster, ConfigError, RunFlags, check_env_id, check_ranges, detect_cluster,
                            nearest_multiples, resolve_run)
from sebulba.devices import Placement, host
from sebulba.envs import has_pixels, make_spec, recv_batch
from sebulba.learner import Bookkeeping, LearnerState, check_learner_memory, gib
from sebulba.networks import NatureEncoder, RunningMoments, TanhGaussian, make_policy_fn, tanh_gaussian_sample
from sebulba.rollouts import Rollout, RolloutAssembler, obs_storage, rollout_shapes, zeros_obs
from sebulba.runtime import Run, run_cli
from sebulba.threads import ParamsSlot, Stopped, Supervisor, Timer, timed_put


@dataclass
class Args(RunFlags):
    """Sebulba SAC. Defaults: MuJoCo HalfCheetah-v4 with CleanRL's sac_continuous_action.py hyperparameters."""

    exp_name: str = "sac_envpool"
    """experiment name, part of the default run name"""
    env_id: str = "HalfCheetah-v4"
    """EnvPool task id with continuous (Box) actions and vector observations: MuJoCo (*-v4), Pendulum-v1, ..."""
    total_timesteps: int = 1_000_000
    """env steps to train for, summed over every env"""
    local_num_envs: int = 8
    """envs in each actor thread's EnvPool pool"""
    num_actor_threads: int = 1
    """actor threads per actor device, each with its own EnvPool pool"""
    checkpoint_interval: int = 1000
    """save a checkpoint (with the replay buffer unless --no-save-buffer) every this many updates (also at the end and on SIGINT/SIGTERM/SIGUSR1); 0 = only then"""
    norm_obs: tyro.conf.Suppress[bool | None] = False  # SAC trains on raw observations and rewards, as the paper
    norm_reward: tyro.conf.Suppress[bool | None] = False
    atari_protocol: tyro.conf.Suppress[str] = "cleanba"  # Atari's; SAC takes Box actions only
    episodic_life: tyro.conf.Suppress[bool | None] = None
    read_mission: tyro.conf.Suppress[bool | None] = None  # MiniGrid's and BabyAI's; their actions are discrete
    eval_greedy: bool = False
    """evaluate with the mean action (tanh of the Gaussian's mean, mapped onto the bounds) instead of sampling"""
    # What a user of the on-policy scripts types, and SAC's name for it (runtime.unknown_flag); a class
    # attribute, not a field (no annotation), so not a flag.
    flag_hints = {
        "--learning-rate": "--policy-lr (the actor's) and --q-lr (the critics' and the temperature's)",
        "--lr": "--policy-lr (the actor's) and --q-lr (the critics' and the temperature's)",
        "--ent-coef": "--alpha (the entropy temperature, with --no-autotune)",
        "--update-epochs": "--replay-ratio (gradient steps per env step)"}

    num_steps: int = 16
    """transitions per env in one rollout (one update inserts num_steps x envs of them)"""
    buffer_size: int = 1_000_000
    """replay capacity in transitions, split evenly over the learner devices (each holds its env slice's)"""
    save_buffer: bool = True
    """checkpoint the replay buffer with the learner state; off (--no-save-buffer): a resumed run refills it (--learning-starts env steps) before learning again"""
    learning_starts: int = 5_000
    """env steps of uniformly random actions before the first gradient step"""
    replay_ratio: float = 1.0
    """gradient steps per env step after --learning-starts, exact (1: CleanRL's one step per env step)"""
    minibatch_size: int = 256
    """transitions per gradient step over all learner devices (each samples its share from its own shard)"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.005
    """Polyak averaging coefficient of the target critics: target <- tau x online + (1 - tau) x target"""
    policy_lr: float = 3e-4
    """Adam learning rate of the actor"""
    q_lr: float = 1e-3
    """Adam learning rate of the twin critics and of the temperature"""
    policy_frequency: int = 2
    """delayed policy updates: every this many gradient steps, this many actor (and temperature) steps (TD3-style, as CleanRL)"""
    target_network_frequency: int = 1
    """Polyak-update the target critics every this many gradient steps"""
    alpha: float = 0.2
    """entropy temperature when --no-autotune"""
    autotune: bool = True
    """tune the temperature towards a target entropy of -|A| (starting at alpha = 1, as CleanRL)"""
    hiddens: tuple[int, ...] = (256, 256)
    """hidden layer widths of the actor and of each critic (ReLU MLPs)"""


@dataclass(frozen=True)
class Setup(config.Setup):
    """Quantities derived once from Args (sebulba/config.py), SAC's replay sizes."""

    minibatch_per_device: int = 0  # transitions each learner device samples per gradient step
    capacity_per_device: int = 0  # replay slots on each learner device
    random_rollouts: int = 0  # rollouts (updates) whose actions are uniformly random: ceil(learning_starts / batch)


def resolve(args: Args, cluster: Cluster = Cluster()) -> Setup:
    """Check `args` and derive the batch and replay arithmetic over every process of `cluster`.

    Raises:
      ConfigError: one line naming the flag and valid values: a task without Box actions, a
        replay ratio <= 0, --learning-starts at or past the run's end, sizes that do not split
        over the learner devices, a buffer smaller than one update's transitions.
    """
    check_ranges(args, positive=("num_steps", "buffer_size", "minibatch_size", "policy_frequency",
                                 "target_network_frequency"),
                 above_zero=("replay_ratio", "policy_lr", "q_lr", "alpha"), unit_interval=("gamma", "tau"),
                 non_negative=("learning_starts",))
    check_env_id(args.env_id)
    spec = make_spec(args.env_id)
    if type(spec.action_space).__name__ != "Box":
        raise ConfigError(f"--env-id {args.env_id} has discrete actions ({spec.action_space}); SAC needs continuous "
                          "(Box) actions: use sebulba/ppo_envpool.py or sebulba/impala_envpool.py for this task")
    setup = resolve_run(args, args.num_steps, cluster)
    learners = cluster.num_processes * len(args.learner_device_ids)
    run_steps = setup.num_updates * setup.batch_size
    if args.learning_starts >= run_steps:
        raise ConfigError(f"--learning-starts={args.learning_starts} is not before the end of the run ({run_steps} env "
                          "steps): no gradient step would be taken; lower it or raise --total-timesteps")
    if not gradient_steps_due(run_steps, args.learning_starts, args.replay_ratio):
        learning = run_steps - args.learning_starts
        raise ConfigError(f"--replay-ratio={args.replay_ratio} takes no gradient step in this run ({learning} env "
                          f"steps after --learning-starts); use at least {1 / learning:.2g}")
    for name, value in (("minibatch_size", args.minibatch_size), ("buffer_size", args.buffer_size)):
        if value % learners:
            raise ConfigError(f"{config.flag(name)}={value} does not split over {learners} learner devices; use "
                              f"{nearest_multiples(value, learners)}")
    capacity, per_update = args.buffer_size // learners, args.num_steps * setup.envs_per_learner
    if capacity < per_update:
        raise ConfigError(f"--buffer-size={args.buffer_size} holds {capacity} transitions per learner device, fewer "
                          f"than one update inserts there ({per_update}); use at least {per_update * learners}")
    return Setup(**dataclasses.asdict(setup), minibatch_per_device=args.minibatch_size // learners,
                 capacity_per_device=capacity, random_rollouts=-(-args.learning_starts // setup.batch_size))


# ---------------------------------------------------------------------------
# Networks: the actor (what the actor threads and evaluation run) and the twin critics.

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # the actor's log-std range (CleanRL's sac_continuous_action.py)


def torch_dense(features: int, fan_in: int) -> nn.Dense:
    """A Dense layer initialised as PyTorch's nn.Linear, which CleanRL's sac_continuous_action.py
    keeps: weights and biases uniform in ±1/sqrt(fan_in) (flax's default, LeCun normal weights
    and zero biases, starts the weights sqrt(3) x wider)."""
    bound = 1.0 / np.sqrt(fan_in)
    return nn.Dense(features, kernel_init=nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
                    bias_init=lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound))


def features(obs, pixels: bool):
    """Observations [B, *obs] -> the MLP's input [B, F] float32: vectors flattened; with `pixels`
    (CarRacing's frames, uint8 [B, C, H, W]) the Nature CNN's convolutions (Mnih et al. 2015),
    its flattened output. Each network (the actor, each critic) has an encoder of its own."""
    if pixels:
        return NatureEncoder((), name="encoder")(obs)
    return obs.reshape((obs.shape[0], -1)).astype(jnp.float32)


class Actor(nn.Module):
    """The policy: a ReLU MLP (after the Nature CNN's convolutions on pixels), then the mean and
    log-std of a TanhGaussian over (-1, 1)^A, log-std squashed into [LOG_STD_MIN, LOG_STD_MAX].
    Returns (TanhGaussian, value [B] = 0): the shared policy function (sebulba/networks.py) wants
    a value; SAC's are Q(s, a), on the learner. `continuous` tells that function to map actions
    onto the env's bounds."""

    action_dim: int
    hiddens: tuple[int, ...]
    pixels: bool = False  # pixel observations (CarRacing): the Nature CNN's convolutions first
    continuous: bool = True

    @nn.compact
    def __call__(self, obs, obs_moments: RunningMoments | None = None):
        x = features(obs, self.pixels)
        for h in self.hiddens:
            x = nn.relu(torch_dense(h, x.shape[-1])(x))
        log_std = jnp.tanh(torch_dense(self.action_dim, x.shape[-1])(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1.0)
        return TanhGaussian(torch_dense(self.action_dim, x.shape[-1])(x), log_std), jnp.zeros(obs.shape[0])


class QNetwork(nn.Module):
    hiddens: tuple[int, ...]
    pixels: bool = False

    @nn.compact
    def __call__(self, obs, action):  # [B, *obs], [B, A] -> [B]
        x = jnp.concatenate([features(obs, self.pixels), action], axis=-1)
        for h in self.hiddens:
            x = nn.relu(torch_dense(h, x.shape[-1])(x))
        return torch_dense(1, x.shape[-1])(x)[:, 0]


class Critic(nn.Module):
    """Twin Q networks with separate params, evaluated together: (obs [B, D], action [B, A] in
    (-1, 1)) -> Q [2, B]."""

    hiddens: tuple[int, ...]
    pixels: bool = False

    @nn.compact
    def __call__(self, obs, action):
        twin = nn.vmap(QNetwork, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=2)
        return twin(self.hiddens, self.pixels)(obs, action)


def make_agent(args: Args):
    """(Actor for --env-id's action space, the env spec)."""
    spec = make_spec(args.env_id)
    return Actor(spec.action_space.shape[0], tuple(args.hiddens), has_pixels(args.env_id)), spec


def init_params(agent: Actor, spec, key):
    return jax.jit(agent.init)(key, zeros_obs(spec.observation_space, 1))  # one program: eager init is many


# ---------------------------------------------------------------------------
# Pure math: the soft target, the three losses and the Polyak update.


def soft_q_target(reward, terminated, next_q, next_logprob, alpha, gamma: float):
    """The critics' regression target (Haarnoja et al. 2018b, eqs. 2-3, with the twin minimum of
    Fujimoto et al. 2018): y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a'|s')),
    a' ~ pi(.|s') from the current actor, Q' the target critics. A truncated transition
    (terminated 0) bootstraps from its final observation s'.

    Args:
      reward, terminated: [B] float32. next_q: [2, B] target critics at (s', a').
      next_logprob: [B] log pi(a'|s'). alpha: the temperature (scalar).
    Returns: [B] float32 (no gradient flows through it: the caller's stop_gradient).
    """
    chex.assert_rank([reward, terminated, next_logprob, next_q], [1, 1, 1, 2])
    return reward + gamma * (1.0 - terminated) * (jnp.min(next_q, axis=0) - alpha * next_logprob)


def critic_loss(q, target):
    """Sum over the twin critics of the mean squared error to the soft target (CleanRL's
    qf1_loss + qf2_loss; the paper's eq. 5 without its 1/2). q [2, B]; target [B].
    Returns (loss, per-critic losses [2])."""
    chex.assert_rank([q, target], [2, 1])
    losses = jnp.mean(jnp.square(q - target[None]), axis=1)
    return jnp.sum(losses), losses


def actor_loss(q_pi, logprob, alpha):
    """E[alpha log pi(a|s) - min_i Q_i(s, a)], a ~ pi(.|s) reparameterised (Haarnoja et al.
    2018b, eq. 7). q_pi [2, B], logprob [B]."""
    chex.assert_rank([q_pi, logprob], [2, 1])
    return jnp.mean(alpha * logprob - jnp.min(q_pi, axis=0))


def temperature_loss(log_alpha, logprob, target_entropy: float):
    """E[-alpha (log pi(a|s) + target entropy)] with alpha = exp(log_alpha) (eq. 18; CleanRL's
    form, a gradient in log alpha): alpha rises while the policy's entropy -log pi is below the
    target. logprob [B], held constant."""
    return jnp.mean(-jnp.exp(log_alpha) * (jax.lax.stop_gradient(logprob) + target_entropy))


def polyak(target, online, tau: float):
    """target <- tau x online + (1 - tau) x target, leaf by leaf."""
    return jax.tree.map(lambda t, o: tau * o + (1.0 - tau) * t, target, online)


def gradient_steps_due(env_steps: int, learning_starts: int, replay_ratio: float) -> int:
    """Gradient steps the learner has taken once `env_steps` env steps are in the replay:
    floor(replay_ratio x (env_steps - learning_starts)), 0 before the start. The ratio is read
    as the decimal it was written as (0.1 is 1/10 exactly), so the count is exact whatever the
    speed of the actors."""
    ratio = fractions.Fraction(repr(replay_ratio))
    return int(ratio * max(0, env_steps - learning_starts))


# ---------------------------------------------------------------------------
# Actor thread: recv -> policy (uniform before --learning-starts) -> send -> assemble -> queue.


def run_actor(envs, policy, device: jax.Device, key, params_slot: ParamsSlot, rollout_queue: queue.Queue,
              assembler: RolloutAssembler, num_rollouts: int, args: Args, setup: Setup, bounds,
              stop: threading.Event, name: str):
    """Step `envs` with strictly alternating recv -> policy -> send until the assembler has
    emitted rollout `num_rollouts - 1`. Actions that start a transition of the first
    `setup.random_rollouts` rollouts are uniform over (-1, 1)^A (from a NumPy generator seeded
    by this pool's key), the policy's samples after; `bounds` (low, high) maps them onto the
    env's. Each queued item is (Rollout, episode returns, episode lengths, stats dict in
    seconds); --deterministic and --max-policy-lag behave as in ppo_envpool.py.
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    timer, key, last_emit, first_rollout = Timer(), jax.device_put(key, device), time.perf_counter(), assembler.emitted
    low, high = bounds

    def act(params, obs, env_id, key):  # (action in (-1, 1), what `send` gets, logprob, value, key)
        action, sent, logprob, value, key = policy(params[device], obs, key)
        action, sent = np.asarray(action), np.asarray(sent)
        uniform = assembler.action_generation(env_id) < setup.random_rollouts
        if uniform.any():
            action = np.where(uniform[:, None], rng.uniform(-1.0, 1.0, action.shape).astype(np.float32), action)
            sent = low + (action + 1.0) * (high - low) / 2.0
        return action, sent, np.asarray(logprob), np.asarray(value), key

    envs.async_reset()
    while assembler.emitted < num_rollouts:
        if stop.is_set():
            raise Stopped
        with timer("env_recv_time_s"):
            env_id, obs, reward, terminated, truncated, lives = recv_batch(envs, setup.async_batch_size,
                                                                           sort=args.deterministic)
        needed = assembler.min_params_version(env_id, args.max_policy_lag, first_rollout if args.deterministic else 0)
        with timer("params_wait_time_s"):
            version, params = params_slot.wait(needed, stop, args.stall_timeout_s, name, exact=args.deterministic)
        with timer("inference_time_s"):
            action, sent, logprob, value, key = act(params, obs, env_id, key)
        late, wanted = assembler.late_first_rows(env_id, args.max_policy_lag, version)
        if not late.any():
            with timer("env_send_time_s"):
                envs.send(sent, env_id)
        with timer("rollout_assembly_time_s"):
            completed = assembler.add(env_id, obs, reward, terminated, truncated, lives, action, logprob, value,
                                      version)
        for rollout, returns, lengths in completed:
            now, stats = time.perf_counter(), timer.pop()
            stats["actor_sps"] = rollout.rewards[1:].size / (now - last_emit)  # env steps (not action dimensions)
            with timer("rollout_queue_put_time_s"):
                timed_put(rollout_queue, (rollout, returns, lengths, stats), stop, args.stall_timeout_s, name)
            last_emit = now
        if late.any():  # --max-policy-lag 0: a rollout's first action comes from the params trained on the last one
            if wanted <= assembler.emitted:  # never wait on this thread's own unfinished rollout (deadlock)
                with timer("params_wait_time_s"):
                    version, params = params_slot.wait(wanted, stop, args.stall_timeout_s, name,
                                                       exact=args.deterministic)
                with timer("inference_time_s"):
                    action, again, logprob, value, key = act(params, obs[late], env_id[late], key)
                    sent = sent.copy()  # (the first choice is recorded as row T)
                    sent[late] = again
                assembler.restart_rows(env_id[late], action, logprob, value, version)
            with timer("env_send_time_s"):
                envs.send(sent, env_id)


# ---------------------------------------------------------------------------
# Learner: the replay on the learner mesh and one compiled SPMD program per update.


class SACState(LearnerState):
    """LearnerState (the actor's params, Adam state and step: what actors, evaluation and the
    params hash read) plus the twin critics with their Adam state (`critic.step` counts gradient
    steps), their Polyak-averaged targets and the temperature log alpha with its Adam state.
    All of it is checkpointed; the replay buffer is a checkpoint item of its own."""

    critic: TrainState
    target_params: Any
    temperature: TrainState


def make_train_state(args: Args, setup: Setup, params, placement: Placement):
    """The learner's SACState replicated over the learner mesh (critics initialised from --seed;
    the targets start equal to them; log alpha at 0 with --autotune, else log --alpha) and the
    actor's (constant) learning-rate schedule, for the logs."""
    spec = make_spec(args.env_id)
    critic = Critic(tuple(args.hiddens), has_pixels(args.env_id))
    critic_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    critic_params = jax.jit(critic.init)(critic_key, zeros_obs(spec.observation_space, 1),
                                         np.zeros((1, *spec.action_space.shape), np.float32))
    log_alpha = {"log_alpha": jnp.float32(0.0 if args.autotune else np.log(args.alpha))}  # (a dict: TrainState's)
    state = SACState.create(apply_fn=None, params=params, tx=optax.adam(args.policy_lr),
                            obs_moments=RunningMoments.create(()), return_moments=RunningMoments.create(()),
                            critic=TrainState.create(apply_fn=None, params=critic_params, tx=optax.adam(args.q_lr)),
                            target_params=critic_params,
                            temperature=TrainState.create(apply_fn=None, params=log_alpha, tx=optax.adam(args.q_lr)))
    return placement.replicate(state), optax.constant_schedule(args.policy_lr)


def learner_batch(rollout: Rollout) -> Rollout:
    """What the learner takes of a rollout: observations, actions, rewards and episode ends
    (the behaviour log-probs, values and versions stay on the host)."""
    return rollout._replace(logprobs=None, values=None, versions=None, discounted_returns=None)


def replay_example(spec) -> replay.Transition:
    """One stored transition's shapes and dtypes for the task's spaces."""
    obs_shape, obs_dtype = obs_storage(spec.observation_space)
    obs = jax.ShapeDtypeStruct(obs_shape, obs_dtype)
    return replay.Transition(obs, jax.ShapeDtypeStruct(spec.action_space.shape, np.float32),
                             jax.ShapeDtypeStruct((), np.float32), jax.ShapeDtypeStruct((), bool), obs)


def replay_shapes(spec, setup: Setup, mesh: Mesh) -> replay.ReplayState:
    """The buffer as ShapeDtypeStructs on the mesh: for compiling (and the memory check) before it exists."""
    shapes = jax.eval_shape(lambda: replay.create(replay_example(spec), setup.capacity_per_device, mesh))
    sharded = NamedSharding(mesh, P("learner"))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded), shapes)


def make_update_fn(args: Args, setup: Setup, agent: Actor, mesh: Mesh):
    """SAC update over the learner mesh: (SACState, ReplayState, learner_batch(Rollout) [T+1,
    envs] sharded on the env axis, key, gradient steps n) -> (SACState, ReplayState, metrics).

    One compiled `jit(shard_map(...))` program: each device inserts its env slice's valid
    transitions into its replay shard (sebulba/replay.py), then `lax.fori_loop` takes n
    gradient steps (n a traced scalar: one program for every n). Step i samples
    --minibatch-size / devices transitions on each device (the sampling key folded with the
    device index), updates the critics, every --policy-frequency steps takes that many actor
    and temperature steps (as CleanRL), and every --target-network-frequency steps moves the
    targets; each gradient is `lax.pmean`'d, so the params stay replicated. The buffer is donated
    (updated in place). Metrics: means over the steps (actor ones over the actor steps), alpha
    and the replay's size after the update. An MLP gradient inside a loop keeps its speed on
    XLA:CPU (the 10-20x slowdown of docs/performance.md is the conv nets').
    """
    critic = Critic(tuple(args.hiddens), has_pixels(args.env_id))
    target_entropy = -float(agent.action_dim)  # -|A| (Haarnoja et al. 2018b, section 5)
    freq = args.policy_frequency

    def critic_step(state: SACState, batch: replay.Transition, key):
        alpha = jnp.exp(state.temperature.params["log_alpha"])
        next_action, next_logprob = tanh_gaussian_sample(agent.apply(state.params, batch.next_obs)[0], key)
        next_q = critic.apply(state.target_params, batch.next_obs, next_action)
        target = soft_q_target(batch.reward, batch.terminated.astype(jnp.float32), next_q, next_logprob, alpha,
                               args.gamma)

        def loss(params):
            q = critic.apply(params, batch.obs, batch.action)
            return critic_loss(q, target)[0], (critic_loss(q, target)[1], jnp.mean(q))

        # Params are replicated (invariant over "learner"); casting to varying keeps each gradient
        # local, and the pmean averages them (as ppo_envpool's update).
        params = jax.lax.pcast(state.critic.params, "learner", to="varying")
        (_, (losses, q_mean)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        state = state.replace(critic=state.critic.apply_gradients(grads=jax.lax.pmean(grads, "learner")))
        return state, jax.lax.pmean({"q1_loss": losses[0], "q2_loss": losses[1], "q_mean": q_mean}, "learner")

    def actor_step(state: SACState, batch: replay.Transition, key):
        alpha = jnp.exp(state.temperature.params["log_alpha"])
        actor_key, temperature_key = jax.random.split(key)

        def loss(params):
            action, logprob = tanh_gaussian_sample(agent.apply(params, batch.obs)[0], actor_key)
            return actor_loss(critic.apply(state.critic.params, batch.obs, action), logprob, alpha), logprob

        (a_loss, logprob), grads = jax.value_and_grad(loss, has_aux=True)(
            jax.lax.pcast(state.params, "learner", to="varying"))
        state = state.apply_gradients(grads=jax.lax.pmean(grads, "learner"))
        metrics = {"actor_loss": a_loss, "entropy": -jnp.mean(logprob)}
        if args.autotune:  # with the updated actor's log-probs, as CleanRL
            logprob = tanh_gaussian_sample(agent.apply(state.params, batch.obs)[0], temperature_key)[1]
            t_loss, grads = jax.value_and_grad(lambda p: temperature_loss(p["log_alpha"], logprob, target_entropy))(
                jax.lax.pcast(state.temperature.params, "learner", to="varying"))
            state = state.replace(temperature=state.temperature.apply_gradients(grads=jax.lax.pmean(grads, "learner")))
            metrics["alpha_loss"] = t_loss
        return state, jax.lax.pmean(metrics, "learner")

    def actor_steps(state: SACState, batch, key):  # --policy-frequency actor steps; their mean metrics
        metrics = []
        for j in range(freq):
            state, m = actor_step(state, batch, jax.random.fold_in(key, j))
            metrics.append(m)
        return state, jax.tree.map(lambda *m: sum(m) / freq, *metrics)

    def train(state: SACState, buffer: replay.ReplayState, batch: Rollout, key, num_steps):
        transitions, valid = replay.rollout_transitions(batch.obs, batch.actions, batch.rewards, batch.terminated,
                                                        batch.truncated)
        buffer = replay.insert(buffer, transitions, valid)
        device = jax.lax.axis_index("learner")
        zeros = {"critic": {k: jnp.float32(0) for k in ("q1_loss", "q2_loss", "q_mean")},
                 "actor": {k: jnp.float32(0) for k in ("actor_loss", "entropy") + ("alpha_loss",) * args.autotune},
                 "actor_updates": jnp.float32(0)}

        def body(i, carry):
            state, sums = carry
            sample_key, noise_key = jax.random.split(jax.random.fold_in(key, i))
            minibatch = replay.sample(buffer, sample_key, setup.minibatch_per_device)
            critic_key, actor_key = jax.random.split(jax.random.fold_in(noise_key, device))
            step = state.critic.step
            state, c_metrics = critic_step(state, minibatch, critic_key)
            acts = step % freq == 0
            state, a_metrics = jax.lax.cond(acts, actor_steps, lambda s, *_: (s, zeros["actor"]), state, minibatch,
                                            actor_key)
            state = jax.lax.cond(step % args.target_network_frequency == 0,
                                 lambda s: s.replace(target_params=polyak(s.target_params, s.critic.params, args.tau)),
                                 lambda s: s, state)
            sums = {"critic": jax.tree.map(jnp.add, sums["critic"], c_metrics),
                    "actor": jax.tree.map(jnp.add, sums["actor"], a_metrics),
                    "actor_updates": sums["actor_updates"] + acts}
            return state, sums

        state, sums = jax.lax.fori_loop(0, num_steps, body, (state, zeros))
        metrics = {k: v / jnp.maximum(num_steps, 1) for k, v in sums["critic"].items()}
        metrics |= {k: v / jnp.maximum(sums["actor_updates"], 1.0) for k, v in sums["actor"].items()}
        metrics |= {"alpha": jnp.exp(state.temperature.params["log_alpha"]),
                    "replay/size": jax.lax.psum(buffer.size[0], "learner").astype(jnp.float32)}
        return state, buffer, metrics

    train = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(), P("learner"), P(None, "learner"), P(), P()),
                                  out_specs=(P(), P("learner"), P())), donate_argnums=(1,))
    replicated = NamedSharding(mesh, P())

    def update(state: SACState, buffer: replay.ReplayState, batch: Rollout, key, num_steps: int):
        # A multi-process jit takes no host values: the count as an array on the mesh.
        steps = jax.make_array_from_process_local_data(replicated, np.int32(num_steps))
        return train(state, buffer, batch, key, steps)

    update.programs = {"train": train}  # for inspection (the memory check compiles it)
    return update


def run_learner(run: Run, state: SACState, buffer: replay.ReplayState, update_fn, lr_schedule, key, args: Args):
    """Consume one rollout per actor thread (fixed order) per update: transfer the batch onto
    the learner mesh, insert it into the replay and take the gradient steps it is due
    (`gradient_steps_due`: exact, whatever the actors' speed), publish the actor params to the
    actor devices. `Bookkeeping` logs (docs/sac_envpool.md lists every metric) and checkpoints
    the state and, with --save-buffer, the buffer. A run resumed without its buffer takes no
    gradient step until --learning-starts env steps have refilled it (the steps it skips are not
    made up)."""
    books, timer, placement, setup = Bookkeeping(run, lr_schedule), Timer(), run.placement, run.setup
    done = int(host(state.critic.step))  # gradient steps so far (a resumed run's too)
    refill_until = 0
    if run.meta is not None and not args.save_buffer:
        refill_until = run.start_update * setup.batch_size + args.learning_starts
        if run.lead:
            print(f"resumed without a replay buffer (--no-save-buffer): refilling it until env step {refill_until} "
                  f"(--learning-starts {args.learning_starts}) before the next gradient step", flush=True)
    saved = lambda buffer: {"replay": buffer} if args.save_buffer else None  # noqa: E731
    for update in range(run.start_update, setup.num_updates):
        if run.stop_requested():
            break
        items = run.next_items(timer)  # one per actor thread, in order; None: a stop signal
        if items is None:
            break
        with timer("transfer_time_s"):
            batch = jax.block_until_ready(placement.to_learners([learner_batch(rollout) for rollout, *_ in items]))
        lag = update - np.concatenate([rollout.versions[:-1].ravel() for rollout, *_ in items])
        items = [item[1:] for item in items]
        env_steps = (update + 1) * setup.batch_size
        due = gradient_steps_due(env_steps, args.learning_starts, args.replay_ratio)
        steps = 0 if env_steps <= refill_until else due - gradient_steps_due(
            env_steps - setup.batch_size, args.learning_starts, args.replay_ratio)
        key, update_key = jax.random.split(key)
        with timer("update_time_s"):
            state, buffer, metrics = update_fn(state, buffer, batch, update_key, steps)
            metrics = jax.tree.map(lambda m: float(host(m)), metrics)
        del batch
        run.params_slot.publish(update + 1, placement.to_actors((state.params, state.obs_moments)))
        if steps and not done:  # the run's first gradient step
            books.steady_from = None  # the console's ETA at the learning pace, not the warm-up's
            if run.lead:
                print(f"update {update + 1}: learning starts ({env_steps} env steps in the replay, the first "
                      f"{setup.random_rollouts * setup.batch_size} with uniform actions); then "
                      f"{args.replay_ratio:g} gradient step{'' if args.replay_ratio == 1 else 's'} per env step",
                      flush=True)
        done += steps
        stage_times = timer.pop()
        if steps:
            metrics["learner/gradient_steps_per_s"] = steps / stage_times["update_time_s"]
        else:  # no gradient step: nothing to say about the losses
            metrics = {k: v for k, v in metrics.items() if k.startswith("replay/")}
        metrics |= {"replay/fill": metrics["replay/size"] / args.buffer_size, "replay/gradient_steps_total": done,
                    "replay/replay_ratio_total": done / max(env_steps - args.learning_starts, 1)}
        run.summary["gradient_steps"] = done
        books.record(update, state, key, lag, items, metrics, stage_times, saved(buffer))
    books.finish(state, key, saved(buffer))


# ---------------------------------------------------------------------------
# main: the actor threads, the rollout queues, the learner mesh with its replay, the params going back.


def main(args: Args) -> dict:
    """Train with SAC, or resume the run named --run-name from its newest checkpoint.

    Returns the summary written to runs/<run_name>/summary.json (with `gradient_steps`);
    `summary["interrupted_by"]` names the signal when SIGINT/SIGTERM/SIGUSR1 stopped the run
    after a checkpoint.

    Raises:
      ConfigError: before any thread or device work, for a configuration that cannot work
        (including a replay buffer that does not fit in the learner's memory, and an
        unreadable or mismatched checkpoint).
      RunFailed: a thread failed (its traceback is printed first) or stalled.
    """
    cluster = detect_cluster(args)
    setup = resolve(args, cluster)
    run = Run.open(args, setup, cluster)  # devices, resume check, the layout line; runs/<run_name>/ once checked
    if run.finished:
        return run.summary
    agent, spec = make_agent(args)
    key, init_key, learner_key, actor_key = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    placement = run.placement  # actor devices; the learner mesh over every process's learner devices
    state, lr_schedule = make_train_state(args, setup, init_params(agent, spec, init_key), placement)
    update_fn = make_update_fn(args, setup, agent, placement.mesh)
    batch = learner_batch(rollout_shapes(args.num_steps, setup.num_envs_total, spec, placement.env_sharded))
    buffer = replay_shapes(spec, setup, placement.mesh)
    scalar = jax.ShapeDtypeStruct((), np.int32, sharding=placement.replicated)
    key_shape = jax.ShapeDtypeStruct((2,), np.uint32, sharding=placement.replicated)
    buffer_bytes = replay.transition_bytes(replay_example(spec)) * setup.capacity_per_device
    train = update_fn.programs["train"].lower(state, buffer, batch, key_shape, scalar).compile()
    host_rollouts = 2 * setup.num_actor_threads_total * args.local_num_envs  # filled and queued
    check_learner_memory(train, placement, batch, host_rollouts,
                         f"lower --buffer-size (the replay takes {gib(buffer_bytes)} per learner device)")
    state, learner_key = run.resume(state, learner_key)  # a resumed run: its directory, then its checkpoint
    if run.meta is not None and args.save_buffer:
        buffer = run.checkpointer.restore_item(run.start_update, "replay", buffer)
    else:
        buffer = replay.create(replay_example(spec), setup.capacity_per_device, placement.mesh)
    policy = make_policy_fn(agent, spec.action_space)
    bounds = (spec.action_space.low.astype(np.float32), spec.action_space.high.astype(np.float32))
    run.queues = [queue.Queue(maxsize=1) for _ in range(setup.num_actor_threads_total)]
    run.params_slot.publish(run.start_update, placement.to_actors((state.params, state.obs_moments)))

    def actor(thread_index: int, device: jax.Device):
        for begin, end in run.env_segments():  # one pool for the run; --deterministic: one per checkpoint interval
            with run.actor_pool(thread_index, begin, spec, actor_key, args.num_steps, args.gamma,
                                True) as (envs, assembler, key):
                run_actor(envs, policy, device, key, run.params_slot, run.queues[thread_index], assembler, end, args,
                          setup, bounds, run.interrupted, f"actor thread {thread_index}")

    run.add_evaluator(agent, spec)  # the final evaluation; with --eval-interval an eval thread
    supervisor = Supervisor(run.stop)
    for i, (device, k) in enumerate((d, k) for d in placement.actor_devices for k in range(args.num_actor_threads)):
        supervisor.add(f"actor-{device.id}-{k}", actor, i, device)
    learner = supervisor.add("learner", run_learner, run, state, buffer, update_fn, lr_schedule, learner_key, args)
    return run.launch(supervisor, learner)


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (docs/reliability.md): 0 finished, 1 a
    thread failed or stalled, 2 bad configuration, 128 + signal number when a stop signal
    ended the run after a checkpoint."""
    return run_cli(Args, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
