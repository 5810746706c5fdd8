"""The benchmark suite's own arithmetic and report: rates from console lines, the
work-conserving limit, flag translation, and a report rendered from a small results set.
Speeds themselves are measured by benchmark/run.py, never asserted here."""

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import common  # noqa: E402
import report  # noqa: E402

LINES = [(10.0, 100, 1, None), (12.0, 200, 2, 20.0), (14.0, 300, 3, 480.0), (15.0, 400, 4, 500.0)]


def test_steady_rates_skip_the_compiling_update():
    sps, ups = common.steady_rates(LINES)  # from update 2 (t=12) to update 4 (t=15)
    assert sps == pytest.approx(200 / 3) and ups == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="need at least 3 updates"):
        common.steady_rates(LINES[:2])


def test_a_resumed_runs_console_lines_add_up_every_sessions_seconds(tmp_path):
    """benchmark/learning.py's runs outlive a session: run_script appends each session's console to
    console.log after its seconds since that launch; the curve's clock adds the sessions up."""
    line = "step {:>10} | update {}/9 | sps     100 | return {} | policy lag 0.00 (max 0) | eta 1s"
    (tmp_path / "console.log").write_text("\n".join([
        "2.0\trun bench: ...", f"10.0\t{line.format(100, 1, '     n/a')}", f"20.0\t{line.format(200, 2, '     1.5')}",
        "21.0\tSIGTERM: checkpointing and stopping",
        "3.0\tresumed from ...", f"12.0\t{line.format(300, 3, '     2.5')}"]) + "\n")
    assert common.logged_lines(tmp_path) == [(10.0, 100, 1, None), (20.0, 200, 2, 1.5), (21.0 + 12.0, 300, 3, 2.5)]
    assert common.logged_lines(tmp_path / "none") == []


def test_a_run_killed_between_checkpoints_keeps_one_curve(tmp_path):
    """A SIGKILL leaves no checkpoint of the last steps: the next session resumes from an older one
    and redoes them. The curve keeps the redone lines, not both; the lost seconds stay counted."""
    line = "step {:>10} | update {}/9 | sps     100 | return {} | policy lag 0.00 (max 0) | eta 1s"
    (tmp_path / "console.log").write_text("\n".join([
        f"10.0\t{line.format(100, 1, '     1.0')}", f"20.0\t{line.format(200, 2, '     2.0')}",
        f"30.0\t{line.format(300, 3, '     3.0')}",  # killed here; the newest checkpoint was update 1's
        "3.0\tresumed from ...", f"12.0\t{line.format(200, 2, '     2.5')}", f"15.0\t{line.format(300, 3, '     3.5')}",
    ]) + "\n")
    assert common.logged_lines(tmp_path) == [(10.0, 100, 1, 1.0), (30.0 + 12.0, 200, 2, 2.5), (30.0 + 15.0, 300, 3, 3.5)]


def test_time_to_return_is_the_first_line_at_the_threshold():
    assert common.time_to_return(LINES, 475) == (14.0, 300)
    assert common.time_to_return(LINES, 501) == (None, None)


def test_work_conserving_limit_and_spread():
    assert common.work_conserving_limit(2, {"env": 5e-6, "inference": 3e-6, "learning": 2e-6}) == pytest.approx(2e5)
    assert common.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def test_impala_flags_drop_ppo_only_flags():
    assert common.impala_flags(["--env-id", "X", "--num-minibatches", "4", "--update-epochs", "4", "--num-steps",
                                "8"]) == ["--env-id", "X", "--num-steps", "8"]


