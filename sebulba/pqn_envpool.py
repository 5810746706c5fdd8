"""Sebulba PQN on EnvPool's asynchronous API.

Actor threads step EnvPool pools with `recv`/`send` on dedicated actor devices, choose
ε-greedy actions from a Q-network and record each observation's greedy value max_a Q(s, a);
an SPMD learner (`jax.jit(jax.shard_map(...))` over a `Mesh` of separate learner devices)
computes Q(λ) targets backward over each rollout from those values and regresses Q(s, a) onto
them for a few epochs of minibatches, then sends new parameters back to every actor device.
This is PQN (Gallici et al. 2025, "Simplifying Deep Temporal Difference Learning"; reference
code purejaxql and CleanRL's pqn.py / pqn_atari_envpool.py): Q-learning on many parallel envs
with no replay buffer and no target network, kept stable by LayerNorm in the Q-network.

    actor device a, thread k                      learner mesh (L1..Ln)
    +-------------------------------+  rollout   +-----------------------------------+
    | envpool async (num_envs N,    |  queue     | gather one rollout per thread     |
    |   batch B <= N)               | (bounded)  | device_put, env axis split over L |
    | recv -> ε-greedy Q -> send(id)|----------->| jit(shard_map(...)): Q(λ), then   |
    | per-env trajectory buffers    |            |   epochs x minibatch steps, pmean |
    | newest params <---------------+------------| publish (version, params)         |
    +-------------------------------+   params   +-----------------------------------+

Usage (on a CPU-only machine missing devices become virtual CPU devices):

    python sebulba/pqn_envpool.py --actor-device-ids 0 --learner-device-ids 1 2 3
    python sebulba/pqn_envpool.py --env-id CartPole-v1 ...  # preset: README

This file holds what changes with the algorithm, top to bottom: the hyperparameters, the
Q-network, the ε schedule, Q(λ) and the TD loss, the actor loop, the learner update and loop,
and `main`. The actor loop, the learner loop and `main` follow sebulba/ppo_envpool.py's, on
purpose: each script shows its whole data path. What every algorithm shares is imported from
sebulba/ (see docs/architecture.md). See docs/pqn_envpool.md for the flags, the logged metrics
and the presets.
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
from typing import Literal, NamedTuple

if __name__ == "__main__":  # Ctrl-C while the libraries load: exit quietly (run_cli takes the signal back)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

if not __package__:  # run as a file: import the shared modules from this checkout (installed or not), and
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # keep sebulba/config.py etc. off the top level

from sebulba import config
from sebulba.config import Cluster, ConfigError, RunFlags, check_network, check_ranges, detect_cluster, resolve_run
from sebulba.devices import Placement, host
from sebulba.envs import has_pixels, is_minigrid, make_spec, recv_batch
from sebulba.learner import Bookkeeping, LearnerState, check_learner_memory
from sebulba.networks import LayerNormMLP, NatureEncoder, RunningMoments, make_epsilon_greedy_fn
from sebulba.rollouts import Rollout, RolloutAssembler, rollout_shapes, zeros_obs
from sebulba.runtime import Run, run_cli
from sebulba.threads import ParamsSlot, Stopped, Supervisor, Timer, timed_put


@dataclass
class Args(RunFlags):
    """Sebulba PQN. Defaults: Atari (Breakout-v5) under CleanRL's protocol with the hyperparameters
    of CleanRL's pqn_atari_envpool.py (8 envs x 128 steps, 4 epochs of 4 minibatches)."""

    exp_name: str = "pqn_envpool"
    """experiment name, part of the default run name"""
    env_id: str = "Breakout-v5"
    """EnvPool task id with discrete actions: Atari `*-v5` (the Nature CNN with LayerNorm) or a vector task (the LayerNorm MLP); not Box actions, not MiniGrid/BabyAI"""
    total_timesteps: int = 10_000_000
    """env steps to train for, summed over every env (Atari: frames = 4 x env steps)"""
    local_num_envs: int = 8
    """envs in each actor thread's EnvPool pool"""
    num_actor_threads: int = 1
    """actor threads per actor device, each with its own EnvPool pool"""
    atari_protocol: Literal["cleanba", "cleanrl", "machado"] = "cleanrl"
    """Atari env settings of one published setup (docs/ppo_envpool.md#atari-protocols): cleanrl (CleanRL's envpool scripts, PQN's Atari source: EnvPool's defaults + life loss ends a training episode), cleanba, machado"""
    eval_greedy: bool = True
    """evaluate with the greedy policy, argmax_a Q (purejaxql's EPS_TEST 0); --no-eval-greedy: ε-greedy with ε = --end-e"""
    norm_obs: tyro.conf.Suppress[bool | None] = False  # PQN's sources normalise neither; LayerNorm scales the features
    norm_reward: tyro.conf.Suppress[bool | None] = False
    read_mission: tyro.conf.Suppress[bool | None] = None  # MiniGrid's and BabyAI's dictionary observations: not here
    # purejaxql's names (runtime.unknown_flag); a class attribute, not a field, so not a flag.
    flag_hints = {"--eps-start": "--start-e", "--eps-finish": "--end-e", "--eps-decay": "--exploration-fraction",
                  "--gae-lambda": "--q-lambda", "--lambda": "--q-lambda", "--num-epochs": "--update-epochs",
                  "--epsilon": "--start-e, --end-e and --exploration-fraction (the actors' ε schedule)",
                  "--norm-obs": "nothing: PQN normalises no observation, as its sources (LayerNorm scales the features)",
                  "--norm-reward": "nothing: PQN trains on the task's rewards (Atari's clipped), as its sources",
                  "--read-mission": "sebulba/ppo_envpool.py: PQN takes no MiniGrid or BabyAI task"}

    learning_rate: float = 2.5e-4
    """RAdam learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    num_steps: int = 128
    """transitions per env in one rollout (the Q(λ) targets' horizon)"""
    gamma: float = 0.99
    """discount factor"""
    q_lambda: float = 0.65
    """λ of the Q(λ) targets: 0 = one-step Q-learning, 1 = Monte-Carlo returns to the rollout's end"""
    num_minibatches: int = 4
    """minibatches per epoch on each learner device"""
    update_epochs: int = 4
    """passes over each rollout batch"""
    max_grad_norm: float = 10.0
    """global gradient norm clip"""
    start_e: float = 1.0
    """ε of the first rollouts' ε-greedy actions"""
    end_e: float = 0.01
    """ε after the decay, to the end of the run"""
    exploration_fraction: float = 0.10
    """share of the run's updates over which ε decays linearly from --start-e to --end-e"""
    hiddens: tuple[int, ...] = (512,)
    """dense layer widths after the Nature CNN (Atari), or of the MLP (vector observations; CleanRL's pqn.py: 120 84)"""


@dataclass(frozen=True)
class Setup(config.Setup):
    """Quantities derived once from Args (sebulba/config.py), PQN's minibatch and ε decay."""

    minibatch_size: int = 0  # per learner device
    decay_updates: float = 0.0  # updates over which ε decays: --exploration-fraction x updates


def resolve(args: Args, cluster: Cluster = Cluster()) -> Setup:
    """Check `args` and derive the batch arithmetic over every process of `cluster`.

    Raises:
      ConfigError: one line naming the flag and valid values: a task without discrete actions or
        with dictionary observations, ε or λ out of [0, 1], minibatches that do not split the batch.
    """
    check_ranges(args, positive=("num_steps", "num_minibatches", "update_epochs"),
                 above_zero=("learning_rate", "max_grad_norm"), unit_interval=("gamma",))
    for name in ("q_lambda", "start_e", "end_e", "exploration_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"{config.flag(name)}={getattr(args, name)} must be in [0, 1]")
    check_network(args.env_id, (), args.hiddens, "nature")  # --env-id first
    if not args.hiddens:
        raise ConfigError("--hiddens is empty: PQN's Q-network needs at least one LayerNorm layer (CleanRL's: 512 on "
                          "Atari, 120 84 on vector tasks)")
    spec = make_spec(args.env_id)
    if type(spec.action_space).__name__ != "Discrete":
        raise ConfigError(f"--env-id {args.env_id} has continuous actions ({spec.action_space}); PQN takes the max "
                          "over discrete actions: use sebulba/sac_envpool.py or sebulba/ppo_envpool.py for this task")
    if is_minigrid(args.env_id):
        raise ConfigError(f"--env-id {args.env_id} has dictionary observations (MiniGrid/BabyAI); PQN here takes "
                          "pixels and vector observations: use sebulba/ppo_envpool.py for this task")
    setup = resolve_run(args, args.num_steps, cluster)
    per_learner = args.num_steps * setup.envs_per_learner
    if per_learner % args.num_minibatches:
        raise ConfigError(f"{per_learner} transitions per learner device (num_steps x envs per learner) do not split "
                          f"into --num-minibatches={args.num_minibatches}; choose a number that divides {per_learner}")
    return Setup(**dataclasses.asdict(setup), minibatch_size=per_learner // args.num_minibatches,
                 decay_updates=args.exploration_fraction * setup.num_updates)


# ---------------------------------------------------------------------------
# The Q-network: the Nature CNN or an MLP, each with LayerNorm (sebulba/networks.py), and a linear head.


class QNetwork(nn.Module):
    """Q(s, ·) [B, A] float32 for observations [B, *obs]: Atari frames through the Nature CNN with a
    LayerNorm after every conv and dense layer (CleanRL's pqn_atari_envpool.py), vector
    observations through a LayerNorm MLP (CleanRL's pqn.py), then a linear head (orthogonal
    init, gain sqrt(2), as CleanRL's layer_init). LayerNorm is what keeps TD learning without a
    target network stable (Gallici et al. 2025). `obs_moments` is taken and unused
    (the shared actors and evaluation pass it; PQN normalises no observation)."""

    num_actions: int
    hiddens: tuple[int, ...]
    pixels: bool  # pixel observations (Atari, Procgen, CarRacing): the conv encoder
    eval_epsilon: float = 0.0  # ε of a non-greedy evaluation (--no-eval-greedy): --end-e
    q_network = True  # (not a field) sebulba.networks.make_policy_fn: an ε-greedy policy over Q
    continuous = False

    @nn.compact
    def __call__(self, obs, obs_moments: RunningMoments | None = None):
        x = NatureEncoder(self.hiddens, layer_norm=True)(obs) if self.pixels else LayerNormMLP(self.hiddens)(obs)
        return nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x)


def make_agent(args: Args):
    """(QNetwork for --env-id's observations and discrete actions, the env spec with the training protocol's settings)."""
    spec = make_spec(args.env_id, args.atari_protocol, args.episodic_life)
    return QNetwork(spec.action_space.n, tuple(args.hiddens), has_pixels(args.env_id), args.end_e), spec


def init_params(agent: QNetwork, spec, key):
    return jax.jit(agent.init)(key, zeros_obs(spec.observation_space, 1))  # one program: eager init is many


# ---------------------------------------------------------------------------
# Pure math: the ε schedule, Q(λ) targets and the TD loss.


def epsilon_schedule(version, start_e: float, end_e: float, decay_updates: float):
    """ε of the actions chosen with params version `version` (updates done; an int or an int
    array): linear from `start_e` at version 0 to `end_e` at `decay_updates` (--exploration-fraction
    x updates), then `end_e` (purejaxql's eps_scheduler(n_updates); CleanRL's linear_schedule
    per env step, here per update). A function of the version, so the ε of every transition
    follows from the version the rollout records with it, whatever the policy lag. float64."""
    progress = np.minimum(np.asarray(version, np.float64) / decay_updates, 1.0) if decay_updates > 0 else 1.0
    return (1.0 - progress) * start_e + progress * end_e


def q_lambda_targets(rewards, values, terminated, truncated, gamma: float, q_lambda: float):
    """Peng's Q(λ) targets (Peng & Williams 1996) as PQN computes them (Gallici et al. 2025;
    purejaxql's _compute_targets), backward over a rollout, with episode ends.

    Transition t goes from s_t to s_{t+1}, earning `rewards[t]`; values[t + 1] = max_a Q(s_{t+1}, a)
    as the actor recorded it. Termination makes s_{t+1} worth 0; truncation (a time limit)
    bootstraps fully from s_{t+1}, the episode's final observation; either way the λ-return
    does not cross the episode end:

      G_t = r_t + gamma * (1 - term_t) * [V_{t+1} + lambda * (1 - trunc_t) * (G_{t+1} - V_{t+1})]
      G_T = V_T   (the bootstrap of the rollout's last transition)

    λ = 0 gives one-step Q-learning targets r_t + gamma * max_a Q(s_{t+1}, a); λ = 1 the discounted
    rewards to the end of the rollout (or of the episode) plus the discounted bootstrap.

    Args:
      rewards: [T, B] float32.
      values: [T + 1, B] float32, max_a Q(s_t, a).
      terminated, truncated: [T, B] bool, how transition t ended.
    Returns:
      targets [T, B] float32.
    """
    chex.assert_rank([rewards, values, terminated, truncated], 2)
    chex.assert_equal_shape([rewards, terminated, truncated, values[1:]])
    not_term = 1.0 - terminated.astype(jnp.float32)
    continues = not_term * (1.0 - truncated.astype(jnp.float32))

    def step(next_return, xs):
        reward, next_value, not_term, continues = xs
        target = reward + gamma * (not_term * next_value + q_lambda * continues * (next_return - next_value))
        return target, target

    _, targets = jax.lax.scan(step, values[-1], (rewards, values[1:], not_term, continues), reverse=True)
    return targets


class Minibatch(NamedTuple):
    obs: jax.Array  # [M, *obs_shape]
    actions: jax.Array  # [M] int32
    targets: jax.Array  # [M] float32, Q(λ) targets
    mask: jax.Array  # [M] float32, 0 for EnvPool's auto-reset steps


def q_loss(params, apply_fn, mb: Minibatch):
    """Mean squared TD error of Q(s, a) against the (constant) Q(λ) targets, over the transitions
    `mb.mask` keeps (CleanRL's F.mse_loss; purejaxql halves it). Returns (loss, metrics dict):
    td_loss, q_values (the mean Q(s, a) of the actions taken), q_max (the mean max_a Q(s, a))."""
    q = apply_fn(params, mb.obs)
    q_taken = jnp.take_along_axis(q, mb.actions[:, None], axis=-1)[:, 0]
    count = jnp.maximum(jnp.sum(mb.mask), 1.0)
    loss = jnp.sum(mb.mask * jnp.square(q_taken - jax.lax.stop_gradient(mb.targets))) / count
    return loss, dict(td_loss=loss, q_values=jnp.sum(mb.mask * q_taken) / count,
                      q_max=jnp.sum(mb.mask * jnp.max(q, axis=-1)) / count)


def prepare_transitions(rollout: Rollout, gamma: float, q_lambda: float) -> Minibatch:
    """Turn a rollout's T+1 rows into T training transitions [T, N] (Minibatch fields): transition t
    is (obs_t, action_t), its reward and episode end received with obs_{t+1}; its mask is 0 when
    obs_t itself ended an episode (EnvPool's auto-reset step: the action is ignored)."""
    mask = ~(rollout.terminated[:-1] | rollout.truncated[:-1])
    targets = q_lambda_targets(rollout.rewards[1:], rollout.values, rollout.terminated[1:], rollout.truncated[1:],
                               gamma, q_lambda)
    return Minibatch(rollout.obs[:-1], rollout.actions[:-1], targets, mask.astype(jnp.float32))


def learner_batch(rollout: Rollout) -> Rollout:
    """What the learner takes of a rollout: observations, actions, the recorded max_a Q, rewards
    and episode ends (the behaviour log-probs, versions and discounted returns stay on the host)."""
    return rollout._replace(logprobs=None, versions=None, discounted_returns=None)


# ---------------------------------------------------------------------------
# Actor thread: recv -> ε-greedy Q -> send -> assemble -> queue.


def run_actor(envs, policy, device: jax.Device, key, params_slot: ParamsSlot, rollout_queue: queue.Queue,
              assembler: RolloutAssembler, num_rollouts: int, args: Args, setup: Setup, stop: threading.Event,
              name: str):
    """Step `envs` with strictly alternating recv -> policy -> send until the assembler has
    emitted rollout `num_rollouts - 1`. Actions are ε-greedy with the ε of the params version
    that chose them (`epsilon_schedule`); the recorded values are max_a Q(s_t, a) from the same
    params, Q(λ)'s bootstraps, and the log-probabilities the behaviour policy's.

    Each queued item is (Rollout, episode returns, episode lengths, stats dict in seconds, and
    random_action_share: the share of the actions sent since the previous rollout was queued
    that were the uniform draw; with --max-policy-lag 0 a rollout's re-chosen first actions
    count, not the first choices recorded as the last one's row T). Policy versions and
    --deterministic as in sebulba/ppo_envpool.py's run_actor.
    """
    timer, key, last_emit, first_rollout = Timer(), jax.device_put(key, device), time.perf_counter(), assembler.emitted
    explored, acted = 0, 0

    def act(params, obs, version, key):
        epsilon = float(epsilon_schedule(version, args.start_e, args.end_e, setup.decay_updates))
        action, logprob, value, chose_randomly, key = policy(params[device], obs, key, epsilon)
        return np.asarray(action), np.asarray(logprob), np.asarray(value), np.asarray(chose_randomly), key

    envs.async_reset()
    while assembler.emitted < num_rollouts:
        if stop.is_set():
            raise Stopped
        with timer("env_recv_time_s"):
            env_id, obs, reward, terminated, truncated, lives = recv_batch(envs, batch_size=setup.async_batch_size,
                                                                           sort=args.deterministic)
        needed = assembler.min_params_version(env_id, args.max_policy_lag, first_rollout if args.deterministic else 0)
        with timer("params_wait_time_s"):
            version, params = params_slot.wait(needed, stop, args.stall_timeout_s, name, exact=args.deterministic)
        with timer("inference_time_s"):
            action, logprob, value, chose_randomly, key = act(params, obs, version, key)
        late, wanted = assembler.late_first_rows(env_id, args.max_policy_lag, version)
        if not late.any():
            with timer("env_send_time_s"):
                envs.send(action, env_id)
        with timer("rollout_assembly_time_s"):
            completed = assembler.add(env_id, obs, reward, terminated, truncated, lives, action, logprob, value, version)
        for rollout, returns, lengths in completed:
            now, stats = time.perf_counter(), timer.pop()
            stats["actor_sps"] = rollout.rewards[1:].size / (now - last_emit)
            stats["random_action_share"], explored, acted = explored / max(acted, 1), 0, 0
            with timer("rollout_queue_put_time_s"):
                timed_put(rollout_queue, (rollout, returns, lengths, stats), stop, args.stall_timeout_s, name)
            last_emit = now
        if late.any():  # --max-policy-lag 0: a rollout's first action comes from the params trained on the last one
            if wanted <= assembler.emitted:  # never wait on this thread's own unfinished rollout (deadlock)
                with timer("params_wait_time_s"):
                    version, params = params_slot.wait(wanted, stop, args.stall_timeout_s, name, exact=args.deterministic)
                with timer("inference_time_s"):
                    again, logprob, value, again_randomly, key = act(params, jax.tree.map(lambda x: x[late], obs),
                                                                      version, key)
                    action, chose_randomly = action.copy(), chose_randomly.copy()  # (the first choice is
                    action[late], chose_randomly[late] = again, again_randomly  # read-only, recorded as row T)
                assembler.restart_rows(env_id[late], again, logprob, value, version)
            with timer("env_send_time_s"):
                envs.send(action, env_id)
        explored, acted = explored + int(chose_randomly.sum()), acted + len(action)  # the actions sent


# ---------------------------------------------------------------------------
# Learner: one compiled SPMD update over the learner mesh.


def make_train_state(args: Args, setup: Setup, params, placement: Placement):
    """The learner's LearnerState (RAdam after global-norm clipping, as CleanRL's and purejaxql's
    PQN) replicated over the learner mesh, and its learning-rate schedule (linear to 0 over every
    minibatch step with --anneal-lr)."""
    lr_schedule = optax.linear_schedule(args.learning_rate, 0.0 if args.anneal_lr else args.learning_rate,
                                        setup.num_updates * args.update_epochs * args.num_minibatches)
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.radam(lr_schedule))
    state = LearnerState.create(apply_fn=None, params=params, tx=tx, obs_moments=RunningMoments.create(()),
                                return_moments=RunningMoments.create(()))
    return placement.replicate(state), lr_schedule


