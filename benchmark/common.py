"""Shared pieces of the benchmark suite: machine description, CPU sampling, runs of the real
scripts in fresh processes with timestamped console lines, statistics.

Nothing here imports JAX, so a benchmark can choose its device count before JAX starts.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import psutil

warnings.filterwarnings("ignore", module="gymnasium")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark" / "results"
# The scripts' console line, one per --log-frequency updates.
LINE = re.compile(r"^step\s+(\d+) \| update (\d+)/(\d+) \| sps\s+(\d+) \| return\s+(\S+)")

# The README presets: the learning-curve and time-to-solve runs use them unchanged.
PPO_CARTPOLE = ["--env-id", "CartPole-v1", "--total-timesteps", "100000", "--local-num-envs", "8", "--num-steps",
                "32", "--num-actor-threads", "1", "--hiddens", "64", "64", "--num-minibatches", "1",
                "--update-epochs", "20", "--learning-rate", "1e-3", "--gamma", "0.98", "--gae-lambda", "0.8",
                "--clip-coef", "0.2", "--ent-coef", "0.0", "--async-batch-size", "8"]
# CleanRL's MuJoCo PPO settings (ppo_continuous_action.py) over 8 envs x 256 steps, the whole pool per `recv`
# (README's MuJoCo preset with --env-id and the task's budget, 1M env steps).
PPO_MUJOCO = ["--total-timesteps", "1000000", "--local-num-envs", "8", "--num-steps", "256", "--num-actor-threads",
              "1", "--hiddens", "64", "64", "--num-minibatches", "32", "--update-epochs", "10", "--learning-rate",
              "3e-4", "--clip-coef", "0.2", "--ent-coef", "0.0", "--async-batch-size", "8"]
IMPALA_CARTPOLE = ["--env-id", "CartPole-v1", "--total-timesteps", "320000", "--local-num-envs", "8", "--num-steps",
                   "8", "--num-actor-threads", "1", "--hiddens", "64", "64", "--optimizer", "adam",
                   "--learning-rate", "7e-4", "--ent-coef", "0.0", "--max-grad-norm", "8", "--norm-reward", "True",
                   "--async-batch-size", "8"]
# Breakout as in the performance issue: 12 envs per thread, 32 steps, 4 minibatches x 4 epochs,
# IMPALA ResNet 16-32-32/256 (the script's Atari defaults otherwise).
# `recv` batch = the pool in both: the only difference between the async and sync modes of
# e2e.py is then the policy-lag bound (e2e.py sweeps smaller batches separately).
PPO_BREAKOUT = ["--env-id", "Breakout-v5", "--num-actor-threads", "1", "--local-num-envs", "12",
                "--async-batch-size", "12", "--num-steps", "32", "--num-minibatches", "4", "--update-epochs", "4"]
# CleanRL's ppo_atari_envpool.py sizes (the learning benchmark's Breakout row): its protocol, the Nature CNN, 8 envs x
# 128 steps, 4 minibatches x 4 epochs; the whole pool per `recv`.
PPO_BREAKOUT_CLEANRL = ["--env-id", "Breakout-v5", "--atari-protocol", "cleanrl", "--atari-encoder", "nature",
                        "--hiddens", "512", "--num-actor-threads", "1", "--local-num-envs", "8", "--async-batch-size", "8",
                        "--num-steps", "128", "--num-minibatches", "4", "--update-epochs", "4", "--learning-rate",
                        "2.5e-4", "--clip-coef", "0.1", "--ent-coef", "0.01"]
# CartPole for throughput: one thread x 48 envs, 32 steps, MLP 64-64, PPO's 4 minibatches x 4
# epochs: 1,536 env steps per update, divisible over 1, 2 or 3 learner devices.
PPO_CARTPOLE_THROUGHPUT = ["--env-id", "CartPole-v1", "--num-actor-threads", "1", "--local-num-envs", "48",
                           "--async-batch-size", "48", "--num-steps", "32", "--hiddens", "64", "64"]
LAYOUTS = {"a0-l0": [0], "a0-l1": [1], "a0-l1,2": [1, 2], "a0-l1,2,3": [1, 2, 3]}
# The configurations benchmark/stages.py and benchmark/e2e.py measure; `updates` per e2e run
# (rates exclude the first, which compiles); `quick`: part of --quick.
# `main_layout`: where the IMPALA and --deterministic variants are measured too.
TASKS = {
    "CartPole-v1": {"flags": PPO_CARTPOLE_THROUGHPUT, "layouts": LAYOUTS, "main_layout": "a0-l0", "updates": 30,
                    "quick": True},
    "Breakout-v5": {"flags": PPO_BREAKOUT, "layouts": {k: LAYOUTS[k] for k in ("a0-l0", "a0-l1,2,3")},
                    "main_layout": "a0-l1,2,3", "updates": 3, "quick": False},
    # PPO alone (no IMPALA or PPO-LSTM rows beside it): one process on 2 cores, the learning row's layout.
    "Breakout-v5 (CleanRL's sizes)": {"flags": PPO_BREAKOUT_CLEANRL, "layouts": {"a0-l0": LAYOUTS["a0-l0"]},
                                      "main_layout": "a0-l0", "updates": 8, "quick": False, "ppo_only": True},
}
PPO_ONLY_FLAGS = ("--num-minibatches", "--update-epochs")  # dropped from a task's flags for the IMPALA script


def flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def impala_flags(flags: list[str]) -> list[str]:
    """A PPO task's flags for sebulba/impala_envpool.py: the same actors and batch; one V-trace step per batch."""
    out, skip = [], 0
    for flag in flags:
        if skip:
            skip -= 1
        elif flag in PPO_ONLY_FLAGS:
            skip = 1
        else:
            out.append(flag)
    return out


