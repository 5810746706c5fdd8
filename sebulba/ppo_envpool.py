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

See docs/ppo_envpool.md for the flags, the logged metrics and the presets.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import hashlib
import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import chex
import envpool
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tyro
import wandb
from flax.training.train_state import TrainState
from jax.experimental.multihost_utils import process_allgather, sync_global_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tensorboardX import SummaryWriter


@dataclass
class Args:
    """Sebulba PPO. Defaults: Atari (Breakout-v5) with Cleanba's PPO hyperparameters."""

    exp_name: str = "ppo_envpool"
    """experiment name, part of the default run name"""
    seed: int = 1
    """root seed for parameters, actions and environments"""
    track: bool = False
    """mirror metrics and config to Weights & Biases (set WANDB_MODE=offline to log locally)"""
    wandb_project_name: str = "sebulba"
    """W&B project"""
    wandb_entity: str | None = None
    """W&B entity (team or user); None uses your default entity"""
    log_frequency: int = 10
    """write metrics and one console line every this many learner updates"""
    run_name: str | None = None
    """run directory name under runs/; default {env_id}__{exp_name}__{seed}__{unix time}"""

    env_id: str = "Breakout-v5"
    """EnvPool task id: Atari `*-v5` (IMPALA ResNet), or a vector-observation task with discrete or Box actions (MLP)"""
    total_timesteps: int = 50_000_000
    """env steps to train for, summed over every env (Atari: frames = 4 x env steps)"""
    local_num_envs: int = 64
    """envs in each actor thread's EnvPool pool"""
    async_batch_size: int | None = None
    """envs returned by each `recv`; smaller than --local-num-envs so stepping and inference overlap; None = half the pool"""
    num_env_threads: int = 0
    """EnvPool worker threads per pool; 0 = this machine's cores divided over the actor threads"""
    episodic_life: bool = False
    """Atari: end a training episode at every life loss (the raw game return is still logged per game)"""
    norm_obs: bool | None = None
    """True: normalise observations by their running mean and std (clipped to +-10); None: True for MuJoCo tasks,
    False otherwise; vector observations only"""
    norm_reward: bool | None = None
    """True: scale training rewards by the running std of the discounted return (clipped to +-10); None: True for
    MuJoCo tasks, False otherwise; vector observations only"""
    eval_interval: int = 0
    """evaluate the newest params every this many updates in a separate thread on its own pool (eval/*); 0 = never"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the eval pool), also of the final one in summary.json; 0 = none"""
    eval_greedy: bool = False
    """evaluate with the policy's mode (argmax; the Gaussian mean) instead of sampled actions (on Atari a greedy
    policy can stall a game until the 27k-step limit)"""

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
    gradient_accumulation_steps: int = 1
    """microbatches each minibatch's gradient is averaged over, one program each: the working memory of one
    microbatch (means and --norm-adv statistics are taken per microbatch)"""
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
    channels: tuple[int, ...] = (16, 32, 32)
    """IMPALA ResNet channels, one conv stack each (Atari)"""
    hiddens: tuple[int, ...] = (256,)
    """dense layer widths after the ResNet (Atari), or of the MLP (vector observations)"""

    actor_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """local device ids that run actor threads and policy inference"""
    learner_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """local device ids of the learner mesh; the batch's env axis is split over them"""
    num_actor_threads: int = 2
    """actor threads per actor device, each with its own EnvPool pool"""
    max_policy_lag: int = 1
    """bound on policy lag (learner version - version that chose the action); 0 = synchronous: lockstep envs and
    actors that wait for every update (CleanRL-style alternation, the baseline of benchmark/e2e.py)"""
    stall_timeout_s: float = 600.0
    """seconds without a rollout or a parameter update before the run fails as stalled"""
    checkpoint_interval: int = 100
    """save a checkpoint every this many updates (also at the end and on SIGINT/SIGTERM/SIGUSR1); 0 = only then"""
    distributed: bool = False
    """join a multi-process run (jax.distributed); an srun step is detected, elsewhere also give --coordinator-address,
    --num-processes and --process-id or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID"""
    coordinator_address: str | None = None
    """--distributed outside SLURM: host:port where process 0 runs the coordinator"""
    num_processes: int | None = None
    """--distributed outside SLURM: processes in the run"""
    process_id: int | None = None
    """--distributed outside SLURM: this process's index, 0 .. num_processes - 1"""
    deterministic: bool = False
    """bit-identical reruns and resumes: lockstep envs, exact policy versions, env restarts at checkpoints"""


# ---------------------------------------------------------------------------
# Configuration: derived quantities and checks, before any thread or device work.


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