MAX_STEPS_IN_FLIGHT = 8  # minibatch programs dispatched before waiting on them (sebulba/ppo_envpool.py says why)


def make_update_fn(args: Args, agent: QNetwork, mesh: Mesh):
    """PQN update over the learner mesh: (LearnerState, Rollout [T+1, envs] sharded on the env
    axis, key) -> (LearnerState, metrics dict of scalars).

    Compiled `jit(shard_map(...))` pieces: `prepare` (Q(λ) targets on each device's env slice;
    the frames are not copied), `shuffle` (one permutation of transition indices per epoch and
    device) and `step` (one minibatch's gradient, `lax.pmean` over devices, one RAdam step).
    Python drives update_epochs x num_minibatches steps; a Q-network without a conv net (vector
    observations) gets one `scanned` program instead: `lax.scan` over epochs and minibatches of
    the same steps (sebulba/ppo_envpool.py's make_update_fn says why conv nets do not). The
    returned function has `.programs` ({name: jitted program}) for inspection.
    """
    n_mb, env_axis = args.num_minibatches, P(None, "learner")

    def prepare(rollout: Rollout) -> Minibatch:  # per device: [T+1, n] -> [T * n]
        transitions = prepare_transitions(rollout, args.gamma, args.q_lambda)
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), transitions._replace(obs=None))

    def shuffle(data: Minibatch, key):  # per device: [T * n] -> [n_mb, T * n / n_mb] int32 transition indices
        key = jax.random.fold_in(key, jax.lax.axis_index("learner"))
        return jax.random.permutation(key, data.actions.shape[0]).reshape((n_mb, -1))

    def step(state: LearnerState, obs, data: Minibatch, perm, index):
        """One minibatch's gradient (averaged over devices), one RAdam step, and its metrics."""
        rows = perm[index]
        # Rows 0..T-1 of the rollout's [T+1, n, ...] observations are transitions 0..T*n-1 when flattened.
        mb = jax.tree.map(lambda x: x[rows], data)._replace(obs=obs.reshape((-1,) + obs.shape[2:])[rows])
        params = jax.lax.pcast(state.params, "learner", to="varying")  # a local gradient, averaged below
        (_, metrics), grads = jax.value_and_grad(q_loss, has_aux=True)(params, agent.apply, mb)
        state = state.apply_gradients(grads=jax.lax.pmean(grads, "learner"))
        return state, jax.tree.map(lambda m: jax.lax.pmean(m, "learner"), metrics)

    def scanned(state: LearnerState, obs, data: Minibatch, key):
        """Every epoch's minibatch steps in one program: lax.scan over epochs and minibatches."""
        def epoch(state, epoch_key):
            perm = shuffle_rows(data, epoch_key)
            return jax.lax.scan(lambda state, index: minibatch_step(state, obs, data, perm, index), state,
                                jnp.arange(n_mb))

        state, metrics = jax.lax.scan(epoch, state, jax.random.split(key, args.update_epochs))
        return state, jax.tree.map(jnp.mean, metrics)

    shuffle_rows, minibatch_step = shuffle, step  # per device, for `scanned` (the names below become programs)
    prepare = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=env_axis, out_specs=P("learner")))
    shuffle = jax.jit(jax.shard_map(shuffle, mesh=mesh, in_specs=(P("learner"), P()), out_specs=env_axis))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), env_axis, P("learner"), env_axis, P()),
                                 out_specs=(P(), P())))
    scanned = None if agent.pixels else jax.jit(jax.shard_map(
        scanned, mesh=mesh, in_specs=(P(), env_axis, P("learner"), P()), out_specs=(P(), P())))
    # Minibatch indices as arrays on the mesh: a multi-process jit takes no host values.
    index = [jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, P()), np.int32(i))
             for i in range(n_mb)]

    def update(state: LearnerState, rollout: Rollout, key):
        data = prepare(rollout)
        if scanned is not None:
            return scanned(state, rollout.obs, data, key)
        metrics = []
        for epoch_key in jax.random.split(key, args.update_epochs):
            perm = shuffle(data, epoch_key)
            for minibatch in index:
                state, m = step(state, rollout.obs, data, perm, minibatch)
                metrics.append(m)
                if len(metrics) % MAX_STEPS_IN_FLIGHT == 0:
                    jax.block_until_ready(state)
        return state, jax.tree.map(lambda *m: jnp.mean(jnp.stack(m)), *metrics)

    update.programs = {"prepare": prepare, "shuffle": shuffle, "step": step, **({"scanned": scanned} if scanned else {})}
    return update


