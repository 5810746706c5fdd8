"""Sebulba PPO on EnvPool's asynchronous API.

Actor threads step EnvPool pools with `recv`/`send` on dedicated actor devices and
assemble rollouts per env id; an SPMD learner (`jax.jit(jax.shard_map(...))` over a
`Mesh` of separate learner devices) runs PPO (Schulman et al. 2017) with GAE
(Schulman et al. 2016) and sends new parameters back to every actor device.

    actor device a, thread k                      learner mesh (L1..Ln)
    +-------------------------------+  rollout   +-----------------------------------+
    | envpool async (num_envs N,    |  queue     | gather one rollout per thread     |
    |   batch B <= N)               | (bounded)  | device_put, env axis split over L |
    | recv -> policy -> send(id)    |----------->| jit(shard_map(...)): GAE, then    |
    | per-env trajectory buffers    |            |   epochs x minibatch steps, pmean |
    | newest params <---------------+------------| publish (version, params)         |
    +-------------------------------+   params   +-----------------------------------+

Usage (on a CPU-only machine missing devices become virtual CPU devices):

    python sebulba/ppo_envpool.py --actor-device-ids 0 --learner-device-ids 1 2 3
    python sebulba/ppo_envpool.py --env-id CartPole-v1 --total-timesteps 100000 ...  # preset: README

This file holds what changes with the algorithm, top to bottom: the hyperparameters, the
network, GAE and the PPO loss, the actor loop, the learner update and loop, and `main`, which
wires the actor threads, the rollout queues, the learner mesh and the params going back. What
every algorithm shares is imported from sebulba/ (flags, devices, envs, rollouts, networks,
threads, checkpoints, metrics, evaluation, learner, runtime; see docs/architecture.md).
See docs/ppo_envpool.md for the flags, the logged metrics and the presets.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

if __name__ == "__main__":  # Ctrl-C while the libraries load: exit quietly (run_cli takes the signal back)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if not __package__:  # run as a file: import the shared modules from this checkout (installed or not), and
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # keep sebulba/config.py etc. off the top level

from sebulba import config
from sebulba.config import (Cluster, ConfigError, RunFlags, check_network, check_ranges, detect_cluster, normalization,
                            resolve_run)
from sebulba.devices import Placement, host
from sebulba.envs import has_pixels, is_minigrid, make_spec, recv_batch
from sebulba.missions import reads_mission
from sebulba.learner import Bookkeeping, LearnerState, gib, learner_memory, make_normalizer_update
from sebulba.networks import (MiniGridEncoder, MLPEncoder, RunningMoments, entropy, log_prob, make_atari_encoder,
                              make_policy_fn)
from sebulba.rollouts import Rollout, RolloutAssembler, rollout_shapes, zeros_obs
from sebulba.runtime import Run, run_cli
from sebulba.threads import ParamsSlot, Stopped, Supervisor, Timer, timed_put


@dataclass
class Args(RunFlags):
    """Sebulba PPO. Defaults: Atari (Breakout-v5) with Cleanba's PPO hyperparameters."""

    exp_name: str = "ppo_envpool"
    """experiment name, part of the default run name"""

    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    num_steps: int = 128
    """transitions per env in one rollout"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    num_minibatches: int = 4
    """minibatches per epoch on each learner device"""
    gradient_accumulation_steps: int | None = None
    """microbatches per minibatch gradient, one program each: less memory, the same gradient; None: 1, or the fewest that fit in memory (printed)"""
    update_epochs: int = 4
    """passes over each rollout batch"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: float = 0.1
    """PPO surrogate clipping coefficient epsilon"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient norm clip"""
    atari_encoder: str = "impala"
    """encoder of pixel tasks (Atari, Procgen, CarRacing): impala (Espeholt et al. 2018's ResNet) or nature (Mnih et al. 2015's CNN; use --hiddens 512 for the paper's)"""
    channels: tuple[int, ...] = (16, 32, 32)
    """IMPALA ResNet channels, one conv stack each (pixel tasks, --atari-encoder impala)"""
    hiddens: tuple[int, ...] = (256,)
    """dense layer widths after the ResNet (Atari) or the MiniGrid id embeddings, or of the MLP (vector observations)"""


@dataclass(frozen=True)
class Setup(config.Setup):
    """Quantities derived once from Args (sebulba/config.py), PPO's minibatch size and microbatches."""

    minibatch_size: int = 0  # per learner device
    gradient_accumulation_steps: int = 1  # the flag's number; for None `main` settles it (fit_gradient_accumulation)


