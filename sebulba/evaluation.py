"""Evaluation: whole episodes with a trained policy on a pool of its own, the eval thread that
evaluates during training (--eval-interval), and what the final evaluation and
scripts/evaluate.py share.
"""

from __future__ import annotations

import queue
import time

import jax
import numpy as np

from sebulba.envs import evaluation_step_limit, is_minigrid, make_envs, resolve_episodic_life
from sebulba.networks import make_policy_fn
from sebulba.threads import ParamsSlot, Stopped, timed_put

EVAL_SEED_OFFSET = 1_000_003  # evaluation pools: an env seed range of their own, far from the training pools'.
EVAL_SEED_STRIDE = 10_007  # env seeds between the evaluation pools of consecutive --seed values


def eval_seed(run_seed: int) -> int:
    """EnvPool seed of the evaluation pools of the run with --seed `run_seed` (EnvPool seeds their
    envs eval_seed, eval_seed + 1, ...; the policy's action key too): EVAL_SEED_OFFSET on from the
    training pools', and EVAL_SEED_STRIDE apart per run seed, so runs with consecutive --seed
    values evaluate on disjoint env seeds up to that many episodes (with consecutive bases, seeds
    1 and 2 shared 9 of 10 evaluation start states). Wraps at 2**31 (EnvPool's int seed)."""
    return (EVAL_SEED_OFFSET + run_seed * EVAL_SEED_STRIDE) % 2**31


def run_episodes(envs, policy, params, key, stop=None, record=None, episodic_life: bool = False,
                 max_steps: int | None = None):
    """One whole game in each env of a synchronous pool (batch = all envs), with `policy` from
    make_policy_fn. Returns (raw returns [N] float64, lengths [N] int64 in env steps, key), in
    env-id order. `record(running)` is called after the reset and after every step (video);
    `stop` is checked every step. With `max_steps` an env's game ends after that many env steps
    (`sebulba.envs.evaluation_step_limit`: tasks EnvPool never truncates).

    With `episodic_life` (Atari, the pool made as training made it: a life loss terminates
    EnvPool's episode, as in CleanRL's protocol, and EnvPool resets the life, pressing FIRE
    where the protocol does) the game goes on across life losses and ends when no life is
    left or at truncation; the auto-reset step after a life loss (its action ignored, reward 0)
    is not counted in the length. A recurrent policy's state starts at zeros in every env and
    restarts where training restarted it: at the observation after each life loss, as the
    actors do after EnvPool's life-loss termination.

    Raises:
      Stopped: `stop` was set.
    """
    num_envs = envs.config["num_envs"]
    returns, lengths, running = np.zeros(num_envs), np.zeros(num_envs, np.int64), np.ones(num_envs, bool)
    recurrent = getattr(policy, "recurrent", False)  # a RecurrentPolicy: one state per env, from zeros
    state, starts = (policy.zero_state(num_envs), np.ones(num_envs, bool)) if recurrent else (None, None)
    obs, info = envs.reset()
    lives = info.get("lives") if recurrent and episodic_life else None  # None: no life-loss restarts
    lost = np.zeros(num_envs, bool)  # this observation showed a life lost
    auto_reset = np.zeros(num_envs, bool)  # the next step is EnvPool's reset after a life-loss termination
    if record:
        record(running)
    while running.any():
        if stop is not None and stop.is_set():
            raise Stopped
        if recurrent:
            action, env_action, _, _, _, state, key = policy(params, obs, state, starts, key)
        else:
            action, env_action, _, _, key = policy(params, obs, key)
        obs, reward, terminated, truncated, info = envs.step(np.asarray(action if env_action is None else env_action))
        if recurrent:  # the first observation after a life loss starts from zeros; nothing else does
            starts = lost
            if lives is not None:
                lost, lives = info["lives"] < lives, info["lives"]
        returns += np.where(running, reward, 0.0)
        lengths += running & ~auto_reset
        if record:
            record(running)  # the frame of this step, the last one included
        game_over = truncated | (terminated & (info["lives"] == 0) if episodic_life else terminated)
        auto_reset = terminated & ~game_over
        running &= ~game_over
        if max_steps is not None:
            running &= lengths < max_steps
    return returns, lengths, key


class Evaluator:
    """`episodes` whole episodes (Atari: whole games) with the training protocol's env settings
    (`protocol`, `episodic_life`: the run's --atari-protocol and --episodic-life) on a pool of
    its own (one EnvPool thread), one per env, actions sampled from the policy (its mode with
    `greedy`, --eval-greedy); see `run_episodes`. `options` go to `make_envs` (Procgen's
    evaluation levels, `sebulba.envs.procgen_levels`). Returns eval/* metrics:
    raw episodic return mean and std, mean length in env steps, seconds taken, and on MiniGrid
    and BabyAI (where a task defines success: the goal reached, a positive return) the share
    of episodes that succeeded. `close()` closes
    the pool."""

    def __init__(self, env_id: str, episodes: int, agent, action_space, greedy: bool, seed: int,
                 protocol: str = "cleanba", episodic_life: bool | None = None, **options):
        self.envs = make_envs(env_id, episodes, episodes, seed, 1, protocol, episodic_life, **options)
        self.policy = make_policy_fn(agent, action_space, greedy=greedy)
        self.seed, self.key, self.greedy = seed, jax.random.PRNGKey(seed), greedy
        self.episodic_life = resolve_episodic_life(env_id, protocol, episodic_life)
        self.max_steps = evaluation_step_limit(env_id)
        self.defines_success = is_minigrid(env_id)  # MiniGrid and BabyAI: a positive return is the goal reached

    def __call__(self, params, stop) -> dict[str, float]:
        start = time.perf_counter()
        returns, lengths, self.key = run_episodes(self.envs, self.policy, params, self.key, stop,
                                                  episodic_life=self.episodic_life, max_steps=self.max_steps)
        return ({"eval/episodic_return_mean": float(returns.mean()), "eval/episodic_return_std": float(returns.std()),
                 "eval/episodic_length_mean": float(lengths.mean())}
                | ({"eval/success_rate": float(np.mean(returns > 0))} if self.defines_success else {})
                | {"eval/time_s": time.perf_counter() - start})

    def close(self):
        self.envs.close()


def run_evaluator(evaluator: Evaluator, params_slot: ParamsSlot, results: queue.Queue, device: jax.Device,
                  interval: int, start_update: int, num_updates: int, stall_timeout_s: float, stop):
    """Eval thread: each time the learner publishes a multiple of `interval` updates (before
    the last update, `num_updates`, which the final evaluation covers), evaluate the newest
    params on `device` and queue the metrics, with the version evaluated, for the learner to log."""
    version = start_update
    try:
        while (wanted := (version // interval + 1) * interval) < num_updates:
            # No deadline: stalls are the actors' and the learner's to detect; `stop` ends the wait.
            version, params = params_slot.wait(wanted, stop, float("inf"), "evaluator")
            if version >= num_updates:  # woke after the last update: the final evaluation covers these params
                return
            try:
                metrics = evaluator(params[device], stop) | {"eval/params_version": float(version)}
            except Stopped:
                print(f"eval at update {version} was still running when the run stopped: not logged", flush=True)
                raise
            if stop.is_set():  # training ended meanwhile: Run.launch logs what is in the queue
                if results.full():
                    print(f"eval at update {version} finished after the run stopped: not logged", flush=True)
                else:
                    results.put_nowait(metrics)
                return
            timed_put(results, metrics, stop, stall_timeout_s, "evaluator")
    finally:
        evaluator.close()