def check_memory(update_fn, args: Args, setup: Setup, state: LearnerState, rollout: Rollout, placement: Placement):
    """Refuse a learner whose largest program (the whole update where it is one, else one minibatch
    step) does not fit, before any thread starts (sebulba/learner.py's check_learner_memory)."""
    programs, replicated = update_fn.programs, state.step.sharding
    data = jax.eval_shape(programs["prepare"], rollout)
    key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
    if "scanned" in programs:
        compiled = programs["scanned"].lower(state, rollout.obs, data, key).compile()
    else:
        perm = jax.eval_shape(programs["shuffle"], data, key)
        index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
        compiled = programs["step"].lower(state, rollout.obs, data, perm, index).compile()
    host_rollouts = 2 * setup.num_actor_threads_total * args.local_num_envs  # filled and queued
    check_learner_memory(compiled, placement, rollout, host_rollouts,
                         "lower --local-num-envs or --num-steps, or raise --num-minibatches")


def run_learner(run: Run, state: LearnerState, update_fn, lr_schedule, key):
    """Consume one rollout per actor thread (fixed order) per update: transfer the batch onto
    the learner mesh, update, publish the params to the actor devices. Between updates
    `Bookkeeping` logs (docs/pqn_envpool.md lists every metric; charts/epsilon is the mean ε of
    the transitions trained on, from the versions that chose them), checkpoints every
    --checkpoint-interval updates and keeps the summary; a stop signal ends the loop at an
    update boundary, agreed over every process, and after it the last checkpoint is written.
    """
    books, timer, placement, args, setup = Bookkeeping(run, lr_schedule), Timer(), run.placement, run.flags, run.setup
    for update in range(run.start_update, setup.num_updates):
        if run.stop_requested():
            break
        items = run.next_items(timer)  # one per actor thread, in order; None: a stop signal
        if items is None:
            break
        with timer("transfer_time_s"):
            batch = jax.block_until_ready(placement.to_learners([learner_batch(rollout) for rollout, *_ in items]))
        versions = np.concatenate([rollout.versions[:-1].ravel() for rollout, *_ in items])
        epsilon = float(np.mean(epsilon_schedule(versions, args.start_e, args.end_e, setup.decay_updates)))
        items = [item[1:] for item in items]  # the host rollouts are on the learner now: free their frames
        key, update_key = jax.random.split(key)
        with timer("update_time_s"):
            state, metrics = update_fn(state, batch, update_key)
            metrics = jax.tree.map(host, metrics) | {"charts/epsilon": epsilon}
        del batch  # before the next rollouts arrive
        run.params_slot.publish(update + 1, placement.to_actors((state.params, state.obs_moments)))
        books.record(update, state, key, update - versions, items, metrics, timer.pop())
    books.finish(state, key)