def resolve(args: Args, cluster: Cluster = Cluster()) -> Setup:
    """Check `args` and derive the batch arithmetic over every process of `cluster`.

    Raises:
      ConfigError: one line naming the flag and valid values.
    """
    accumulation = args.gradient_accumulation_steps
    check_ranges(args, positive=("num_steps", "num_minibatches", "update_epochs")
                 + ("gradient_accumulation_steps",) * (accumulation is not None),
                 above_zero=("learning_rate", "max_grad_norm", "clip_coef"), unit_interval=("gamma", "gae_lambda"),
                 non_negative=("ent_coef", "vf_coef"))
    check_network(args.env_id, args.channels, args.hiddens, args.atari_encoder)  # --env-id first
    setup = resolve_run(args, args.num_steps, cluster)
    per_learner = args.num_steps * setup.envs_per_learner
    if per_learner % (args.num_minibatches * (accumulation or 1)):
        given = f" x --gradient-accumulation-steps={accumulation}" if accumulation else ""
        raise ConfigError(f"{per_learner} transitions per learner device (num_steps x envs per learner) do not split "
                          f"into --num-minibatches={args.num_minibatches}{given}; choose sizes whose product divides "
                          f"{per_learner}")
    return Setup(**dataclasses.asdict(setup), minibatch_size=per_learner // args.num_minibatches,
                 gradient_accumulation_steps=accumulation or 1)


# ---------------------------------------------------------------------------
# Networks: the encoders, the observation statistics and the action distributions are in
# sebulba/networks.py; the agent's heads are here.


class Agent(nn.Module):
    """Policy and value heads. Atari: one shared encoder (the IMPALA ResNet or the Nature CNN);
    MiniGrid's dictionary observations: one shared MiniGridEncoder (id embeddings, then the
    `hiddens` layers); vector observations: separate policy and value MLPs (as in CleanRL's classic-control and MuJoCo PPO), so the
    value loss does not swamp the policy's features. With `norm_obs`, observations are first normalised by
    `obs_moments`. Returns (policy, value [B]) where policy is logits [B, A] for discrete
    actions, or (mean [B, A], log_std [B, A]) of a diagonal Gaussian whose log-std is a learned,
    state-independent vector (Schulman et al. 2017's MuJoCo setup)."""

    num_actions: int  # discrete: actions; continuous: action dimensions
    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    pixels: bool  # pixel observations (Atari, Procgen, CarRacing): the conv encoder
    continuous: bool = False
    norm_obs: bool = False
    minigrid: bool = False
    read_mission: bool = False  # MiniGrid/BabyAI: the encoder reads the mission (--read-mission, resolved)
    atari_encoder: str = "impala"  # --atari-encoder

    @nn.compact
    def __call__(self, obs, obs_moments: RunningMoments | None = None):
        if self.norm_obs:
            obs = obs_moments.normalize(obs)
        if self.pixels:
            policy_x = value_x = make_atari_encoder(self.atari_encoder, self.channels, self.hiddens)(obs)
        elif self.minigrid:
            policy_x = value_x = MiniGridEncoder(self.hiddens, mission=self.read_mission)(obs)
        else:
            policy_x, value_x = MLPEncoder(self.hiddens)(obs), MLPEncoder(self.hiddens)(obs)
        policy = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(policy_x)
        if self.continuous:
            log_std = self.param("log_std", nn.initializers.zeros, (self.num_actions,))
            policy = (policy, jnp.broadcast_to(log_std, policy.shape))
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(value_x)[:, 0]
        return policy, value


def make_agent(args: Args):
    """(Agent for --env-id's observation and action spaces, the env spec with the training protocol's settings)."""
    spec = make_spec(args.env_id, args.atari_protocol, args.episodic_life)
    continuous = type(spec.action_space).__name__ == "Box"
    num_actions = spec.action_space.shape[0] if continuous else spec.action_space.n
    agent = Agent(num_actions, tuple(args.channels), tuple(args.hiddens), has_pixels(args.env_id), continuous,
                  normalization(args.env_id, args.norm_obs, args.norm_reward)[0], is_minigrid(args.env_id),
                  reads_mission(args.env_id, args.read_mission), args.atari_encoder)
    return agent, spec


def init_params(agent: Agent, spec, key):
    moments = RunningMoments.create(() if agent.minigrid else spec.observation_space.shape)
    return jax.jit(agent.init)(key, zeros_obs(spec.observation_space, 1), moments)  # one program: eager init is many


# ---------------------------------------------------------------------------
# Pure math: GAE and the PPO loss.


