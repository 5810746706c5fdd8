"""Sebulba IMPALA on EnvPool's asynchronous API.

Actor threads step EnvPool pools with `recv`/`send` on dedicated actor devices and
assemble rollouts per env id; an SPMD learner (`jax.jit(jax.shard_map(...))` over a
`Mesh` of separate learner devices) trains on the rollouts as they arrive with the IMPALA
loss and V-trace off-policy correction (Espeholt et al. 2018), and sends new parameters
back to every actor device. V-trace is what keeps the learner correct under policy lag.

    actor device a, thread k                      learner mesh (L1..Ln)
    +-------------------------------+  rollout   +-----------------------------------+
    | envpool async (num_envs N,    |  queue     | take rollouts as they arrive      |
    |   batch B <= N)               | (bounded,  | device_put, env axis split over L |
    | recv -> policy -> send(id)    |  shared)   | jit(shard_map(...)): V-trace,     |
    | per-env trajectory buffers    |----------->|   one gradient step, psum         |
    | newest params <---------------+------------| publish (version, params)         |
    +-------------------------------+   params   +-----------------------------------+

Usage (on a CPU-only machine missing devices become virtual CPU devices):

    python sebulba/impala_envpool.py --actor-device-ids 0 --learner-device-ids 1 2 3
    python sebulba/impala_envpool.py --env-id CartPole-v1 ...  # preset: docs/impala_envpool.md

This file holds what changes with the algorithm, top to bottom: the hyperparameters, the
network, V-trace and the IMPALA loss, the actor loop, the learner update and loop, and `main`,
which wires the actor threads, the rollout queue, the learner mesh and the params going back.
The network, the actor loop and the learner loop are the same as sebulba/ppo_envpool.py's, on
purpose: each script shows its whole data path. What every algorithm shares is imported from
sebulba/ (see docs/architecture.md). See docs/impala_envpool.md for the flags, the logged
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
from typing import Literal, NamedTuple

if __name__ == "__main__":  # Ctrl-C while the libraries load: exit quietly (run_cli takes the signal back)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

if not __package__:  # run as a file: import the shared modules from this checkout (installed or not), and
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # keep sebulba/config.py etc. off the top level

from sebulba.config import (Cluster, ConfigError, RunFlags, Setup, check_network, check_ranges, detect_cluster,
                            normalization, resolve_run)
from sebulba.devices import Placement, host
from sebulba.envs import has_pixels, is_minigrid, make_spec, recv_batch
from sebulba.learner import Bookkeeping, LearnerState, check_learner_memory, make_normalizer_update
from sebulba.missions import reads_mission
from sebulba.networks import (MiniGridEncoder, MLPEncoder, RunningMoments, entropy, log_prob, make_atari_encoder,
                              make_policy_fn)
from sebulba.rollouts import Rollout, RolloutAssembler, rollout_shapes, zeros_obs
from sebulba.runtime import Run, run_cli
from sebulba.threads import ParamsSlot, Stopped, Supervisor, Timer, timed_put


@dataclass
class Args(RunFlags):
    """Sebulba IMPALA. Defaults: Atari (Breakout-v5), IMPALA's hyperparameters (Espeholt et al. 2018) with
    PyTorch's RMSProp, as Cleanba and TorchBeast run them (docs/impala_envpool.md: beside Cleanba)."""

    exp_name: str = "impala_envpool"
    """experiment name, part of the default run name"""
    max_policy_lag: int = 1
    """bound on policy lag (learner version - acting version); 0 = synchronous; see docs/impala_envpool.md"""

    learning_rate: float = 6e-4
    """optimizer learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    optimizer: Literal["rmsprop", "rmsprop-torch", "adam"] = "rmsprop-torch"
    """rmsprop (TF1's, the paper's code: eps inside the root, accumulators from 1), rmsprop-torch (PyTorch's, Cleanba's: eps outside, from 0), both decay 0.99 and eps 0.01; or adam (eps 1e-5)"""
    num_steps: int = 20
    """transitions per env in one rollout (the V-trace unroll length)"""
    gamma: float = 0.99
    """discount factor"""
    vtrace_lambda: float = 1.0
    """V-trace lambda: traces c_t = lambda * min(c_clip, pi/mu)"""
    rho_clip: float = 1.0
    """V-trace rho-bar: importance weights of the TD errors and policy gradient clipped at this value"""
    c_clip: float = 1.0
    """V-trace c-bar: trace-cutting importance weights clipped at this value (c-bar <= rho-bar)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """baseline (value) loss coefficient"""
    max_grad_norm: float = 40.0
    """global gradient norm clip"""
    atari_encoder: str = "impala"
    """encoder of pixel tasks (Atari, Procgen, CarRacing): impala (Espeholt et al. 2018's ResNet) or nature (Mnih et al. 2015's CNN; use --hiddens 512 for the paper's)"""
    channels: tuple[int, ...] = (16, 32, 32)
    """IMPALA ResNet channels, one conv stack each (pixel tasks, --atari-encoder impala)"""
    hiddens: tuple[int, ...] = (256,)
    """dense layer widths after the ResNet (Atari), or of the MLP (vector observations)"""