def machine() -> dict:
    """Code version (git), CPU model, cores, GPUs (nvidia-smi), Python and library versions, date."""
    cpu = platform.processor() or "unknown"
    if Path("/proc/cpuinfo").exists():
        # A "model name" alone can hide two generations ("AMD EPYC": AVX2-only boxes and AVX-512 ones, on which
        # the same scripts ran 2-3x apart): family, model and the widest vector unit come with it.
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
        flags = info.get("flags", "").split()
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
        cpu = ", ".join(x for x in (info.get("model name", cpu), info.get("cpu family") and
                                    f"family {info['cpu family']} model {info.get('model', '?')}", isa) if x)
    gpus = []
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        gpus = [g.strip() for g in out.stdout.splitlines() if g.strip()]
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "envpool", "gymnasium", "ale-py", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    git = subprocess.run(["git", "describe", "--always"], cwd=ROOT, capture_output=True, text=True,
                         check=False).stdout.strip() or None
    # Dirty = the code that runs changed since the commit (the scripts, the benchmarks, the
    # dependencies' pins); pages, tests and the suite's own outputs do not change a measurement.
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "sebulba", "scripts",
                              "benchmark/*.py", "pyproject.toml"], cwd=ROOT,
                             capture_output=True, text=True, check=False).stdout.strip()
    git = f"{git}-dirty" if git and changed else git
    return {"commit": git, "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpus": gpus, "python": platform.python_version(), "versions": versions,
            "date": datetime.date.today().isoformat()}