def compute_gae(rewards, values, terminated, truncated, gamma: float, gae_lambda: float):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) with episode ends.

    Transition t goes from state s_t (value `values[t]`) to s_{t+1} (value `values[t+1]`),
    earning `rewards[t]`. If it ended the episode by termination, s_{t+1} is worth 0; by
    truncation (time limit), s_{t+1} is bootstrapped from `values[t+1]`. Either way the
    recursion does not cross the episode end:

      delta_t = r_t + gamma * (1 - term_t) * V(s_{t+1}) - V(s_t)
      A_t     = delta_t + gamma * lambda * (1 - term_t) * (1 - trunc_t) * A_{t+1}

    Args:
      rewards: [T, B] float32.
      values: [T + 1, B] float32; values[T] bootstraps the last transition.
      terminated, truncated: [T, B] bool, how transition t ended.
    Returns:
      (advantages [T, B], returns [T, B]) with returns = advantages + values[:T].
    """
    chex.assert_rank([rewards, values, terminated, truncated], 2)
    chex.assert_equal_shape([rewards, terminated, truncated, values[1:]])
    not_term = 1.0 - terminated.astype(jnp.float32)
    not_done = not_term * (1.0 - truncated.astype(jnp.float32))
    deltas = rewards + gamma * not_term * values[1:] - values[:-1]

    def step(next_advantage, xs):
        delta, continues = xs
        advantage = delta + gamma * gae_lambda * continues * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(step, jnp.zeros_like(deltas[0]), (deltas, not_done), reverse=True)
    return advantages, advantages + values[:-1]


def masked_mean(x, mask):
    """Mean of x over entries where mask is 1; 0 when the mask is empty."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def normalize_advantages(advantages, mask):
    """Zero-mean, unit-std advantages using only unmasked entries for the statistics."""
    mean = masked_mean(advantages, mask)
    std = jnp.sqrt(masked_mean(jnp.square(advantages - mean), mask))
    return (advantages - mean) / (std + 1e-8)


class Minibatch(NamedTuple):
    obs: jax.Array  # [M, *obs_shape], or a dict of such (MiniGrid)
    actions: jax.Array  # [M] int32, or [M, A] float32 unclipped Gaussian samples
    logprobs: jax.Array  # [M] behaviour-policy log pi(a|s)
    advantages: jax.Array  # [M]
    returns: jax.Array  # [M] value targets
    mask: jax.Array  # [M] float32, 0 for EnvPool's auto-reset steps


def ppo_loss(params, apply_fn, mb: Minibatch, clip_coef: float, ent_coef: float, vf_coef: float, norm_adv: bool):
    """Clipped surrogate objective (Schulman et al. 2017, eq. 7) + value loss - entropy bonus.

    Every mean is weighted by `mb.mask`, so auto-reset steps carry no gradient and do not
    enter the advantage statistics. Returns (loss, metrics dict).
    """
    policy, values = apply_fn(params, mb.obs)
    log_ratio = log_prob(policy, mb.actions) - mb.logprobs
    ratio = jnp.exp(log_ratio)
    advantages = normalize_advantages(mb.advantages, mb.mask) if norm_adv else mb.advantages
    pg_loss = masked_mean(jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef)), mb.mask)
    v_loss = 0.5 * masked_mean(jnp.square(values - mb.returns), mb.mask)
    mean_entropy = masked_mean(entropy(policy), mb.mask)
    loss = pg_loss - ent_coef * mean_entropy + vf_coef * v_loss
    metrics = dict(policy_loss=pg_loss, value_loss=v_loss, entropy=mean_entropy,
                   approx_kl=masked_mean((ratio - 1) - log_ratio, mb.mask),
                   clipfrac=masked_mean((jnp.abs(ratio - 1) > clip_coef).astype(jnp.float32), mb.mask))
    return loss, metrics


def prepare_transitions(rollout: Rollout, gamma: float, gae_lambda: float, return_moments=None) -> Minibatch:
    """Turn a rollout's T+1 rows into T training transitions [T, N] (Minibatch fields).

    Transition t is (obs_t, action_t) -> reward and episode end received with obs_{t+1}.
    Its mask is 0 when obs_t itself ended an episode: EnvPool ignores that action and resets
    (the auto-reset step), so it must carry no learning signal. With `return_moments`
    (--norm-reward) rewards are divided by the running std of the discounted return and
    clipped to [-10, 10] (reward scaling, Engstrom et al. 2020).
    """
    mask = ~(rollout.terminated[:-1] | rollout.truncated[:-1])
    rewards = rollout.rewards[1:]
    if return_moments is not None:
        rewards = jnp.clip(rewards / jnp.sqrt(return_moments.var + 1e-8), -10.0, 10.0)
    advantages, returns = compute_gae(rewards, rollout.values, rollout.terminated[1:],
                                      rollout.truncated[1:], gamma, gae_lambda)
    return Minibatch(jax.tree.map(lambda x: x[:-1], rollout.obs), rollout.actions[:-1], rollout.logprobs[:-1], advantages, returns,
                     mask.astype(jnp.float32))


