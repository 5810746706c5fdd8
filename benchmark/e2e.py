"""End-to-end throughput of the scripts (PPO, IMPALA, PPO-LSTM, SAC), asynchronous vs synchronous.

    python benchmark/e2e.py              # every layout and sweep, 3 repetitions (~50 min on 2 cores)
    python benchmark/e2e.py --quick      # PPO, CartPole-v1, a0-l0, 1 repetition (~35 s)
    python benchmark/e2e.py --recurrent  # only the PPO-LSTM rows and the PPO rows beside them (~15 min)
    python benchmark/e2e.py --recurrent --task CartPole-v1  # of those, CartPole's (~5 min)
    python benchmark/e2e.py --off-policy # only the SAC rows (~12 min)

Every run is the real script in a fresh process (`python sebulba/ppo_envpool.py ...
--log-frequency 1`) for the configurations of common.TASKS, on each device layout (a0-l0,
a0-l1, a0-l1,2, a0-l1,2,3: virtual CPU devices here, GPUs where present), in two modes:

* `async`: policy lag <= 1 (the default): actors collect the next rollout while the learner
  trains on the last;
* `sync`: the same flags plus `--max-policy-lag 0`: the actors wait for every update, as in a
  CleanRL-style synchronous loop.

Both use `recv` batch = the whole pool (lockstep stepping, which sync requires), so the
policy-lag bound is the only difference; smaller batches are a separate sweep.

Plus, on each task's main layout, `--deterministic` and sebulba/impala_envpool.py with the
same actors and batch (async and sync; one V-trace step per batch instead of PPO's 4 x 4
minibatches), sebulba/ppo_lstm_envpool.py with the same flags (PPO-LSTM: its 128-unit LSTM
between the encoder and the heads, minibatches of whole env sequences; async, and sync on
CartPole), and on CartPole a0-l1 sweeps of actor threads per device and of the `recv`
batch (a quarter and a half of the pool; half is the script's default).
`--recurrent` re-measures only the PPO-LSTM rows and the PPO rows of the same task, layout and
mode (so the two are compared in one sitting) and merges them into the existing e2e.json; every
row records the commit it ran on. `--off-policy` measures sebulba/sac_envpool.py on Hopper-v4 (its
defaults: 8 envs x 16 steps, 256-256 networks, minibatches of 256) on a0-l0 and a0-l1 at replay
ratios 1 and 0.1, learning from the 11th update on, and merges its rows likewise: steady env
steps/s and gradient steps/s (env steps/s x the ratio, exact) after learning starts, the learner
update's own gradient steps/s, and the share of the actor thread's time spent waiting (for
params within --max-policy-lag, and for room in the rollout queue) against the learner's share
spent waiting for rollouts: where the decoupling pays, one side waits and the other does not.
Per run: steady env steps/s and learner updates/s (between the console lines of update 1
and the last: compilation excluded), time to the first update (launch, imports and
compilation included), CPU-seconds per env step, peak resident memory of the run (MiB),
and the machine's CPU utilisation every 0.5 s. Atari: env steps; frames = 4x. Writes benchmark/results/e2e.json (or under --out).
"""

from __future__ import annotations

import json
import statistics

from common import LAYOUTS, TASKS, cli_parser, flag_value, impala_flags, machine, run_script, save, spread, steady_rates

SCRIPTS = {"PPO": "ppo_envpool.py", "IMPALA": "impala_envpool.py", "PPO-LSTM": "ppo_lstm_envpool.py",
           "SAC": "sac_envpool.py"}
# SAC on Hopper-v4 with the script's defaults; the first 10 updates (1,280 env steps) act randomly and take no
# gradient step, so its steady rates start after them. Updates after those, per replay ratio.
SAC_HOPPER = ["--env-id", "Hopper-v4", "--learning-starts", "1280", "--buffer-size", "100000"]
SAC_RANDOM_UPDATES, SAC_UPDATES = 10, {"1": 60, "0.1": 400}
ACTOR_TIMES = ("env_recv_time_s", "inference_time_s", "env_send_time_s", "rollout_assembly_time_s",
               "params_wait_time_s", "rollout_queue_put_time_s")
LEARNER_TIMES = ("rollout_queue_get_time_s", "transfer_time_s", "update_time_s")
WAITING = [f"actor/{t}" for t in ACTOR_TIMES] + [f"learner/{t}" for t in LEARNER_TIMES] + [
    "learner/gradient_steps_per_s"]