def spread(values: list[float]) -> dict:
    """Median, min and max of repeated measurements (None entries, e.g. unsolved runs, excluded)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class PeriodicSampler:
    """Calls `sample()` every `period` seconds in a background thread while the `with` block
    runs (after `begin()` once, in that thread)."""

    def __init__(self, period: float = 0.5):
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def begin(self):
        pass

    def sample(self):
        raise NotImplementedError

    def _run(self):
        self.begin()
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class CpuSampler(PeriodicSampler):
    """Per-core CPU utilisation of the whole machine (percent, 0-100 per core), sampled every
    `period` seconds in a background thread while the `with` block runs; with `watch` set to
    a psutil.Process, also the peak resident memory (bytes) of that process and its children."""

    def __init__(self, period: float = 0.5):
        super().__init__(period)
        self.samples: list[tuple[float, list[float]]] = []  # (seconds since start, per-core %)
        self.watch: psutil.Process | None = None
        self.peak_rss = 0

    def _rss(self) -> int:
        try:
            return sum(p.memory_info().rss for p in [self.watch, *self.watch.children(recursive=True)])
        except psutil.Error:  # the process is gone
            return 0

    def begin(self):
        psutil.cpu_percent(percpu=True)  # the first call only starts the interval
        self.start = time.perf_counter()

    def sample(self):
        self.samples.append((time.perf_counter() - self.start, psutil.cpu_percent(percpu=True)))
        if self.watch is not None:
            self.peak_rss = max(self.peak_rss, self._rss())

    def per_core_mean(self, since: float = 0.0) -> list[float]:
        """Mean utilisation of each core over the samples taken `since` seconds after the start or later."""
        samples = [cores for t, cores in self.samples if t >= since]
        return [statistics.fmean(s[c] for s in samples) for c in range(len(samples[0]))] if samples else []

    def series(self) -> list[tuple[float, float]]:
        """(seconds, mean utilisation over cores in percent) per sample."""
        return [(t, statistics.fmean(cores)) for t, cores in self.samples]


def run_script(script: str, flags: list[str], stop_at_return: float | None = None, timeout: float = 900,
               cache_dir: Path | None = None, eval_episodes: int = 0, log_frequency: int = 1,
               env: dict[str, str] | None = None, scalars: tuple[str, ...] = (), workdir: Path | None = None,
               window: tuple[float, int] | None = None) -> dict:
    """Run `python sebulba/<script> <flags> --log-frequency 1 --eval-episodes 0` (training alone,
    no final evaluation, unless `eval_episodes`) in a fresh process and directory, compiling
    every program (no persistent compilation cache) unless `cache_dir` names one.

    Returns the run's summary.json, every console line as (seconds since launch, global step,
    update, episodic return or None), the machine's CPU utilisation over time (and per core
    after the first update, start-up excluded), the child's
    CPU-seconds (user + system), its peak resident memory (sampled every 0.5 s) and the
    wall-clock seconds. With `stop_at_return` the run is
    sent SIGTERM at the first line whose return reaches it (it checkpoints and exits 143); with
    `window` = (seconds, lines), at the first line at least that many seconds after the first
    update's line and with at least that many lines after it (a fixed window of steady training).
    `env` adds variables to the child's environment; `scalars` names TensorBoard tags whose
    logged (global step, value) pairs are returned under "scalars". With `workdir` the run lives
    in workdir/runs/bench and stays there: a run stopped before the end (a session's end, a kill)
    resumes from its newest checkpoint when called again with the same flags and `workdir`, and
    `lines` then hold only this session's; every session's output is appended to
    workdir/console.log, each line after its seconds since that session's launch and a tab
    (`logged_lines` reads every session's back).

    Raises:
      RuntimeError: the run failed (its output is included).
    """
    lines, output = [], []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with (contextlib.nullcontext(str(workdir)) if workdir else tempfile.TemporaryDirectory()) as tmp, \
            CpuSampler() as cpu:
        if workdir:
            workdir.mkdir(parents=True, exist_ok=True)
        log = open(workdir / "console.log", "a") if workdir else None  # noqa: SIM115 - closed below
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(ROOT / "sebulba" / script), *flags, "--run-name", "bench",
                                 "--log-frequency", str(log_frequency), "--eval-episodes", str(eval_episodes),
                                 "--compilation-cache-dir", str(cache_dir)], cwd=tmp, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        cpu.watch = psutil.Process(proc.pid)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        stopped = []  # a stop signal to this process goes to the run too (it checkpoints), then ends this one
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, lambda signum, _: (stopped.append(signum), proc.send_signal(signum)))
                        for s in (signal.SIGINT, signal.SIGTERM)}
        for text in proc.stdout:
            output.append(text)
            if log:  # as it comes, with seconds since launch: a session that ends mid-run keeps what it printed
                log.write(f"{time.perf_counter() - start:.1f}\t{text}")
                log.flush()
            match = LINE.match(text)
            if match:
                ret = None if match[5] == "n/a" else float(match[5])
                lines.append((time.perf_counter() - start, int(match[1]), int(match[2]), ret))
                if stop_at_return is not None and ret is not None and ret >= stop_at_return and proc.poll() is None:
                    proc.terminate()
                if window and lines[-1][0] - lines[0][0] >= window[0] and len(lines) > window[1] and proc.poll() is None:
                    proc.terminate()
        code = proc.wait()
        timer.cancel()
        for s, handler in handlers.items():
            signal.signal(s, handler)
        wall = time.perf_counter() - start
        if log:
            log.close()
        if stopped:
            print(f"{signal.Signals(stopped[0]).name}: the run exited {code} (it checkpoints on a stop signal); "
                  "the same command resumes it", file=sys.stderr, flush=True)
            raise SystemExit(128 + stopped[0])

        summary_file = Path(tmp) / "runs" / "bench" / "summary.json"
        if code not in (0, 143) or not summary_file.exists():
            raise RuntimeError(f"{script} {' '.join(flags)} exited {code}:\n{''.join(output[-40:])}")
        summary = json.loads(summary_file.read_text())
        logged = {}
        if scalars:
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
            events = EventAccumulator(str(summary_file.parent)).Reload()
            logged = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in scalars}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # Steady phase: from the first console line (first update done) on, so start-up is left out.
    steady = cpu.per_core_mean(since=lines[0][0]) if lines else []
    return {"summary": summary, "lines": lines, "cpu_series": cpu.series(), "cpu_per_core": steady,
            "cpu_s": cpu_s, "wall_s": wall, "peak_rss_bytes": cpu.peak_rss, "scalars": logged}


def logged_lines(workdir: Path) -> list[tuple]:
    """Every session's console lines of a `run_script(..., workdir=...)` run, as `run_script`'s
    `lines` with the seconds counted over the sessions one after the other (each session's
    start-up included, the time between sessions not). A session that resumed from a checkpoint
    older than the last line (the run was killed between checkpoints) redid those env steps: the
    lines it replaces are dropped from the curve, their seconds stay in the wall clock."""
    lines, offset, last = [], 0.0, 0.0
    log = workdir / "console.log"
    for entry in log.read_text().splitlines() if log.exists() else []:
        seconds, _, text = entry.partition("\t")
        if float(seconds) < last:  # a new session
            offset += last
        last = float(seconds)
        if match := LINE.match(text):
            step = int(match[1])
            while lines and lines[-1][1] >= step:  # redone after a resume from an older checkpoint
                lines.pop()
            lines.append((offset + last, step, int(match[2]), None if match[5] == "n/a" else float(match[5])))
    return lines


def random_stepper(envs):
    """For an EnvPool pool after `async_reset`: a function that does one `recv` and sends uniformly random
    discrete actions to the envs received, returning how many env steps it took."""
    rng, n = np.random.default_rng(0), envs.action_space.n

    def step():
        info = envs.recv()[-1]
        envs.send(rng.integers(0, n, len(info["env_id"])).astype(np.int32), info["env_id"])
        return len(info["env_id"])

    return step


def steady_rates(lines: list[tuple], skip: int = 1) -> tuple[float, float]:
    """(env steps/s, updates/s) between the console line after the first `skip` updates and the
    last one: compilation and start-up excluded. Needs a line per update (--log-frequency 1).

    Raises:
      ValueError: fewer than skip + 2 lines (nothing to measure between).
    """
    if len(lines) < skip + 2:
        raise ValueError(f"{len(lines)} console lines: need at least {skip + 2} updates to measure a steady rate")
    (t0, s0, u0, _), (t1, s1, u1, _) = lines[skip], lines[-1]
    return (s1 - s0) / (t1 - t0), (u1 - u0) / (t1 - t0)


def time_to_return(lines: list[tuple], threshold: float) -> tuple[float, int] | tuple[None, None]:
    """(seconds since launch, global step) of the first console line whose return >= threshold."""
    for t, step, _, ret in lines:
        if ret is not None and ret >= threshold:
            return t, step
    return None, None


def work_conserving_limit(cores: int, cpu_s_per_step: dict[str, float]) -> float:
    """Env steps/s the machine could reach if every core were busy with nothing but the
    measured work: cores / (sum of CPU-seconds per env step of each stage)."""
    return cores / sum(cpu_s_per_step.values())


def cli_parser(doc: str, name: str, quick: str | None):
    """The command line every part shares: --quick (with what it measures; none where `quick` is None) and --out."""
    import argparse
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", type=Path, default=RESULTS, help=f"directory for {name}.json (default: benchmark/results)")
    return p


def save(name: str, data: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, separators=(",", ":")))  # compact: curves are long
    return path
