"""What every learner shares besides its loss: the learner state (`LearnerState`: params,
optimiser state, normalisation statistics), the update of those statistics on the mesh, and
`Bookkeeping`, what the learner thread records around its updates: the metric windows and the
console line, the eval thread's results, periodic and final checkpoints, the run's summary,
and the final evaluation.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import signal
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
import psutil
from flax.training.train_state import TrainState
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sebulba.config import ConfigError
from sebulba.devices import host
from sebulba.networks import RunningMoments
from sebulba.rollouts import Rollout
from sebulba.threads import Stopped

if TYPE_CHECKING:
    from sebulba.runtime import Run


class LearnerState(TrainState):
    """TrainState (params, optimiser state, step) and the running statistics of --norm-obs
    (obs_moments, of the obs shape; scalar when off) and --norm-reward (return_moments)."""

    obs_moments: RunningMoments
    return_moments: RunningMoments


def make_normalizer_update(norm_obs: bool, norm_reward: bool, mesh: Mesh):
    """jit(shard_map): (obs_moments, return_moments, Rollout sharded on the env axis) -> both
    updated with the rollout's new rows 1..T (observations; discounted returns) where
    `norm_obs` / `norm_reward` (--norm-obs / --norm-reward, resolved) are on; the identity when
    both are off."""

    def refresh(obs_moments: RunningMoments, return_moments: RunningMoments, rollout: Rollout):
        return (obs_moments.update(rollout.obs[1:], "learner") if norm_obs else obs_moments,
                return_moments.update(rollout.discounted_returns[1:], "learner") if norm_reward else return_moments)

    if not (norm_obs or norm_reward):
        return lambda obs_moments, return_moments, _: (obs_moments, return_moments)
    return jax.jit(jax.shard_map(refresh, mesh=mesh, in_specs=(P(), P(), P(None, "learner")), out_specs=P()))


# A run may use this share of the memory free where its learner runs; XLA's allocator, the env
# pools and the transfers need the rest (a default-size Breakout run on a 23 GiB host outgrew 90 %).
MEMORY_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class LearnerMemory:
    """Bytes the learner's largest program needs against the bytes free where it runs.

    `working` and `arguments`: XLA's temporary bytes and the program's arguments, per learner
    device. `devices`: the learner devices that share `free` (the CPU's virtual devices share
    the host's memory; an accelerator counts its own). `host_rollouts`: on the CPU, the rollouts
    the actors hold on the host too (0 on an accelerator). `free`: None when the device does not
    say.
    """

    working: int
    arguments: int
    devices: int
    host_rollouts: int
    free: int | None
    where: str

    @property
    def per_device(self) -> int:
        return self.working + self.arguments

    @property
    def total(self) -> int:
        return self.per_device * self.devices + self.host_rollouts

    @property
    def allowed(self) -> float:
        return MEMORY_SHARE * self.free if self.free is not None else float("inf")

    @property
    def fits(self) -> bool:
        return self.total <= self.allowed

    def describe(self) -> str:
        """What is needed, of what, against what a run may use and why (when it does not fit)."""
        parts = f"{gib(self.per_device)} per learner device for its gradient program"
        if self.devices > 1 or self.host_rollouts:
            parts = (f"{gib(self.per_device)} for the gradient program on each of {self.devices} learner device(s)"
                     + (f", {gib(self.host_rollouts)} of rollouts on the host" if self.host_rollouts else ""))
        return (f"the learner needs {gib(self.total)} ({parts}), more than the {gib(self.allowed)} a run may use: "
                f"{MEMORY_SHARE * 100:.0f} % of the {gib(self.free)} {self.where} has free (the rest is for XLA's "
                "allocator, the env pools and the transfers)")

    def refusal(self, remedy: str) -> str:
        """One line: `describe`, then `remedy`."""
        return f"{self.describe()}; {remedy}"


def gib(nbytes: float) -> str:
    """'20.3 GiB'."""
    return f"{nbytes / 2**30:.1f} GiB"


def learner_memory(compiled, placement, rollout: Rollout, host_env_rollouts: int) -> LearnerMemory:
    """What the learner's largest program needs and what is free for it, before any thread starts.

    `compiled` is that program, compiled ahead of time for `rollout` (the global batch as
    ShapeDtypeStructs). On the CPU backend the virtual devices share the host's available memory
    (psutil), which must also hold the rollouts the actors keep on the host (`host_env_rollouts`
    envs' worth: the ones being filled and queued); on an accelerator each device's free bytes
    (`memory_stats`). Compiling the program costs seconds for a conv net on the CPU; the run's
    own call then reads it from the compilation cache.
    """
    analysis = compiled.memory_analysis()
    working, arguments = analysis.temp_size_in_bytes, analysis.argument_size_in_bytes
    local = [d for d in placement.mesh.devices.flat if d.process_index == jax.process_index()]
    if local[0].platform == "cpu":
        nbytes = sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(rollout))
        per_env = nbytes / rollout.rewards.shape[1]
        return LearnerMemory(working, arguments, len(local), int(host_env_rollouts * per_env),
                             psutil.virtual_memory().available, "the host")
    stats = local[0].memory_stats() or {}
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None
    return LearnerMemory(working, arguments, 1, 0, free, str(local[0]))


def check_learner_memory(compiled, placement, rollout: Rollout, host_env_rollouts: int, shrink: str) -> int:
    """Refuse a run whose learner cannot hold its largest program, before any thread starts: it
    needs (`learner_memory`) more than MEMORY_SHARE (80 %) of what is free. Returns the bytes
    needed per learner device.

    Raises:
      ConfigError: one line with the figures, the rule and `shrink`, the script's flags that
        shrink the program (e.g. "lower --local-num-envs or --num-steps").
    """
    memory = learner_memory(compiled, placement, rollout, host_env_rollouts)
    if not memory.fits:
        raise ConfigError(memory.refusal(shrink))
    return memory.per_device


def params_sha256(params) -> str:
    """SHA-256 of every parameter's bytes, leaves in tree order: equal hashes, equal params."""
    leaves = [host(x) for x in jax.tree.leaves(params)]
    return hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in leaves)).hexdigest()