def one_run(script: str, flags: list[str], skip: int = 1) -> dict:
    result = run_script(script, flags, scalars=tuple(WAITING) if script == SCRIPTS["SAC"] else ())
    sps, ups = steady_rates(result["lines"], skip)
    global_step = result["summary"]["global_step"]
    run = {"sps": sps, "updates_per_s": ups, "time_to_first_update_s": result["lines"][0][0],
           "cpu_s_per_step": result["cpu_s"] / global_step, "cpu_per_core": result["cpu_per_core"],
           "cpu_series": result["cpu_series"], "peak_rss_mib": result["peak_rss_bytes"] / 2**20}
    if result["scalars"]:  # SAC: where the time goes once learning has started
        start = result["lines"][skip][1]  # the global step of the first steady line
        mean = {tag: statistics.fmean(v for step, v in points if step > start) for tag, points in result["scalars"].items()}
        run["actor_waiting_share"] = (mean["actor/params_wait_time_s"] + mean["actor/rollout_queue_put_time_s"]) / sum(
            mean[f"actor/{t}"] for t in ACTOR_TIMES)
        run["learner_waiting_share"] = mean["learner/rollout_queue_get_time_s"] / sum(
            mean[f"learner/{t}"] for t in LEARNER_TIMES)
        run["update_gradient_steps_per_s"] = mean["learner/gradient_steps_per_s"]
    return run


def configuration(task: str, layout: str, mode: str, recv_batch: int | None = None, threads: int = 1,
                  algo: str = "PPO", sweep: str = "") -> dict:
    spec = TASKS[task]
    flags = list(spec["flags"])
    n, steps = int(flag_value(flags, "--local-num-envs")), int(flag_value(flags, "--num-steps"))
    if recv_batch is not None:
        flags[flags.index("--async-batch-size") + 1] = str(recv_batch)
    flags += ["--learner-device-ids", *map(str, spec["layouts"][layout]),
              "--total-timesteps", str(spec["updates"] * n * steps * threads)]
    if threads != 1:
        flags += ["--num-actor-threads", str(threads)]
    if mode == "sync":
        flags += ["--max-policy-lag", "0"]
    elif mode == "deterministic":
        flags += ["--deterministic"]
    return {"task": task, "algo": algo, "script": SCRIPTS[algo], "layout": layout, "mode": mode, "threads": threads,
            "sweep": sweep, "name": f"{algo} {task} {layout} {mode}{sweep}",
            "flags": impala_flags(flags) if algo == "IMPALA" else flags}


def off_policy_configurations() -> list[dict]:
    """SAC on Hopper-v4, a0-l0 and a0-l1, replay ratios 1 and 0.1."""
    configs = []
    for layout in ("a0-l0", "a0-l1"):
        for ratio, updates in SAC_UPDATES.items():
            total = (SAC_RANDOM_UPDATES + updates) * 8 * 16
            configs.append({"task": "Hopper-v4", "algo": "SAC", "script": SCRIPTS["SAC"], "layout": layout, "mode": "async",
                            "threads": 1, "sweep": f", replay ratio {ratio}", "replay_ratio": float(ratio),
                            "name": f"SAC Hopper-v4 {layout} async, replay ratio {ratio}",
                            "flags": [*SAC_HOPPER, "--replay-ratio", ratio, "--total-timesteps", str(total),
                                      "--learner-device-ids", *map(str, LAYOUTS[layout])]})
    return configs