def resolve(args: Args, cluster: Cluster = Cluster()) -> Setup:
    """Check `args` and derive the batch arithmetic over every process of `cluster` (sebulba/config.py).

    Raises:
      ConfigError: one line naming the flag and valid values.
    """
    check_ranges(args, positive=("num_steps",), above_zero=("learning_rate", "max_grad_norm", "rho_clip", "c_clip"),
                 unit_interval=("gamma", "vtrace_lambda"), non_negative=("ent_coef", "vf_coef"))
    check_network(args.env_id, args.channels, args.hiddens, args.atari_encoder)
    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {args.optimizer}: use {', '.join(OPTIMIZERS)}")
    if args.c_clip > args.rho_clip:
        raise ConfigError(f"--c-clip={args.c_clip} must not exceed --rho-clip={args.rho_clip} (Espeholt et al. 2018, "
                          "section 4.1)")
    return resolve_run(args, args.num_steps, cluster)  # checks --env-id first


# ---------------------------------------------------------------------------
# Networks: the encoders, the observation statistics and the action distributions are in
# sebulba/networks.py; the agent's heads are here (as in sebulba/ppo_envpool.py).


class Agent(nn.Module):
    """Policy and value heads. Atari: one shared encoder (the IMPALA ResNet or the Nature CNN);
    MiniGrid's and BabyAI's dictionary observations: one shared MiniGridEncoder (id embeddings, the mission read where `read_mission`,
    then the `hiddens` layers); vector observations: separate policy and value MLPs (as in
    CleanRL's classic-control and MuJoCo PPO), so the value loss does not swamp the policy's
    features. With `norm_obs`, observations are first normalised by `obs_moments`. Returns (policy, value [B]) where policy is logits [B, A] for discrete
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
# Pure math: V-trace and the IMPALA loss.


class VTrace(NamedTuple):
    vs: jax.Array  # [T, B] V-trace value targets v_s
    pg_advantages: jax.Array  # [T, B] clipped-rho policy-gradient advantages
    rhos: jax.Array  # [T, B] unclipped importance weights pi/mu


def vtrace(values, rewards, discounts, traces, log_rhos, rho_clip: float = 1.0, c_clip: float = 1.0,
           vtrace_lambda: float = 1.0) -> VTrace:
    """V-trace targets and advantages (Espeholt et al. 2018, eq. 1 and section 4.2).

    Transition t goes from x_t (value `values[t]`) to x_{t+1} (value `values[t+1]`), earning
    `rewards[t]`, discounted by `discounts[t]` (gamma, or 0 when x_{t+1} terminated its
    episode). `traces[t]` is 0 when x_{t+1} ended the episode in any way: the recursion never
    crosses an episode end, so on truncation x_{t+1} is bootstrapped from its own value.

      rho_t   = min(rho_clip, pi/mu),   c_t = lambda * min(c_clip, pi/mu)
      delta_t = rho_t * (r_t + discount_t * V(x_{t+1}) - V(x_t))
      v_t - V(x_t) = delta_t + discount_t * c_t * traces_t * (v_{t+1} - V(x_{t+1}))
      A_t     = rho_t * (r_t + discount_t * vnext_t - V(x_t)),
                vnext_t = V(x_{t+1}) + lambda * traces_t * (v_{t+1} - V(x_{t+1}))   (v_T = V(x_T))

    With lambda = 1, vnext_t = v_{t+1} as in the paper; for lambda < 1 the bootstrap mixes
    v_{t+1} and V(x_{t+1}) as rlax does. With traces = 1 this is
    rlax.vtrace_td_error_and_advantage (c_clip = 1, one rho clip for both uses). The inputs
    are not differentiated through (they are targets).

    Args:
      values: [T + 1, B] float32; values[T] bootstraps the last transition.
      rewards, discounts, traces, log_rhos: [T, B] float32 (log_rhos = log pi - log mu).
    Returns:
      VTrace of [T, B] float32 arrays.
    """
    chex.assert_rank([values, rewards, discounts, traces, log_rhos], 2)
    chex.assert_equal_shape([rewards, discounts, traces, log_rhos, values[1:]])
    values, rhos = jax.lax.stop_gradient(values), jnp.exp(jax.lax.stop_gradient(log_rhos))
    clipped_rhos = jnp.minimum(rho_clip, rhos)
    cs = vtrace_lambda * jnp.minimum(c_clip, rhos)
    deltas = clipped_rhos * (rewards + discounts * values[1:] - values[:-1])

    def step(next_correction, xs):  # correction_t = v_t - V(x_t)
        delta, discount, c, trace = xs
        correction = delta + discount * c * trace * next_correction
        return correction, correction

    _, corrections = jax.lax.scan(step, jnp.zeros_like(deltas[0]), (deltas, discounts, cs, traces), reverse=True)
    vs = values[:-1] + corrections
    next_corrections = jnp.concatenate([corrections[1:], jnp.zeros_like(corrections[:1])])
    vnext = values[1:] + vtrace_lambda * traces * next_corrections
    return VTrace(vs, clipped_rhos * (rewards + discounts * vnext - values[:-1]), rhos)


def masked_mean(x, mask):
    """Mean of x over entries where mask is 1; 0 when the mask is empty."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def impala_loss(params, apply_fn, rollout, args):
    """IMPALA loss on one device's rollout slice [T+1, n] (Espeholt et al. 2018, section 4.2): the
    sum over transitions of the policy gradient with V-trace advantages + vf_coef * 0.5 (v_s - V(x_s))^2
    - ent_coef * entropy.

    Transition t is (obs_t, action_t) -> reward and episode end received with obs_{t+1}; its
    mask is 0 when obs_t itself ended an episode (EnvPool's auto-reset step: the action is
    ignored), so that step carries no gradient. The loss is a sum over the unmasked transitions,
    as in the paper's code, so RMSProp's epsilon and the gradient clip act on gradients of the
    paper's scale; the metrics are means over them. Returns (loss, metrics dict).
    """
    t1, n = rollout.actions.shape[:2]
    rows = jax.tree.map(lambda x: x.reshape((t1 * n,) + x.shape[2:]), rollout.obs)  # a dict of them too
    policy, values = apply_fn(params, rows)
    policy, values = jax.tree.map(lambda x: x.reshape(t1, n, -1)[:-1], policy), values.reshape(t1, n)
    logprobs = log_prob(policy, rollout.actions[:-1])
    terminated, truncated = rollout.terminated[1:].astype(jnp.float32), rollout.truncated[1:].astype(jnp.float32)
    mask = 1.0 - (rollout.terminated[:-1] | rollout.truncated[:-1]).astype(jnp.float32)
    targets = vtrace(values, rollout.rewards[1:], args.gamma * (1.0 - terminated),
                     (1.0 - terminated) * (1.0 - truncated), logprobs - rollout.logprobs[:-1],
                     args.rho_clip, args.c_clip, args.vtrace_lambda)
    pg_losses = -targets.pg_advantages * logprobs
    v_losses = 0.5 * jnp.square(targets.vs - values[:-1])
    entropies = entropy(policy)
    loss = jnp.sum(mask * (pg_losses - args.ent_coef * entropies + args.vf_coef * v_losses))
    metrics = dict(policy_loss=masked_mean(pg_losses, mask), value_loss=masked_mean(v_losses, mask),
                   entropy=masked_mean(entropies, mask),
                   approx_kl=masked_mean(-(logprobs - rollout.logprobs[:-1]), mask),
                   rho_clipfrac=masked_mean((targets.rhos > args.rho_clip).astype(jnp.float32), mask))
    return loss, metrics


