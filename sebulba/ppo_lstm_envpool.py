"""Sebulba PPO with an LSTM core on EnvPool's asynchronous API.

PPO with GAE as in sebulba/ppo_envpool.py, for partially observed tasks: an LSTM (flax's
OptimizedLSTMCell) sits between the encoder and the policy and value heads. EnvPool's `recv`
returns envs in any order, so each env's recurrent state travels with its env id: the actor
keeps one (cell, hidden) row per env, reads and writes it by id in every batch, and starts it
from zeros at the first observation of each training episode. Every rollout carries each env's
state at its first row; the learner replays whole env sequences from those states.

    actor device a, thread k                      learner mesh (L1..Ln)
    +-------------------------------+  rollout,  +-----------------------------------+
    | envpool async (num_envs N,    |  states at | gather one rollout per thread     |
    |   batch B <= N)               |  row 0     | device_put, env axis split over L |
    | recv -> policy(state[id]) ->  |----------->| jit(shard_map(...)): GAE, then    |
    |   send(id); state[id] = new   | (bounded)  |   epochs x env minibatches: the   |
    | per-env trajectory buffers    |            |   encoder on all T x b at once,   |
    |                               |            |   lax.scan over the LSTM only     |
    | newest params <---------------+------------| publish (version, params)         |
    +-------------------------------+   params   +-----------------------------------+

Usage (on a CPU-only machine missing devices become virtual CPU devices):

    python sebulba/ppo_lstm_envpool.py --env-id MiniGrid-MemoryS7-v0 ...  # presets: docs/ppo_lstm_envpool.md
    python sebulba/ppo_lstm_envpool.py --actor-device-ids 0 --learner-device-ids 1 2 3

This file holds what the recurrent core changes, top to bottom: its flags, the network, the
replay of sequences, the actor loop with its per-env states, the learner update over env
minibatches and the learner loop, and `main`. PPO itself (its flags, GAE, the clipped loss,
the optimiser) is sebulba/ppo_envpool.py's, imported from there; what every algorithm shares
comes from sebulba/ (see docs/architecture.md). docs/ppo_lstm_envpool.md has the flags, the
metrics and the presets.
"""

from __future__ import annotations

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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import tyro
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if not __package__:  # run as a file: import the shared modules from this checkout (installed or not), and
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # keep sebulba/config.py etc. off the top level

from sebulba import ppo_envpool as ppo
from sebulba.config import Cluster, ConfigError, check_ranges, detect_cluster, normalization, resolve_run
from sebulba.devices import host
from sebulba.envs import has_pixels, is_minigrid, make_spec, recv_batch
from sebulba.missions import reads_mission
from sebulba.learner import Bookkeeping, LearnerState, check_learner_memory, make_normalizer_update
from sebulba.networks import (MiniGridEncoder, MLPEncoder, RecurrentPolicy, RunningMoments, make_atari_encoder,
                              make_policy_fn)
from sebulba.rollouts import Rollout, RolloutAssembler, rollout_shapes, zeros_obs
from sebulba.runtime import Run, run_cli
from sebulba.threads import ParamsSlot, Stopped, Supervisor, Timer, timed_put

make_train_state = ppo.make_train_state  # Adam after global-norm clipping, as PPO's (scripts/evaluate.py reads it here)


