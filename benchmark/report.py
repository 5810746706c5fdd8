"""Regenerate RESULTS.md and the plots from the raw results of the benchmark suite.

    python benchmark/report.py                                   # benchmark/results -> benchmark/RESULTS.md, docs/img/
    python benchmark/report.py --results DIR --md FILE --img DIR

Reads env_throughput.json, stages.json, e2e.json, time_to_solve.json, startup.json, memory.json, conv.json,
sac_step.json, learning.json,
gpu.json and peers.json (whichever exist)
and writes every table and figure from them; nothing in RESULTS.md is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import RESULTS, ROOT  # noqa: E402
from peers import peers_section  # noqa: E402

# The performance targets the project set itself, checked against the data.
ACTOR_EFFICIENCY, LIMIT_FRACTION, CARTPOLE_SPS, SOLVE_S, BREAKOUT_SPS, ASYNC_RATIO, FIRST_UPDATE_S, RSS_RATIO = (
    0.85, 0.85, 25_000, 60, 40, 1.5, 60, 2.5)
SECOND_RUN_FIRST_UPDATE_S = 3.0
# PPO at CleanRL's Atari sizes (common.TASKS' "Breakout-v5 (CleanRL's sizes)"), 2 cores: env steps/s, share of the limit.
CLEANRL_BREAKOUT, CLEANRL_BREAKOUT_SPS, CLEANRL_BREAKOUT_FRACTION = "Breakout-v5 (CleanRL's sizes)", 400, 0.8
# SAC at CleanRL's sizes (256-256 networks, minibatch 256), 2 cores: gradient steps/s, the update alone and end to end
# at replay ratio 1 (where env steps/s equal gradient steps/s).
SAC_GRADIENT_STEPS = 250
CLEANBA_BREAKOUT_SPS = 6_100  # Cleanba's PPO on 1 A100 with 10 CPU cores (derived from its published runtimes)


def fmt(s: dict | None, digits: int = 0, scale: float = 1.0) -> str:
    if not s or s.get("median") is None:
        return "n/a"
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{m:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})"


def load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_section(data: list[dict], names: list[str]) -> list[str]:
    """One row per results part: the machine it was measured on (the learning part: the CPUs its rows name), the
    date and the code."""
    out = ["## Machine", "", "Each part of these results as it was measured: its CPU (model, family and model "
           "number, widest vector unit, where recorded), cores, memory, GPU, software, date and code (git; `-dirty`: "
           "with uncommitted changes to the code that runs: sebulba/, scripts/, benchmark/*.py or the pins; records "
           "made before that rule counted a changed page too).", "",
           "| part | CPU | cores | memory | GPU | software | date | code |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, d in zip(names, data):
        if not d:
            continue
        m = d["machine"]
        cpu, date, code = m["cpu"], m["date"], m.get("commit") or "?"
        if name == "learning":  # each row records its own CPU and code (the learning table)
            cpu = "; ".join(sorted({r.get("cpu") or cpu for r in d["results"].values()}))
            date, code = f"last written {date}", "each row's, in its table"
        versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v and k in ("jax", "envpool"))
        out.append(f"| {name} | {cpu} | {m['cores']} | {m['memory_gib']} GiB | {', '.join(m['gpus']) or 'none'} | "
                   f"Python {m['python']}, {versions} | {date} | {code} |")
    return [*out, ""]


def env_section(env: dict, img: Path, rel: str) -> list[str]:
    out = ["## Environment throughput (`benchmark/env_throughput.py`)", "",
           "Random actions, no policy or learning: the physical limit of the actor side. Env steps/s "
           f"(Atari: frames = 4×), median (min–max) of {env['reps']} windows of {env['seconds']} s; CPU % per core "
           "of the whole machine (100 = one core busy).", "",
           "| task | envs | mode | EnvPool threads | env steps/s | CPU % per core |", "| --- | --- | --- | --- | --- | --- |"]
    for r in env["rows"]:
        out.append(f"| {r['env_id']} | {r['num_envs']} | {r['mode']} | {r['threads'] or '–'} | {fmt(r['sps'])} | "
                   f"{' / '.join(f'{c:.0f}' for c in r['cpu_per_core'])} |")
    tasks = sorted({r["env_id"] for r in env["rows"]})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in env["rows"] if r["env_id"] == task]
        top = max(r["threads"] or 0 for r in rows)
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["num_envs"], r["sps"]["median"]) for r in rows
                         if r["mode"] == mode and r["threads"] in (None, top))
            ax.plot(*zip(*pts), marker="o", label=mode + (f" ({top} threads)" if mode.startswith("envpool") else ""))
        ax.set(xscale="log", yscale="log", xlabel="envs", ylabel="env steps/s", title=task)
        ax.legend(fontsize=7)
    save_fig(fig, img / "env_throughput.png")
    return [*out, "", f"![throughput vs env count]({rel}/env_throughput.png)", ""]


def stage_section(stages: dict, e2e: dict | None) -> list[str]:
    out = ["## Actor efficiency and distance to the limit (`benchmark/stages.py`, `benchmark/e2e.py`)", "",
           f"Each stage alone, median (min–max) of {stages['reps']} windows of {stages['seconds']} s, process CPU "
           "time (user + system, every thread). Actor efficiency = the real actor loop's env steps/s ÷ raw EnvPool "
           "async env steps/s on the same pool. Work-conserving limit = cores ÷ (env + inference + learning "
           "CPU-seconds per env step); fraction = end-to-end steady env steps/s (PPO, async) ÷ that limit.", "",
           "| task | recv batch | raw EnvPool env steps/s | actor env steps/s | actor efficiency | env µs/step | "
           "inference µs/step |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for task, t in stages["tasks"].items():
        s = t["summary"]
        out.append(f"| {task} | {t['recv_batch']} of {t['flags'][t['flags'].index('--local-num-envs') + 1]} | "
                   f"{fmt(s['raw_env_sps'])} | {fmt(s['actor_sps'])} | {fmt(s['actor_efficiency'], 2)} | "
                   f"{fmt(s['env_cpu_s_per_step'], 1, 1e6)} | {fmt(s['inference_cpu_s_per_step'], 1, 1e6)} |")
    out += ["", "| task | layout | learning µs/step | limit env steps/s | end-to-end env steps/s | fraction of limit |",
            "| --- | --- | --- | --- | --- | --- |"]
    for task, t in stages["tasks"].items():
        for layout, cpu in t["learning_cpu_s_per_step"].items():
            limit = t["work_conserving_limit_sps"][layout]
            row = find(e2e, "PPO", task, layout, "async")
            e2e_sps = row["sps"]["median"] if row else None
            frac = f"{e2e_sps / limit:.2f}" if e2e_sps else "n/a"
            med = sorted(cpu)[len(cpu) // 2]
            out.append(f"| {task} | {layout} | {med * 1e6:,.1f} | {limit:,.0f} | {fmt(row['sps']) if row else 'n/a'} "
                       f"| {frac} |")
    elsewhere = [f"{task} (stages at {t['commit']} on {t['cpu']})" for task, t in stages["tasks"].items()
                 if t.get("cpu") and t["cpu"] != stages["machine"]["cpu"]]
    if elsewhere:  # merged by `stages.py --task`: a limit and its end-to-end row compare within one box only
        out += ["", "Kept from an earlier sitting on another CPU: " + "; ".join(elsewhere) + "."]
    latency = [(task, t["summary"]) for task, t in stages["tasks"].items()
               if (t["summary"].get("policy_us_alone") or {}).get("median") is not None]
    if latency:
        out += ["", "One policy call (the `recv` batch's observations in, action, log-prob and value out to the "
                "host; wall-clock µs, median), alone and with a load looping in another thread: the learner's "
                "update on learner device 1 (as end to end on a0-l1), or NumPy matrix products on every core.", "",
                "| task | alone | beside the learner (XLA) | beside NumPy |", "| --- | --- | --- | --- |"]
        out += [f"| {task} | {fmt(s['policy_us_alone'])} | {fmt(s['policy_us_beside_learner'])} | "
                f"{fmt(s['policy_us_beside_numpy'])} |" for task, s in latency]
    sweep = [(task, r) for task, t in stages["tasks"].items() for r in t.get("efficiency_sweep", [])]
    if sweep:
        out += ["", "Actor efficiency against the pool: envs per pool, `recv` batch and EnvPool worker threads "
                "(the end-to-end configuration above uses the first row's pool).", "",
                "| task | envs | recv batch | EnvPool threads | raw EnvPool env steps/s | actor env steps/s | "
                "actor efficiency |", "| --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {task} | {r['envs']} | {r['recv_batch']} | {r['env_threads']} | {fmt(r['raw_env_sps'])} | "
                f"{fmt(r['actor_sps'])} | {fmt(r['actor_efficiency'], 2)} |" for task, r in sweep]
    return [*out, ""]


def find(e2e: dict | None, algo: str, task: str, layout: str, mode: str, sweep: str = "") -> dict | None:
    for r in (e2e or {}).get("rows", []):
        if (r["algo"], r["task"], r["layout"], r["mode"], r["sweep"]) == (algo, task, layout, mode, sweep):
            return r
    return None


def measured_on(row: dict, data: dict) -> str:
    """", on <CPU>": the CPU a row was measured on (its own record, else its file's machine)."""
    return f", on {row.get('cpu') or data['machine']['cpu']}"


def e2e_section(e2e: dict, stages: dict | None, img: Path, rel: str) -> list[str]:
    out = ["## End to end, asynchronous vs synchronous (`benchmark/e2e.py`)", "",
           f"The real scripts in fresh processes; median (min–max) of {e2e['reps']} runs. Steady rates exclude the "
           "first update (compilation); first update = seconds from launch (imports and compilation included); "
           "CPU % per core = the machine's, after the first update. "
           "`sync` = the same flags with `--max-policy-lag 0` (the actors wait for every update); both step the "
           "whole pool per `recv` unless the row names a smaller batch. "
           "Env steps (Atari frames = 4×).", "",
           "| algo | task | layout | mode | env steps/s | updates/s | first update (s) | CPU % per core | "
           "peak RSS (MiB) | code |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in e2e["rows"]:
        out.append(f"| {r['algo']} | {r['task']} | {r['layout']} | {r['mode']}{r['sweep']} | {fmt(r['sps'])} | "
                   f"{fmt(r['updates_per_s'], 2)} | {fmt(r['time_to_first_update_s'], 1)} | "
                   f"{' / '.join(f'{c:.0f}' for c in r['cpu_per_core'])} | {fmt(r.get('peak_rss_mib'))} | "
                   f"{r.get('commit') or e2e['machine'].get('commit') or '?'}{measured_on(r, e2e)} |")
    recurrent = [(r, find(e2e, "PPO", r["task"], r["layout"], r["mode"], r["sweep"]))
                 for r in e2e["rows"] if r["algo"] == "PPO-LSTM"]
    if recurrent:
        out += ["", "The cost of memory: sebulba/ppo_lstm_envpool.py (128-unit LSTM) against sebulba/ppo_envpool.py "
                "on the same flags.", "", "| task | layout | mode | PPO-LSTM ÷ PPO, env steps/s | "
                "PPO-LSTM ÷ PPO, first update |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {r['task']} | {r['layout']} | {r['mode']} | {r['sps']['median'] / p['sps']['median']:.2f} | "
                f"{r['time_to_first_update_s']['median'] / p['time_to_first_update_s']['median']:.2f} |"
                for r, p in recurrent if p]
    off_policy = [r for r in e2e["rows"] if r["algo"] == "SAC"]
    if off_policy:
        out += ["", "Off-policy (sebulba/sac_envpool.py, `--off-policy`): after learning starts, env steps/s and "
                "gradient steps/s end to end (env steps/s × the replay ratio, which is exact), the learner update's "
                "own gradient steps/s (its program alone), and the share of each side's time spent waiting: the actor "
                "thread for params (the policy-lag bound) or queue room, the learner for rollouts.", "",
                "| task | layout | replay ratio | env steps/s | gradient steps/s | update alone, gradient steps/s | "
                "actor waiting | learner waiting | code |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {r['task']} | {r['layout']} | {r['replay_ratio']:g} | {fmt(r['sps'])} | "
                f"{r['sps']['median'] * r['replay_ratio']:,.0f} | {fmt(r['update_gradient_steps_per_s'])} | "
                f"{r['actor_waiting_share']['median']:.0%} | {r['learner_waiting_share']['median']:.0%} | "
                f"{r.get('commit') or '?'} |" for r in off_policy]
    out += ["", "| algo | task | layout | async ÷ sync |", "| --- | --- | --- | --- |"]
    pairs = []
    for r in e2e["rows"]:
        sync = find(e2e, r["algo"], r["task"], r["layout"], "sync", r["sweep"])
        if r["mode"] == "async" and sync:
            pairs.append((r, sync))
            out.append(f"| {r['algo']} | {r['task']} | {r['layout']}{r['sweep']} | "
                       f"{r['sps']['median'] / sync['sps']['median']:.2f} |")
    tasks = list(dict.fromkeys(r["task"] for r, _ in pairs))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        sel = [(a, s) for a, s in pairs if a["task"] == task]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [a["sps"]["median"] for a, _ in sel], 0.4, label="async")
        ax.bar([i + 0.2 for i in x], [s["sps"]["median"] for _, s in sel], 0.4, label="sync")
        ax.set_xticks(list(x), [f"{a['algo']} {a['layout']}{a['sweep']}" for a, _ in sel], rotation=30, ha="right",
                      fontsize=7)
        ax.set(ylabel="env steps/s (steady)", title=task)
        ax.legend()
    save_fig(fig, img / "e2e_async_vs_sync.png")
    out += ["", f"![async vs sync]({rel}/e2e_async_vs_sync.png)", ""]

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        layouts = [r["layout"] for r in e2e["rows"] if r["task"] == task and r["algo"] == "PPO"
                   and r["mode"] == "async" and not r["sweep"]]
        for mode in ("async", "sync"):
            ax.plot(layouts, [find(e2e, "PPO", task, lay, mode)["sps"]["median"] for lay in layouts], marker="o",
                    label=f"PPO {mode}")
        if stages and task in stages["tasks"]:
            limits = stages["tasks"][task]["work_conserving_limit_sps"]
            ax.plot([lay for lay in layouts if lay in limits], [limits[lay] for lay in layouts if lay in limits],
                    ls="--", marker="_", markersize=20, color="grey", label="work-conserving limit")
        ax.set(xlabel="layout (actor devices - learner devices)", ylabel="env steps/s (steady)", title=task)
        ax.legend(fontsize=8)
    save_fig(fig, img / "e2e_learner_scaling.png")
    out += [f"![scaling with learner devices]({rel}/e2e_learner_scaling.png)", ""]

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        a, s = next((a, s) for a, s in pairs if a["task"] == task and a["algo"] == "PPO")
        for row, label in ((a, "async"), (s, "sync")):
            if row["cpu_series"]:
                ax.plot(*zip(*row["cpu_series"]), label=f"{label} ({row['layout']})")
        ax.set(xlabel="seconds since launch", ylabel="CPU % (mean over cores)", ylim=(0, 105), title=task)
        ax.legend(fontsize=8)
    save_fig(fig, img / "cpu_utilisation.png")
    return [*out, f"![CPU utilisation over time]({rel}/cpu_utilisation.png)", ""]


def solve_section(tts: dict, img: Path, rel: str) -> list[str]:
    out = ["## Time to solve CartPole-v1 (`benchmark/time_to_solve.py`)", "",
           f"The README presets, seeds 1–{max(len(v['runs']) for v in tts['results'].values())}; solved = "
           f"`episodic_return_mean` ≥ {tts['threshold']:.0f}; seconds from launch (imports and compilation "
           "included). Median (min–max) over the solved runs.", "",
           "| algo | solved | seconds to solve | env steps to solve |", "| --- | --- | --- | --- |"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for (algo, r), color in zip(tts["results"].items(), ("C0", "C1")):
        out.append(f"| {algo} | {r['solved']} of {r['seeds']} | {fmt(r['seconds'], 1)} | {fmt(r['global_step'])} |")
        for i, run in enumerate(r["runs"]):
            pts = [(t, ret) for t, _, ret in run["curve"] if ret is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, alpha=0.6, lw=1, label=algo if i == 0 else None)
    ax.axhline(tts["threshold"], color="grey", ls="--", lw=1)
    ax.set(xlabel="seconds since launch", ylabel="episodic return (mean of last 20)", title="CartPole-v1")
    ax.legend()
    save_fig(fig, img / "learning_curves.png")
    return [*out, "", f"![learning curves]({rel}/learning_curves.png)", ""]


def startup_section(start: dict) -> list[str]:
    out = ["## Start-up and the compilation cache (`benchmark/startup.py`)", "",
           f"The README presets stopped after {start['updates']} updates; seconds from launch to the first console line "
           "(imports, devices, env pools and compilation included). Each repeat starts from an empty "
           "`--compilation-cache-dir`: the first run compiles and fills it, the second run of the same command "
           f"reads it. Median (min–max) of {max(len(r['runs']) for r in start['results'].values())} repeats. The "
           "other parts run with the cache off, as first runs.", "",
           "| algo | first update, first run | first update, second run | programs cached |", "| --- | --- | --- | --- |"]
    for algo, r in start["results"].items():
        out.append(f"| {algo} | {fmt(r['first_s'], 1)} s | {fmt(r['second_s'], 1)} s | "
                   f"{r['runs'][0]['cache_entries']} |")
    return [*out, ""]


def conv_section(conv: dict) -> list[str]:
    out = ["## The Nature CNN's gradient on the CPU (`benchmark/conv.py`)", "",
           f"One gradient of a policy-and-value loss of the Nature CNN over {conv['batch']} frames "
           f"({conv['gflop_per_gradient']:.1f} GFLOP: the forward pass and both backward products), median of several "
           "steps after compiling; cores busy = CPU-seconds ÷ wall seconds. The scripts' `ValidConv` runs the matmul "
           "over patches on the CPU (docs/performance.md).", "",
           "| the convolutions as | ms a gradient | cores busy | GFLOP/s |", "| --- | --- | --- | --- |"]
    names = {"xla_convolution": "XLA's convolution (flax's nn.Conv)", "matmul_over_patches": "a matmul over patches "
             "(ValidConv)", "matmul_chain_ceiling": "plain matmuls of the same shapes (the ceiling)"}
    for key, r in conv["results"].items():
        out.append(f"| {names.get(key, key)} | {r['step_s'] * 1e3:.0f} ({r['step_s_min'] * 1e3:.0f}–"
                   f"{r['step_s_max'] * 1e3:.0f}) | {r['cpu_s_per_step'] / r['step_s']:.2f} | {r['gflop_per_s']:.0f} |")
    return [*out, ""]


def sac_step_section(sac: dict) -> list[str]:
    r = sac["results"]
    median = lambda key: r[key]["median"]  # noqa: E731
    return ["## SAC's update alone (`benchmark/sac_step.py`)", "",
            f"sebulba/sac_envpool.py's compiled update on {r['env_id']} with CleanRL's sizes ({'-'.join(map(str, r['hiddens']))} "
            f"networks, minibatch {r['minibatch']}), programs of {r['steps_per_program']} gradient steps, one learner "
            f"device; {r['step_gflop']:.2f} GFLOP a step (its matrix multiplies). Median (min–max) of "
            f"{r['gradient_steps_per_s']['n']} repetitions; the ceiling is a chain of 256 × 256 float32 matmuls "
            "on the same cores.", "",
            "| gradient steps/s | GFLOP/s | cores busy | matmul chain, GFLOP/s | share of the chain |",
            "| --- | --- | --- | --- | --- |",
            f"| {median('gradient_steps_per_s'):.0f} ({r['gradient_steps_per_s']['min']:.0f}–"
            f"{r['gradient_steps_per_s']['max']:.0f}) | {median('gflop_per_s'):.0f} | {median('cores_busy'):.2f} | "
            f"{median('matmul_chain_gflop_per_s'):.0f} | {median('gflop_per_s') / median('matmul_chain_gflop_per_s'):.2f} |",
            ""]


def gpu_section(gpu: dict) -> list[str]:
    m, dry = gpu["machine"], gpu.get("dry_run", False)
    out = ["## On a GPU (`benchmark/gpu.py`)", ""]
    if dry:
        out += ["**A dry run on the CPU (`--dry-run`: tiny sizes, virtual CPU devices for the layouts): it shows that "
                "the check works, not how fast anything is.**", ""]
    out += [f"{', '.join(m['gpus']) or 'no GPU'}; {m['cpu']}, {m['cores']} cores; code {m.get('commit')}. "
            "Each run a fresh process, compilation cache off, stopped by SIGTERM after a fixed window of training; "
            "layouts `aA-lL` name the actor's and the learner's GPUs. Steady env steps/s after the first update; "
            "actor and learner rates are `charts/actor_sps` and `charts/learner_sps`; GPU memory is the peak "
            "`nvidia-smi` reported in use over every GPU, with JAX's preallocation off. Median (min–max) over the runs.",
            ""]
    if env := gpu["results"].get("Breakout-v5/EnvPool"):
        r = env["runs"][0]
        out += [f"Raw EnvPool Breakout-v5 (random actions, send/recv, {r['num_envs']} envs, recv batch "
                f"{r['batch_size']}, {r['num_threads']} threads): {fmt(env['sps'])} env steps/s: the actor side's "
                "ceiling on this machine.", ""]
    out += ["| run | runs | first update | env steps/s | actor env steps/s | learner env steps/s | GPU memory peak |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in gpu["results"].items():
        if name != "Breakout-v5/EnvPool":
            out.append(f"| {name} | {len(r['runs'])} | {fmt(r['time_to_first_update_s'], 1)} s | {fmt(r['sps'])} | "
                       f"{fmt(r['actor_sps'])} | {fmt(r['learner_sps'])} | "
                       f"{fmt(r['gpu_memory_peak_mib'], 1, 1 / 1024)}{' GiB' * bool(r['gpu_memory_peak_mib']['n'])} |")
    breakout = gpu["results"].get("Breakout-v5/PPO/a0-l0")
    if breakout and breakout["sps"]["median"] and not dry:
        ratio = breakout["sps"]["median"] / CLEANBA_BREAKOUT_SPS
        out += ["", f"Breakout-v5 PPO (a0-l0) against Cleanba's {CLEANBA_BREAKOUT_SPS:,} env steps/s (1 A100, 10 CPU "
                f"cores): {ratio:.2f}×."]
    return [*out, ""]


def cleanba_section(cleanba: dict, learn: dict | None, img: Path, rel: str) -> list[str]:
    out = ["## Beside Cleanba's IMPALA (`benchmark/cleanba.py`)", ""]
    rows = {name: r for name, r in ((learn or {}).get("results") or {}).items()
            if name.startswith("Breakout-v5/IMPALA/2M-cleanba")}
    if rows:  # ours at Cleanba's settings, each optimizer, beside the points read off Cleanba's own curve
        from learning import CLEANBA_IMPALA_BREAKOUT_CURVE
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for name, r in rows.items():
            for run in r["runs"]:
                steps, returns = zip(*[(s, v) for s, v in run["curve"] if v is not None])
                ax.plot(steps, returns, lw=1, label=f"ours, {name.split('/')[-1]} (seed {run['seed']})")
        cleanba_steps, cleanba_returns = zip(*CLEANBA_IMPALA_BREAKOUT_CURVE)
        ax.plot(cleanba_steps, cleanba_returns, "ko--", label="Cleanba cleanba_impala.py (its README's plot, 3 seeds)")
        ax.set_xlabel("env steps")
        ax.set_ylabel("return (mean of last 20 games)")
        ax.set_title("Breakout-v5, IMPALA under Cleanba's protocol and hyperparameters")
        ax.legend(fontsize=7)
        save_fig(fig, img / "cleanba_impala_breakout.png")
        out += ["Learning at Cleanba's settings (`benchmark/learning.py`'s `Breakout-v5/IMPALA/2M-cleanba*` rows: "
                "`-cleanba` with PyTorch's RMSProp, as Cleanba; `-tf1-rmsprop` the same with TF1's) beside the points "
                "read off Cleanba's own curve (its README's main_10CPU.png, the mean of 3 seeds on an A100 with 10 CPU "
                "cores; its metric, each env's latest game averaged over envs). Cleanba's own run does not fit on "
                "these cores (its throughput below).", "",
                f"![Breakout-v5 IMPALA beside Cleanba]({rel}/cleanba_impala_breakout.png)", ""]
    parity = cleanba.get("parity")
    if parity:
        b = parity["batch"]
        out += [f"One real rollout ({b['env_id']} under the `{b['protocol']}` protocol, {b['num_envs']} envs × "
                f"{b['num_steps']} steps, {b['episode_ends']} episode ends, {b['rewards']} rewards; {b['network']}) "
                "through Cleanba's own update (cleanba_impala.py at commit "
                f"{parity['cleanba_commit'][:12]}, in .venv-cleanba) and ours (code {parity['machine'].get('commit')}, on "
                f"{parity['machine']['cpu']}), from the same parameters with the same "
                "hyperparameters. `aligned`: Cleanba fed ours' alignment of rewards, discounts and masks; `native`: "
                "the batch as Cleanba's actor stores it. Loss terms are sums over the batch; differences are "
                "‖ours − Cleanba's‖ / ‖Cleanba's‖.", "",
                "| alignment | our optimizer | loss | policy term | value term | entropy term | gradient | "
                "step after 1 update | after the last | step norm, ours ÷ Cleanba's, 1st update |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for alignment, rows in parity["results"].items():
            for optimizer, r in rows.items():
                steps = sorted((k for k in r if k.startswith("after_")), key=lambda k: int(k.split("_")[1]))
                first, last = r[steps[0]], r[steps[-1]]
                out.append(f"| {alignment} | {optimizer} | " + " | ".join(
                    f"{r[k]['relative_difference']:.1e}" for k in ("loss", "pg_loss", "v_loss", "ent_loss"))
                    + f" | {r['gradient_relative_difference']:.1e} | {first['step_relative_difference']:.1e} | "
                    f"{last['step_relative_difference']:.1e} ({steps[-1].split('_')[1]}) | "
                    f"{first['step_norm_ours'] / first['step_norm_cleanba']:.3f} (after the last: "
                    f"{last['step_norm_ours'] / last['step_norm_cleanba']:.3f}) |")
        out.append("")
    throughput = cleanba.get("throughput")
    if throughput:
        m, sps, trained = throughput["machine"], throughput["sps_lines"], throughput["training_time_s"]
        learner = (f"its learner's `training time` per update of 2,560 env steps: "
                   f"{', '.join(f'{t:.0f} s' for _, t in trained)}" if trained else
                   f"no learner update finished in the {throughput['seconds']:.0f} s (its actors' `SPS:` lines, "
                   f"{', '.join(map(str, sps)) or 'none'}, were printed while they filled their queues; then they "
                   "waited for the learner)")
        out += [f"Cleanba's `{throughput['command']}` as its users run it (its defaults: Breakout-v5, 2 actor threads "
                f"× 64 envs × 20 steps, 4 minibatches, actor and learner on device 0) on {m['cpu']}, {m['cores']} "
                f"cores, stopped after {throughput['seconds']:.0f} s: {learner}.", ""]
    return out


def mean_spread(values: list[float], digits: int) -> str:
    """"mean ± std" over seeds; one seed's figure alone (a std of one run would read as no spread)."""
    return f"{statistics.fmean(values):,.{digits}f}" + (
        f" ± {statistics.pstdev(values):,.{digits}f}" if len(values) > 1 else "")


def return_digits(values: list[float]) -> int:
    """Decimals for returns: 2 where they lie in [0, 10) (MiniGrid's in [0, 1]), else 1."""
    return 2 if max(map(abs, values)) < 10 else 1


def reference_text(ref: list | None) -> str:
    """A learning row's reference, "figure ± std (source)"; a threshold (no std, or 0) without the ±."""
    return (f"{ref[0]:,.1f}" + (f" ± {ref[1]:,.1f}" if ref[1] else "") + f" ({ref[2]})") if ref else "–"


def learning_section(learn: dict, img: Path, rel: str) -> list[str]:
    def mean_std(values):
        values = [v for v in values if v is not None]
        return mean_spread(values, return_digits(values)) if values else "n/a"
    out = ["## Learning quality (`benchmark/learning.py`)", "",
           "End-of-run return by CleanRL's protocol: the mean raw return of the last 20 finished training games "
           "at the end of each run (`episodic_return_mean`), then mean ± std over seeds. Final evaluation: "
           "`final_eval` in summary.json (10 games with sampled actions on a separate pool; MiniGrid and BabyAI: 100 games, "
           "with each seed's success rate, the share of games with a positive return), mean ± std over seeds. Wall clock: one run, launch to exit, median over seeds. Code: the commit each task ran on.", "",
           "| task | seeds | reference (published) | ours, end of run | ours, final evaluation | target | | wall clock "
           "per run | code |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in learn["results"].items():
        ref = r["reference"]
        reference = reference_text(ref)
        wall = statistics.median(run["wall_s"] for run in r["runs"])
        verdict = {True: "met", False: "missed", None: ""}[r["met"]]
        successes = [x["final_success"] for x in r["runs"] if x.get("final_success") is not None]
        success = f" (success {', '.join(f'{v:.2f}' for v in successes)})" if name.startswith(("MiniGrid", "BabyAI")) else ""
        cut = f" (cut to {r['budget']:,} env steps)" if r.get("budget") else ""  # learning.py --budget
        stopped = [x["global_step"] for x in r["runs"] if x.get("unfinished")]  # resumes with the same command
        cut += f" (unfinished: stopped at {min(stopped):,} env steps)" if stopped else ""
        out.append(f"| {name}{cut} | {len(r['runs'])} | {reference} | {mean_std([x['end_return'] for x in r['runs']])} | "
                   f"{mean_std([x['final_eval'] for x in r['runs']])}{success} | {r['target'] or '–'} | {verdict} | {wall:,.0f} s | "
                   f"{r.get('commit') or learn['machine'].get('commit') or '?'}{measured_on(r, learn)} |")
        timed = all(run.get("wall_curve") for run in r["runs"])  # rows run since learning.py recorded the clock
        fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 3.5), squeeze=False)
        ax = axes[0][0]
        if timed:  # the same curve against wall clock: every session of a resumed run, one after the other
            for run in r["runs"]:
                points = [(t / 60, v) for t, (_, v) in zip(run["wall_curve"], run["curve"]) if v is not None]
                axes[0][1].plot([t for t, _ in points], [v for _, v in points], color="C0", lw=0.8)
            if ref:
                axes[0][1].axhline(ref[0], color="grey", ls="--", lw=1)
            axes[0][1].set(xlabel="wall clock, minutes on 2 CPU cores (each seed)", title=f"{name}, against time")
        curves = [[(s, v) for s, v in run["curve"] if v is not None] for run in r["runs"]]
        curves = [c for c in curves if c]
        if curves:
            grid = sorted({s for c in curves for s, _ in c})
            at = [[next((v for s, v in reversed(c) if s <= g), None) for c in curves] for g in grid]
            keep = [(g, [v for v in vs if v is not None]) for g, vs in zip(grid, at)]
            keep = [(g, vs) for g, vs in keep if vs]
            means = [statistics.fmean(vs) for _, vs in keep]
            stds = [statistics.pstdev(vs) for _, vs in keep]
            steps = [g for g, _ in keep]
            for c in curves:  # each seed thin: a mean over seeds that split (some learn, some do not) hides it
                ax.plot([s for s, _ in c], [v for _, v in c], color="C0", lw=0.5, alpha=0.5)
            ax.plot(steps, means, color="C0", label=f"ours ({len(curves)} seed{'s' if len(curves) > 1 else ''}: "
                    f"{'mean ± std, each seed thin' if len(curves) > 1 else 'its curve'})")
            ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                            color="C0", alpha=0.25)
        ppo = learn["results"].get(name.replace("/SAC/", "/PPO/"))  # SAC's rows: PPO's curve on the same axes
        if "/SAC/" in name and ppo:
            runs = [[(s, v) for s, v in run["curve"] if v is not None] for run in ppo["runs"]]
            grid = sorted({s for c in runs for s, _ in c})
            means = [statistics.fmean(vs) for g in grid
                     if (vs := [v for c in runs if (v := next((v for s, v in reversed(c) if s <= g), None)) is not None])]
            ax.plot(grid[len(grid) - len(means):], means, color="C1", label=f"PPO ({len(runs)} seeds, mean)")
        if ref:
            ax.axhline(ref[0], color="grey", ls="--", lw=1, label="reference")
        ax.set(xlabel="env steps", ylabel="return (mean of last 20 games)", title=name)
        ax.legend()
        file = name.replace("/", "_") + ".png"
        save_fig(fig, img / "learning" / file)
        r["png"] = f"{rel}/learning/{file}"
    out.append("")
    out += [f"![{name}]({r['png']})" for name, r in learn["results"].items()]
    return [*out, ""]


def memory_section(mem: dict) -> list[str]:
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    threads, envs, steps = mem["num_actor_threads"], mem["local_num_envs"], mem["num_steps"]
    flags = " ".join(mem["run_flags"])
    minibatch = threads * envs * steps // 4
    return ["## Host memory (`benchmark/memory.py`)", "",
            f"Computed for sebulba/ppo_envpool.py on {mem['env_id']} at the script's default sizes ({threads} actor "
            f"threads × {envs} envs × {steps} steps, IMPALA ResNet 16-32-32/256, 4 minibatches of {minibatch:,} "
            f"frames). Rollouts in flight = {mem['in_flight_per_thread']} per actor thread (being assembled, queued, "
            "on the learner). Working memory = XLA's compiled temporary bytes of the program taking one gradient. "
            f"Measured: the peak RSS of `python sebulba/ppo_envpool.py {flags}`, sampled every 0.5 s from launch to "
            f"the end of its second update, median (min–max) of {mem['reps']} runs, against that run's own rollouts "
            "in flight.", "",
            "| | |", "| --- | --- |",
            f"| frames in rollouts / received by the learner's programs | {mem['rollout_obs_dtype']} / {mem['learner_obs_dtype']} |",
            f"| default sizes: one rollout (per actor thread) | {gib(mem['rollout_bytes'])} |",
            f"| default sizes: rollouts in flight | {gib(mem['in_flight_bytes'])} |",
            f"| default sizes: working memory, one {minibatch:,}-frame minibatch | {gib(mem['minibatch_working_bytes'])} |",
            f"| default sizes: working memory, as {mem['accumulation']} microbatches (one per program) | "
            f"{gib(mem['microbatch_working_bytes'])} |",
            f"| measured run: rollouts in flight | {gib(mem['run_in_flight_bytes'])} |",
            f"| measured run: peak RSS (MiB) | {fmt(mem['peak_rss_bytes'], scale=2**-20)} |",
            f"| measured run: peak RSS ÷ its rollouts in flight | {fmt(mem['peak_rss_over_in_flight'], 2)} |", ""]


def targets_section(stages, e2e, tts, mem=None, start=None, sac=None) -> list[str]:
    rows = []

    def add(measure, value, target, ok):
        rows.append(f"| {measure} | {value} | {target} | {'met' if ok else 'missed'} |")
    cart = (stages or {}).get("tasks", {}).get("CartPole-v1")
    if cart:
        eff = cart["summary"]["actor_efficiency"]["median"]
        add("actor efficiency, CartPole-v1", f"{eff:.2f}", f"≥ {ACTOR_EFFICIENCY}", eff >= ACTOR_EFFICIENCY)
    for task, t in (stages or {}).get("tasks", {}).items():
        for layout in ("a0-l0", "a0-l1,2,3"):
            row = find(e2e, "PPO", task, layout, "async")
            if row and layout in t["work_conserving_limit_sps"]:
                frac = row["sps"]["median"] / t["work_conserving_limit_sps"][layout]
                aim = CLEANRL_BREAKOUT_FRACTION if task == CLEANRL_BREAKOUT else LIMIT_FRACTION
                add(f"end-to-end ÷ limit, PPO {task} {layout}", f"{frac:.2f}", f"≥ {aim}", frac >= aim)
    cart_rows = [r for r in (e2e or {}).get("rows", []) if r["algo"] == "PPO" and r["task"] == "CartPole-v1"]
    if cart_rows:
        best = max(cart_rows, key=lambda r: r["sps"]["median"])
        add(f"CartPole-v1 end-to-end env steps/s, PPO (best: {best['layout']} {best['mode']}{best['sweep']})",
            f"{best['sps']['median']:,.0f}", f"≥ {CARTPOLE_SPS:,}", best["sps"]["median"] >= CARTPOLE_SPS)
    if tts and "PPO" in tts["results"]:
        s = tts["results"]["PPO"]["seconds"]["median"]
        add("CartPole-v1 wall clock to return ≥ 475, PPO, median", f"{s:.1f} s" if s else "unsolved", f"< {SOLVE_S} s",
            bool(s) and s < SOLVE_S)
    row = find(e2e, "PPO", CLEANRL_BREAKOUT, "a0-l0", "async")
    if row:
        add(f"{CLEANRL_BREAKOUT} a0-l0 steady env steps/s, PPO", f"{row['sps']['median']:.0f}",
            f"≥ {CLEANRL_BREAKOUT_SPS}", row["sps"]["median"] >= CLEANRL_BREAKOUT_SPS)
    row = find(e2e, "PPO", "Breakout-v5", "a0-l1,2,3", "async")
    if row:
        add("Breakout-v5 a0-l1,2,3 steady env steps/s, PPO", f"{row['sps']['median']:.0f}", f"≥ {BREAKOUT_SPS}",
            row["sps"]["median"] >= BREAKOUT_SPS)
        first = row["time_to_first_update_s"]["median"]
        add("Breakout-v5 a0-l1,2,3 time to first update", f"{first:.1f} s", f"< {FIRST_UPDATE_S} s",
            first < FIRST_UPDATE_S)
    for task, layout in (("CartPole-v1", "a0-l0"), ("Breakout-v5", "a0-l1,2,3")):
        a, s = find(e2e, "PPO", task, layout, "async"), find(e2e, "PPO", task, layout, "sync")
        if a and s:
            ratio = a["sps"]["median"] / s["sps"]["median"]
            add(f"async ÷ sync, PPO {task} {layout}", f"{ratio:.2f}", f"≥ {ASYNC_RATIO}", ratio >= ASYNC_RATIO)
    if start and "PPO" in start["results"]:
        second = start["results"]["PPO"]["second_s"]["median"]
        add("CartPole-v1 PPO README command, time to first update on its second run (compilation cache)",
            f"{second:.1f} s", f"≤ {SECOND_RUN_FIRST_UPDATE_S} s", second <= SECOND_RUN_FIRST_UPDATE_S)
    if sac:
        steps = sac["results"]["gradient_steps_per_s"]["median"]
        add(f"SAC gradient steps/s, CleanRL's sizes, the update alone ({sac['results']['env_id']}, sac_step.py)",
            f"{steps:.0f}", f"≥ {SAC_GRADIENT_STEPS}", steps >= SAC_GRADIENT_STEPS)
    row = find(e2e, "SAC", "Hopper-v4", "a0-l0", "async", ", replay ratio 1")
    if row:
        steps = row["sps"]["median"] * row["replay_ratio"]
        add("SAC gradient steps/s end to end, Hopper-v4 a0-l0, replay ratio 1", f"{steps:.0f}",
            f"≥ {SAC_GRADIENT_STEPS}", steps >= SAC_GRADIENT_STEPS)
    if mem:
        uint8 = mem["rollout_obs_dtype"] == mem["learner_obs_dtype"] == "uint8"
        add("Breakout-v5 frames stay uint8 until the network (rollouts / learner programs' input; float only "
            "for one microbatch inside: tests/test_learner.py::test_frames_stay_uint8_until_the_network)",
            f"{mem['rollout_obs_dtype']} / {mem['learner_obs_dtype']}", "uint8", uint8)
        ratio = mem["peak_rss_over_in_flight"]["median"]
        sizes = "--quick sizes" if mem["quick"] else f"default sizes (--gradient-accumulation-steps {mem['accumulation']})"
        add(f"peak RSS ÷ rollouts in flight, Breakout-v5 {sizes}", f"{ratio:.2f} ({mem['peak_rss_bytes']['median'] / 2**30:.1f} GiB)",
            f"≤ {RSS_RATIO}", ratio <= RSS_RATIO)
    if not rows:
        return []
    return ["## Performance targets", "", "Measured here against the project's performance targets.", "",
            "| measure | measured (median) | target | |", "| --- | --- | --- | --- |", *rows, ""]


# README's presets (the anchor of each one's commands) and the learning.py rows that measure them, in README's order.
README_PRESETS = [
    ("CartPole-v1, PPO", "cartpole-v1-ppo", ["CartPole-v1/PPO/100k"]),
    ("CartPole-v1, IMPALA", "cartpole-v1-impala", ["CartPole-v1/IMPALA"]),
    ("CartPole-v1, PQN", "cartpole-v1-pqn", ["CartPole-v1/PQN/500k", "CartPole-v1/PQN/500k-lag0"]),
    ("CartPole-v1, PPO-LSTM", "cartpole-v1-ppo-lstm", []),
    ("MuJoCo, PPO", "mujoco-ppo", ["HalfCheetah-v4/PPO/1M", "Hopper-v4/PPO/1M", "Walker2d-v4/PPO/1M"]),
    ("MiniGrid-MemoryS7-v0, PPO-LSTM", "minigrid-memorys7-v0-ppo-lstm", ["MiniGrid-MemoryS7-v0/PPO-LSTM/4M",
                                                                         "MiniGrid-MemoryS7-v0/PPO/4M"]),
    ("MiniGrid and BabyAI, PPO reading the mission", "minigrid-and-babyai-ppo-reading-the-mission",
     ["MiniGrid-GoToDoor-5x5-v0/PPO/500k", "MiniGrid-GoToDoor-5x5-v0/PPO-mission-hidden/500k",
      "BabyAI-GoToLocal-v0/PPO/2M"]),
    ("SAC", "sac", ["Hopper-v4/SAC/300k", "HalfCheetah-v4/SAC/300k", "Walker2d-v4/SAC/300k"]),
    ("Other task families", "other-task-families", ["LunarLander-v2/PPO/1M", "LunarLander-v2/PQN/1M",
                                                    "CheetahRun-v1/PPO/1M", "CheetahRun-v1/SAC/500k",
                                                    "WalkerWalk-v1/SAC/500k", "StarpilotEasy-v0/PPO/2M-nature",
                                                    "CarRacing-v2/PPO/1M"]),
    ("Atari", "atari", ["Breakout-v5/PPO/2M-cleanrl", "Breakout-v5/PQN/2M-cleanrl", "Breakout-v5/IMPALA/2M-cleanba"]),
]
PRESETS_BEGIN = "<!-- presets: generated by benchmark/report.py from benchmark/results/learning.json; do not edit -->"
PRESETS_END = "<!-- /presets -->"


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def presets_table(learn: dict) -> list[str]:
    """README's presets table: for each learning.py row of a preset, what it reached (the last-20 mean of training
    games at the end, and the final evaluation; success rates on MiniGrid and BabyAI), its reference, its target
    and whether every seed's figures meet it, the seeds and the median wall clock of a run, as learning.json has
    them. A preset without a row, or whose row has not run yet, says so; a reference shows its std where it has one."""
    rows = learn["results"]
    out = ["| preset | learning.py row | reached: last-20 mean at the end; final evaluation | reference | target | "
           "seeds | a run |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, anchor, names in README_PRESETS:
        if not names:
            out.append(f"| [{label}](#{anchor}) | none | tested in the suite only (tests/) | | | | |")
        for name in names:
            if name not in rows:  # a row with a command in README and no run yet
                out.append(f"| [{label}](#{anchor}) | {name} | not run yet: `python benchmark/learning.py --only {name}` "
                           "| | | | |")
                continue
            r = rows[name]
            runs = r["runs"]
            ends = [run["end_return"] for run in runs if run.get("end_return") is not None]
            evals = [run["final_eval"] for run in runs if run.get("final_eval") is not None]
            success = [run["final_success"] for run in runs if run.get("final_success") is not None]
            digits = return_digits(ends + evals)
            reached = mean_spread(ends, digits)
            if evals:
                reached += f"; {statistics.fmean(evals):,.{digits}f}"
            if success and name.split("/")[0].startswith(("MiniGrid", "BabyAI")):
                reached += f"; success rate {statistics.fmean(success):.2f}"
            if r.get("budget"):
                reached += f" (cut at {r['budget']:,} env steps)"
            reference = reference_text(r.get("reference"))
            verdict = {True: "met", False: "**missed**", None: "–"}[r.get("met")]
            target = f"{r['target']}: {verdict}" if r.get("target") else "–"
            wall = statistics.median(run["wall_s"] for run in runs)
            out.append(f"| [{label}](#{anchor}) | {name} | {reached} | {reference} | {target} | {len(runs)} | "
                       f"{duration(wall)} |")
    return out


def write_presets(learn: dict, readme: Path) -> bool:
    """Replace README's presets table (between PRESETS_BEGIN and PRESETS_END) with `presets_table`; whether it
    changed."""
    text = readme.read_text()
    head, _, rest = text.partition(PRESETS_BEGIN + "\n")
    _, _, tail = rest.partition(PRESETS_END)
    new = head + PRESETS_BEGIN + "\n" + "\n".join(presets_table(learn)) + "\n" + PRESETS_END + tail
    readme.write_text(new)
    return new != text


def save_fig(fig, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: Path, md: Path, img: Path) -> Path:
    """Write `md` from the results files in `results` (plots into `img`); for the repository's own RESULTS.md,
    README's presets table too (`write_presets`)."""
    names = ("env_throughput", "stages", "e2e", "time_to_solve", "startup", "memory", "conv", "sac_step", "learning",
             "gpu", "peers")
    env, stages, e2e, tts, start, mem, conv, sac, learn, gpu, peers = parts = [load(results, n) for n in names]
    cleanba = load(results, "cleanba")  # two parts of its own (parity, throughput), each with its machine
    if not any(parts):
        raise SystemExit(f"no results in {results}: run benchmark/run.py first")
    rel = os.path.relpath(img, md.parent)
    quick = any(d.get("quick") for d in parts if d)
    lines = ["# Benchmark results", "",
             f"Generated by `benchmark/report.py` from `{os.path.relpath(results, ROOT)}/*.json` "
             f"({'--quick: smoke-test sizes, not for quoting' if quick else 'full mode'}); reproduce with "
             f"`python benchmark/run.py{' --quick' if quick else ''}`. "
             f"{'One short repetition each (the ranges are that one value). ' if quick else 'Medians of several runs with (min–max). '}"
             "What each figure means and how to read it: docs/benchmarks.md.", ""]
    lines += machine_section(parts, names)
    lines += targets_section(stages, e2e, tts, mem, start, sac)
    if env:
        lines += env_section(env, img, rel)
    if stages:
        lines += stage_section(stages, e2e)
    if e2e:
        lines += e2e_section(e2e, stages, img, rel)
    if tts:
        lines += solve_section(tts, img, rel)
    if start:
        lines += startup_section(start)
    if mem:
        lines += memory_section(mem)
    if conv:
        lines += conv_section(conv)
    if sac:
        lines += sac_step_section(sac)
    if learn:
        lines += learning_section(learn, img, rel)
    if cleanba:
        lines += cleanba_section(cleanba, learn, img, rel)
    if gpu:
        lines += gpu_section(gpu)
    if peers:
        lines += peers_section(peers, img, rel, save_fig)
    md.write_text("\n".join(lines))
    if learn and md.resolve() == (ROOT / "benchmark" / "RESULTS.md").resolve():
        write_presets(learn, ROOT / "README.md")
    return md


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory of the raw results")
    parser.add_argument("--md", type=Path, default=ROOT / "benchmark" / "RESULTS.md", help="markdown file to write")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img", help="directory for the PNG plots")
    cli = parser.parse_args()
    print("written:", report(cli.results, cli.md, cli.img))