def deterministic_stop_line(done: int, latest: int | None) -> str:
    """What a --deterministic run stopped after `done` updates says about its resume, given its
    newest checkpoint `latest` (an update count; None: none)."""
    if latest == done:
        return (f"--deterministic: stopped at update {done}, which has a periodic checkpoint; the same command resumes "
                "from it exactly")
    if done == 0:
        return "--deterministic: stopped before the first update; the same command starts the run anew"
    start = "the start" if latest is None else f"update {latest}"
    return (f"--deterministic: no checkpoint at update {done}; the same command resumes from {start} and redoes updates "
            f"{(latest or 0) + 1}..{done} exactly")


class Bookkeeping:
    """The learner thread's records, kept apart from its loop. After each update (`record`):
    the eval thread's results, the metric windows, a checkpoint every --checkpoint-interval
    updates, the summary; every --log-frequency updates the metrics (means over the window
    unless the name says min/max; see docs/ppo_envpool.md for each) go to TensorBoard / W&B and
    one line to the console. At the end (`finish`): the last checkpoint, the final evaluation
    and the params hash, into the summary. `run.episodes` holds (raw return, length) of the
    last 20 finished games.
    """

    def __init__(self, run: Run, lr_schedule):
        self.run, self.lr_schedule = run, lr_schedule
        self.window: dict[str, list[float]] = collections.defaultdict(list)
        self.start_time = self.cpu_start_wall = time.time()
        self.cpu_start = sum(os.times()[:2])
        self.steady_from: tuple[float, int] | None = None  # (time, updates done) after this session's first update
        self.update_summary(run.start_update)

    def checkpoint(self, updates_done: int, state, key, extra: dict | None = None):  # every process takes part
        run = self.run
        if run.checkpointer.manager.latest_step() == updates_done:
            return
        meta = dict(update=updates_done, global_step=updates_done * run.setup.batch_size, wandb_id=run.wandb_id,
                    learner_key=host(jax.random.key_data(key)).tolist(), episodes=list(run.episodes),
                    num_processes=run.setup.num_processes, args=dataclasses.asdict(run.flags),
                    setup=dataclasses.asdict(run.setup))  # the derived sizes too (a script's choices: PPO's microbatches)
        run.checkpointer.save(updates_done, state, meta, extra)  # orbax writes each array once
        run.summary.update(checkpoint=str(run.checkpointer.manager.directory / str(updates_done)))

    def update_summary(self, updates_done: int):
        episodes = self.run.episodes
        self.run.summary.update(
            global_step=updates_done * self.run.setup.batch_size, updates=updates_done,
            episodic_return_mean=float(np.mean([r for r, _ in episodes])) if episodes else None,
            episodic_length_mean=float(np.mean([n for _, n in episodes])) if episodes else None)

    def record(self, update: int, state, key, lag, items, losses: dict[str, float], stage_times: dict[str, float],
               extra: dict | None = None):
        """After update `update` (0-based) produced `state` (learner PRNG key `key`): `lag` [N]
        policy lag of every transition trained on, `items` (episode returns, episode lengths,
        actor stats) per rollout, `losses` the update's metrics (logged as losses/<name>, or as
        they are when the name has a '/'; one ending in _total logs its newest value, not the
        window's mean), `stage_times` the learner's seconds per stage, `extra` what a checkpoint
        holds beside the state (`Checkpointer.save`)."""
        run, setup, flags, window = self.run, self.run.setup, self.run.flags, self.window
        if self.steady_from is None:  # the first update compiled: the ETA is timed from its end
            self.steady_from = (time.time(), update + 1)
        while not run.eval_results.empty():
            run.log_eval(run.eval_results.get_nowait(), (update + 1) * setup.batch_size)
        window["policy_lag/min"].append(lag.min())
        window["policy_lag/mean"].append(lag.mean())
        window["policy_lag/max"].append(lag.max())
        for returns, lengths, stats in items:
            run.episodes.extend(zip(returns, lengths))
            for k, v in stats.items():
                window[f"actor/{k}"].append(v)
        for k, v in stage_times.items():
            window[f"learner/{k}"].append(v)
        for k, v in losses.items():
            window[k if "/" in k else f"losses/{k}"].append(v)
        global_step = (update + 1) * setup.batch_size
        if flags.checkpoint_interval and (update + 1) % flags.checkpoint_interval == 0:
            self.checkpoint(update + 1, state, key, extra)
        self.update_summary(update + 1)
        if (update + 1) % flags.log_frequency and update + 1 < setup.num_updates:
            return

        now, cpu_now = time.time(), sum(os.times()[:2])
        steps_this_session = global_step - run.start_update * setup.batch_size
        record = {k: float(v[-1] if k.endswith("_total") else np.mean(v)) for k, v in window.items()}
        record["policy_lag/min"], record["policy_lag/max"] = min(window["policy_lag/min"]), max(window["policy_lag/max"])
        learner_time = record["learner/transfer_time_s"] + record["learner/update_time_s"]
        record |= {"charts/sps": steps_this_session / (now - self.start_time),
                   "charts/actor_sps": record.pop("actor/actor_sps") * setup.num_actor_threads_total,
                   "charts/learner_sps": setup.batch_size / max(learner_time, 1e-9),
                   "charts/learning_rate": float(self.lr_schedule(state.step)),
                   "charts/updates": update + 1,
                   "charts/rollout_queue_size": float(np.mean([q.qsize() for q in run.queues])),
                   "charts/cpu_utilization": (cpu_now - self.cpu_start) / ((now - self.cpu_start_wall)
                                                                           * (os.cpu_count() or 1))}
        if run.episodes:
            record["charts/episodic_return"] = run.summary["episodic_return_mean"]
            record["charts/episodic_length"] = run.summary["episodic_length_mean"]
        window.clear()
        self.cpu_start, self.cpu_start_wall = cpu_now, now
        run.logger.log(record, global_step)
        if setup.process_id:
            return
        (since, done), left = self.steady_from, setup.num_updates - update - 1  # at the pace of the steady updates
        eta = f"{left * (now - since) / (update + 1 - done):5.0f}s" if update + 1 > done else "    -"
        ret = f"{run.summary['episodic_return_mean']:8.1f}" if run.episodes else "     n/a"
        print(f"step {global_step:>10d} | update {update + 1}/{setup.num_updates} | sps {record['charts/sps']:7.0f} "
              f"| return {ret} | policy lag {record['policy_lag/mean']:.2f} (max {record['policy_lag/max']:.0f}) "
              f"| eta {eta}", flush=True)

    def finish(self, state, key, extra: dict | None = None):
        """After the learner's loop: checkpoint (with `extra`, as `record`; unless --deterministic
        was stopped between checkpoints: it says where the same command resumes), the final
        evaluation when every update is done, the params hash."""
        run, setup, summary = self.run, self.run.setup, self.run.summary
        stopped_by = run.stopped_by
        if stopped_by:
            summary["interrupted_by"] = signal.Signals(stopped_by).name
        if stopped_by and run.flags.deterministic:
            # EnvPool cannot save env state, so only a periodic checkpoint (where the envs restart)
            # resumes into the same run; the updates since it are redone, identically.
            latest, done = run.checkpointer.manager.latest_step(), summary["updates"]
            if not setup.process_id:
                print(deterministic_stop_line(done, latest))
            summary["checkpoint"] = str(run.checkpointer.manager.directory / str(latest)) if latest is not None else None
        else:
            self.checkpoint(summary["updates"], state, key, extra)
        if not stopped_by and run.make_evaluator is not None and summary["updates"] == setup.num_updates:
            self.final_evaluation((state.params, state.obs_moments))
        summary["params_sha256"] = params_sha256(state.params)

    def final_evaluation(self, params):
        run, num_updates = self.run, self.run.setup.num_updates
        params = run.placement.to_actors(params)[run.placement.actor_devices[0]]
        start, evaluator = time.perf_counter(), run.make_evaluator()
        try:
            metrics = evaluator(params, run.interrupted) | {"eval/params_version": float(num_updates)}
            metrics["eval/time_s"] = time.perf_counter() - start  # with making the pool and compiling the policy
            run.log_eval(metrics, run.summary["global_step"], final=True)
            run.summary["final_eval"] = {k.removeprefix("eval/"): v for k, v in metrics.items()} | {
                "params_version": num_updates, "seed": evaluator.seed, "greedy": evaluator.greedy}
        except Stopped:  # a stop signal during the final evaluation: training is done and saved
            if not run.signum:
                raise
            run.summary["interrupted_by"] = signal.Signals(run.signum).name
        finally:
            evaluator.close()