@dataclass
class Args(ppo.Args):
    """Sebulba PPO with an LSTM core. Defaults: Atari (Breakout-v5) with Cleanba's PPO hyperparameters."""

    exp_name: str = "ppo_lstm_envpool"
    """experiment name, part of the default run name"""
    lstm_size: int = 128
    """width of the LSTM's cell and hidden state (CleanRL's ppo_atari_lstm.py: 128)"""
    num_minibatches: int = 4
    """minibatches per epoch on each learner device: whole env sequences (must divide the envs per learner device)"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 1  # not a flag here: a minibatch is whole sequences


def resolve(args: Args, cluster: Cluster = Cluster()) -> ppo.Setup:
    """ppo_envpool's checks and batch arithmetic, and minibatches of whole env sequences.

    Raises:
      ConfigError: one line naming the flag and valid values.
    """
    check_ranges(args, positive=("lstm_size", "num_minibatches"))
    if args.gradient_accumulation_steps != 1:
        raise ConfigError(f"--gradient-accumulation-steps={args.gradient_accumulation_steps}: a minibatch here is whole "
                          "env sequences; use 1 and shrink minibatches with --num-minibatches")
    envs = resolve_run(args, args.num_steps, cluster).envs_per_learner  # the shared checks first
    if envs % args.num_minibatches:
        divisors = [d for d in range(1, envs + 1) if envs % d == 0]
        raise ConfigError(f"{envs} envs per learner device do not split into --num-minibatches={args.num_minibatches} "
                          f"minibatches of whole env sequences; use one of {divisors}")
    return ppo.resolve(args, cluster)


# ---------------------------------------------------------------------------
# Network: ppo_envpool's encoders (sebulba/networks.py), an LSTM, the heads.


class Agent(nn.Module):
    """Encoder -> LSTM -> policy and value heads. The encoder is the IMPALA ResNet or the Nature CNN (Atari, --atari-encoder), the
    MiniGridEncoder (dictionary observations) or an MLP (vector observations), shared by both
    heads as the LSTM is. A state [B, 2, lstm_size] float32 holds each row's (cell, hidden).
    `__call__` takes one step: (policy, value [B], new state); policy as in ppo_envpool.Agent
    (logits [B, A], or a Gaussian's (mean, log_std) [B, A] each). `encode`, `core` and `heads`
    are the three parts, for `replay`."""

    num_actions: int
    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    pixels: bool  # pixel observations (Atari, Procgen, CarRacing): the conv encoder
    continuous: bool = False
    norm_obs: bool = False
    minigrid: bool = False
    lstm_size: int = 128
    read_mission: bool = False  # MiniGrid/BabyAI: the encoder reads the mission (--read-mission, resolved)
    atari_encoder: str = "impala"  # --atari-encoder

    def setup(self):
        self.encoder = (make_atari_encoder(self.atari_encoder, self.channels, self.hiddens) if self.pixels else
                        MiniGridEncoder(self.hiddens, mission=self.read_mission) if self.minigrid
                        else MLPEncoder(self.hiddens))
        self.lstm = nn.OptimizedLSTMCell(self.lstm_size)
        self.policy_head = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))
        self.value_head = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))
        if self.continuous:
            self.log_std = self.param("log_std", nn.initializers.zeros, (self.num_actions,))

    def encode(self, obs, obs_moments: RunningMoments | None = None):  # [B, *obs] -> [B, F]
        return self.encoder(obs_moments.normalize(obs) if self.norm_obs else obs)

    def core(self, state, x):  # ([B, 2, H], [B, F]) -> ([B, 2, H], [B, H])
        (c, h), y = self.lstm((state[:, 0], state[:, 1]), x)
        return jnp.stack([c, h], axis=1), y

    def heads(self, y):  # [B, H] -> (policy, value [B])
        policy = self.policy_head(y)
        if self.continuous:
            policy = (policy, jnp.broadcast_to(self.log_std, policy.shape))
        return policy, self.value_head(y)[:, 0]

    def __call__(self, obs, state, obs_moments: RunningMoments | None = None):
        state, y = self.core(state, self.encode(obs, obs_moments))
        return *self.heads(y), state


def make_agent(args: Args):
    """(Agent for --env-id's spaces, the env spec with the training protocol's settings)."""
    spec = make_spec(args.env_id, args.atari_protocol, args.episodic_life)
    continuous = type(spec.action_space).__name__ == "Box"
    num_actions = spec.action_space.shape[0] if continuous else spec.action_space.n
    agent = Agent(num_actions, tuple(args.channels), tuple(args.hiddens), has_pixels(args.env_id), continuous,
                  normalization(args.env_id, args.norm_obs, args.norm_reward)[0], is_minigrid(args.env_id),
                  args.lstm_size, reads_mission(args.env_id, args.read_mission), args.atari_encoder)
    return agent, spec


def init_params(agent: Agent, spec, key):
    moments = RunningMoments.create(() if agent.minigrid else spec.observation_space.shape)
    return jax.jit(agent.init)(key, zeros_obs(spec.observation_space, 1), np.zeros((1, 2, agent.lstm_size), np.float32),
                               moments)  # one program: eager init is many


def lstm_kernels(lstm_params):
    """flax OptimizedLSTMCell's params (`Agent.lstm`) as (W_i [F, 4H], W_h [H, 4H], bias [4H]),
    each gate's block in its order i, f, g, o (flax adds the bias on the hidden side; the sum is
    the same). The layout stays flax's: checkpoints and the actors' cell (`Agent.core`) use it."""
    def cat(name, kind):
        return jnp.concatenate([lstm_params[f"{name}{g}"][kind] for g in "ifgo"], axis=-1)
    return cat("i", "kernel"), cat("h", "kernel"), cat("h", "bias")


def lstm_cell(c, h, x_gates, w_h):
    """One step of flax's OptimizedLSTMCell (Hochreiter & Schmidhuber 1997, with Gers et al.
    2000's forget gate) given the input's share of the gate pre-activations: z = x_gates +
    split(h W_h) per gate; i, f, o = sigmoid(z_i, z_f, z_o); g = tanh(z_g); c' = f c + i g;
    h' = o tanh(c').

    c, h [b, H] float32; x_gates (x_i, x_f, x_g, x_o) [b, H] each, x W_i + bias, computed for
    every row before the time loop (`replay`); w_h [H, 4H]. Returns (c', h', (i, f, g, o,
    tanh c')), the activations `lstm_sequence`'s backward pass reads.
    """
    z_i, z_f, z_g, z_o = jnp.split(h @ w_h, 4, axis=-1)
    i, f, o = jax.nn.sigmoid(z_i + x_gates[0]), jax.nn.sigmoid(z_f + x_gates[1]), jax.nn.sigmoid(z_o + x_gates[3])
    g = jnp.tanh(z_g + x_gates[2])
    c = f * c + i * g
    tanh_c = jnp.tanh(c)
    return c, o * tanh_c, (i, f, g, o, tanh_c)


def _lstm_forward(x_gates, starts, c, h, w_h):  # -> (h_t [T, b, H], what each step started from and computed)
    def step(carry, inputs):
        x, start = inputs
        c, h = (jnp.where(start[:, None], 0.0, s) for s in carry)  # the row begins a training episode: zeros
        c_next, h_next, activations = lstm_cell(c, h, x, w_h)
        return (c_next, h_next), (h_next, (c, h, activations))

    _, (hs, saved) = jax.lax.scan(step, (c, h), (x_gates, starts))
    return hs, (saved, starts, w_h)


@jax.custom_vjp
def lstm_sequence(x_gates, starts, c, h, w_h):
    """`lstm_cell` over T steps from the state (c, h) [b, H], restarting from zeros at each row
    of `starts` [T, b] bool; x_gates 4 x [T, b, H]. Returns h_t [T, b, H] float32.

    The gradient is backpropagation through time written out (`_lstm_backward`): the scan back
    in time carries (dc, dh) and emits the gate cotangents dz_t; W_h's gradient sum_t h_{t-1}^T
    dz_t is then one [H, T b] x [T b, 4H] matmul, where autodiff of the scan added an [H, b] x
    [b, 4H] product inside every step (tested equal; docs/ppo_lstm_envpool.md has the timings).
    """
    return _lstm_forward(x_gates, starts, c, h, w_h)[0]


def _lstm_backward(residuals, d_hs):
    (c_in, h_in, activations), starts, w_h = residuals  # c_in, h_in: the state each step started from
    w_h_t = w_h.T  # [4H, H] once: written inside the step, XLA:CPU transposed it at every step

    def step(carry, inputs):
        dc, dh = carry  # cotangents of the state step t produced
        d_out, start, c, (i, f, g, o, tanh_c) = inputs
        dh = dh + d_out
        dc = dc + dh * o * (1.0 - tanh_c * tanh_c)
        dz = jnp.concatenate([dc * g * i * (1.0 - i), dc * c * f * (1.0 - f), dc * i * (1.0 - g * g),
                              dh * tanh_c * o * (1.0 - o)], axis=-1)  # [b, 4H]: of the pre-activations
        return (jnp.where(start[:, None], 0.0, dc * f), jnp.where(start[:, None], 0.0, dz @ w_h_t)), dz

    zeros = jnp.zeros_like(d_hs[0])
    (dc, dh), dz = jax.lax.scan(step, (zeros, zeros), (d_hs, starts, c_in, activations), reverse=True)
    t, b, size = h_in.shape
    d_w_h = h_in.reshape((t * b, size)).T @ dz.reshape((t * b, -1))
    return tuple(jnp.split(dz, 4, axis=-1)), np.zeros(starts.shape, jax.dtypes.float0), dc, dh, d_w_h


lstm_sequence.defvjp(_lstm_forward, _lstm_backward)


def replay(agent: Agent, params, obs, state, starts, obs_moments: RunningMoments):
    """The policy and values of whole env sequences, as the actors computed them.

    obs [T, b, *obs] (or a dict of such), `state` [b, 2, H]: each sequence's LSTM state at row
    0, as the actor used it; `starts` [T, b] bool: rows whose observation begins a training
    episode, where the state restarts from zeros (row 0's is already in `state`). What does
    not depend on the previous step runs on all T x b rows at once, outside the time loop: the
    encoder (on XLA:CPU a conv-net gradient inside `lax.scan` is 10-20x slower,
    docs/performance.md), the LSTM's input projection x W_i + bias (one [T b, F] x [F, 4H]
    matmul) and the heads; `lstm_sequence` scans only h W_h and the gates.
    Returns (policy [T, b, ...], values [T, b]).
    """
    t, b = starts.shape
    flat = jax.tree.map(lambda x: x.reshape((t * b,) + x.shape[2:]), obs)
    features = agent.apply(params, flat, obs_moments, method=Agent.encode)
    w_i, w_h, bias = lstm_kernels(params["params"]["lstm"])
    # Four arrays, not one [T, b, 4H] sliced per gate in the loop (XLA:CPU ran that forward 1.5x slower).
    x_gates = tuple(x.reshape((t, b, -1)) for x in jnp.split(features @ w_i + bias, 4, axis=-1))
    hs = lstm_sequence(x_gates, starts, state[:, 0], state[:, 1], w_h)
    policy, values = agent.apply(params, hs.reshape((t * b, -1)), method=Agent.heads)
    return jax.tree.map(lambda x: x.reshape((t, b) + x.shape[1:]), policy), values.reshape((t, b))


class Sequences(NamedTuple):
    """What an actor thread hands over: a rollout and each env's LSTM state at its row 0,
    [1, N, 2, H] float32 (the env axis second, as in every Rollout field)."""

    rollout: Rollout
    initial_state: np.ndarray


# ---------------------------------------------------------------------------
# Actor thread: recv -> policy(state[id]) -> send -> assemble -> queue.


def run_actor(envs, policy: RecurrentPolicy, device: jax.Device, key, params_slot: ParamsSlot,
              rollout_queue: queue.Queue, assembler: RolloutAssembler, num_rollouts: int, args: Args, batch_size: int,
              stop: threading.Event, name: str):
    """ppo_envpool's actor loop with one LSTM state per env.

    `states[e]` is env e's state after its last step. A batch's rows that begin a training
    episode (the env's previous observation ended one: termination, truncation, or a life
    loss with --episodic-life; and every env's first observation) start from zeros; EnvPool's
    auto-reset row (the one ending an episode) still steps the old episode's state, as its
    action is ignored anyway. The state a row used is recorded when the row is row 0 of a
    rollout, and each queued item is (Sequences, episode returns, episode lengths, stats).
    """
    timer, key, last_emit, first_rollout = Timer(), jax.device_put(key, device), time.perf_counter(), assembler.emitted
    states = policy.zero_state(assembler.num_envs)
    initial: dict[int, np.ndarray] = {}  # rollout index -> [N, 2, H] states used at its row 0
    envs.async_reset()
    while assembler.emitted < num_rollouts:
        if stop.is_set():
            raise Stopped
        with timer("env_recv_time_s"):
            env_id, obs, reward, terminated, truncated, lives = recv_batch(envs, batch_size, sort=args.deterministic)
        needed = assembler.min_params_version(env_id, args.max_policy_lag, first_rollout if args.deterministic else 0)
        with timer("params_wait_time_s"):
            version, params = params_slot.wait(needed, stop, args.stall_timeout_s, name, exact=args.deterministic)
        starts = assembler.prev_done[env_id]  # the env's previous observation ended an episode
        with timer("inference_time_s"):
            action, env_action, logprob, value, used, states_out, key = policy(params[device], obs, states[env_id],
                                                                               starts, key)
            action, logprob, value, used = np.asarray(action), np.asarray(logprob), np.asarray(value), np.asarray(used)
            states[env_id] = np.asarray(states_out)
            sent = action if env_action is None else np.asarray(env_action)
        first_rows = (assembler.row[env_id] == 0) | (assembler.row[env_id] == assembler.num_steps)
        if first_rows.any():  # row T of rollout g - 1 is row 0 of g
            generations = assembler.action_generation(env_id)
            for g in np.unique(generations[first_rows]):
                sel = first_rows & (generations == g)
                initial.setdefault(int(g), np.zeros_like(states))[env_id[sel]] = used[sel]
        late, wanted = assembler.late_first_rows(env_id, args.max_policy_lag, version)
        if not late.any():
            with timer("env_send_time_s"):
                envs.send(sent, env_id)
        generation = assembler.emitted
        with timer("rollout_assembly_time_s"):
            completed = assembler.add(env_id, obs, reward, terminated, truncated, lives, action, logprob, value, version)
        for rollout, returns, lengths in completed:
            now, stats = time.perf_counter(), timer.pop()
            stats["actor_sps"] = rollout.rewards[1:].size / (now - last_emit)  # env steps (not action dimensions)
            sequences = Sequences(rollout, initial.pop(generation)[None])
            with timer("rollout_queue_put_time_s"):
                timed_put(rollout_queue, (sequences, returns, lengths, stats), stop, args.stall_timeout_s, name)
            last_emit, generation = now, generation + 1
        if late.any():  # --max-policy-lag 0: a rollout's first action comes from the params trained on the last one
            if wanted <= assembler.emitted:  # never wait on this thread's own unfinished rollout (deadlock)
                with timer("params_wait_time_s"):
                    version, params = params_slot.wait(wanted, stop, args.stall_timeout_s, name, exact=args.deterministic)
                with timer("inference_time_s"):  # from the same state in, so row 0's recorded state stays true
                    action, env_action, logprob, value, _, states_out, key = policy(
                        params[device], jax.tree.map(lambda x: x[late], obs), used[late], np.zeros(late.sum(), bool), key)
                    sent = sent.copy()  # (the first choice is read-only, and recorded as row T)
                    sent[late] = np.asarray(action if env_action is None else env_action)
                    states[env_id[late]] = np.asarray(states_out)
                assembler.restart_rows(env_id[late], np.asarray(action), np.asarray(logprob), np.asarray(value), version)
            with timer("env_send_time_s"):
                envs.send(sent, env_id)


# ---------------------------------------------------------------------------
# Learner: GAE, then minibatches of whole env sequences replayed from their first state.


def make_update_fn(args: Args, agent: Agent, mesh: Mesh):
    """PPO update over the learner mesh: (LearnerState, Sequences [T+1, envs] sharded on the env
    axis, key) -> (LearnerState, metrics dict of scalars).

    As ppo_envpool's update (the normalisers, `prepare` with GAE on each device's env slice),
    except that a minibatch is whole env sequences: `shuffle` permutes each device's envs once
    per epoch into --num-minibatches groups, and `step` replays its group's T rows from their
    row-0 states (`replay`: the encoder on all rows at once, `lax.scan` over the LSTM only),
    takes ppo_envpool's clipped loss on them, `lax.pmean`s the gradient over devices and
    applies one Adam step. The time axis is never split. Python drives update_epochs x
    num_minibatches `step` programs, dispatched asynchronously; an agent without a conv net
    (not Atari) gets one `scanned` program instead, `lax.scan` over epochs and minibatches of
    the same steps (as ppo_envpool's: on XLA:CPU a conv-net gradient inside `lax.scan` is
    10-20x slower, so Atari keeps one program per step).
    """
    n_mb, env_axis = args.num_minibatches, P(None, "learner")
    norm_obs, norm_reward = normalization(args.env_id, args.norm_obs, args.norm_reward)
    refresh_normalizers = make_normalizer_update(norm_obs, norm_reward, mesh)

    def prepare(return_moments: RunningMoments, rollout: Rollout) -> ppo.Minibatch:  # per device: [T, n] each
        transitions = ppo.prepare_transitions(rollout, args.gamma, args.gae_lambda, return_moments if norm_reward else None)
        return transitions._replace(obs=None)  # the frames stay in the rollout: `step` gathers its envs' columns

    def shuffle(data: ppo.Minibatch, key):  # per device: [n_mb, n / n_mb] env indices
        key = jax.random.fold_in(key, jax.lax.axis_index("learner"))
        return jax.random.permutation(key, data.mask.shape[1]).reshape((n_mb, -1))

    def step(state: LearnerState, obs, initial_state, data: ppo.Minibatch, perm, index):
        envs = perm[index]
        part = jax.tree.map(lambda x: x[:, envs], data)
        # Row t > 0 begins an episode when row t - 1 ended one (its mask is 0); row 0's state is given.
        starts = jnp.concatenate([jnp.zeros((1, envs.shape[0]), bool), part.mask[:-1] == 0])
        part = part._replace(obs=(jax.tree.map(lambda x: x[:-1, envs], obs), initial_state[0, envs], starts))
        params = jax.lax.pcast(state.params, "learner", to="varying")  # a local gradient, averaged by the pmean below
        (_, metrics), grads = jax.value_and_grad(ppo.ppo_loss, has_aux=True)(
            params, lambda p, inputs: replay(agent, p, *inputs, state.obs_moments), part, args.clip_coef,
            args.ent_coef, args.vf_coef, args.norm_adv)
        grads = jax.lax.pmean(grads, "learner")
        return state.apply_gradients(grads=grads), jax.tree.map(lambda m: jax.lax.pmean(m, "learner"), metrics)

    def scanned(state: LearnerState, obs, initial_state, data: ppo.Minibatch, key):
        """Every epoch's minibatch steps in one program: lax.scan over epochs and minibatches."""
        def epoch(state, epoch_key):
            perm = shuffle_envs(data, epoch_key)
            return jax.lax.scan(lambda state, index: one_step(state, obs, initial_state, data, perm, index),
                                state, jnp.arange(n_mb))

        state, metrics = jax.lax.scan(epoch, state, jax.random.split(key, args.update_epochs))
        return state, jax.tree.map(jnp.mean, metrics)

    shuffle_envs, one_step = shuffle, step  # per device, for `scanned` (the names below become programs)
    prepare = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=(P(), env_axis), out_specs=env_axis))
    shuffle = jax.jit(jax.shard_map(shuffle, mesh=mesh, in_specs=(env_axis, P()), out_specs=env_axis))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), env_axis, env_axis, env_axis, env_axis, P()),
                                 out_specs=(P(), P())))
    scanned = None if agent.pixels else jax.jit(jax.shard_map(
        scanned, mesh=mesh, in_specs=(P(), env_axis, env_axis, env_axis, P()), out_specs=(P(), P())))
    index = [jax.make_array_from_process_local_data(NamedSharding(mesh, P()), np.int32(i)) for i in range(n_mb)]

    def update(state: LearnerState, batch: Sequences, key):
        rollout = batch.rollout  # normalisation as in ppo_envpool: the loss uses the statistics that acted
        obs_moments, return_moments = refresh_normalizers(state.obs_moments, state.return_moments, rollout)
        state = state.replace(return_moments=return_moments)
        data, metrics = prepare(return_moments, rollout), []
        if scanned is not None:
            state, metrics = scanned(state, rollout.obs, batch.initial_state, data, key)
            return state.replace(obs_moments=obs_moments), metrics
        for epoch_key in jax.random.split(key, args.update_epochs):
            perm = shuffle(data, epoch_key)
            for minibatch in index:
                state, m = step(state, rollout.obs, batch.initial_state, data, perm, minibatch)
                metrics.append(m)
                if len(metrics) % ppo.MAX_STEPS_IN_FLIGHT == 0:
                    jax.block_until_ready(state)
        return state.replace(obs_moments=obs_moments), jax.tree.map(lambda *m: jnp.mean(jnp.stack(m)), *metrics)

    update.programs = {"prepare": prepare, "shuffle": shuffle, "step": step,  # for inspection
                       **({"scanned": scanned} if scanned else {})}
    return update


