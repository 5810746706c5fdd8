"""Time to the first update, with and without JAX's persistent compilation cache.

    python benchmark/startup.py            # PPO and IMPALA README presets, 3 repeats (~2 min on 2 cores)
    python benchmark/startup.py --quick    # PPO only, 1 repeat (~30 s)

Each repeat gives a script a new, empty cache directory (--compilation-cache-dir) and runs
the same command twice in fresh processes: the first run compiles every program and writes
it to the cache, the second reads them. Both are the README preset stopped after its third
update; "time to first update" is seconds from launch to the first console line (imports,
devices, env pools and compilation included), the wait a user sees. The other parts of the
suite run with the cache off, so each of their runs compiles, as a first run does. Writes
benchmark/results/startup.json (or under --out).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import IMPALA_CARTPOLE, PPO_CARTPOLE, cli_parser, flag_value, run_script, save, spread

PRESETS = {"PPO": ("ppo_envpool.py", PPO_CARTPOLE, 8 * 32), "IMPALA": ("impala_envpool.py", IMPALA_CARTPOLE, 8 * 8)}
UPDATES = 3


def with_budget(flags: list[str], steps: int) -> list[str]:
    i = flags.index("--total-timesteps")
    return [*flags[:i + 1], str(steps), *flags[i + 2:]]


def run(quick: bool, repeats: int) -> dict:
    results = {}
    for algo, (script, flags, batch) in PRESETS.items():
        if quick and algo != "PPO":
            continue
        assert int(flag_value(flags, "--local-num-envs")) * int(flag_value(flags, "--num-steps")) == batch
        flags = with_budget(flags, UPDATES * batch)
        runs = []
        for repeat in range(repeats):
            with tempfile.TemporaryDirectory() as cache:
                first, second = (run_script(script, flags, cache_dir=Path(cache)) for _ in range(2))
                entries = len(list(Path(cache).iterdir()))
            runs.append({"first_s": first["lines"][0][0], "second_s": second["lines"][0][0],
                         "first_wall_s": first["wall_s"], "second_wall_s": second["wall_s"], "cache_entries": entries})
            print(f"{algo} repeat {repeat + 1}: first update at {runs[-1]['first_s']:.1f} s (empty cache), "
                  f"{runs[-1]['second_s']:.1f} s (second run); {entries} programs cached", flush=True)
        results[algo] = {"script": script, "flags": flags, "runs": runs,
                         **{k: spread([r[k] for r in runs]) for k in ("first_s", "second_s", "first_wall_s",
                                                                       "second_wall_s")}}
    return results


if __name__ == "__main__":
    parser = cli_parser(__doc__, "startup", "PPO only, one repeat")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs per script")
    cli = parser.parse_args()
    print("written:", save("startup", {"quick": cli.quick, "updates": UPDATES,
                                       "results": run(cli.quick, 1 if cli.quick else cli.repeats)}, cli.out))