# ---------------------------------------------------------------------------
# Actor thread: recv -> policy -> send -> assemble -> queue.


def run_actor(envs, policy, device: jax.Device, key, params_slot: ParamsSlot, rollout_queue: queue.Queue,
              assembler: RolloutAssembler, num_rollouts: int, args: Args, batch_size: int,
              stop: threading.Event, name: str):
    """Step `envs` with strictly alternating recv -> policy -> send until the assembler has
    emitted rollout `num_rollouts - 1`.

    The recorded log-probabilities are PPO's old policy in the ratio and the recorded values
    GAE's baselines, both from the params version recorded with them.

    Each queued item is (Rollout, episode returns, episode lengths, stats dict in seconds).
    With --deterministic each batch is the whole pool sorted by env id, and the action
    starting a transition of rollout g comes from params version max(g - max_policy_lag,
    first rollout of this pool) exactly.
    """
    timer, key, last_emit, first_rollout = Timer(), jax.device_put(key, device), time.perf_counter(), assembler.emitted
    envs.async_reset()
    while assembler.emitted < num_rollouts:
        if stop.is_set():
            raise Stopped
        with timer("env_recv_time_s"):
            env_id, obs, reward, terminated, truncated, lives = recv_batch(envs, batch_size, sort=args.deterministic)
        needed = assembler.min_params_version(env_id, args.max_policy_lag, first_rollout if args.deterministic else 0)
        with timer("params_wait_time_s"):
            version, params = params_slot.wait(needed, stop, args.stall_timeout_s, name, exact=args.deterministic)
        with timer("inference_time_s"):
            action, env_action, logprob, value, key = policy(params[device], obs, key)
            action, logprob, value = np.asarray(action), np.asarray(logprob), np.asarray(value)
            sent = action if env_action is None else np.asarray(env_action)
        late, wanted = assembler.late_first_rows(env_id, args.max_policy_lag, version)
        if not late.any():
            with timer("env_send_time_s"):
                envs.send(sent, env_id)
        with timer("rollout_assembly_time_s"):
            completed = assembler.add(env_id, obs, reward, terminated, truncated, lives, action, logprob, value, version)
        for rollout, returns, lengths in completed:
            now, stats = time.perf_counter(), timer.pop()
            stats["actor_sps"] = rollout.rewards[1:].size / (now - last_emit)  # env steps (not action dimensions)
            with timer("rollout_queue_put_time_s"):
                timed_put(rollout_queue, (rollout, returns, lengths, stats), stop, args.stall_timeout_s, name)
            last_emit = now
        if late.any():  # --max-policy-lag 0: a rollout's first action comes from the params trained on the last one
            if wanted <= assembler.emitted:  # never wait on this thread's own unfinished rollout (deadlock)
                with timer("params_wait_time_s"):
                    version, params = params_slot.wait(wanted, stop, args.stall_timeout_s, name, exact=args.deterministic)
                with timer("inference_time_s"):
                    action, env_action, logprob, value, key = policy(params[device], jax.tree.map(lambda x: x[late], obs), key)
                    sent = sent.copy()  # (the first choice is read-only, and recorded as row T)
                    sent[late] = np.asarray(action if env_action is None else env_action)
                assembler.restart_rows(env_id[late], np.asarray(action), np.asarray(logprob), np.asarray(value), version)
            with timer("env_send_time_s"):
                envs.send(sent, env_id)


# ---------------------------------------------------------------------------
# Learner: one compiled SPMD update over the learner mesh.


def make_train_state(args: Args, setup: Setup, params, placement: Placement):
    """The learner's LearnerState (Adam after global-norm clipping, fresh statistics) replicated over
    the learner mesh, and its learning-rate schedule (linear to 0 over every minibatch step with --anneal-lr)."""
    lr_schedule = optax.linear_schedule(args.learning_rate, 0.0 if args.anneal_lr else args.learning_rate,
                                        setup.num_updates * args.update_epochs * args.num_minibatches)
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adam(lr_schedule, eps=1e-5))
    obs_shape = make_agent(args)[1].observation_space.shape if setup.norm_obs else ()
    state = LearnerState.create(apply_fn=None, params=params, tx=tx, obs_moments=RunningMoments.create(obs_shape),
                                return_moments=RunningMoments.create(()))
    return placement.replicate(state), lr_schedule


