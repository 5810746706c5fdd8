"""Wall-clock time to solve CartPole-v1 with the README presets, PPO and IMPALA.

    python benchmark/time_to_solve.py            # 5 seeds per script, full runs (~8 min on 2 cores)
    python benchmark/time_to_solve.py --quick    # PPO, seed 1, stopped when solved (~25 s)

"Solved": the script's `episodic_return_mean` (mean raw return of the last 20 finished
episodes, printed every update with --log-frequency 1) reaches 475. Time is wall-clock from
launching `python sebulba/<script> ...` in a fresh process (imports and compilation
included), the way a user waits for it. Runs that never reach 475 count as unsolved and are
reported as such, not dropped silently. Every console line is kept as a learning curve
(seconds since launch, env steps, return). Writes benchmark/results/time_to_solve.json (or
under --out).
"""

from __future__ import annotations

from common import IMPALA_CARTPOLE, PPO_CARTPOLE, cli_parser, run_script, save, spread, time_to_return

THRESHOLD = 475.0
PRESETS = {"PPO": ("ppo_envpool.py", PPO_CARTPOLE), "IMPALA": ("impala_envpool.py", IMPALA_CARTPOLE)}


def run(quick: bool, seeds: list[int]) -> dict:
    results = {}
    for algo, (script, flags) in PRESETS.items():
        if quick and algo != "PPO":
            continue
        runs = []
        for seed in seeds:
            result = run_script(script, [*flags, "--seed", str(seed)], stop_at_return=THRESHOLD if quick else None)
            seconds, step = time_to_return(result["lines"], THRESHOLD)
            runs.append({"seed": seed, "seconds": seconds, "global_step": step, "wall_s": result["wall_s"],
                         "final_return": result["summary"].get("episodic_return_mean"),
                         "curve": [(round(t, 2), s, r if r is None else round(r, 1)) for t, s, _, r in result["lines"]]})
            print(f"{algo} seed {seed}: " + (f"solved at {seconds:.1f} s, {step:,} env steps" if seconds else
                                             f"not solved in {result['wall_s']:.0f} s") +
                  f"; final return {runs[-1]['final_return']}", flush=True)
        results[algo] = {"script": script, "flags": flags, "runs": runs,
                         "seconds": spread([r["seconds"] for r in runs]),
                         "global_step": spread([r["global_step"] for r in runs]),
                         "solved": sum(r["seconds"] is not None for r in runs), "seeds": len(runs)}
    return results


if __name__ == "__main__":
    parser = cli_parser(__doc__, "time_to_solve", "PPO, seed 1, stopped once solved")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 1..N per script")
    cli = parser.parse_args()
    seeds = [1] if cli.quick else list(range(1, cli.seeds + 1))
    print("written:", save("time_to_solve", {"quick": cli.quick, "threshold": THRESHOLD,
                                             "results": run(cli.quick, seeds)}, cli.out))
