"""EnvPool's training protocol: which task family an id is, the env settings every script
trains and evaluates with, the pools themselves, the check on each `recv` batch, and the
pool lifetimes of a --deterministic run."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import envpool
import numpy as np

from sebulba.missions import WordPool, word_spec


def is_atari(env_id: str) -> bool:
    return type(envpool.make_spec(env_id)).__name__ == "AtariEnvSpec"


def is_mujoco(env_id: str) -> bool:
    return envpool.registration.registry.specs[env_id][0].startswith("envpool.mujoco")  # (module, spec class, kw)


@functools.cache
def has_dict_obs(env_id: str) -> bool:
    """Whether the task's observations are a dict of arrays (MiniGrid/BabyAI: image, direction, mission)."""
    return type(envpool.make_spec(env_id).observation_space).__name__ == "Dict"


# Named Atari protocols (--atari-protocol): the EnvPool settings of one published setup each, so a run is
# comparable with that source's curves and tables. Rewards always come back raw: clipping for training
# happens in `RolloutAssembler`, so the raw game score stays available (both sources clip in training).
# Every protocol: 84x84 grey frames, 4 stacked, frame skip 4, a 27,000-step (108k-frame) limit.
ATARI_PROTOCOLS: dict[str, dict[str, Any]] = {
    # Cleanba's cleanba_ppo.py / cleanba_impala.py `make_env` (Huang et al. 2023), citing Machado et al. 2018
    # for sticky actions, the full action set and no life-loss signal; EnvPool's default FIRE at reset kept.
    "cleanba": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, episodic_life=False,
                    use_fire_reset=True),
    # CleanRL's envpool Atari scripts (ppo_atari_envpool.py, pqn_atari_envpool.py): EnvPool's defaults plus
    # episodic_life=True: no sticky actions, the minimal action set, up to 30 no-ops, FIRE at reset.
    "cleanrl": dict(repeat_action_probability=0.0, full_action_space=False, noop_max=30, episodic_life=True,
                    use_fire_reset=True),
    # Machado et al. 2018 ("Revisiting the ALE"), strictly: as cleanba, but the agent must press FIRE itself.
    "machado": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, episodic_life=False,
                    use_fire_reset=False),
}

def resolve_episodic_life(env_id: str, protocol: str = "cleanba", override: bool | None = None) -> bool:
    """Whether a life loss ends a training episode: `override` (--episodic-life) if given, else the
    Atari protocol's; always False outside Atari (no lives)."""
    if not is_atari(env_id):
        return False
    return ATARI_PROTOCOLS[protocol]["episodic_life"] if override is None else override


def env_settings(env_id: str, protocol: str = "cleanba", episodic_life: bool | None = None) -> dict[str, Any]:
    """EnvPool settings of the training protocol, for `make_envs` and for the spec that sizes
    the network (the full action space has 18 actions, the minimal one fewer).

    Atari follows the named protocol `protocol` (ATARI_PROTOCOLS, --atari-protocol), with a
    life loss ending a training episode as `episodic_life` (--episodic-life) says, or the
    protocol's own choice when None. Other tasks: EnvPool's defaults ({}).

    Raises:
      KeyError: `protocol` is not in ATARI_PROTOCOLS (`sebulba.config` checks it first).
    """
    if not is_atari(env_id):
        return {}
    return dict(ATARI_PROTOCOLS[protocol], episodic_life=resolve_episodic_life(env_id, protocol, episodic_life),
                reward_clip=False, max_episode_steps=27_000)


def make_spec(env_id: str, protocol: str = "cleanba", episodic_life: bool | None = None):
    """EnvPool's spec of `env_id` under the training protocol (observation and action spaces);
    MiniGrid's and BabyAI's `mission` as the word ids that `make_envs`'s pools return."""
    spec = envpool.make_spec(env_id, **env_settings(env_id, protocol, episodic_life))
    return word_spec(spec, env_id) if has_dict_obs(env_id) else spec


def make_envs(env_id: str, num_envs: int, batch_size: int, seed: int, num_threads: int, protocol: str = "cleanba",
              episodic_life: bool | None = None, **options):
    """EnvPool pool (gymnasium API) with the training protocol's settings (`env_settings`), in
    async mode when batch_size < num_envs; `options` go to envpool.make as they are (render_mode,
    say). MiniGrid's and BabyAI's observations carry the mission as word ids (sebulba/missions.py),
    not bytes."""
    pool = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=seed,
                        num_threads=num_threads, **options, **env_settings(env_id, protocol, episodic_life))
    return WordPool(pool, env_id) if has_dict_obs(env_id) else pool


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


def recv_batch(envs, batch_size: int, sort: bool = False):
    """One `recv`, checked: (env_id [B] int32, obs [B, *obs] or a dict of such, reward [B] raw,
    terminated [B], truncated [B], lives [B] or None). With `sort` (--deterministic) the rows
    are in env-id order.

    Raises:
      RuntimeError: see `check_env_ids`.
    """
    obs, reward, terminated, truncated, info = envs.recv()
    env_id = check_env_ids(np.asarray(info["env_id"]), batch_size)
    lives = info.get("lives")
    if sort:
        order = np.argsort(env_id)
        env_id, reward, terminated, truncated = (x[order] for x in (env_id, reward, terminated, truncated))
        obs = {k: x[order] for k, x in obs.items()} if isinstance(obs, dict) else obs[order]
        lives = None if lives is None else lives[order]
    return env_id, obs, reward, terminated, truncated, lives


RUN_SEED_STRIDE = 10_000_019  # env seeds between the training pools of consecutive --seed values


def pool_seed(seed: int, thread: int, first_rollout: int, num_envs_total: int, num_envs: int) -> int:
    """EnvPool seed of the pool of global actor thread `thread` (process-major) that starts at
    rollout `first_rollout` in the run with --seed `seed`; EnvPool seeds its envs seed, seed + 1,
    ..., so every env of every thread, process and pool (a --deterministic run makes one per
    checkpoint interval) gets a seed of its own (cleanrl PR#238, envpool#298). Runs with
    different --seed values start RUN_SEED_STRIDE env seeds apart (--seed 1 at 1), so their
    training envs share no seed until a run has made that many env slots; with bases seed,
    seed + 1, ..., --seed 1 and 2 shared all but one env. Wraps at 2**31 (EnvPool's int seed).
    Apart from the evaluation pools' seeds (evaluation.eval_seed, from 1,000,003 on): --seed 1's
    stay below them for its first 1,000,000 / num_envs_total rollouts, --seed 2's on start above."""
    base = seed + (seed - 1) * RUN_SEED_STRIDE
    return (base + (thread + first_rollout * num_envs_total // num_envs) * num_envs) % 2**31


def env_segments(start_update: int, num_updates: int, deterministic: bool,
                 checkpoint_interval: int) -> list[tuple[int, int]]:
    """Rollout ranges [begin, end) each served by one fresh EnvPool pool: the whole run, or
    with --deterministic one per checkpoint interval, so a run resumed from a periodic
    checkpoint restarts its envs exactly where the uninterrupted run did."""
    if not deterministic or not checkpoint_interval:
        return [(start_update, num_updates)]
    interval = checkpoint_interval
    cuts = [start_update, *range((start_update // interval + 1) * interval, num_updates, interval), num_updates]
    return list(itertools.pairwise(cuts))