# Minibatch (or microbatch) programs dispatched before waiting for them. On XLA:CPU, ~300 queued steps whose
# all-reduces span two devices stall in the collective rendezvous and abort the process
# (32 minibatches x 10 epochs on --learner-device-ids 1 2); on GPUs a wait every 8 steps
# costs one pipeline drain per 8 steps.
MAX_STEPS_IN_FLIGHT = 8


def make_update_fn(args: Args, agent: Agent, mesh: Mesh):
    """PPO update over the learner mesh: (LearnerState, Rollout [T+1, envs] sharded on the env
    axis, key) -> (LearnerState, metrics dict of scalars).

    --norm-reward's return statistics take in the rollout first and scale its rewards;
    --norm-obs's observation statistics take it in after the update, which normalises with
    the ones the actors acted with (the actors receive the new ones with the new params). Then compiled
    `jit(shard_map(...))` pieces: `prepare` (GAE on each device's env slice, rewards scaled
    with --norm-reward; the frames are not copied), `shuffle` (one permutation of transition
    indices per epoch and device), `gradient` (one microbatch's share of the minibatch's
    gradient, its frames gathered from the rollout, `lax.pmean` over devices, added to the
    minibatch's sum) and `step` (the minibatch's last microbatch, then one Adam step). Python
    drives update_epochs x num_minibatches x gradient_accumulation_steps programs (None counts
    as 1 here; `main` settles it first); dispatch is asynchronous, so the device runs them back
    to back. An agent without a conv net (not Atari) and without accumulation gets one
    `scanned` program instead: `lax.scan` over epochs and minibatches of the same steps. The
    microbatches add up to the minibatch's own gradient, not an approximation of it: each microbatch's masked means are weighted by its share of the minibatch's unmasked
    transitions, and --norm-adv takes its statistics over the whole minibatch (up to float
    rounding, the same step as --gradient-accumulation-steps 1; the logged losses likewise).
    One program per microbatch, so that only one microbatch's
    activations exist at a time: unrolled inside one program, XLA kept them all alive (a
    4,096-frame IMPALA-ResNet minibatch: 20.3 GiB of working memory, 18.8 GiB as 16
    microbatches; 1.3 GiB per 256-frame microbatch program). Why not one program with
    `lax.scan` loops: on XLA:CPU that program's conv-net gradients compile to a slow,
    non-Eigen convolution (15-40x slower, unrolled or not; measured in docs/performance.md),
    while the one-minibatch program keeps the fast kernels. On GPUs the difference is a few
    microseconds of dispatch per program.

    The returned function has `.programs` ({name: jitted program}) for inspection
    (benchmark/memory.py reads their compiled memory).
    """
    n_mb, n_acc, env_axis = args.num_minibatches, args.gradient_accumulation_steps or 1, P(None, "learner")
    norm_obs, norm_reward = normalization(args.env_id, args.norm_obs, args.norm_reward)
    refresh_normalizers = make_normalizer_update(norm_obs, norm_reward, mesh)

    def prepare(return_moments: RunningMoments, rollout: Rollout) -> Minibatch:  # per device: [T+1, n] -> [T * n]
        transitions = prepare_transitions(rollout, args.gamma, args.gae_lambda, return_moments if norm_reward else None)
        # Observations stay in the rollout (no copy of the frames): `step` gathers its rows.
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), transitions._replace(obs=None))

    def shuffle(data: Minibatch, key):  # per device: [T * n] -> [n_mb, T * n / n_mb] int32 transition indices
        key = jax.random.fold_in(key, jax.lax.axis_index("learner"))
        return jax.random.permutation(key, data.actions.shape[0]).reshape((n_mb, -1))

    def add_gradient(state: LearnerState, grads, obs, data: Minibatch, perm, index, micro):
        """`grads` plus one microbatch's share of the minibatch's gradient (averaged over devices), and its metrics."""
        rows = perm[index].reshape((n_acc, -1))[micro]
        # Rows 0..T-1 of the rollout's [T+1, n, ...] observations are transitions 0..T*n-1 when flattened.
        part = jax.tree.map(lambda x: x[rows], data)._replace(
            obs=jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[rows], obs))
        norm_adv = args.norm_adv
        if n_acc > 1:  # the minibatch's statistics and weights, from its [M] advantages and mask (no frames)
            mask = data.mask[perm[index]]
            weight = jnp.sum(part.mask) / jnp.maximum(jnp.sum(mask), 1.0)  # masked mean of the part -> of the whole
            if norm_adv:
                advantages = normalize_advantages(data.advantages[perm[index]], mask)
                part, norm_adv = part._replace(advantages=advantages.reshape((n_acc, -1))[micro]), False
        # Params are replicated (invariant over "learner"); the gradient of an invariant input
        # would come back already summed over devices. Casting to varying keeps it local, so
        # the pmean below averages it.
        params = jax.lax.pcast(state.params, "learner", to="varying")
        (_, metrics), g = jax.value_and_grad(ppo_loss, has_aux=True)(
            params, lambda p, obs: agent.apply(p, obs, state.obs_moments), part, args.clip_coef, args.ent_coef,
            args.vf_coef, norm_adv)
        if n_acc == 1:
            grads = jax.tree.map(lambda acc, g: acc + g, grads, jax.lax.pmean(g, "learner"))
        else:  # (the update logs the mean over microbatches: weight x n_acc makes it the minibatch's)
            grads = jax.tree.map(lambda acc, g: acc + g, grads, jax.lax.pmean(jax.tree.map(lambda g: g * weight, g),
                                                                              "learner"))
            metrics = jax.tree.map(lambda m: m * weight * n_acc, metrics)
        return grads, jax.tree.map(lambda m: jax.lax.pmean(m, "learner"), metrics)

    def step(state: LearnerState, grads, obs, data: Minibatch, perm, index, micro):
        """The minibatch's last microbatch, then one Adam step; zeros to accumulate the next one in."""
        grads, metrics = add_gradient(state, grads, obs, data, perm, index, micro)
        return state.apply_gradients(grads=grads), jax.tree.map(jnp.zeros_like, grads), metrics

    def zeros(params):
        return jax.tree.map(jnp.zeros_like, params)

    def scanned(state: LearnerState, obs, data: Minibatch, key):
        """Every epoch's minibatch steps in one program: lax.scan over epochs and minibatches."""
        def epoch(state, epoch_key):
            perm = shuffle_rows(data, epoch_key)

            def minibatch(state, index):
                grads, metrics = add_gradient(state, zero_grads(state.params), obs, data, perm, index, 0)
                return state.apply_gradients(grads=grads), metrics

            return jax.lax.scan(minibatch, state, jnp.arange(n_mb))

        state, metrics = jax.lax.scan(epoch, state, jax.random.split(key, args.update_epochs))
        return state, jax.tree.map(jnp.mean, metrics)

    shuffle_rows, zero_grads = shuffle, zeros  # per device, for `scanned` (the names below become programs)
    prepare = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=(P(), env_axis), out_specs=P("learner")))
    shuffle = jax.jit(jax.shard_map(shuffle, mesh=mesh, in_specs=(P("learner"), P()), out_specs=env_axis))
    in_specs = (P(), P(), env_axis, P("learner"), env_axis, P(), P())
    gradient = jax.jit(jax.shard_map(add_gradient, mesh=mesh, in_specs=in_specs, out_specs=(P(), P())))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P(), P(), P())))
    zeros = jax.jit(jax.shard_map(zeros, mesh=mesh, in_specs=P(), out_specs=P()))
    # Without a conv net and without accumulation, the whole update is one program: a few
    # dispatches instead of 2 x epochs x minibatches (the README CartPole preset's 20 steps of a
    # 64-64 MLP were mostly dispatch).
    scanned = None if agent.pixels or n_acc > 1 else jax.jit(jax.shard_map(
        scanned, mesh=mesh, in_specs=(P(), env_axis, P("learner"), P()), out_specs=(P(), P())))
    # Minibatch and microbatch indices as arrays on the mesh: a multi-process jit takes no host values.
    index = [jax.make_array_from_process_local_data(NamedSharding(mesh, P()), np.int32(i))
             for i in range(max(n_mb, n_acc))]

    def update(state: LearnerState, rollout: Rollout, key):
        # The loss normalises observations with the statistics the actors acted with (they came
        # with the params), so the ratio starts at 1; the rollout's own observations enter the
        # statistics after the update, for the next. Rewards are scaled with the fresh return std.
        obs_moments, return_moments = refresh_normalizers(state.obs_moments, state.return_moments, rollout)
        state = state.replace(return_moments=return_moments)
        data = prepare(return_moments, rollout)
        if "scanned" in programs:
            state, metrics = programs["scanned"](state, rollout.obs, data, key)
            return state.replace(obs_moments=obs_moments), metrics
        grads, metrics = zeros(state.params), []
        for epoch_key in jax.random.split(key, args.update_epochs):
            perm = shuffle(data, epoch_key)
            for minibatch in index[:n_mb]:
                # One program per microbatch: only one microbatch's activations exist at a time.
                for micro in index[:n_acc - 1]:
                    grads, m = gradient(state, grads, rollout.obs, data, perm, minibatch, micro)
                    metrics.append(m)
                state, grads, m = step(state, grads, rollout.obs, data, perm, minibatch, index[n_acc - 1])
                metrics.append(m)
                if len(metrics) % MAX_STEPS_IN_FLIGHT == 0:
                    jax.block_until_ready(state)
        return state.replace(obs_moments=obs_moments), jax.tree.map(lambda *m: jnp.mean(jnp.stack(m)), *metrics)

    # For inspection, and for `fit_gradient_accumulation`, which puts the compiled one-program update in place.
    programs = {"prepare": prepare, "shuffle": shuffle, "gradient": gradient, "step": step,
                **({"scanned": scanned} if scanned else {})}
    update.programs = programs
    return update