def test_report_renders_tables_targets_and_plots(tmp_path):
    machine = {"cpu": "test cpu", "cores": 2, "memory_gib": 1.0, "gpus": [], "python": "3.11", "versions": {},
               "date": "2026-11-30"}
    s = lambda v: common.spread([v])  # noqa: E731
    (tmp_path / "stages.json").write_text(json.dumps({"machine": machine, "reps": 1, "seconds": 1, "tasks": {
        "CartPole-v1": {"flags": ["--local-num-envs", "48"], "recv_batch": 24, "learning_cpu_s_per_step":
                        {"a0-l0": [30e-6]}, "work_conserving_limit_sps": {"a0-l0": 40_000.0},
                        "summary": {"raw_env_sps": s(2e5), "actor_sps": s(1e5), "actor_efficiency": s(0.5),
                                    "env_cpu_s_per_step": s(7e-6), "inference_cpu_s_per_step": s(12e-6)}},
        "Breakout-v5 (CleanRL's sizes)": {  # merged by `stages.py --task` from another sitting
            "flags": ["--local-num-envs", "8"], "recv_batch": 8, "learning_cpu_s_per_step": {"a0-l0": [7e-3]},
            "work_conserving_limit_sps": {"a0-l0": 280.0}, "commit": "abc1234", "cpu": "other cpu",
            "summary": {"raw_env_sps": s(2e3), "actor_sps": s(1e3), "actor_efficiency": s(0.5),
                        "env_cpu_s_per_step": s(3e-4), "inference_cpu_s_per_step": s(4e-4)}}}}))
    row = dict(algo="PPO", task="CartPole-v1", layout="a0-l0", sweep="", updates_per_s=s(10),
               time_to_first_update_s=s(9), cpu_per_core=[90, 80], peak_rss_mib=s(600), cpu_series=[(0.5, 50.0)])
    (tmp_path / "e2e.json").write_text(json.dumps({"machine": machine, "reps": 1, "rows": [
        {**row, "mode": "async", "sps": s(30_000)}, {**row, "mode": "sync", "sps": s(15_000)},
        {**row, "algo": "PPO-LSTM", "mode": "async", "sps": s(12_000), "time_to_first_update_s": s(18),
         "commit": "abc1234", "cpu": "other cpu"},  # re-measured on another box and merged
        {**row, "algo": "SAC", "task": "Hopper-v4", "mode": "async", "sweep": ", replay ratio 0.1", "replay_ratio": 0.1,
         "sps": s(2_000), "update_gradient_steps_per_s": s(150), "actor_waiting_share": s(0.05),
         "learner_waiting_share": s(0.6), "commit": "abc1234"},
        {**row, "task": "Breakout-v5 (CleanRL's sizes)", "mode": "async", "sps": s(238), "commit": "abc1234",
         "cpu": "other cpu"}]}))
    (tmp_path / "startup.json").write_text(json.dumps({"machine": {**machine, "cpu": "other cpu", "commit": "def5678"},
                                                       "updates": 3, "results": {"PPO": {
        "runs": [{"cache_entries": 59}], "first_s": s(5.9), "second_s": s(2.9)}}}))
    md = report.report(tmp_path, tmp_path / "RESULTS.md", tmp_path / "img")
    text = md.read_text()
    assert "| end-to-end ÷ limit, PPO CartPole-v1 a0-l0 | 0.75 | ≥ 0.85 | missed |" in text
    assert "| async ÷ sync, PPO CartPole-v1 a0-l0 | 2.00 | ≥ 1.5 | met |" in text
    assert "| end-to-end ÷ limit, PPO Breakout-v5 (CleanRL's sizes) a0-l0 | 0.85 | ≥ 0.8 | met |" in text
    assert "| Breakout-v5 (CleanRL's sizes) a0-l0 steady env steps/s, PPO | 238 | ≥ 400 | missed |" in text
    assert "Kept from an earlier sitting on another CPU: Breakout-v5 (CleanRL's sizes) (stages at abc1234" in text
    assert "| actor efficiency, CartPole-v1 | 0.50 | ≥ 0.85 | missed |" in text
    assert "| CartPole-v1 | a0-l0 | async | 0.40 | 2.00 |" in text  # PPO-LSTM ÷ PPO
    assert "| 600 (600–600) | abc1234, on other cpu |" in text  # each e2e row names its code and its CPU
    assert "| 600 (600–600) | ?, on test cpu |" in text  # the file's machine's, where the row records none
    assert "| startup | other cpu | 2 |" in text and "| def5678 |" in text  # each part names its own CPU and code
    assert "| Hopper-v4 | a0-l0 | 0.1 | 2,000 (2,000–2,000) | 200 | 150 (150–150) | 5% | 60% | abc1234 |" in text
    assert "(best: a0-l0 async) | 30,000 | ≥ 25,000 | met |" in text
    assert "| PPO | 5.9 (5.9–5.9) s | 2.9 (2.9–2.9) s | 59 |" in text
    assert "time to first update on its second run (compilation cache) | 2.9 s | ≤ 3.0 s | met |" in text
    assert "time_to_solve" not in text and "env_throughput.png" not in text  # absent parts are left out
    assert {p.name for p in (tmp_path / "img").iterdir()} == {"e2e_async_vs_sync.png", "e2e_learner_scaling.png",
                                                               "cpu_utilisation.png"}


def test_e2e_recurrent_rows_sit_beside_ppo_and_merge_by_name():
    import e2e
    rows = e2e.configurations(quick=False, recurrent=True)
    lstm = [(r["task"], r["layout"], r["mode"]) for r in rows if r["algo"] == "PPO-LSTM"]
    assert lstm == [("CartPole-v1", "a0-l0", "async"), ("CartPole-v1", "a0-l0", "sync"),
                    ("Breakout-v5", "a0-l1,2,3", "async")]
    assert [(r["task"], r["layout"], r["mode"]) for r in rows if r["algo"] == "PPO"] == lstm
    assert all(r["script"] == "ppo_lstm_envpool.py" for r in rows if r["algo"] == "PPO-LSTM")
    previous = {"machine": {"commit": "old", "cpu": "old cpu"},
                "rows": [{"name": "a", "sps": 1}, {"name": "b", "sps": 2}, {"name": "d", "sps": 5, "commit": "older"}]}
    merged = e2e.merge(previous, [{"name": "b", "sps": 3, "commit": "new", "cpu": "new cpu"},
                                  {"name": "c", "sps": 4, "commit": "new", "cpu": "new cpu"}])
    assert merged == [{"name": "a", "sps": 1, "commit": "old", "cpu": "old cpu"},
                      {"name": "b", "sps": 3, "commit": "new", "cpu": "new cpu"},
                      {"name": "d", "sps": 5, "commit": "older", "cpu": "old cpu"},
                      {"name": "c", "sps": 4, "commit": "new", "cpu": "new cpu"}]