def configurations(quick: bool, recurrent: bool = False) -> list[dict]:
    if recurrent:  # the PPO-LSTM rows and the PPO rows they are compared with
        lstm = [c for c in configurations(False) if c["algo"] == "PPO-LSTM"]
        return [configuration(c["task"], c["layout"], c["mode"]) for c in lstm] + lstm
    configs = []
    for task, spec in TASKS.items():
        if quick and not spec["quick"]:
            continue
        for layout in (["a0-l0"] if quick else spec["layouts"]):
            configs += [configuration(task, layout, "async"), configuration(task, layout, "sync")]
        if quick or spec.get("ppo_only"):
            continue
        main = spec["main_layout"]
        configs += [configuration(task, main, "async", algo="IMPALA"), configuration(task, main, "async", algo="PPO-LSTM")]
        if task == "CartPole-v1":  # Breakout is learner-bound: these would only repeat its minute-long runs
            configs += [configuration(task, main, "sync", algo="IMPALA"), configuration(task, main, "sync", algo="PPO-LSTM"),
                        configuration(task, main, "deterministic"),
                        configuration(task, "a0-l1", "async", threads=2, sweep=", 2 actor threads"),
                        configuration(task, "a0-l1", "sync", threads=2, sweep=", 2 actor threads")]
            n = int(flag_value(spec["flags"], "--local-num-envs"))
            for batch, why in ((n // 4, ""), (n // 2, ", the script's default")):
                configs.append(configuration(task, "a0-l1", "async", batch, sweep=f", recv batch {batch}{why}"))
    return configs


def run(quick: bool, reps: int, recurrent: bool = False, off_policy: bool = False, task: str | None = None) -> list[dict]:
    configs = off_policy_configurations() if off_policy else configurations(quick, recurrent)
    if not (quick or recurrent or off_policy):
        configs += off_policy_configurations()
    configs = [c for c in configs if task in (None, c["task"])]
    here = machine()  # once: it runs git
    commit, cpu = here["commit"], here["cpu"]
    runs = {c["name"]: [] for c in configs}
    for rep in range(reps):  # interleaved, so drift in machine load hits every configuration alike
        for c in configs:
            runs[c["name"]].append(one_run(c["script"], c["flags"], SAC_RANDOM_UPDATES + 1 if c["algo"] == "SAC" else 1))
            r = runs[c["name"]][-1]
            print(f"[{rep + 1}/{reps}] {c['name']:56s} {r['sps']:9,.0f} env steps/s, {r['updates_per_s']:6.2f} "
                  f"updates/s, first update at {r['time_to_first_update_s']:5.1f} s", flush=True)
    rows = []
    for c in configs:
        rs = runs[c["name"]]
        rows.append({**c, **{k: spread([r[k] for r in rs]) for k in ("sps", "updates_per_s", "time_to_first_update_s",
                                                                     "cpu_s_per_step", "peak_rss_mib")},
                     "cpu_per_core": [spread(list(x))["median"] for x in zip(*(r["cpu_per_core"] for r in rs))],
                     "cpu_series": rs[0]["cpu_series"], "sps_runs": [r["sps"] for r in rs], "commit": commit, "cpu": cpu,
                     **{k: spread([r[k] for r in rs]) for k in ("actor_waiting_share", "learner_waiting_share",
                                                                "update_gradient_steps_per_s") if k in rs[0]}})
    return rows


def merge(previous: dict, rows: list[dict]) -> list[dict]:
    """The previous run's rows with `rows` in place of those of the same name (new names appended); a
    kept row without its own commit or CPU takes the previous run's (the file's `machine` becomes the new run's)."""
    new = {r["name"]: r for r in rows}
    kept = [new.pop(r["name"], None) or {"commit": previous["machine"].get("commit"), "cpu": previous["machine"].get("cpu"),
                                         **r} for r in previous["rows"]]
    return kept + list(new.values())


if __name__ == "__main__":
    parser = cli_parser(__doc__, "e2e", "PPO, CartPole-v1, a0-l0, async and sync, 1 repetition")
    parser.add_argument("--reps", type=int, default=3, help="runs per configuration (median reported)")
    parser.add_argument("--recurrent", action="store_true",
                        help="only the PPO-LSTM rows and the PPO rows beside them, merged into the existing e2e.json")
    parser.add_argument("--off-policy", action="store_true",
                        help="only the SAC rows (Hopper-v4, replay ratios 1 and 0.1), merged into the existing e2e.json")
    parser.add_argument("--task", choices=[*TASKS, "Hopper-v4"], help="only this task's rows, merged into the existing e2e.json")
    cli = parser.parse_args()
    reps = 1 if cli.quick else cli.reps
    rows = run(cli.quick, reps, cli.recurrent, cli.off_policy, cli.task)
    previous = cli.out / "e2e.json"
    if (cli.recurrent or cli.off_policy or cli.task) and previous.exists():
        kept = json.loads(previous.read_text())
        if kept.get("quick") == cli.quick and kept.get("reps") == reps:
            rows = merge(kept, rows)
    print("written:", save("e2e", {"quick": cli.quick, "reps": reps, "rows": rows}, cli.out))
