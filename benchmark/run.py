"""The benchmark suite in one command: measure, then regenerate RESULTS.md and the plots.

    python benchmark/run.py            # every part: the throughput parts, then every learning row (more than a day
                                       # on 2 cores) -> benchmark/results/, RESULTS.md, docs/img/
    python benchmark/run.py --quick    # smoke test, ~4 min -> benchmark/results/quick/ (RESULTS.md, img/)
    python benchmark/run.py --only e2e stages    # re-measure some parts, keep the others' results

Needs the `bench` extra (pip install -e ".[bench]"); without it, one line says so (exit code 2).

Runs, each in its own process on an otherwise quiet machine: env_throughput (the actor
side's physical limit), stages (each stage alone: actor efficiency, work-conserving limit),
e2e (the scripts end to end, async vs sync, every layout), time_to_solve (CartPole-v1,
PPO and IMPALA, 5 seeds), startup (time to the first update, first and second run with the
compilation cache), memory (peak host memory at the default Atari sizes), learning (learning
quality against published results, several seeds per task); then report. Every part records
the machine (CPU, cores, GPUs, library versions). --quick measures tiny versions of the same
(CartPole only beyond env throughput and memory; learning only with --only learning) into
benchmark/results/quick/, never over the full results.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("env_throughput", "stages", "e2e", "time_to_solve", "startup", "memory", "learning")
# The `bench` extra of pyproject.toml, by import name: looked for before anything imports them.
BENCH_MODULES = {"psutil": "psutil", "matplotlib": "matplotlib", "gymnasium": "gymnasium", "ale_py": "ale-py",
                 "cv2": "opencv-python-headless"}


def missing_bench_packages() -> list[str]:
    """The `bench` extra's packages that Python cannot import here, by their pip names."""
    return [package for module, package in BENCH_MODULES.items() if importlib.util.find_spec(module) is None]


if __name__ == "__main__" and (missing := missing_bench_packages()):
    print(f"error: the benchmarks need the bench extra ({', '.join(missing)} missing): pip install -e \".[bench]\"",
          file=sys.stderr)
    sys.exit(2)

from common import RESULTS, ROOT  # noqa: E402 - psutil (the bench extra)
from report import report  # noqa: E402 - matplotlib (the bench extra)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (~4 min on 2 cores)")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="parts to (re)measure (default: all; --quick: all but "
                        "learning)")
    cli = parser.parse_args()
    out = RESULTS / "quick" if cli.quick else RESULTS
    here = Path(__file__).resolve().parent
    start = time.perf_counter()
    for part in cli.only or [p for p in PARTS if not (cli.quick and p == "learning")]:
        print(f"== {part}", flush=True)
        code = subprocess.run([sys.executable, str(here / f"{part}.py"), "--out", str(out), *["--quick"] * cli.quick],
                              cwd=here).returncode
        if code:  # its traceback is above; a second one from here would only repeat the exit code
            print(f"error: benchmark/{part}.py failed (exit {code}); its output is above", file=sys.stderr)
            sys.exit(1)
    md = out / "RESULTS.md" if cli.quick else ROOT / "benchmark" / "RESULTS.md"
    img = out / "img" if cli.quick else ROOT / "docs" / "img"
    print(f"== report: {report(out, md, img)}, plots in {img} ({time.perf_counter() - start:.0f} s in all)")