def compile_gradient_step(update_fn, args: Args, state: LearnerState, rollout: Rollout):
    """The learner's largest program compiled ahead of time for `rollout` (a Rollout of
    ShapeDtypeStructs): the whole update where it is one program (`scanned`), else the one
    taking one (micro)batch's gradient. Its memory analysis is what `fit_gradient_accumulation`
    (through learner_memory) and benchmark/memory.py read."""
    programs, replicated = update_fn.programs, state.step.sharding
    data = jax.eval_shape(programs["prepare"], state.return_moments, rollout)
    key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
    if "scanned" in programs:
        return programs["scanned"].lower(state, rollout.obs, data, key).compile()
    perm = jax.eval_shape(programs["shuffle"], data, key)
    index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
    program = programs["step" if (args.gradient_accumulation_steps or 1) == 1 else "gradient"]
    return program.lower(state, state.params, rollout.obs, data, perm, index, index).compile()


def fit_gradient_accumulation(args: Args, setup: Setup, agent: Agent, state: LearnerState, rollout: Rollout,
                              placement: Placement, recorded: int | None = None):
    """(--gradient-accumulation-steps for this run, its update function), checked against the
    learner's memory by check_learner_memory's rule (at most 80 % of what is free).

    A number given is taken as it is. None takes `recorded` (the count a resumed run trained
    with) or 1 when that fits, else the fewest microbatches per minibatch that fit, and says so:
    the counts that divide the minibatch, from the fewest a linear estimate allows (working
    memory shrinks with the microbatch; the arguments, the rollout among them, do not), each
    compiled to check it. The count changes the memory, not the math: the microbatches'
    gradients add up to the minibatch's (`make_update_fn`). With several processes every one
    takes the largest count any of them chose.

    Raises:
      ConfigError: a number given that does not fit (the line names the fewest that does), or
        no count that fits (lower --local-num-envs or --num-steps).
    """
    host_rollouts = 2 * setup.num_actor_threads_total * args.local_num_envs  # filled and queued

    def measure(count: int):
        counted = dataclasses.replace(args, gradient_accumulation_steps=count)
        update_fn = make_update_fn(counted, agent, placement.mesh)
        compiled = compile_gradient_step(update_fn, counted, state, rollout)
        if "scanned" in update_fn.programs:  # the update runs what was measured: compiled once, not again at its call
            update_fn.programs["scanned"] = compiled
        return update_fn, learner_memory(compiled, placement, rollout, host_rollouts)

    given, minibatch = args.gradient_accumulation_steps, setup.minibatch_size
    first = given or recorded or 1
    update_fn, memory = measure(first)
    count, fitted = first, memory
    while not fitted.fits:  # the next count from the last one's figures: working memory ~ 1 / count
        room = (fitted.allowed - fitted.host_rollouts) / fitted.devices - fitted.arguments  # for working memory
        fewest = fitted.working * count / room if room > 0 else count + 1
        if room <= 0 and count > 1:  # every count's program takes the rollout and the state (count 1's: Adam's too)
            count = None
        else:
            count = next((c for c in range(count + 1, minibatch + 1) if minibatch % c == 0 and c >= fewest), None)
        if count is None:
            raise ConfigError(memory.refusal(f"no --gradient-accumulation-steps fits (the rollout and the state take "
                                             f"{gib(fitted.arguments)} per learner device whatever the microbatch): "
                                             "lower --local-num-envs or --num-steps"))
        update_fn, fitted = measure(count)
    if count != first:
        choice = (f"{count} microbatches of {minibatch // count} transitions per minibatch, {gib(fitted.total)} "
                  "in all, the same gradient")
        if given is not None:
            raise ConfigError(memory.refusal(f"use --gradient-accumulation-steps {count}, the fewest that fit "
                                             f"({choice}), or lower --local-num-envs or --num-steps"))
        if setup.process_id == 0:
            print(f"--gradient-accumulation-steps None takes {choice}; with {first}, {memory.describe()}", flush=True)
    if setup.num_processes > 1 and given is None:
        agreed = placement.agree_max(count)  # the same programs on every process
        if agreed != count:
            count, update_fn = agreed, make_update_fn(dataclasses.replace(args, gradient_accumulation_steps=agreed),
                                                      agent, placement.mesh)
    return count, update_fn