# ---------------------------------------------------------------------------
# Actor thread: recv -> policy -> send -> assemble -> queue.


def run_actor(envs, policy, device: jax.Device, key, params_slot: ParamsSlot, rollout_queue: queue.Queue,
              assembler: RolloutAssembler, num_rollouts: int, args: Args, batch_size: int,
              stop: threading.Event, name: str):
    """Step `envs` with strictly alternating recv -> policy -> send until the assembler has
    emitted rollout `num_rollouts - 1`.

    The recorded log-probabilities are V-trace's behaviour policy mu (the learner recomputes
    the values itself, with the params it trains).

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
                    action, env_action, logprob, value, key = policy(params[device], obs[late], key)
                    sent = sent.copy()  # (the first choice is read-only, and recorded as row T)
                    sent[late] = np.asarray(action if env_action is None else env_action)
                assembler.restart_rows(env_id[late], np.asarray(action), np.asarray(logprob), np.asarray(value), version)
            with timer("env_send_time_s"):
                envs.send(sent, env_id)


# --optimizer: learning-rate schedule -> optax transformation. The two RMSProps differ where it matters early
# on: TF1's divides by sqrt(nu + eps) with nu starting at 1, so the first steps are about lr * g and, once nu has
# decayed, a gradient below sqrt(eps) = 0.1 is divided by about 0.1; PyTorch's divides by sqrt(nu) + eps with nu
# from 0, so the first step is about 10 lr * sign(g), and a small gradient is divided by about |g| + 0.01.
OPTIMIZERS = {
    "rmsprop": lambda lr: optax.rmsprop(lr, decay=0.99, eps=0.01, initial_scale=1.0, eps_in_sqrt=True),
    "rmsprop-torch": lambda lr: optax.rmsprop(lr, decay=0.99, eps=0.01, initial_scale=0.0, eps_in_sqrt=False),
    "adam": lambda lr: optax.adam(lr, eps=1e-5),
}


def make_train_state(args: Args, setup: Setup, params, placement: Placement):
    """The learner's LearnerState (fresh statistics; --optimizer, one of OPTIMIZERS, after
    global-norm clipping of the summed loss's gradient) replicated
    over the learner mesh, and its learning-rate schedule (linear to 0 over the updates with
    --anneal-lr)."""
    lr_schedule = optax.linear_schedule(args.learning_rate, 0.0 if args.anneal_lr else args.learning_rate,
                                        setup.num_updates)
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), OPTIMIZERS[args.optimizer](lr_schedule))
    obs_shape = make_agent(args)[1].observation_space.shape if setup.norm_obs else ()
    state = LearnerState.create(apply_fn=None, params=params, tx=tx, obs_moments=RunningMoments.create(obs_shape),
                                return_moments=RunningMoments.create(()))
    return placement.replicate(state), lr_schedule


def make_update_fn(args: Args, agent: Agent, mesh: Mesh):
    """IMPALA update over the learner mesh: (LearnerState, Rollout [T+1, envs] sharded on the env
    axis, key) -> (LearnerState, metrics dict of scalars).

    With --norm-reward the return statistics take in the rollout first, and its rewards are
    divided by the running std of the discounted return and clipped to [-10, 10]; with
    --norm-obs the loss normalises observations with the statistics the actors acted with, and
    the rollout's observations enter them after the step (actors receive them with the params). One compiled
    `jit(shard_map(...))` program and one gradient step per batch: each device computes
    V-trace and the loss (a sum) on its env slice, gradients are `lax.psum`'d over
    "learner", so the step is that of the loss summed over the batch. V-trace's backward
    `lax.scan` runs on stop-gradient values, so no conv-net gradient sits inside a loop (the
    XLA:CPU slowdown of docs/performance.md does not apply). `key` is unused (no shuffling); it keeps the signature shared with PPO's.
    """
    norm_obs, norm_reward = normalization(args.env_id, args.norm_obs, args.norm_reward)
    refresh_normalizers = make_normalizer_update(norm_obs, norm_reward, mesh)

    def update(state: LearnerState, rollout: Rollout):
        if norm_reward:
            scale = jax.lax.rsqrt(state.return_moments.var + 1e-8)
            rollout = rollout._replace(rewards=jnp.clip(rollout.rewards * scale, -10.0, 10.0))
        # Params are replicated (invariant over "learner"); the gradient of an invariant input
        # would come back already summed over devices. Casting to varying keeps it local, and
        # the psum below makes it the gradient of the loss summed over the whole batch.
        params = jax.lax.pcast(state.params, "learner", to="varying")
        (_, metrics), grads = jax.value_and_grad(impala_loss, has_aux=True)(
            params, lambda p, obs: agent.apply(p, obs, state.obs_moments), rollout, args)
        grads = jax.lax.psum(grads, "learner")
        metrics = jax.tree.map(lambda m: jax.lax.pmean(m, "learner"), metrics)
        return state.apply_gradients(grads=grads), metrics

    update = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), P(None, "learner")), out_specs=(P(), P())))

    def refresh_and_update(state: LearnerState, rollout: Rollout, key):
        # The loss normalises observations with the statistics the actors acted with; the
        # rollout's observations enter them after the step, for the next rollouts.
        obs_moments, return_moments = refresh_normalizers(state.obs_moments, state.return_moments, rollout)
        state, metrics = update(state.replace(return_moments=return_moments), rollout)
        return state.replace(obs_moments=obs_moments), metrics

    refresh_and_update.programs = {"update": update}  # for inspection (check_learner_memory)
    return refresh_and_update


def run_learner(run: Run, state: LearnerState, update_fn, lr_schedule, key):
    """Consume num_actor_threads rollouts per update as they arrive (--deterministic: one per
    thread, in thread order): transfer them onto the learner mesh, take one V-trace gradient
    step, publish the params to the actor devices. Between updates `Bookkeeping` logs (see
    docs/impala_envpool.md for every metric), checkpoints every
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
    """Train with IMPALA, or resume the run named --run-name from its newest checkpoint.

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
    # The learner takes rollouts as they arrive: one queue shared by every actor thread, read
    # once per thread per update. --deterministic keeps one queue per thread, read in order.
    num_threads = setup.num_actor_threads_total
    shared = queue.Queue(maxsize=num_threads)
    run.queues = [queue.Queue(maxsize=1) for _ in range(num_threads)] if args.deterministic else [shared] * num_threads
    agent, spec = make_agent(args)
    key, init_key, learner_key, actor_key = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    placement = run.placement  # actor devices; the learner mesh over every process's learner devices
    state, lr_schedule = make_train_state(args, setup, init_params(agent, spec, init_key), placement)
    update_fn = make_update_fn(args, agent, placement.mesh)
    rollout = rollout_shapes(args.num_steps, setup.num_envs_total, spec, placement.env_sharded)
    check_learner_memory(update_fn.programs["update"].lower(state, rollout).compile(), placement, rollout,
                         2 * setup.num_actor_threads_total * args.local_num_envs,  # filled and queued
                         "lower --local-num-envs or --num-steps (one update takes the whole rollout)")
    state, learner_key = run.resume(state, learner_key)  # a resumed run: its directory, then its checkpoint
    policy = make_policy_fn(agent, spec.action_space)
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