def test_e2e_off_policy_rows_are_sac_at_two_replay_ratios():
    import e2e
    rows = e2e.off_policy_configurations()
    assert [(r["layout"], r["replay_ratio"]) for r in rows] == [("a0-l0", 1.0), ("a0-l0", 0.1), ("a0-l1", 1.0),
                                                                ("a0-l1", 0.1)]
    for r in rows:  # 10 random updates of 128 env steps, then the measured ones
        total = int(common.flag_value(r["flags"], "--total-timesteps"))
        assert r["script"] == "sac_envpool.py" and total == (10 + e2e.SAC_UPDATES[f"{r['replay_ratio']:g}"]) * 128


def test_learning_targets_and_report(tmp_path):
    import learning

    def run(end, final=500.0, curve=((1000, 100.0), (2000, 480.0), (3000, 500.0))):
        return {"seed": 1, "wall_s": 60.0, "end_return": end, "final_eval": final, "curve": list(curve)}
    ref = (1442.6, 46.0, "CleanRL")
    assert learning.met("mean ≥ ref − 1 std", [run(1400.0), run(1393.4)], ref)  # mean 1396.7 vs 1442.6 - 46.0
    assert not learning.met("mean ≥ ref − 1 std", [run(1400.0), run(1393.0)], ref)
    assert learning.met("mean ≥ 480", [run(500.0), run(469.1), run(500.0)], None)
    assert not learning.met("mean ≥ 480", [run(500.0), run(459.9)], None)
    assert not learning.met("every seed ends ≥ 475, final eval too", [run(500.0, final=318.0)], None)
    dip = ((1000, 476.0), (2000, 449.0), (3000, 500.0))  # reached 475, then fell below 450
    assert not learning.met("every seed reaches ≥ 475 and the last-20 mean stays ≥ 450 after", [run(500.0, curve=dip)],
                            None)
    assert learning.met("every seed reaches ≥ 475 and the last-20 mean stays ≥ 450 after", [run(500.0)], None)
    reaches = learning.TASKS["CartPole-v1/PQN/500k"][4]
    assert learning.met(reaches, [run(300.0, curve=dip), run(500.0)], None)  # reached, whatever came after
    assert not learning.met(reaches, [run(500.0), run(474.0, curve=((1000, 474.9), (2000, None)))], None)
    assert not learning.met("mean ≥ 480", [run(None)], None)  # a run without a finished game fails
    hopper = learning.TASKS["Hopper-v4/SAC/300k"][4]  # the mean over seeds at 300k env steps
    assert learning.met(hopper, [run(2500.0), run(1500.0), run(2000.0)], None)
    assert not learning.met(hopper, [run(2500.0), run(1500.0), run(1999.0)], None)
    memory = lambda success: {**run(0.9), "final_success": success}  # noqa: E731
    assert learning.met("every seed's final success rate ≥ 0.9", [memory(0.97), memory(0.9)], None)
    assert not learning.met("every seed's final success rate ≥ 0.9", [memory(0.97), memory(0.89)], None)
    assert learning.met("final success rate near guessing (≤ 0.7)", [memory(0.52), memory(0.61)], None)
    breakout = learning.TASKS["Breakout-v5/IMPALA/1.5M"][4]
    assert learning.met(breakout, [run(10.0)], None) and not learning.met(breakout, [run(9.9)], None)
    assert not learning.met("final success rate near guessing (≤ 0.7)", [memory(0.52), memory(0.95)], None)
    machine = {"cpu": "test cpu", "cores": 2, "memory_gib": 1.0, "gpus": [], "python": "3.11", "versions": {},
               "date": "2026-12-01"}
    (tmp_path / "learning.json").write_text(json.dumps({"machine": machine, "quick": False, "results": {
        "HalfCheetah-v4/PPO/1M": {"script": "ppo_envpool.py", "flags": [], "reference": list(ref),
                                  "target": "mean ≥ ref − 1 std", "runs": [run(1500.0), run(1300.0)], "met": True},
        "HalfCheetah-v4/SAC/1M": {"script": "sac_envpool.py", "flags": [], "reference": [9634.9, 1423.7, "CleanRL"],
                                  "target": "mean ≥ ref − 1 std", "runs": [run(9000.0)], "met": True}}}))
    text = report.report(tmp_path, tmp_path / "RESULTS.md", tmp_path / "img").read_text()
    assert ("| HalfCheetah-v4/PPO/1M | 2 | 1,442.6 ± 46.0 (CleanRL) | 1,400.0 ± 100.0 | 500.0 ± 0.0 | "
            "mean ≥ ref − 1 std | met | 60 s | ?, on test cpu |") in text
    assert (tmp_path / "img" / "learning" / "HalfCheetah-v4_PPO_1M.png").exists()
    assert "| HalfCheetah-v4/SAC/1M | 1 | 9,634.9 ± 1,423.7 (CleanRL) | 9,000.0 |" in text  # one seed: no spread
    assert (tmp_path / "img" / "learning" / "HalfCheetah-v4_SAC_1M.png").exists()  # with PPO's curve beside it