def compile_step(update_fn, state: LearnerState, batch: Sequences):
    """The `step` program compiled ahead of time for `batch` (ShapeDtypeStructs), for check_learner_memory."""
    programs, replicated = update_fn.programs, state.step.sharding
    data = jax.eval_shape(programs["prepare"], state.return_moments, batch.rollout)
    perm = jax.eval_shape(programs["shuffle"], data, jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated))
    index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
    return programs["step"].lower(state, batch.rollout.obs, batch.initial_state, data, perm, index).compile()


def run_learner(run: Run, state: LearnerState, update_fn, lr_schedule, key):
    """ppo_envpool's learner loop: one Sequences item per actor thread (fixed order) per update,
    transferred onto the learner mesh (the states split over the env axis with their envs),
    one update, the params published to the actor devices; `Bookkeeping` logs, checkpoints
    and keeps the summary, and a stop signal ends the loop at an update boundary."""
    books, timer, placement = Bookkeeping(run, lr_schedule), Timer(), run.placement
    for update in range(run.start_update, run.setup.num_updates):
        if run.stop_requested():
            break
        items = run.next_items(timer)  # one per actor thread, in order; None: a stop signal
        if items is None:
            break
        with timer("transfer_time_s"):
            batch = jax.block_until_ready(placement.to_learners([sequences for sequences, *_ in items]))
        lag = update - np.concatenate([sequences.rollout.versions[:-1].ravel() for sequences, *_ in items])
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
    """Train PPO with an LSTM core, or resume the run named --run-name from its newest checkpoint.

    Returns the summary written to runs/<run_name>/summary.json. The actors' LSTM states are
    not checkpointed: EnvPool cannot save its envs, so a resumed run starts every env in a new
    episode, whose state is zeros (docs/ppo_lstm_envpool.md).

    Raises:
      ConfigError: before any thread or device work, for a configuration that cannot work.
      RunFailed: a thread failed (its traceback is printed first) or stalled.
    """
    cluster = detect_cluster(args)
    setup = resolve(args, cluster)
    run = Run.open(args, setup, cluster)  # devices, resume check, runs/<run_name>/, config.json, the layout line
    if run.finished:
        return run.summary
    agent, spec = make_agent(args)
    key, init_key, learner_key, actor_key = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    placement = run.placement  # actor devices; the learner mesh over every process's learner devices
    state, lr_schedule = make_train_state(args, setup, init_params(agent, spec, init_key), placement)
    state, learner_key = run.resume(state, learner_key)
    update_fn = make_update_fn(args, agent, placement.mesh)
    rollout = rollout_shapes(args.num_steps, setup.num_envs_total, spec, placement.env_sharded)
    states = jax.ShapeDtypeStruct((1, setup.num_envs_total, 2, args.lstm_size), np.float32,
                                  sharding=placement.env_sharded)
    check_learner_memory(compile_step(update_fn, state, Sequences(rollout, states)), placement, rollout,
                         2 * setup.num_actor_threads_total * args.local_num_envs,  # filled and queued
                         "raise --num-minibatches (fewer env sequences per minibatch), or lower --local-num-envs or --num-steps")
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