def run_learner(run: Run, state: LearnerState, update_fn, lr_schedule, key):
    """Consume one rollout per actor thread (fixed order) per update: transfer the batch onto
    the learner mesh, update, publish the params to the actor devices. Between updates
    `Bookkeeping` logs (see docs/ppo_envpool.md for every metric), checkpoints every
    --checkpoint-interval updates and keeps the summary; a stop signal ends the loop at an
    update boundary, agreed over every process, and after it the last checkpoint is written.
    """
    books, timer, placement = Bookkeeping(run, lr_schedule), Timer(), run.placement
    for update in range(run.start_update, run.setup.num_updates):
        if run.stop_requested():
            break
        items = run.next_items(timer)  # one per actor thread, in order; None: a stop signal
        if items is None:
            break
        with timer("transfer_time_s"):
            batch = jax.block_until_ready(placement.to_learners([rollout for rollout, *_ in items]))
        lag = update - np.concatenate([rollout.versions[:-1].ravel() for rollout, *_ in items])
        items = [item[1:] for item in items]  # the host rollouts are on the learner now: free their frames
        key, update_key = jax.random.split(key)
        with timer("update_time_s"):
            state, metrics = update_fn(state, batch, update_key)
            metrics = jax.tree.map(host, metrics)
        del batch  # before the next rollouts arrive
        run.params_slot.publish(update + 1, placement.to_actors((state.params, state.obs_moments)))
        books.record(update, state, key, lag, items, metrics, timer.pop())
    books.finish(state, key)