# ---------------------------------------------------------------------------
# main: the actor threads, the rollout queues, the learner mesh and the params going back.


def main(args: Args) -> dict:
    """Train with PQN, or resume the run named --run-name from its newest checkpoint.

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
    update_fn = make_update_fn(args, agent, placement.mesh)
    check_memory(update_fn, args, setup, state, learner_batch(rollout_shapes(args.num_steps, setup.num_envs_total, spec,
                                                                       placement.env_sharded)), placement)
    state, learner_key = run.resume(state, learner_key)  # a resumed run: its directory, then its checkpoint
    policy = make_epsilon_greedy_fn(agent)
    # One bounded queue per actor thread; the learner reads them in thread order.
    run.queues = [queue.Queue(maxsize=1) for _ in range(setup.num_actor_threads_total)]
    run.params_slot.publish(run.start_update, placement.to_actors((state.params, state.obs_moments)))

    def actor(thread_index: int, device: jax.Device):
        for begin, end in run.env_segments():  # one pool for the run; --deterministic: one per checkpoint interval
            with run.actor_pool(thread_index, begin, spec, actor_key, args.num_steps, args.gamma, False) as (
                    envs, assembler, key):
                run_actor(envs, policy, device, key, run.params_slot, run.queues[thread_index], assembler, end, args,
                          setup, run.interrupted, f"actor thread {thread_index}")

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