def _nearest_multiples(value: int, divisor: int) -> str:
    lower = (value // divisor) * divisor
    options = [v for v in (lower, lower + divisor) if v > 0]
    return " or ".join(str(v) for v in options)


def is_atari(env_id: str) -> bool:
    return type(envpool.make_spec(env_id)).__name__ == "AtariEnvSpec"


def is_mujoco(env_id: str) -> bool:
    return envpool.registration.registry.specs[env_id][0].startswith("envpool.mujoco")  # (module, spec class, kw)


def normalization(args: Args) -> tuple[bool, bool]:
    """(--norm-obs, --norm-reward) with None resolved: on for MuJoCo tasks, off otherwise."""
    default = is_mujoco(args.env_id)
    return (default if args.norm_obs is None else args.norm_obs,
            default if args.norm_reward is None else args.norm_reward)


HEARTBEAT_TIMEOUT_S = 20  # a process silent this long is dead: jax.distributed ends the others

# What JAX's own SLURM detection reads (jax._src.clusters.SlurmCluster); all are set inside an `srun` step.
SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@dataclass(frozen=True)
class Cluster:
    """The processes of this run: (1, 0) unless --distributed."""

    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None  # None under SLURM: JAX finds it
    slurm_job_id: str | None = None


def detect_cluster(args: Args) -> Cluster:
    """Processes of a --distributed run, from the flags, JAX_* variables or a SLURM step.

    A shell on an allocated SLURM node (SLURM_JOB_ID set, no step variables; case K10) runs
    as a single process and says so.

    Raises:
      ConfigError: --distributed with neither SLURM nor a complete coordinator setting.
    """
    if not args.distributed:
        given = [f for f, v in (("--coordinator-address", args.coordinator_address), ("--num-processes",
                                 args.num_processes), ("--process-id", args.process_id)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --distributed; add it to join a multi-process run")
        return Cluster()
    env = os.environ
    address = args.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    count = args.num_processes if args.num_processes is not None else env.get("JAX_NUM_PROCESSES")
    index = args.process_id if args.process_id is not None else env.get("JAX_PROCESS_ID")
    if (address, count, index) != (None, None, None):
        missing = [f for f, v in (("--coordinator-address", address), ("--num-processes", count),
                                  ("--process-id", index)) if v is None]
        if missing:
            raise ConfigError(f"--distributed outside SLURM also needs {' and '.join(missing)} "
                              "(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
        count, index = int(count), int(index)
        if not 0 <= index < count:
            raise ConfigError(f"--process-id={index} must be in 0..{count - 1} for --num-processes={count}")
        return Cluster(count, index, address, env.get("SLURM_JOB_ID"))
    if all(v in env for v in SLURM_STEP_VARS):
        return Cluster(int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), None, env["SLURM_JOB_ID"])
    if "SLURM_JOB_ID" in env:
        missing = ", ".join(v for v in SLURM_STEP_VARS if v not in env)
        tasks = f"; launch with srun to run all {env['SLURM_NTASKS']} tasks" if int(env.get("SLURM_NTASKS", 1)) > 1 else ""
        print(f"--distributed: SLURM_JOB_ID is set but {missing} not (a shell on an allocated node, not an srun "
              f"step): running as a single process{tasks}")
        return Cluster(slurm_job_id=env["SLURM_JOB_ID"])
    raise ConfigError("--distributed needs a SLURM step (launch with srun) or --coordinator-address, --num-processes "
                      "and --process-id (scripts/launch_local.py sets them on one machine)")


@dataclass(frozen=True)
class Setup:
    """Quantities derived once from Args (never CLI flags). Counts are global (every process)
    unless the name says local."""

    run_name: str
    async_batch_size: int
    num_env_threads: int
    num_actor_threads_total: int  # local: over every actor device of this process
    num_envs_total: int  # envs feeding one update, every process
    batch_size: int  # env steps per update, every process
    num_updates: int
    minibatch_size: int  # per learner device
    envs_per_learner: int
    num_processes: int = 1
    process_id: int = 0
    norm_obs: bool = False  # --norm-obs / --norm-reward resolved (None: on for MuJoCo)
    norm_reward: bool = False


def resolve(args: Args, cluster: Cluster = Cluster()) -> Setup:
    """Check `args` and derive the batch arithmetic over every process of `cluster`.

    Raises:
      ConfigError: one line naming the flag and valid values.
    """
    for name in ("local_num_envs", "num_steps", "num_minibatches", "gradient_accumulation_steps",
                 "update_epochs", "num_actor_threads", "total_timesteps", "log_frequency"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    for name in ("learning_rate", "stall_timeout_s", "max_grad_norm"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    for name in ("gamma", "gae_lambda"):
        if not 0 < getattr(args, name) <= 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be in (0, 1]")
    for name in ("max_policy_lag", "checkpoint_interval", "ent_coef", "vf_coef", "eval_interval", "eval_episodes"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    if not args.actor_device_ids or not args.learner_device_ids:
        raise ConfigError("--actor-device-ids and --learner-device-ids each need at least one id")
    for flag, ids in (("actor", args.actor_device_ids), ("learner", args.learner_device_ids)):
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ConfigError(f"--{flag}-device-ids {ids}: ids must be distinct and >= 0")
    if args.env_id not in envpool.list_all_envs():
        close = difflib.get_close_matches(args.env_id, envpool.list_all_envs(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see envpool.list_all_envs()"
        raise ConfigError(f"--env-id {args.env_id} is not an EnvPool task{hint}")
    if args.eval_interval and not args.eval_episodes:
        raise ConfigError(f"--eval-interval={args.eval_interval} needs --eval-episodes > 0")
    if is_atari(args.env_id) and any(normalization(args)):
        raise ConfigError("--norm-obs and --norm-reward are for vector observations; Atari frames are scaled by 1/255 "
                          "and rewards clipped to [-1, 1]")
    n = args.local_num_envs
    lockstep = args.deterministic or args.max_policy_lag == 0  # every env in every recv
    if lockstep and args.async_batch_size not in (None, n):
        mode = "--deterministic" if args.deterministic else "--max-policy-lag 0 (synchronous)"
        raise ConfigError(f"{mode} steps every env in lockstep: drop --async-batch-size or set it to "
                          f"--local-num-envs={n}")
    async_batch = args.async_batch_size if args.async_batch_size is not None else n if lockstep else max(1, n // 2)
    if not 0 < async_batch <= n or n % async_batch:
        raise ConfigError(f"--async-batch-size={async_batch} must divide --local-num-envs={n}; "
                          f"use one of {[d for d in range(1, n + 1) if n % d == 0]}")
    num_learners = len(args.learner_device_ids)  # per process; each process feeds its own learner devices
    if n % num_learners:
        raise ConfigError(f"--local-num-envs={n} is not divisible by {num_learners} learner devices; "
                          f"use {_nearest_multiples(n, num_learners)}")
    num_threads = len(args.actor_device_ids) * args.num_actor_threads
    num_envs_total = cluster.num_processes * num_threads * n
    envs_per_learner = num_envs_total // (cluster.num_processes * num_learners)
    per_learner = args.num_steps * envs_per_learner
    chunks = args.num_minibatches * args.gradient_accumulation_steps
    if per_learner % chunks:
        raise ConfigError(f"{per_learner} transitions per learner device (num_steps x envs per learner) do not split "
                          f"into --num-minibatches={args.num_minibatches} x --gradient-accumulation-steps="
                          f"{args.gradient_accumulation_steps}; choose sizes whose product divides {per_learner}")
    batch_size = args.num_steps * num_envs_total
    if args.total_timesteps < batch_size:
        raise ConfigError(f"--total-timesteps={args.total_timesteps} is smaller than one batch ({batch_size} env steps "
                          f"= num_steps x envs); use at least {batch_size}")
    if args.run_name is None and cluster.num_processes > 1 and cluster.slurm_job_id is None:
        raise ConfigError("--distributed: give every process the same --run-name (the default contains the start time)")
    # Under SLURM the default name is stable across requeues of the job, which then resume.
    stamp = f"slurm{cluster.slurm_job_id}" if cluster.slurm_job_id else str(int(time.time()))
    cores = os.cpu_count() or 1
    return Setup(
        run_name=args.run_name or f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{stamp}",
        async_batch_size=async_batch,
        num_env_threads=args.num_env_threads or max(1, cores // num_threads),
        num_actor_threads_total=num_threads,
        num_envs_total=num_envs_total,
        batch_size=batch_size,
        num_updates=args.total_timesteps // batch_size,
        minibatch_size=per_learner // args.num_minibatches,
        envs_per_learner=envs_per_learner,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        norm_obs=normalization(args)[0],
        norm_reward=normalization(args)[1],
    )


def setup_devices(args: Args, cluster: Cluster = Cluster()) -> tuple[list[jax.Device], list[jax.Device]]:
    """Start the JAX backend; return (this process's actor devices, the learner devices of
    every process, process-major: the learner mesh).

    Device ids are local to each process. On the CPU backend `jax_num_cpu_devices` is raised
    to cover the largest requested id, unless the user's XLA_FLAGS already set a device count
    (never overwritten). A multi-process cluster joins `jax.distributed` first (CPU
    collectives through gloo); a process that dies is noticed by the others' heartbeat
    within HEARTBEAT_TIMEOUT_S and ends them.

    Raises:
      ConfigError: a requested id does not exist on this process.
    """
    ids = sorted(set(args.actor_device_ids + args.learner_device_ids))
    needed = ids[-1] + 1
    created = False
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        with contextlib.suppress(RuntimeError):  # the backend is already up (e.g. in tests): use what exists
            if needed > jax.config.jax_num_cpu_devices:
                jax.config.update("jax_num_cpu_devices", needed)
                created = True
    if cluster.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        explicit = cluster.coordinator_address is not None  # else JAX reads the SLURM step itself
        # local_device_ids: this process owns every GPU it names (JAX would give one per SLURM task).
        jax.distributed.initialize(cluster.coordinator_address, cluster.num_processes if explicit else None,
                                   cluster.process_id if explicit else None, local_device_ids=ids,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    devices = jax.local_devices()
    if needed > len(devices):
        raise ConfigError(f"device id {needed - 1} requested but this process has {len(devices)} "
                          f"{devices[0].platform} devices; use ids 0..{len(devices) - 1}")
    if created and devices[0].platform == "cpu" and needed > 1:
        print(f"no accelerator: running on {len(devices)} virtual CPU devices (jax_num_cpu_devices={needed})")
    per_process = [jax.local_devices(process_index=p) for p in range(jax.process_count())]
    learners = [local[i] for local in per_process for i in args.learner_device_ids]
    return [devices[i] for i in args.actor_device_ids], learners


# ---------------------------------------------------------------------------
# Environments.


def env_settings(args: Args) -> dict[str, Any]:
    """EnvPool settings of the training protocol, for `make_envs` and for the spec that sizes
    the network (Atari's full action space has 18 actions, the default spec fewer).

    Atari follows the Machado et al. (2018) evaluation protocol: sticky actions (p=0.25),
    full action space, no life-loss signal unless --episodic-life, 108k-frame (27k-step)
    limit, no no-op starts beyond EnvPool's minimum. Rewards come back raw; clipping for
    training happens in `RolloutAssembler` so the raw game score stays available.
    """
    if not is_atari(args.env_id):
        return {}
    return dict(episodic_life=args.episodic_life, reward_clip=False, repeat_action_probability=0.25,
                full_action_space=True, max_episode_steps=27_000, noop_max=1)


def make_envs(args: Args, num_envs: int, batch_size: int, seed: int, num_threads: int):
    """EnvPool pool with the training protocol's settings, in async mode when batch_size < num_envs."""
    return envpool.make(args.env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size,
                        seed=seed, num_threads=num_threads, **env_settings(args))


# ---------------------------------------------------------------------------
# Networks.


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.channels, (3, 3))(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(y))
        return x + y


class ImpalaEncoder(nn.Module):
    """IMPALA ResNet (Espeholt et al. 2018, Fig. 3): conv, max-pool, two residual blocks per stack."""

    channels: tuple[int, ...]
    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs):  # obs: [B, C, H, W] uint8 frames
        x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
        for c in self.channels:
            x = nn.Conv(c, (3, 3))(x)
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            x = ResidualBlock(c)(x)
            x = ResidualBlock(c)(x)
        x = nn.relu(x).reshape((x.shape[0], -1))
        for h in self.hiddens:
            x = nn.relu(nn.Dense(h)(x))
        return x


class MLPEncoder(nn.Module):
    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs):  # obs: [B, D] float
        x = obs.reshape((obs.shape[0], -1)).astype(jnp.float32)
        for h in self.hiddens:
            x = nn.tanh(nn.Dense(h, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


class RunningMoments(NamedTuple):
    """Running mean and variance of a stream of samples, each of the shape of `mean`."""

    mean: jax.Array  # float32
    var: jax.Array  # float32, population variance
    count: jax.Array  # float32 scalar, samples seen (starts at 1e-4, as gym's RunningMeanStd)

    @staticmethod
    def create(shape) -> RunningMoments:
        return RunningMoments(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32), jnp.float32(1e-4))

    def normalize(self, x):
        """(x - mean) / std, clipped to [-10, 10] (as CleanRL's MuJoCo PPO)."""
        return jnp.clip((x - self.mean) / jnp.sqrt(self.var + 1e-8), -10.0, 10.0)

    def update(self, x, axis_name: str) -> RunningMoments:
        """Add the samples x [T, n, *shape] of every device on mesh axis `axis_name` (equal n
        on each): the batch's moments in two passes over the mesh, merged with the running ones
        by Chan et al. (1979)'s parallel rule. Inside shard_map; the result is invariant."""
        x = x.reshape((-1,) + self.mean.shape).astype(jnp.float32)
        count = x.shape[0] * jax.lax.psum(1, axis_name)
        mean = jax.lax.pmean(jnp.mean(x, axis=0), axis_name)
        var = jax.lax.pmean(jnp.mean(jnp.square(x - mean), axis=0), axis_name)
        total = self.count + count
        delta = mean - self.mean
        m2 = self.var * self.count + var * count + jnp.square(delta) * self.count * count / total
        return RunningMoments(self.mean + delta * count / total, m2 / total, total)


class Agent(nn.Module):
    """Policy and value heads. Atari: one shared ResNet; vector observations: separate policy
    and value MLPs (as in CleanRL's classic-control and MuJoCo PPO), so the value loss does not
    swamp the policy's features. With `norm_obs`, observations are first normalised by
    `obs_moments`. Returns (policy, value [B]) where policy is logits [B, A] for discrete
    actions, or (mean [B, A], log_std [B, A]) of a diagonal Gaussian whose log-std is a learned,
    state-independent vector (Schulman et al. 2017's MuJoCo setup)."""

    num_actions: int  # discrete: actions; continuous: action dimensions
    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    atari: bool
    continuous: bool = False
    norm_obs: bool = False

    @nn.compact
    def __call__(self, obs, obs_moments: RunningMoments | None = None):
        if self.norm_obs:
            obs = obs_moments.normalize(obs)
        if self.atari:
            policy_x = value_x = ImpalaEncoder(self.channels, self.hiddens)(obs)
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
    spec = envpool.make_spec(args.env_id, **env_settings(args))
    continuous = type(spec.action_space).__name__ == "Box"
    num_actions = spec.action_space.shape[0] if continuous else spec.action_space.n
    agent = Agent(num_actions, tuple(args.channels), tuple(args.hiddens), is_atari(args.env_id), continuous,
                  normalization(args)[0])
    return agent, spec


def init_params(agent: Agent, spec, key):
    obs_space = spec.observation_space
    return agent.init(key, np.zeros((1, *obs_space.shape), obs_space.dtype), RunningMoments.create(obs_space.shape))


# Action distributions: `policy` is logits [B, A] (categorical) or (mean, log_std) [B, A] each (diagonal Gaussian).


def log_prob(policy, actions):
    """log pi(a|s) [B] of actions [B] int32 (categorical) or [B, A] float32 (Gaussian, unclipped
    sample: the env receives it clipped to the action space, the loss sees it as sampled)."""
    if isinstance(policy, tuple):
        mean, log_std = policy
        z = (actions - mean) / jnp.exp(log_std)
        return jnp.sum(-0.5 * jnp.square(z) - log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)
    return jnp.take_along_axis(jax.nn.log_softmax(policy), actions[..., None], axis=-1)[..., 0]


def entropy(policy):
    """Entropy [B] in nats."""
    if isinstance(policy, tuple):
        return jnp.sum(policy[1] + 0.5 * jnp.log(2 * jnp.pi * jnp.e), axis=-1)
    logp = jax.nn.log_softmax(policy)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sample_action(policy, key, greedy: bool = False):
    """An action per row: sampled, or with `greedy` the mode (argmax; the Gaussian mean)."""
    if isinstance(policy, tuple):
        mean, log_std = policy
        return mean if greedy else mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape)
    return (jnp.argmax(policy, axis=-1) if greedy else jax.random.categorical(key, policy)).astype(jnp.int32)


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
    obs: jax.Array  # [M, *obs_shape]
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


# ---------------------------------------------------------------------------
# Rollout assembly: EnvPool returns env ids in any order; each env has its own time axis.


class Rollout(NamedTuple):
    """num_steps + 1 rows per env. Row t holds what `recv` returned for obs_t and the action
    taken on it; row num_steps is also row 0 of the env's next rollout.

    obs [T+1, N, *obs]; actions [T+1, N] int32 or [T+1, N, A] float32 (Box: as sampled, before
    clipping to the bounds); logprobs, values [T+1, N] float32 (behaviour policy); rewards
    [T+1, N] float32 (training reward received *with* obs_t, i.e. of transition t-1);
    terminated, truncated [T+1, N] bool (obs_t ended its episode); versions [T+1, N] int32
    (params version that chose actions[t]); discounted_returns [T+1, N] float32 (discounted
    sum of the episode's training rewards up to obs_t: --norm-reward's statistic).
    """

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    versions: np.ndarray
    discounted_returns: np.ndarray


class RolloutAssembler:
    """Writes each `recv` batch into per-env trajectories and emits complete rollouts.

    Tracks the raw (unclipped) return and length of every real game: a game ends on
    truncation, or on termination with no lives left (with --episodic-life a life loss
    terminates the training episode but not the game). Envs that EnvPool runs ahead write
    into the next rollout's buffer, never into another env's time axis.
    """

    max_pending = 8  # rollouts one env may run ahead of the slowest before we call it starvation

    def __init__(self, num_envs: int, num_steps: int, obs_shape, obs_dtype, clip_rewards: bool, episodic_life: bool,
                 first_rollout: int = 0, action_shape=(), action_dtype=np.int32, gamma: float = 0.99):
        self.num_envs, self.num_steps = num_envs, num_steps
        self.obs_shape, self.obs_dtype = tuple(obs_shape), obs_dtype
        self.action_shape, self.action_dtype = tuple(action_shape), action_dtype
        self.clip_rewards, self.episodic_life, self.gamma = clip_rewards, episodic_life, gamma
        self.discounted_return = np.zeros(num_envs, np.float32)
        self.generation = np.full(num_envs, first_rollout, np.int64)  # rollout index each env is writing
        self.row = np.zeros(num_envs, np.int64)  # next row in that rollout
        self.buffers: dict[int, Rollout] = {}
        self.rows_done: dict[int, int] = collections.Counter()  # envs that wrote their last row
        self.emitted = first_rollout  # index of the next rollout to complete (= rollouts emitted, on resume too)
        self.game_return = np.zeros(num_envs, np.float64)
        self.game_length = np.zeros(num_envs, np.int64)
        self.prev_done = np.ones(num_envs, bool)  # the first obs after reset carries no reward
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []

    def _buffer(self, generation: int) -> Rollout:
        if generation not in self.buffers:
            if len(self.buffers) >= self.max_pending:
                raise RuntimeError(f"EnvPool ran some envs {self.max_pending} rollouts ahead of others; "
                                   "env stepping is starved - use fewer envs per thread or a larger --async-batch-size")
            shape = (self.num_steps + 1, self.num_envs)
            self.buffers[generation] = Rollout(
                np.zeros(shape + self.obs_shape, self.obs_dtype), np.zeros(shape + self.action_shape, self.action_dtype),
                np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                np.zeros(shape, bool), np.zeros(shape, bool), np.zeros(shape, np.int32), np.zeros(shape, np.float32))
        return self.buffers[generation]

    def action_generation(self, env_id):
        """Rollout index of the transition each env's next action starts ([B] int64): the last
        row of rollout g is row 0 of rollout g + 1, and its action belongs to g + 1."""
        return self.generation[env_id] + (self.row[env_id] == self.num_steps)

    def add(self, env_id, obs, reward, terminated, truncated, lives, actions, logprobs, values, version: int):
        """Record one batch (all [B] arrays, `reward` raw). Returns the rollouts completed by it,
        each as (Rollout, episode returns, episode lengths) for games that ended since the last one."""
        done = terminated | truncated
        counts = ~self.prev_done[env_id]
        self.game_return[env_id] += np.where(counts, reward, 0.0)
        self.game_length[env_id] += counts
        game_over = truncated | (terminated & ((lives == 0) if self.episodic_life and lives is not None else True))
        for e in env_id[game_over]:
            self.episode_returns.append(float(self.game_return[e]))
            self.episode_lengths.append(int(self.game_length[e]))
        self.game_return[env_id[game_over]] = 0.0
        self.game_length[env_id[game_over]] = 0
        train_reward = np.clip(reward, -1.0, 1.0) if self.clip_rewards else reward
        continues = ~self.prev_done[env_id]  # an episode's first obs starts a new discounted return
        self.discounted_return[env_id] = self.gamma * continues * self.discounted_return[env_id] + train_reward
        self.prev_done[env_id] = done
        fields = (obs, actions, logprobs, values, train_reward, terminated, truncated, version,
                  self.discounted_return[env_id])

        generations, rows = self.generation[env_id], self.row[env_id]
        for g in np.unique(generations):
            sel = generations == g
            self._write(self._buffer(int(g)), rows[sel], env_id[sel], fields, sel)
            last = sel & (rows == self.num_steps)
            if last.any():  # the last row of rollout g is row 0 of rollout g + 1
                self._write(self._buffer(int(g) + 1), np.zeros(int(last.sum()), np.int64), env_id[last], fields, last)
                self.rows_done[int(g)] += int(last.sum())
        self.row[env_id] += 1
        wrapped = env_id[self.row[env_id] > self.num_steps]
        self.generation[wrapped] += 1
        self.row[wrapped] = 1

        completed = []
        while self.rows_done.get(self.emitted, 0) == self.num_envs:
            del self.rows_done[self.emitted]
            completed.append((self.buffers.pop(self.emitted), self.episode_returns, self.episode_lengths))
            self.episode_returns, self.episode_lengths = [], []
            self.emitted += 1
        return completed

    @staticmethod
    def _write(buffer: Rollout, rows, env_ids, fields, sel):
        for array, value in zip(buffer, fields):
            array[rows, env_ids] = value[sel] if np.ndim(value) else value


def check_env_ids(env_id, batch_size: int):
    """Validate one `recv` batch's env ids.

    Raises:
      RuntimeError: the batch is empty, has the wrong size, or repeats an env id.
    """
    if len(env_id) != batch_size:
        raise RuntimeError(f"EnvPool recv returned {len(env_id)} envs, expected async batch size {batch_size}; "
                           "recv and send must strictly alternate (envpool#259)")
    if len(np.unique(env_id)) != len(env_id):
        raise RuntimeError(f"EnvPool recv returned duplicate env ids {env_id.tolist()} (envpool#312)")
    return env_id


# ---------------------------------------------------------------------------
# Threads: stop signal, parameter slot, timed queues.


class Stopped(Exception):
    """Raised inside a thread when the run is stopping; not an error."""


class StallError(RuntimeError):
    """No progress for --stall-timeout-s; the message names the waiting component."""


class RunFailed(RuntimeError):
    """A thread failed or stalled; its traceback was printed when it happened."""


class ParamsSlot:
    """Parameter versions published by the learner, {actor device: params} each; the newest
    `keep` are held (more than one only for --deterministic, whose actors ask for an exact one)."""

    def __init__(self, keep: int = 1):
        self._cond = threading.Condition()
        self.keep = keep
        self.version = -1
        self.history: dict[int, dict[jax.Device, Any]] = {}

    def publish(self, version: int, params: dict[jax.Device, Any]):
        with self._cond:
            self.version, self.history[version] = version, params
            for old in [v for v in self.history if v <= version - self.keep]:
                del self.history[old]
            self._cond.notify_all()

    def wait(self, min_version: int, stop: threading.Event, timeout_s: float, who: str, exact: bool = False):
        """(version, {device: params}) once version >= min_version: the newest, or version
        `min_version` itself when `exact`. Never blocks when the version is already there."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.version < min_version:
                if stop.is_set():
                    raise Stopped
                if time.monotonic() > deadline:
                    raise StallError(f"{who} waited {timeout_s:.0f}s for params version {min_version} "
                                     f"(learner is at {self.version}): the learner stalled")
                self._cond.wait(0.1)
            version = min_version if exact else self.version
            return version, self.history[version]


def timed_put(q: queue.Queue, item, stop: threading.Event, timeout_s: float, who: str):
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            return q.put(item, timeout=0.1)
        except queue.Full:
            if time.monotonic() > deadline:
                raise StallError(f"{who} could not hand a rollout to the learner for {timeout_s:.0f}s: "
                                 "the learner stopped consuming") from None
    raise Stopped


def timed_get(q: queue.Queue, stop: threading.Event, timeout_s: float, who: str):
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise StallError(f"{who} received no rollout for {timeout_s:.0f}s: the actor stalled") from None
    raise Stopped


class Timer:
    """Accumulates seconds per stage name: `with timer("env_recv"): ...`."""

    def __init__(self):
        self.totals: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.totals[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), collections.defaultdict(float)
        return totals


# ---------------------------------------------------------------------------
# Actor thread.


def make_policy_fn(agent: Agent, action_space=None, greedy: bool = False):
    """jit((params, obs_moments), obs [B, *obs], key) -> (action, env action, logprob [B], value [B], key).

    The action is what the behaviour policy sampled ([B] int32, or [B, A] float32); the env
    action is the same clipped to a Box `action_space`'s bounds, what `send` gets (None for
    discrete actions: send the action; no second copy to the host). `greedy` takes the
    policy's mode instead of sampling (evaluation)."""
    bounds = (action_space.low, action_space.high) if agent.continuous else None

    @jax.jit
    def policy(params, obs, key):
        params, obs_moments = params
        dist, value = agent.apply(params, obs, obs_moments)
        key, sample_key = jax.random.split(key)
        action = sample_action(dist, sample_key, greedy)
        env_action = None if bounds is None else jnp.clip(action, *bounds)
        return action, env_action, log_prob(dist, action), value, key

    return policy


def run_actor(envs, policy, device: jax.Device, key, params_slot: ParamsSlot, rollout_queue: queue.Queue,
              assembler: RolloutAssembler, num_rollouts: int, args: Args, batch_size: int,
              stop: threading.Event, name: str):
    """Step `envs` with strictly alternating recv -> policy -> send until the assembler has
    emitted rollout `num_rollouts - 1`.

    Each queued item is (Rollout, episode returns, episode lengths, stats dict in seconds).
    With --deterministic each batch is the whole pool sorted by env id, and the action
    starting a transition of rollout g comes from params version max(g - max_policy_lag,
    first rollout of this pool) exactly.
    """
    timer = Timer()
    key = jax.device_put(key, device)
    last_emit = time.perf_counter()
    first_rollout = assembler.emitted
    envs.async_reset()
    while assembler.emitted < num_rollouts:
        if stop.is_set():
            raise Stopped
        with timer("env_recv_time_s"):
            obs, reward, terminated, truncated, info = envs.recv()
        env_id = check_env_ids(np.asarray(info["env_id"]), batch_size)
        lives = info.get("lives")
        if args.deterministic:
            order = np.argsort(env_id)
            env_id, obs, reward, terminated, truncated = (x[order] for x in (env_id, obs, reward, terminated, truncated))
            lives = None if lives is None else lives[order]
        # An action that starts a transition of rollout g must come from params >= g - max_policy_lag;
        # never wait for a version that needs this thread's own unfinished rollout (that would deadlock).
        needed = min(int(assembler.action_generation(env_id).max()) - args.max_policy_lag, assembler.emitted)
        if args.deterministic:
            needed = max(needed, first_rollout)
        with timer("params_wait_time_s"):
            version, params = params_slot.wait(needed, stop, args.stall_timeout_s, name, exact=args.deterministic)
        with timer("inference_time_s"):
            action, env_action, logprob, value, key = policy(params[device], obs, key)
            action, logprob, value = np.asarray(action), np.asarray(logprob), np.asarray(value)
        with timer("env_send_time_s"):
            envs.send(action if env_action is None else np.asarray(env_action), env_id)
        with timer("rollout_assembly_time_s"):
            completed = assembler.add(env_id, obs, reward, terminated, truncated, lives,
                                      action, logprob, value, version)
        for rollout, returns, lengths in completed:
            now = time.perf_counter()
            stats = timer.pop()
            stats["actor_sps"] = rollout.actions[1:].size / (now - last_emit)
            with timer("rollout_queue_put_time_s"):
                timed_put(rollout_queue, (rollout, returns, lengths, stats), stop, args.stall_timeout_s, name)
            last_emit = now


def env_segments(start_update: int, num_updates: int, args: Args) -> list[tuple[int, int]]:
    """Rollout ranges [begin, end) each served by one fresh EnvPool pool: the whole run, or
    with --deterministic one per checkpoint interval, so a run resumed from a periodic
    checkpoint restarts its envs exactly where the uninterrupted run did."""
    if not args.deterministic or not args.checkpoint_interval:
        return [(start_update, num_updates)]
    interval = args.checkpoint_interval
    cuts = [start_update, *range((start_update // interval + 1) * interval, num_updates, interval), num_updates]
    return list(itertools.pairwise(cuts))


# ---------------------------------------------------------------------------
# Evaluation: whole episodes on a pool of its own.


def run_episodes(envs, policy, params, key, stop=None, record=None):
    """One episode in each env of a synchronous pool (batch = all envs), with `policy` from
    make_policy_fn. Returns (raw returns [N] float64, lengths [N] int64 in env steps, key), in
    env-id order. `record(running)` is called after the reset and after every step (video);
    `stop` is checked every step.

    Raises:
      Stopped: `stop` was set.
    """
    num_envs = envs.config["num_envs"]
    returns, lengths, running = np.zeros(num_envs), np.zeros(num_envs, np.int64), np.ones(num_envs, bool)
    obs, _ = envs.reset()
    if record:
        record(running)
    while running.any():
        if stop is not None and stop.is_set():
            raise Stopped
        action, env_action, _, _, key = policy(params, obs, key)
        obs, reward, terminated, truncated, _ = envs.step(np.asarray(action if env_action is None else env_action))
        returns += np.where(running, reward, 0.0)
        lengths += running
        if record:
            record(running)  # the frame of this step, the last one included
        running &= ~(terminated | truncated)
    return returns, lengths, key


class Evaluator:
    """--eval-episodes whole episodes (Atari: whole games, no life-loss episodes) with the
    training protocol's env settings on a pool of its own (one EnvPool thread), one per env,
    actions sampled from the policy (its mode with --eval-greedy). Returns eval/* metrics: raw
    episodic return mean and std, mean length in env steps, seconds taken. `close()` closes
    the pool."""

    def __init__(self, args: Args, agent: Agent, spec, seed: int):
        self.envs = make_envs(dataclasses.replace(args, episodic_life=False), args.eval_episodes, args.eval_episodes,
                              seed, num_threads=1)
        self.policy = make_policy_fn(agent, spec.action_space, greedy=args.eval_greedy)
        self.seed, self.key = seed, jax.random.PRNGKey(seed)

    def __call__(self, params, stop) -> dict[str, float]:
        start = time.perf_counter()
        returns, lengths, self.key = run_episodes(self.envs, self.policy, params, self.key, stop)
        return {"eval/episodic_return_mean": float(returns.mean()), "eval/episodic_return_std": float(returns.std()),
                "eval/episodic_length_mean": float(lengths.mean()), "eval/time_s": time.perf_counter() - start}

    def close(self):
        self.envs.close()


def run_evaluator(run: Run, evaluator: Evaluator, device: jax.Device, stop):
    """Eval thread: each time the learner publishes a multiple of --eval-interval (before the
    last update, which the final evaluation covers), evaluate the newest params on `device`
    and queue the metrics, with the version evaluated, for the learner to log."""
    interval = run.args.eval_interval
    version = run.start_update
    try:
        while (wanted := (version // interval + 1) * interval) < run.setup.num_updates:
            # No deadline: stalls are the actors' and the learner's to detect; `stop` ends the wait.
            version, params = run.params_slot.wait(wanted, stop, float("inf"), "evaluator")
            metrics = evaluator(params[device], stop) | {"eval/params_version": float(version)}
            timed_put(run.eval_results, metrics, stop, run.args.stall_timeout_s, "evaluator")
    finally:
        evaluator.close()


# ---------------------------------------------------------------------------
# Learner: one compiled SPMD update over the learner mesh.


class Placement:
    """Every device placement of the script: actor devices, the learner mesh (the learner
    devices of every process) and its shardings."""

    def __init__(self, actor_devices: list[jax.Device], learner_devices: list[jax.Device]):
        self.actor_devices = actor_devices
        self.mesh = Mesh(np.array(learner_devices), ("learner",))
        self.replicated = NamedSharding(self.mesh, P())
        self.env_sharded = NamedSharding(self.mesh, P(None, "learner"))  # [T, envs, ...]: env axis split
        self.num_local_learners = sum(d.process_index == jax.process_index() for d in learner_devices)

    def to_actors(self, params) -> dict[jax.Device, Any]:
        """One copy of the (replicated) learner `params` on each of this process's actor devices."""
        local = jax.tree.map(lambda x: x.addressable_data(0), params)
        return {d: jax.device_put(local, d) for d in self.actor_devices}

    def replicate(self, tree):
        """Host values, the same on every process -> arrays replicated over the learner mesh."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)), tree)

    def to_learners(self, rollouts: list[Rollout]) -> Rollout:
        """Concatenate this process's per-thread host rollouts [T+1, N] into its [T+1, K*N]
        part of the global batch [T+1, processes*K*N], ordered so each local learner
        device's contiguous env slice holds an equal part of every thread's envs."""
        num_learners = self.num_local_learners

        def interleave(*xs):  # K x [T+1, N, ...] -> [T+1, K*N, ...] in one copy (frames are most of the bytes)
            (t, n), rest, k = xs[0].shape[:2], xs[0].shape[2:], len(xs)
            local = np.empty((t, k * n) + rest, xs[0].dtype)
            per_learner = local.reshape((t, num_learners, k, n // num_learners) + rest)
            for i, x in enumerate(xs):
                per_learner[:, :, i] = x.reshape((t, num_learners, n // num_learners) + rest)
            global_shape = (t, k * n * jax.process_count()) + rest
            return jax.make_array_from_process_local_data(self.env_sharded, local, global_shape)

        return Rollout(*[interleave(*fields) for fields in zip(*rollouts)])


def host(x) -> np.ndarray:
    """The value of an array replicated over the learner mesh, on the host (any process)."""
    return np.asarray(x.addressable_data(0))


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
    return Minibatch(rollout.obs[:-1], rollout.actions[:-1], rollout.logprobs[:-1], advantages, returns,
                     mask.astype(jnp.float32))


class LearnerState(TrainState):
    """TrainState (params, optimiser state, step) and the running statistics of --norm-obs
    (obs_moments, of the obs shape; scalar when off) and --norm-reward (return_moments)."""

    obs_moments: RunningMoments
    return_moments: RunningMoments


def make_normalizer_update(args: Args, mesh: Mesh):
    """jit(shard_map): (obs_moments, return_moments, Rollout sharded on the env axis) -> both
    updated with the rollout's new rows 1..T (observations; discounted returns) where
    --norm-obs / --norm-reward are on; the identity when both are off."""
    norm_obs, norm_reward = normalization(args)

    def refresh(obs_moments: RunningMoments, return_moments: RunningMoments, rollout: Rollout):
        return (obs_moments.update(rollout.obs[1:], "learner") if norm_obs else obs_moments,
                return_moments.update(rollout.discounted_returns[1:], "learner") if norm_reward else return_moments)

    if not (norm_obs or norm_reward):
        return lambda obs_moments, return_moments, _: (obs_moments, return_moments)
    return jax.jit(jax.shard_map(refresh, mesh=mesh, in_specs=(P(), P(), P(None, "learner")), out_specs=P()))


def make_train_state(args: Args, setup: Setup, params, placement: Placement):
    """The learner's LearnerState (Adam after global-norm clipping, fresh statistics) replicated over
    the learner mesh, and its learning-rate schedule (linear to 0 over every minibatch step with --anneal-lr)."""
    lr_schedule = optax.linear_schedule(args.learning_rate, 0.0 if args.anneal_lr else args.learning_rate,
                                        setup.num_updates * args.update_epochs * args.num_minibatches)
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adam(lr_schedule, eps=1e-5))
    obs_shape = make_agent(args)[1].observation_space.shape if normalization(args)[0] else ()
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

    First the --norm-obs / --norm-reward statistics take in the rollout (the update then
    normalises with them; actors receive them with the params). Then compiled
    `jit(shard_map(...))` pieces: `prepare` (GAE on each device's env slice, rewards scaled
    with --norm-reward; the frames are not copied), `shuffle` (one permutation of transition
    indices per epoch and device), `gradient` (one microbatch's gradient, its frames gathered
    from the rollout, `lax.pmean` over devices, added to the minibatch's running mean) and
    `step` (the minibatch's last microbatch, then one Adam step). Python drives update_epochs x
    num_minibatches x gradient_accumulation_steps programs; dispatch is asynchronous, so the
    device runs them back to back. One program per microbatch, so that only one microbatch's
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
    n_mb, n_acc, env_axis = args.num_minibatches, args.gradient_accumulation_steps, P(None, "learner")
    norm_reward = normalization(args)[1]
    refresh_normalizers = make_normalizer_update(args, mesh)

    def prepare(return_moments: RunningMoments, rollout: Rollout) -> Minibatch:  # per device: [T+1, n] -> [T * n]
        transitions = prepare_transitions(rollout, args.gamma, args.gae_lambda, return_moments if norm_reward else None)
        # Observations stay in the rollout (no copy of the frames): `step` gathers its rows.
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), transitions._replace(obs=None))

    def shuffle(data: Minibatch, key):  # per device: [T * n] -> [n_mb, T * n / n_mb] int32 transition indices
        key = jax.random.fold_in(key, jax.lax.axis_index("learner"))
        return jax.random.permutation(key, data.actions.shape[0]).reshape((n_mb, -1))

    def add_gradient(state: LearnerState, grads, obs, data: Minibatch, perm, index, micro):
        """`grads` plus one microbatch's gradient (averaged over devices, / n_acc), and its metrics."""
        rows = perm[index].reshape((n_acc, -1))[micro]
        # Rows 0..T-1 of the rollout's [T+1, n, ...] observations are transitions 0..T*n-1 when flattened.
        part = jax.tree.map(lambda x: x[rows], data)._replace(obs=obs.reshape((-1,) + obs.shape[2:])[rows])
        # Params are replicated (invariant over "learner"); the gradient of an invariant input
        # would come back already summed over devices. Casting to varying keeps it local, so
        # the pmean below averages it.
        params = jax.lax.pcast(state.params, "learner", to="varying")
        (_, metrics), g = jax.value_and_grad(ppo_loss, has_aux=True)(
            params, lambda p, obs: agent.apply(p, obs, state.obs_moments), part, args.clip_coef, args.ent_coef,
            args.vf_coef, args.norm_adv)
        grads = jax.tree.map(lambda acc, g: acc + g / n_acc, grads, jax.lax.pmean(g, "learner"))
        return grads, jax.tree.map(lambda m: jax.lax.pmean(m, "learner"), metrics)

    def step(state: LearnerState, grads, obs, data: Minibatch, perm, index, micro):
        """The minibatch's last microbatch, then one Adam step; zeros to accumulate the next one in."""
        grads, metrics = add_gradient(state, grads, obs, data, perm, index, micro)
        return state.apply_gradients(grads=grads), jax.tree.map(jnp.zeros_like, grads), metrics

    def zeros(params):
        return jax.tree.map(jnp.zeros_like, params)

    prepare = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=(P(), env_axis), out_specs=P("learner")))
    shuffle = jax.jit(jax.shard_map(shuffle, mesh=mesh, in_specs=(P("learner"), P()), out_specs=env_axis))
    in_specs = (P(), P(), env_axis, P("learner"), env_axis, P(), P())
    gradient = jax.jit(jax.shard_map(add_gradient, mesh=mesh, in_specs=in_specs, out_specs=(P(), P())))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P(), P(), P())))
    zeros = jax.jit(jax.shard_map(zeros, mesh=mesh, in_specs=P(), out_specs=P()))
    # Minibatch and microbatch indices as arrays on the mesh: a multi-process jit takes no host values.
    index = [jax.make_array_from_process_local_data(NamedSharding(mesh, P()), np.int32(i))
             for i in range(max(n_mb, n_acc))]

    def update(state: LearnerState, rollout: Rollout, key):
        obs_moments, return_moments = refresh_normalizers(state.obs_moments, state.return_moments, rollout)
        state = state.replace(obs_moments=obs_moments, return_moments=return_moments)
        data = prepare(return_moments, rollout)
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
        return state, jax.tree.map(lambda *m: jnp.mean(jnp.stack(m)), *metrics)

    update.programs = {"prepare": prepare, "shuffle": shuffle, "gradient": gradient, "step": step}  # for inspection
    return update


# ---------------------------------------------------------------------------
# Logging and checkpoints.


class Logger:
    """Console-free metric sink: TensorBoard events in the run directory, mirrored to W&B
    with --track (the same W&B run id is reused on resume). Called from the learner thread;
    a no-op on every process but process 0."""

    def __init__(self, args: Args, setup: Setup, run_dir: Path, wandb_id: str | None):
        self.writer = self.wandb = None
        if setup.process_id:  # process 0 alone writes logs
            return
        self.writer = SummaryWriter(str(run_dir))
        if args.track:
            self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=setup.run_name,
                                    id=wandb_id, resume="allow", dir=str(run_dir),
                                    config=dict(dataclasses.asdict(args), **dataclasses.asdict(setup)))

    def log(self, metrics: dict[str, float], step: int):
        if self.writer is None:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


# Flags that may differ between a run and its resumption; every other flag must match
# (--norm-obs and --norm-reward by their resolved values).
RESUMABLE_FLAGS = {"track", "wandb_project_name", "wandb_entity", "log_frequency", "num_env_threads",
                   "stall_timeout_s", "checkpoint_interval", "total_timesteps", "eval_interval", "eval_episodes",
                   "eval_greedy", "norm_obs", "norm_reward"}
EVAL_SEED_OFFSET = 1_000_003  # evaluation pools: an env seed range of their own, far from the training pools'.


def read_resume_meta(directory: Path, args: Args, num_processes: int = 1) -> dict | None:
    """Metadata of the newest checkpoint in `directory`, or None for a new run.

    Raises:
      ConfigError: the checkpoint is unreadable or was written with other flags.
    """
    if not directory.exists():
        return None
    manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(create=False))
    update = manager.latest_step()
    if update is None:
        return None
    try:
        meta = manager.restore(update, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is the same error to the user
        raise ConfigError(f"cannot read checkpoint {directory}/{update} ({type(error).__name__}); "
                          "delete it or use a new --run-name") from error
    finally:
        manager.close()
    saved = meta["args"]
    now = json.loads(json.dumps(dataclasses.asdict(args)))
    # A deterministic run restarts its envs at every checkpoint interval: the interval is part of the run.
    resumable = RESUMABLE_FLAGS - {"checkpoint_interval"} if args.deterministic else RESUMABLE_FLAGS
    differ = [f"--{k.replace('_', '-')} {saved[k]} (now {v})" for k, v in now.items()
              if k not in resumable and k in saved and v != saved[k]]
    was = normalization(Args(env_id=args.env_id, norm_obs=saved.get("norm_obs"), norm_reward=saved.get("norm_reward")))
    differ += [f"--{flag} {old} (now {new})" for flag, old, new in zip(("norm-obs", "norm-reward"), was,
                                                                       normalization(args)) if old != new]
    if meta.get("num_processes", 1) != num_processes:  # the global batch would change
        differ.append(f"{meta.get('num_processes', 1)} process(es) (now {num_processes})")
    if differ:
        raise ConfigError(f"checkpoint {directory}/{update} was written with " + ", ".join(differ) +
                          "; resume with the same flags or use a new --run-name")
    return meta


class Checkpointer:
    """orbax checkpoints in runs/<run>/checkpoints/<update>: the LearnerState (params, optimizer
    state, step, normalisation statistics) and JSON metadata (update and env-step counters, learner PRNG key, recent
    episodes, W&B run id, the flags). orbax writes to a temporary directory and renames it
    when complete, so a checkpoint half-written when the process died is never loaded. The
    newest 3 are kept."""

    def __init__(self, directory: Path):
        self.manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=3))

    def save(self, update: int, state: LearnerState, meta: dict):
        self.manager.save(update, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)), force=True)

    def restore_state(self, update: int, like: LearnerState) -> LearnerState:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return self.manager.restore(update, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


# ---------------------------------------------------------------------------
# Learner thread, supervisor and main.


class AnyEvent:
    """is_set() when any of the events is set."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


@dataclass
class Run:
    """What the threads of one run share."""

    args: Args
    setup: Setup
    placement: Placement
    params_slot: ParamsSlot
    queues: list[queue.Queue]
    stop: threading.Event  # set when the run ends or fails: every thread returns
    preempt: threading.Event  # set by SIGINT/SIGTERM/SIGUSR1: the learner checkpoints and the run ends
    logger: Logger
    checkpointer: Checkpointer
    start_update: int
    wandb_id: str | None
    summary: dict
    eval_results: queue.Queue  # eval thread -> learner: eval/* metrics to log
    make_evaluator: Any  # () -> Evaluator for the final evaluation; None: no final evaluation on this process
    signum: int = 0  # the first stop signal this process received


def run_learner(run: Run, state: LearnerState, update_fn, lr_schedule, key, episodes: collections.deque):
    """Consume one rollout per actor thread (fixed order) per update; publish params after each;
    checkpoint every --checkpoint-interval updates, at the end, and when preempted; log the eval
    thread's results; after the last update, the final evaluation (into the summary).

    Logs every --log-frequency updates (means over the window unless the name says min/max);
    see the script's page in docs/ for every metric. `episodes` holds (raw return, length) of the
    last 20 finished games.
    """
    args, setup, placement, queues, logger, summary = run.args, run.setup, run.placement, run.queues, run.logger, run.summary
    window: dict[str, list[float]] = collections.defaultdict(list)
    timer = Timer()
    start_time = cpu_start_wall = time.time()
    cpu_start = sum(os.times()[:2])
    # One process alone must not leave the update loop (the others would wait in a collective):
    # with several processes a stop signal is acted on only where every process agrees on it.
    interrupted = AnyEvent(run.stop, run.preempt) if setup.num_processes == 1 else run.stop
    stopped_by = 0

    def checkpoint(updates_done: int):  # every process takes part; orbax writes each array once
        if run.checkpointer.manager.latest_step() == updates_done:
            return
        meta = dict(update=updates_done, global_step=updates_done * setup.batch_size, wandb_id=run.wandb_id,
                    learner_key=host(jax.random.key_data(key)).tolist(), episodes=list(episodes),
                    num_processes=setup.num_processes, args=dataclasses.asdict(args))
        run.checkpointer.save(updates_done, state, meta)
        summary.update(checkpoint=str(run.checkpointer.manager.directory / str(updates_done)))

    def update_summary(updates_done: int):
        summary.update(global_step=updates_done * setup.batch_size, updates=updates_done,
                       episodic_return_mean=float(np.mean([r for r, _ in episodes])) if episodes else None,
                       episodic_length_mean=float(np.mean([n for _, n in episodes])) if episodes else None)

    def log_eval(metrics: dict[str, float], global_step: int, final: bool = False):
        version = int(metrics["eval/params_version"])
        logger.log(metrics | {"eval/global_step": version * setup.batch_size}, global_step)
        print(f"{'final eval' if final else 'eval'} at update {version} ({'greedy' if args.eval_greedy else 'sampled'} "
              f"actions): return {metrics['eval/episodic_return_mean']:.1f} ± "
              f"{metrics['eval/episodic_return_std']:.1f}, length {metrics['eval/episodic_length_mean']:.1f} "
              f"({args.eval_episodes} episodes, {metrics['eval/time_s']:.1f}s)", flush=True)

    update_summary(run.start_update)
    for update in range(run.start_update, setup.num_updates):
        stopped_by = run.signum if setup.num_processes == 1 else int(process_allgather(np.int32(run.signum)).max())
        if stopped_by:
            if not run.signum and not setup.process_id:
                print(f"{signal.Signals(stopped_by).name} on another process: checkpointing and stopping", flush=True)
            break
        try:
            with timer("rollout_queue_get_time_s"):
                items = [timed_get(q, interrupted, args.stall_timeout_s, f"learner (from actor thread {i})")
                         for i, q in enumerate(queues)]
        except Stopped:
            if run.preempt.is_set():
                stopped_by = run.signum
                break
            raise
        with timer("transfer_time_s"):
            batch = jax.block_until_ready(placement.to_learners([it[0] for it in items]))
        lag = update - np.concatenate([rollout.versions[:-1].ravel() for rollout, *_ in items])
        items = [item[1:] for item in items]  # the host rollouts are on the learner now: free their frames
        key, update_key = jax.random.split(key)
        with timer("update_time_s"):
            state, metrics = update_fn(state, batch, update_key)
            metrics = jax.tree.map(host, metrics)
        del batch  # before the next rollouts arrive
        run.params_slot.publish(update + 1, placement.to_actors((state.params, state.obs_moments)))
        while not run.eval_results.empty():
            log_eval(run.eval_results.get_nowait(), (update + 1) * setup.batch_size)

        window["policy_lag/min"].append(lag.min())
        window["policy_lag/mean"].append(lag.mean())
        window["policy_lag/max"].append(lag.max())
        for returns, lengths, stats in items:
            episodes.extend(zip(returns, lengths))
            for k, v in stats.items():
                window[f"actor/{k}"].append(v)
        for k, v in timer.pop().items():
            window[f"learner/{k}"].append(v)
        for k, v in metrics.items():
            window[f"losses/{k}"].append(v)
        global_step = (update + 1) * setup.batch_size
        if args.checkpoint_interval and (update + 1) % args.checkpoint_interval == 0:
            checkpoint(update + 1)
        update_summary(update + 1)
        if (update + 1) % args.log_frequency and update + 1 < setup.num_updates:
            continue

        now, cpu_now = time.time(), sum(os.times()[:2])
        steps_this_session = global_step - run.start_update * setup.batch_size
        record = {k: float(np.mean(v)) for k, v in window.items()}
        record["policy_lag/min"], record["policy_lag/max"] = min(window["policy_lag/min"]), max(window["policy_lag/max"])
        learner_time = record["learner/transfer_time_s"] + record["learner/update_time_s"]
        record |= {"charts/sps": steps_this_session / (now - start_time),
                   "charts/actor_sps": record.pop("actor/actor_sps") * setup.num_actor_threads_total,
                   "charts/learner_sps": setup.batch_size / max(learner_time, 1e-9),
                   "charts/learning_rate": float(lr_schedule(state.step)),
                   "charts/updates": update + 1,
                   "charts/rollout_queue_size": float(np.mean([q.qsize() for q in queues])),
                   "charts/cpu_utilization": (cpu_now - cpu_start) / ((now - cpu_start_wall) * (os.cpu_count() or 1))}
        if episodes:
            record["charts/episodic_return"] = summary["episodic_return_mean"]
            record["charts/episodic_length"] = summary["episodic_length_mean"]
        window.clear()
        cpu_start, cpu_start_wall = cpu_now, now
        logger.log(record, global_step)
        if setup.process_id:
            continue
        eta = (now - start_time) / (update + 1 - run.start_update) * (setup.num_updates - update - 1)
        ret = f"{summary['episodic_return_mean']:8.1f}" if episodes else "     n/a"
        print(f"step {global_step:>10d} | update {update + 1}/{setup.num_updates} | sps {record['charts/sps']:7.0f} "
              f"| return {ret} | policy lag {record['policy_lag/mean']:.2f} (max {record['policy_lag/max']:.0f}) "
              f"| eta {eta:5.0f}s", flush=True)
    if stopped_by:
        summary["interrupted_by"] = signal.Signals(stopped_by).name
    if stopped_by and args.deterministic:
        # EnvPool cannot save env state, so only a periodic checkpoint (where the envs restart)
        # resumes into the same run; the updates since it are redone, identically.
        latest = run.checkpointer.manager.latest_step()
        if not setup.process_id:
            print(f"--deterministic: no checkpoint at update {summary['updates']}; the same command resumes from "
                  f"{f'update {latest}' if latest is not None else 'the start'} and redoes the updates after it exactly")
        summary["checkpoint"] = str(run.checkpointer.manager.directory / str(latest)) if latest is not None else None
    else:
        checkpoint(summary["updates"])
    if not stopped_by and run.make_evaluator is not None and summary["updates"] == setup.num_updates:
        params = placement.to_actors((state.params, state.obs_moments))[placement.actor_devices[0]]
        start, evaluator = time.perf_counter(), run.make_evaluator()
        try:
            metrics = evaluator(params, interrupted) | {"eval/params_version": float(setup.num_updates)}
            metrics["eval/time_s"] = time.perf_counter() - start  # with making the pool and compiling the policy
            log_eval(metrics, summary["global_step"], final=True)
            summary["final_eval"] = {k.removeprefix("eval/"): v for k, v in metrics.items()} | {
                "params_version": setup.num_updates, "seed": evaluator.seed, "greedy": args.eval_greedy}
        except Stopped:  # a stop signal during the final evaluation: training is done and saved
            if not run.signum:
                raise
            summary["interrupted_by"] = signal.Signals(run.signum).name
        finally:
            evaluator.close()
    leaves = [host(x) for x in jax.tree.leaves(state.params)]
    summary["params_sha256"] = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in leaves)).hexdigest()


def main(args: Args) -> dict:
    """Train, or resume the run named --run-name from its newest checkpoint.

    Returns the summary written to runs/<run_name>/summary.json; `summary["interrupted_by"]`
    names the signal when SIGINT/SIGTERM/SIGUSR1 stopped the run after a checkpoint.

    Raises:
      ConfigError: before any thread or device work, for a configuration that cannot work
        (including an unreadable or mismatched checkpoint).
      RunFailed: a thread failed (its traceback is printed first) or stalled.
    """
    cluster = detect_cluster(args)
    setup = resolve(args, cluster)
    lead = setup.process_id == 0  # process 0 alone writes the run directory, logs and the console
    run_dir = Path("runs") / setup.run_name
    actor_devices, learner_devices = setup_devices(args, cluster)  # first: orbax starts the JAX backend
    meta = read_resume_meta(run_dir / "checkpoints", args, setup.num_processes)
    if setup.num_processes > 1:  # every process has looked for a checkpoint before any creates the directory
        sync_global_devices("sebulba: checked for a checkpoint")
    if meta is not None and meta["update"] >= setup.num_updates:
        if lead:
            print(f"{run_dir} already finished at update {meta['update']} (global step {meta['global_step']}); "
                  "raise --total-timesteps to train it further")
        summary_file = run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {"global_step": meta["global_step"]}
        if lead and args.eval_episodes and "final_eval" not in summary:
            print(f"it has no final evaluation (stopped during it?): python scripts/evaluate.py {run_dir} --episodes "
                  f"{args.eval_episodes} --seed {args.seed + EVAL_SEED_OFFSET}{' --greedy' * args.eval_greedy}")
        return summary
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(run_dir / "checkpoints")
    if lead and args.deterministic and not args.checkpoint_interval:
        print("warning: --deterministic with --checkpoint-interval 0: a stop signal leaves nothing to resume from")
    if lead:
        (run_dir / "config.json").write_text(json.dumps({"args": dataclasses.asdict(args),
                                                         "derived": dataclasses.asdict(setup)}, indent=2))
        per_process = setup.num_actor_threads_total * args.local_num_envs
        print(f"run {setup.run_name}{', deterministic' * args.deterministic}: {setup.num_processes} process(es) x "
              f"{len(actor_devices)} actor device(s) x {args.num_actor_threads} thread(s) x {args.local_num_envs} envs "
              f"(recv batch {setup.async_batch_size}) = {setup.num_envs_total} envs; {len(learner_devices)} learner "
              f"device(s) x {setup.envs_per_learner} envs; env steps per update: {args.num_steps * args.local_num_envs} "
              f"per thread, {args.num_steps * per_process} per process, {setup.batch_size} in all; "
              f"{setup.num_updates} updates" + "; observation normalisation" * setup.norm_obs
              + "; reward scaling" * setup.norm_reward)

    atari = is_atari(args.env_id)
    agent, spec = make_agent(args)
    obs_space, action_space = spec.observation_space, spec.action_space
    key = jax.random.PRNGKey(args.seed)
    key, init_key, learner_key, actor_root = jax.random.split(key, 4)
    placement = Placement(actor_devices, learner_devices)
    params = init_params(agent, spec, init_key)
    state, lr_schedule = make_train_state(args, setup, params, placement)
    start_update, wandb_id, episodes = 0, uuid.uuid4().hex[:12] if args.track else None, []
    if meta is not None:
        start_update, wandb_id, episodes = meta["update"], meta["wandb_id"] or wandb_id, meta["episodes"]
        state = checkpointer.restore_state(start_update, state)
        learner_key = np.asarray(meta["learner_key"], dtype=np.uint32)
        if lead:
            print(f"resumed from {checkpointer.manager.directory}/{start_update}: update {start_update}, "
                  f"global step {meta['global_step']}")
    learner_key = placement.replicate(learner_key)
    update_fn = make_update_fn(args, agent, placement.mesh)
    policy = make_policy_fn(agent, action_space)
    eval_seed = args.seed + EVAL_SEED_OFFSET

    run = Run(args, setup, placement, ParamsSlot(keep=args.max_policy_lag + 2 if args.deterministic else 1),
              [queue.Queue(maxsize=1) for _ in range(setup.num_actor_threads_total)], threading.Event(),
              threading.Event(), Logger(args, setup, run_dir, wandb_id), checkpointer, start_update, wandb_id, {},
              queue.Queue(maxsize=4),
              (lambda: Evaluator(args, agent, spec, eval_seed)) if lead and args.eval_episodes else None)
    run.params_slot.publish(start_update, placement.to_actors((state.params, state.obs_moments)))
    errors: list[tuple[str, BaseException]] = []

    def supervised(name, fn, *fn_args):
        def body():
            try:
                fn(*fn_args)
            except Stopped:
                pass
            except BaseException as e:  # noqa: BLE001 - every failure ends the run
                errors.append((name, e))
                traceback.print_exc()
                run.stop.set()
        return threading.Thread(target=body, name=name, daemon=True)

    # With several processes, actors stop only when the learners have agreed to stop (run.stop).
    actors_stop = AnyEvent(run.stop, run.preempt) if setup.num_processes == 1 else run.stop

    def actor(thread_index: int, device):
        # Distinct env seeds and action keys per thread of every process, fresh ones for every pool.
        global_index = setup.process_id * setup.num_actor_threads_total + thread_index
        for begin, end in env_segments(start_update, setup.num_updates, args):
            seed = args.seed + (global_index + begin * setup.num_envs_total // args.local_num_envs) * args.local_num_envs
            envs = make_envs(args, args.local_num_envs, setup.async_batch_size, seed, setup.num_env_threads)
            assembler = RolloutAssembler(args.local_num_envs, args.num_steps, obs_space.shape,
                                         np.float32 if obs_space.dtype == np.float64 else obs_space.dtype,
                                         clip_rewards=atari, episodic_life=args.episodic_life, first_rollout=begin,
                                         action_shape=action_space.shape, gamma=args.gamma,
                                         action_dtype=np.float32 if agent.continuous else np.int32)
            try:
                run_actor(envs, policy, device, jax.random.fold_in(jax.random.fold_in(actor_root, global_index), begin),
                          run.params_slot, run.queues[thread_index], assembler, end, args,
                          setup.async_batch_size, actors_stop, f"actor thread {thread_index}")
            finally:
                envs.close()

    received: list[tuple[int, float]] = []  # (signal, time)

    def on_signal(signum, _frame):
        # A second SIGINT exits at once; one within a second of the first is the same Ctrl-C
        # delivered twice (to the process and to its group, as `timeout -s INT` does).
        if received and signum == signal.SIGINT and time.monotonic() - received[0][1] > 1.0:
            print("second Ctrl-C: exiting now without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        if received:
            return
        received.append((signum, time.monotonic()))
        hint = " (Ctrl-C again exits at once)" if signum == signal.SIGINT else ""
        doing = "stopping (--deterministic: no new checkpoint)" if args.deterministic else "checkpointing and stopping"
        print(f"{signal.Signals(signum).name}: {doing}{hint}", flush=True)
        run.signum = signum
        run.preempt.set()

    stop_signals = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in stop_signals}
    start_time = time.time()
    threads = [supervised(f"actor-{d.id}-{k}", actor, i, d)
               for i, (d, k) in enumerate((d, k) for d in actor_devices for k in range(args.num_actor_threads))]
    threads.append(supervised("learner", run_learner, run, state, update_fn, lr_schedule, learner_key,
                              collections.deque(map(tuple, episodes), maxlen=20)))
    if lead and args.eval_interval:
        threads.insert(0, supervised("evaluator", run_evaluator, run, Evaluator(args, agent, spec, eval_seed),
                                     actor_devices[0], actors_stop))
    try:
        for t in threads:
            t.start()
        while threads[-1].is_alive() and not run.stop.is_set():
            threads[-1].join(0.2)
    finally:
        run.stop.set()
        deadline = time.monotonic() + 10  # threads poll the stop event every 0.1 s; one stuck in native code is left
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        for s, handler in previous.items():
            signal.signal(s, handler)
        run.logger.close()
        checkpointer.close()
    if errors:
        name, error = errors[0]
        others = f" (process {setup.process_id} of {setup.num_processes}: if this is a failed collective, another " \
                 "process ended first; its output has the cause)" if setup.num_processes > 1 else ""
        raise RunFailed(f"{name} failed: {error!r}{others}") from error
    summary = run.summary
    elapsed = time.time() - start_time - summary.get("final_eval", {}).get("time_s", 0.0)  # training alone
    summary.update(elapsed_s=elapsed, sps=(summary["global_step"] - start_update * setup.batch_size) / elapsed,
                   run_dir=str(run_dir))
    if lead:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        status = f"stopped by {summary['interrupted_by']}" if "interrupted_by" in summary else "done"
        ret = summary["episodic_return_mean"]
        print(f"{status}: {summary['global_step']} env steps, {elapsed:.1f}s this session ({summary['sps']:.0f} SPS), "
              f"episodic return {'n/a (no game finished)' if ret is None else f'{ret:.1f}'}; "
              f"checkpoint {summary.get('checkpoint')}")
    return summary


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (docs/reliability.md):
    0 finished, 1 a thread failed or stalled, 2 bad configuration, 128 + signal number when
    SIGINT (130), SIGTERM (143) or SIGUSR1 (138) stopped the run after a checkpoint."""
    args = tyro.cli(Args, args=argv)
    # EnvPool's specs build gymnasium Boxes from float64 bounds; the cast warning is noise.
    warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32", category=UserWarning)
    try:
        summary = main(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:  # the original traceback was printed by its thread
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # a thread stuck inside a native call (EnvPool, XLA) must not keep the process alive
    return 128 + getattr(signal, summary["interrupted_by"]) if "interrupted_by" in summary else 0


if __name__ == "__main__":
    sys.exit(cli())