# ---------------------------------------------------------------------------
# main: the actor threads, the rollout queues, the learner mesh and the params going back.


def main(args: Args) -> dict:
    """Train with PPO, or resume the run named --run-name from its newest checkpoint.

    Returns the summary written to runs/<run_name>/summary.json; `summary["interrupted_by"]`
    names the signal when SIGINT/SIGTERM/SIGUSR1 stopped the run after a checkpoint.

    Raises:
      ConfigError: before any thread or device work, for a configuration that cannot work
        (including an unreadable or mismatched checkpoint).
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
    rollout = rollout_shapes(args.num_steps, setup.num_envs_total, spec, placement.env_sharded)
    recorded = run.meta.get("setup", {}).get("gradient_accumulation_steps") if run.meta is not None else None
    accumulation, update_fn = fit_gradient_accumulation(args, setup, agent, state, rollout, placement, recorded)
    run.setup = setup = dataclasses.replace(setup, gradient_accumulation_steps=accumulation)  # into config.json
    state, learner_key = run.resume(state, learner_key)  # a resumed run: its directory, then its checkpoint
    policy = make_policy_fn(agent, spec.action_space)
    # One bounded queue per actor thread; the learner reads them in thread order.
    run.queues = [queue.Queue(maxsize=1) for _ in range(setup.num_actor_threads_total)]
    run.params_slot.publish(run.start_update, placement.to_actors((state.params, state.obs_moments)))

    def actor(thread_index: int, device: jax.Device):
        for begin, end in run.env_segments():  # one pool for the run; --deterministic: one per checkpoint interval
            with run.actor_pool(thread_index, begin, spec, actor_key, args.num_steps, args.gamma,
                                agent.continuous) as (envs, assembler, key):
                run_actor(envs, policy, device, key, run.params_slot, run.queues[thread_index], assembler, end, args,
                          setup.async_batch_size, run.interrupted, f"actor thread {thread_index}")

    run.add_evaluator(agent, spec)  # the final evaluation; with --eval-interval an eval thread
    supervisor = Supervisor(run.stop)
    for i, (device, k) in enumerate((d, k) for d in placement.actor_devices for k in range(args.num_actor_threads)):
        supervisor.add(f"actor-{device.id}-{k}", actor, i, device)
    learner = supervisor.add("learner", run_learner, run, state, update_fn, lr_schedule, learner_key)
    return run.launch(supervisor, learner)


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (docs/reliability.md): 0 finished, 1 a
    thread failed or stalled, 2 bad configuration, 128 + signal number when a stop signal
    ended the run after a checkpoint."""
    return run_cli(Args, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