@pytest.mark.slow  # compiles programs (or starts processes): not the fast tier's math and bookkeeping
@pytest.mark.parametrize("driver, reason", [(False, "nvidia-smi is not on this machine"), (True, "JAX sees no GPU")])
def test_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path, driver, reason):
    """On a CPU-only machine (and with an NVIDIA driver but a CPU-only JAX): exit 2, one line
    on stderr, nothing written."""
    import os
    import subprocess
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    if driver:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    path = os.pathsep.join([str(bin_dir)] + [p for p in os.environ["PATH"].split(os.pathsep)
                                             if not (Path(p) / "nvidia-smi").exists()])
    proc = subprocess.run([sys.executable, str(Path(common.ROOT) / "benchmark" / "gpu.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path})
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and reason in proc.stderr
    assert not out.exists()


def test_report_renders_the_gpu_section(tmp_path):
    machine = {"cpu": "test cpu", "cores": 16, "memory_gib": 128.0, "gpus": ["NVIDIA H200, 143771 MiB"],
               "python": "3.11", "versions": {}, "date": "2026-12-01", "commit": "abc1234"}
    s = lambda v: common.spread([v])  # noqa: E731
    run = {"script": "ppo_envpool.py", "flags": [], "runs": [{}, {}], "time_to_first_update_s": s(31.0),
           "sps": s(9150.0), "actor_sps": s(12000.0), "learner_sps": s(30000.0), "gpu_memory_peak_mib": s(3584.0)}
    (tmp_path / "gpu.json").write_text(json.dumps({"machine": machine, "dry_run": False, "gpus_used": 1, "results": {
        "Breakout-v5/EnvPool": {"runs": [{"num_envs": 64, "batch_size": 32, "num_threads": 16}], "sps": s(40000.0)},
        "Breakout-v5/PPO/a0-l0": run}}))
    text = report.report(tmp_path, tmp_path / "RESULTS.md", tmp_path / "img").read_text()
    assert "NVIDIA H200, 143771 MiB; test cpu, 16 cores; code abc1234" in text and "dry run" not in text
    assert "(random actions, send/recv, 64 envs, recv batch 32, 16 threads): 40,000 (40,000–40,000) env steps/s" in text
    assert ("| Breakout-v5/PPO/a0-l0 | 2 | 31.0 (31.0–31.0) s | 9,150 (9,150–9,150) | 12,000 (12,000–12,000) | "
            "30,000 (30,000–30,000) | 3.5 (3.5–3.5) GiB |") in text
    assert "(1 A100, 10 CPU cores): 1.50×." in text


@pytest.mark.slow
def test_gpu_check_dry_run_on_the_cpu_writes_its_results_and_section(tmp_path):
    """`benchmark/gpu.py --dry-run`, as CI runs it so the check cannot rot: raw EnvPool and PPO on the split layout
    over two virtual CPU devices at tiny sizes, gpu.json and a RESULTS.md that says it was a dry run."""
    import subprocess
    proc = subprocess.run([sys.executable, str(Path(common.ROOT) / "benchmark" / "gpu.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["dry_run"] and set(written["results"]) == {"Breakout-v5/EnvPool", "Breakout-v5/PPO/a0-l1"}
    for name, r in written["results"].items():
        assert r["sps"]["median"] > 0, name
        if name != "Breakout-v5/EnvPool":
            run = r["runs"][0]
            assert run["updates"] >= 3 and run["actor_sps"] > 0 and run["learner_sps"] > 0, name
            assert run["gpu_memory_peak_mib"] is None  # no nvidia-smi here
    ppo = written["results"]["Breakout-v5/PPO/a0-l1"]["flags"]
    assert ppo[ppo.index("--learner-device-ids") + 1] == "1"
    text = (tmp_path / "RESULTS.md").read_text()
    assert "**A dry run on the CPU" in text and "| Breakout-v5/PPO/a0-l1 | 1 |" in text


@pytest.mark.slow
def test_run_without_the_bench_extra_names_it_in_one_line(tmp_path):
    """`benchmark/run.py --quick` where ale-py cannot be imported: exit 2, one line naming the
    extra to install, before any part starts (it ended in two tracebacks)."""
    import subprocess
    hide = ("import runpy, sys; sys.modules['ale_py'] = None; sys.argv = ['run.py', '--quick']; "
            f"runpy.run_path({str(Path(common.ROOT) / 'benchmark' / 'run.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ale-py" in lines[0] and lines[0].endswith('pip install -e ".[bench]"'), proc.stderr


def test_peer_outputs_become_curves_of_the_last_20_games_against_launch_time():
    """Each system's progress as its users read it, into (seconds since launch, env steps, mean
    return of the last 20 games): ours' console line, CleanRL's line per game (averaged here over
    the last 20), the Zoo's SB3 table, Sample Factory's periodic report."""
    import peers

    ours = peers.Progress("ours")
    ours.feed(5.0, "step        256 | update 1/400 | sps     120 | return      n/a | policy lag 0.00 (max 0) | eta  9s\n")
    ours.feed(6.0, "step        512 | update 2/400 | sps     300 | return     21.5 | policy lag 1.00 (max 1) | eta  8s\n")
    assert ours.points == [(6.0, 512, 21.5)]

    cleanrl = peers.Progress("cleanrl")
    for i in range(25):  # games of return 0, 1, ..., 24: the last 20 are 5..24
        cleanrl.feed(float(i), f"global_step={100 * i}, episodic_return=[{i}.]\n")
    cleanrl.feed(30.0, "SPS: 1234\n")
    assert cleanrl.points[-1] == (24.0, 2400, sum(range(5, 25)) / 20) and len(cleanrl.points) == 25

    sb3 = peers.Progress("sb3")
    for line in ["| rollout/           |          |", "|    ep_len_mean     | 23       |",
                 "|    ep_rew_mean     | 20.7     |", "| time/              |          |",
                 "|    total_timesteps | 2048     |", "|    ep_rew_mean          | 1.02e+03    |",
                 "|    total_timesteps      | 4096        |"]:
        sb3.feed(7.0, line + "\n")
    assert sb3.points == [(7.0, 2048, 20.7), (7.0, 4096, 1020.0)]

    sf = peers.Progress("sample_factory")
    sf.feed(9.0, "[2026-12-03 07:30:01,123][01234] Avg episode reward: [(0, '3.000')]\n")  # before any frame count
    sf.feed(10.0, "[2026-12-03 07:30:05,123][01234] Fps is (10 sec: 4096.0, 60 sec: 4096.0, 300 sec: 4096.0). "
                  "Total num frames: 40960. Throughput: 0: 4096.0. Samples: 40960. Policy #0 lag: (min: 0.0)\n")
    sf.feed(10.1, "[2026-12-03 07:30:05,124][01234] Avg episode reward: [(0, '476.350')], avg true_objective\n")
    assert sf.points == [(10.1, 40960, 476.35)]
    assert sf.reached(475.0) == (10.1, 40960) and sf.reached(500.0) == (None, None)
    sf.feed(12.0, "[2026-12-03 07:30:07,000][01234] Collected {0: 41472}, FPS: 3400.0\n")
    assert sf.collected == 41472  # the env steps it ran: its last batch went past the budget


def test_peer_commands_carry_the_same_ppo_in_each_systems_words(tmp_path):
    """Equal work: the same batch, minibatches, epochs and learning rate in every system's flags;
    the presets: each system's own defaults with only the logging window set."""
    import peers

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    h = peers.EQUAL["Hopper-v4"]
    ours = peers.command("ours", "Hopper-v4", "equal", 3, tmp_path)
    assert [value(ours, f) for f in ("--total-timesteps", "--local-num-envs", "--num-steps", "--num-minibatches",
                                     "--update-epochs", "--learning-rate", "--seed")] == [
        str(peers.BUDGET), "8", "256", "32", "10", "3e-4", "3"]
    cleanrl = peers.command("cleanrl", "Hopper-v4", "equal", 3, tmp_path)
    assert value(cleanrl, "-m") == "cleanrl.ppo_continuous_action"
    assert [value(cleanrl, f) for f in ("--total-timesteps", "--num-envs", "--num-steps", "--num-minibatches",
                                        "--update-epochs", "--learning-rate")] == [
        str(peers.BUDGET), "8", "256", "32", "10", "0.0003"]
    sb3 = peers.command("sb3", "Hopper-v4", "equal", 3, tmp_path)
    assert value(sb3, "-n") == str(peers.BUDGET)
    assert {"n_envs:8", "n_steps:256", "batch_size:64", "n_epochs:10", "learning_rate:'lin_0.0003'",
            "normalize:True", "stats_window_size:20"} <= set(sb3)
    sf = peers.command("sample_factory", "Hopper-v4", "equal", 3, tmp_path)
    assert {f"--train_for_env_steps={peers.BUDGET}", "--batch_size=64", "--num_batches_per_epoch=32",
            "--num_epochs=10", "--rollout=64", "--num_envs_per_worker=4", "--use_rnn=False",
            "--learning_rate=0.0003"} <= set(sf)
    assert h["envs"] * h["steps"] == 2048  # 32 minibatches of 64: every system's batch

    assert peers.command("ours", "CartPole-v1", "preset", 1, tmp_path)[2:-8] == common.PPO_CARTPOLE
    assert value(peers.command("sb3", "CartPole-v1", "preset", 1, tmp_path), "--hyperparams") == "stats_window_size:20"
    assert "-n" not in peers.command("sb3", "CartPole-v1", "preset", 1, tmp_path)  # the Zoo's own budget
    assert not any(a.startswith("--num-") for a in peers.command("cleanrl", "CartPole-v1", "preset", 1, tmp_path))
    sf_preset = peers.command("sample_factory", "CartPole-v1", "preset", 1, tmp_path)  # its docstring's command
    assert {"--use_rnn=False", "--batch_size=512", "--reward_scale=0.1"} <= set(sf_preset)
    assert not any(a.startswith("--train_for_env_steps") for a in sf_preset)
    with pytest.raises(ValueError, match="unknown system rllib: use one of ours, cleanrl, sb3, sample_factory"):
        peers.command("rllib", "CartPole-v1", "preset", 1, tmp_path)


def test_peers_report_compares_each_peer_with_ours(tmp_path):
    import peers

    s = lambda v: common.spread([v])  # noqa: E731
    machine = {"cpu": "test cpu", "cores": 2, "memory_gib": 1.0, "gpus": [], "python": "3.11", "versions": {},
               "date": "2026-12-03"}
    run = {"command": "python sebulba/ppo_envpool.py --env-id CartPole-v1 --seed 1", "curve": [(1.0, 256, 9.0),
                                                                                               (10.0, 25600, 480.0)]}
    data = {"machine": machine, "budget": 102400, "targets": peers.TARGETS, "caps": peers.CAPS, "window": 20,
            "equal": peers.EQUAL, "peer_versions": {"extra": {"stable-baselines3": "2.9.2"}, "venv": {"cleanrl": "1.2.0"}},
            "results": {"CartPole-v1": {
                "equal": {"ours": {"name": "ours", "runs": [run], "error": None, "wall_s": s(30.0), "sps": s(3413.3),
                                   "final_return": s(500.0)},
                          "sb3": {"name": "SB3", "runs": [run], "error": None, "wall_s": s(60.0), "sps": s(1706.7),
                                  "final_return": s(480.0)},
                          "cleanrl": {"name": "CleanRL", "runs": [], "error": "Traceback\nImportError: no gym",
                                      "wall_s": s(None), "sps": s(None), "final_return": s(None)}},
                "preset": {"ours": {"name": "ours", "runs": [run], "error": None, "seconds": s(10.0),
                                    "global_step": s(25600), "reached": 1, "seeds": 1},
                           "sb3": {"name": "SB3", "runs": [run], "error": None, "seconds": s(25.0),
                                   "global_step": s(20000), "reached": 1, "seeds": 1}}}}}
    (tmp_path / "peers.json").write_text(json.dumps(data))
    text = report.report(tmp_path, tmp_path / "RESULTS.md", tmp_path / "img").read_text()
    assert "Beside this project (the `peers` extra): stable-baselines3 2.9.2; in .venv-peers/: cleanrl 1.2.0." in text
    assert "| SB3 | 1 | 60 (60–60) | 1,707 (1,707–1,707) | 2.0× (missed) | 480 (480–480) |" in text
    assert "| CleanRL | failed: ImportError: no gym |" in text
    assert "| SB3 | 1 of 1 | 25 (25–25) | 20,000 (20,000–20,000) | 2.5× (met) |" in text
    assert {p.name for p in (tmp_path / "img").iterdir()} == {"peers_cartpole.png"}


def test_sac_peers_run_cleanrls_hyperparameters_and_the_report_compares_gradient_steps(tmp_path):
    """SAC at equal work: CleanRL sac_continuous_action.py's numbers in every system's flags (ours by its
    defaults), gradient steps/s over the learning phase only, and a table of their ratio."""
    import peers

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    ours = peers.command("ours", "Hopper-v4/SAC", "equal", 2, tmp_path)
    assert ours[1].endswith("sac_envpool.py") and value(ours, "--total-timesteps") == str(peers.SAC_BUDGET)
    cleanrl = peers.command("cleanrl", "Hopper-v4/SAC", "equal", 2, tmp_path)
    assert cleanrl[1].endswith("gym_mujoco_v4.py") and cleanrl[2] == "cleanrl.sac_continuous_action"
    assert [value(cleanrl, f) for f in ("--env-id", "--seed", "--total-timesteps", "--learning-starts", "--q-lr",
                                        "--policy-frequency")] == ["Hopper-v4", "2", "50000", "5000", "0.001", "2"]
    sb3 = peers.command("sb3", "Hopper-v4/SAC", "equal", 2, tmp_path)
    assert value(sb3, "--algo") == "sac" and value(sb3, "-n") == "50000"
    assert {"learning_starts:5000", "batch_size:256", "learning_rate:0.0003", "train_freq:1", "gradient_steps:1",
            "policy_kwargs:dict(net_arch=[256,256])"} <= set(sb3)
    with pytest.raises(ValueError, match="no SAC in sample_factory"):
        peers.command("sample_factory", "Hopper-v4/SAC", "equal", 1, tmp_path)
    # The random phase (up to 5,000 env steps, no gradient steps) is left out: 4,000 env steps in 20 s after it.
    curve = [(5.0, 1000, 0.0), (6.0, 4800, 0.0), (10.0, 6000, 0.0), (20.0, 8000, 0.0), (30.0, 10000, 0.0)]
    assert peers.learning_rate(curve, 5000) == 200.0
    assert peers.learning_rate(curve[:3], 5000) is None

    s = lambda v: common.spread([v])  # noqa: E731
    entry = lambda name, rate, ret: {"name": name, "runs": [{}], "error": None, "wall_s": s(300.0),  # noqa: E731
                                     "sps": s(166.7), "grad_steps_per_s": s(rate), "final_return": s(ret)}
    data = {"window": 20, "sac_budget": peers.SAC_BUDGET, "sac_equal": peers.SAC_EQUAL}
    text = "\n".join(peers.sac_table("Hopper-v4/SAC", {"ours": entry("ours", 210.0, 900.0),
                                                         "cleanrl": entry("CleanRL", 60.0, 1000.0),
                                                         "sb3": entry("SB3", 100.0, 950.0)}, data,
                                      lambda x: "n/a" if x.get("median") is None else f"{x['median']:,.0f}"))
    assert "### Equal work, Hopper-v4/SAC: 50,000 env steps of the same SAC" in text
    assert "| CleanRL | 1 | 300 | 60 | 3.5× (met) | 1,000 |" in text
    assert "| SB3 | 1 | 300 | 100 | 2.1× (missed) | 950 |" in text


def test_time_to_score_median_ranks_a_seed_that_never_scored_slowest():
    import peers

    runs = lambda *secs: [{"seconds": v, "global_step": None if v is None else int(v * 1000)} for v in secs]  # noqa: E731
    two_of_three = peers.summarise(runs(18.0, None, 41.0), "preset")
    seconds = two_of_three["seconds"]
    assert (seconds["median"], seconds["min"], seconds["max"]) == (41.0, 18.0, 41.0)
    assert (two_of_three["global_step"]["median"], two_of_three["reached"], two_of_three["seeds"]) == (41000, 2, 3)
    assert peers.summarise(runs(18.0, None, None), "preset")["seconds"]["median"] is None
    assert peers.summarise(runs(10.0, 20.0, 30.0, None), "preset")["seconds"]["median"] == 25.0
    assert peers.summarise(runs(10.0, 20.0, None, None), "preset")["seconds"]["median"] is None


def test_sac_step_counts_the_matmuls_of_a_step_and_the_report_shows_its_share_of_the_chain(tmp_path):
    import report
    import sac_step
    # HalfCheetah (17 observations, 6 actions), 256-256, minibatch 256. One actor forward: 2 x 256 x (17 x 256 +
    # 256 x 256 + 256 x 12) = 37,355,520; the twin critics': 2 x 2 x 256 x (23 x 256 + 256 x 256 + 256) = 73,400,320.
    # A step: 5 actor forwards (target, actor forward and backward = 3, temperature) and 6 twin ones (target,
    # critics forward and backward = 3, the actor loss's forward and its gradient to the action = 2).
    assert sac_step.step_flops(17, 6, (256, 256), 256) == 5 * 37_355_520 + 6 * 73_400_320
    spread = lambda v: {"median": v, "min": v, "max": v, "n": 5}  # noqa: E731
    machine = {"cpu": "test cpu", "cores": 2, "memory_gib": 1.0, "gpus": [], "python": "3.11", "versions": {},
               "date": "2026-11-30"}
    (tmp_path / "sac_step.json").write_text(json.dumps({"machine": machine, "results": {
        "env_id": "HalfCheetah-v4", "hiddens": [256, 256], "minibatch": 256, "steps_per_program": 128,
        "step_gflop": 0.627, "gradient_steps_per_s": spread(200.0), "gflop_per_s": spread(125.4),
        "cores_busy": spread(1.8), "matmul_chain_gflop_per_s": spread(140.0)}}))
    text = report.report(tmp_path, tmp_path / "RESULTS.md", tmp_path / "img").read_text()
    assert "| 200 (200–200) | 125 | 1.80 | 140 | 0.90 |" in text


def test_cleanba_parity_feeds_both_alignments_of_one_rollout():
    """benchmark/cleanba.py gives Cleanba's IMPALA update the rollout in its actor's alignment (`native`: row t's
    reward and done came with obs_t; mask = 1 - first step of an episode) or in ours (`aligned`: transition t
    earns what came with obs_{t+1}, its discount is 0 when obs_{t+1} terminated, and the row of an episode's last
    observation is masked). One env, 4 rows; obs_1 ends an episode with reward 1, obs_3 earns 1."""
    import jax
    import numpy as np

    import cleanba
    from sebulba.impala_envpool import Agent
    from sebulba.rollouts import Rollout

    agent = Agent(num_actions=2, channels=(), hiddens=(4,), pixels=False)
    params = agent.init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
    col = lambda *values: np.array(values)[:, None]  # noqa: E731
    rollout = Rollout(np.zeros((4, 1, 3), np.float32), col(0, 1, 0, 1).astype(np.int32), col(*[np.log(0.5)] * 4),
                      col(0., 0, 0, 0), col(0., 1, 0, 1), col(False, True, False, False), col(False, False, False, False),
                      col(0, 0, 0, 0), col(0., 0, 0, 0))
    native = cleanba.cleanba_batch(agent, params, rollout, np.array([False]), aligned=False)
    aligned = cleanba.cleanba_batch(agent, params, rollout, np.array([False]), aligned=True)
    assert native["rewards"][:, 0].tolist() == [0, 1, 0, 1] and native["dones"][:, 0].tolist() == [0, 1, 0, 0]
    assert native["firststeps"][:, 0].tolist() == [0, 0, 1, 0]  # obs_2 starts the next episode
    assert aligned["rewards"][:, 0].tolist() == [1, 0, 1, 0] and aligned["dones"][:, 0].tolist() == [1, 0, 0, 0]
    assert aligned["firststeps"][:, 0].tolist() == [0, 1, 0, 0]  # ours masks the transition out of obs_1
    np.testing.assert_allclose(jax.nn.log_softmax(native["logitss"])[..., 0], np.log(0.5), atol=0.05)


def test_cleanba_parity_maps_every_resnet_parameter_once():
    import jax

    import cleanba
    from sebulba.impala_envpool import Args, init_params, make_agent

    agent, spec = make_agent(Args(env_id="Breakout-v5", atari_protocol="cleanba"))
    params = init_params(agent, spec, jax.random.PRNGKey(0))
    mapped = cleanba.cleanba_params(params)
    assert len(mapped) == len(jax.tree.leaves(params))  # 3 stacks x (1 + 2 x 2) convs, a dense, 2 heads: x2 leaves
    assert sum(x.size for x in mapped.values()) == sum(x.size for x in jax.tree.leaves(params))
    assert mapped["network_params/params/ConvSequence_2/ResidualBlock_1/Conv_1/kernel"].shape == (3, 3, 32, 32)
    assert mapped["actor_params/params/Dense_0/kernel"].shape == (256, 18)


def test_the_impala_parity_figures_quoted_in_docs_are_the_recorded_ones():
    """docs/impala_envpool.md quotes the one-batch parity check against Cleanba's update; each figure
    is recomputed here from benchmark/results/cleanba.json."""
    root = Path(__file__).resolve().parents[1]
    parity = json.loads((root / "benchmark/results/cleanba.json").read_text())["parity"]["results"]
    docs = " ".join((root / "docs/impala_envpool.md").read_text().split())
    steps = parity["aligned"]["rmsprop-torch"]
    assert (f"{steps['after_1']['step_relative_difference']:.0e} apart after one update, growing to "
            f"{steps['after_5']['step_relative_difference']:.0e} after five").replace("e-0", "e-") in docs
    native = parity["native"]["rmsprop-torch"]["gradient_relative_difference"]
    assert f"its loss terms and gradient differ from ours by about {100 * native:.0f} %" in docs


def test_the_gpu_needs_quoted_in_readme_are_the_recorded_ones():
    """README's "What the default Atari run needs on GPUs", recomputed from memory.json and env_throughput.json."""
    root = Path(__file__).resolve().parents[1]
    mem = json.loads((root / "benchmark/results/memory.json").read_text())
    env = json.loads((root / "benchmark/results/env_throughput.json").read_text())
    readme = " ".join((root / "README.md").read_text().split())
    best = max(r["sps"]["median"] for r in env["rows"]
               if r["env_id"] == "Breakout-v5" and r["mode"].startswith("envpool") and r["threads"] == 1)
    gib = 2**30
    frames = mem["num_actor_threads"] * mem["local_num_envs"] * mem["num_steps"] // 4
    for quoted in (f"EnvPool steps Breakout-v5 at {best:,.0f} env steps/s on one core",
                   f"({mem['num_actor_threads']} actor threads × {mem['local_num_envs']} envs × {mem['num_steps']} "
                   f"steps, the IMPALA ResNet, 4 minibatches of {frames:,} frames;",
                   f"holds {mem['minibatch_working_bytes'] / gib:.1f} GiB of working memory",
                   f"`--gradient-accumulation-steps {mem['accumulation']}`, {mem['microbatch_working_bytes'] / gib:.2f} GiB",
                   f"A rollout is {mem['rollout_bytes'] / gib:.2f} GiB",
                   f"in flight ({mem['in_flight_bytes'] / gib:.2f} GiB"):
        assert quoted in readme, quoted


def test_the_machine_section_has_one_row_per_part_with_its_own_cpu_and_date():
    """RESULTS.md names, for each results part, the CPU, cores and date it was measured on: no chain of dates, no CPU
    that measured none of the rows."""
    def machine(cpu, date, commit):
        return {"cpu": cpu, "cores": 2, "memory_gib": 23.5, "gpus": [], "python": "3.11", "versions": {"jax": "0.10.2"},
                "date": date, "commit": commit}
    startup = {"machine": machine("AMD EPYC, family 25 model 17, AVX-512", "2026-12-03", "aaa1111")}
    learning = {"machine": machine("Intel Xeon, family 6 model 167, AVX-512", "2026-12-07", "ccc3333"),
                "results": {"a": {"cpu": "AMD EPYC, family 26 model 2, AVX-512"}, "b": {"cpu": "AMD EPYC, family 26 "
                                                                                     "model 2, AVX-512"}}}
    gpu = {"machine": machine("Intel Xeon, family 6 model 167, AVX-512", "2026-12-07", "bbb2222")}
    text = "\n".join(report.machine_section([startup, None, learning, gpu], ["startup", "memory", "learning", "gpu"]))
    section = text
    assert "| gpu | Intel Xeon, family 6 model 167, AVX-512 | 2 | 23.5 GiB | none | Python 3.11, jax 0.10.2 | " \
           "2026-12-07 | bbb2222 |" in section
    assert "| learning | AMD EPYC, family 26 model 2, AVX-512 | 2 |" in section  # the CPU its rows ran on
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| startup", "| learning", "| gpu"]  # no part without results
    assert not any(" to " in row for row in rows) and section.count("AMD EPYC, family 25") == 1


def test_readmes_presets_table_is_the_one_generated_from_the_learning_results():
    """README's presets table is benchmark/report.py's, from benchmark/results/learning.json: a changed result, a
    new row of a preset or a hand edit makes this fail until `python benchmark/report.py` is run."""
    root = Path(__file__).resolve().parents[1]
    learn = json.loads((root / "benchmark/results/learning.json").read_text())
    readme = (root / "README.md").read_text()
    generated = "\n".join([report.PRESETS_BEGIN, *report.presets_table(learn), report.PRESETS_END])
    assert generated in readme
    assert "| [Atari](#atari) | Breakout-v5/IMPALA/2M-cleanba |" in generated and "**missed** | 1 |" in generated


def test_the_stage_timings_in_the_gpu_page_are_the_recorded_ones():
    """docs/gpus.md's table of CPU time per env step (env, policy, learning) is recomputed from stages.json."""
    root = Path(__file__).resolve().parents[1]
    tasks = json.loads((root / "benchmark/results/stages.json").read_text())["tasks"]
    page = (root / "docs/gpus.md").read_text()
    for task in ("CartPole-v1", "Breakout-v5 (CleanRL's sizes)"):
        summary = tasks[task]["summary"]
        env, policy = (summary[k]["median"] * 1e6 for k in ("env_cpu_s_per_step", "inference_cpu_s_per_step"))
        learning = statistics.median(tasks[task]["learning_cpu_s_per_step"]["a0-l0"]) * 1e6
        assert (f"| {task} | {env:,.1f} µs | {policy:,.1f} µs | {learning:,.1f} µs | "
                f"{100 * learning / (env + policy + learning):.0f} % |") in page, task
