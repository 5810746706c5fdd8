"""Every training command in README.md and docs/ works as written, and every link between the pages resolves.

Each `python sebulba/<script>.py ...` command (in a code block, or inline in backticks; one
run by `scripts/launch_local.py -n N --` counts as N processes) is parsed by the script's own
command line and checked by its own `resolve`, so a wrong flag or a bad value fails here. Where
a page quotes the console's layout line (`run <name>: ...`), the command with that run name must
print exactly that line. The vector-task commands also train for one update, with the budget
cut to one batch, except the presets that a learning test trains in full (`FULLY_TRAINED`). Not here: commands with placeholders (`...`, `RUN_DIR`, `<run name>`),
`scripts/evaluate.py` (tests/test_evaluate.py) and the sbatch template (tests/test_slurm.py).
"""

import collections
import dataclasses
import functools
import re
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import tyro

import sebulba.impala_envpool as impala
import sebulba.ppo_envpool as ppo
import sebulba.ppo_lstm_envpool as ppo_lstm
import sebulba.pqn_envpool as pqn
import sebulba.sac_envpool as sac
from sebulba.config import Cluster
from sebulba.envs import has_pixels
from sebulba.runtime import layout_line
from test_envpool_runs import CARTPOLE_PRESET, GOTO_DOOR_PRESET
from test_impala import CARTPOLE_PRESET as IMPALA_CARTPOLE_PRESET
from test_lstm import CARTPOLE_PRESET as LSTM_CARTPOLE_PRESET
from test_pqn import CARTPOLE_PRESET as PQN_CARTPOLE_PRESET

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = {"sebulba/ppo_envpool.py": ppo, "sebulba/impala_envpool.py": impala, "sebulba/ppo_lstm_envpool.py": ppo_lstm,
           "sebulba/sac_envpool.py": sac, "sebulba/pqn_envpool.py": pqn}
PLACEHOLDERS = ("...", "…", "RUN_DIR", "<")


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every `python sebulba/...` command on the pages, as one line each."""
    found = []
    for page in PAGES:
        text = page.read_text()
        blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
        lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
        spans = [span.replace("\n", " ") for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text,
                                                                                           flags=re.S))]
        for command in lines + spans:
            command = command.split(" #")[0].strip()
            command = re.sub(r"^pip install [^&]*&& ", "", command)
            if "python sebulba/" in command and not any(p in command for p in PLACEHOLDERS):
                found.append((page.name, " ".join(command.split())))
    return found


def quoted_layout_lines() -> dict[str, str]:
    """{run name: the layout line a page quotes for it}."""
    spans = (span.replace("\n", " ") for page in PAGES for span in re.findall(r"`(run \S+: [^`]+)`", page.read_text()))
    return {span.split(":")[0].removeprefix("run "): " ".join(span.split()) for span in spans}


def parse(command: str):
    """(script module, Args, Cluster) of one documented command."""
    words = shlex.split(command)
    processes = 1
    if words[:2] == ["python", "scripts/launch_local.py"]:
        processes, words = int(words[words.index("-n") + 1]), words[words.index("--") + 1:]
    assert words[0] == "python" and words[1] in SCRIPTS, command
    module = SCRIPTS[words[1]]
    args = tyro.cli(module.Args, args=words[2:])
    cluster = Cluster(processes, 0, "127.0.0.1:1") if processes > 1 else Cluster()
    return module, args, cluster


COMMANDS = sorted(set(documented_commands()))

# Documented presets that a learning test trains in full (tests/test_envpool_runs.py, test_impala.py, test_lstm.py):
# the page's command must be that test's preset, budget and evaluation games aside, and is not trained
# again for one update here.
FULLY_TRAINED = [(ppo, CARTPOLE_PRESET), (ppo, GOTO_DOOR_PRESET), (impala, IMPALA_CARTPOLE_PRESET),
                 (ppo_lstm, LSTM_CARTPOLE_PRESET), (pqn, PQN_CARTPOLE_PRESET)]
BUDGET = {"total_timesteps", "eval_episodes"}


@functools.cache
def trained_in_full(command: str) -> bool:
    module, args, _ = parse(command)
    flags = {k: v for k, v in dataclasses.asdict(args).items() if k not in BUDGET}
    return any(module is m and flags == {k: v for k, v in dataclasses.asdict(m.Args(**preset)).items()
                                         if k not in BUDGET} for m, preset in FULLY_TRAINED)


def test_each_preset_a_learning_test_trains_is_a_documented_command():
    documented = [c for _, c in COMMANDS if "--help" not in c.split()]
    for module, preset in FULLY_TRAINED:
        assert any(parse(c)[0] is module and trained_in_full(c) and parse(c)[1].env_id == preset["env_id"]
                   for c in documented), (module.__name__, preset["env_id"])


def test_the_pages_document_the_commands_this_test_knows():
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "distributed.md", "ppo_envpool.md", "impala_envpool.md", "ppo_lstm_envpool.md",
            "sac_envpool.md", "pqn_envpool.md"} <= pages
    assert "two_processes" in quoted_layout_lines()


@pytest.mark.parametrize("page, command", COMMANDS)
def test_documented_command_parses_resolves_and_prints_the_layout_the_page_quotes(page, command, capsys):
    if "--help" in command.split():
        with pytest.raises(SystemExit) as exit_:
            parse(command)
        assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
        return
    module, args, cluster = parse(command)
    setup = module.resolve(args, cluster)
    quoted = quoted_layout_lines().get(args.run_name)
    if quoted is not None:
        line = layout_line(args, setup, len(args.actor_device_ids), len(args.learner_device_ids) * cluster.num_processes)
        assert line == quoted, f"{page}: {command}"


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted({c for _, c in COMMANDS if "--env-id" in c and "--distributed" not in c
                                            and not has_pixels(c.split("--env-id ")[1].split()[0])
                                            and not trained_in_full(c)}))
def test_documented_vector_task_command_trains_one_update(command, capsys):
    module, args, cluster = parse(command)
    batch = module.resolve(args, cluster).batch_size
    args.total_timesteps, args.eval_episodes, args.eval_interval, args.run_name = batch, 0, 0, "docs"
    if hasattr(args, "update_epochs"):  # what this checks is that the command starts and trains, not its epochs
        args.update_epochs = 1
    if module is sac:  # one update, which then also takes its gradient steps
        args.learning_starts = 0
    summary = module.main(args)
    assert summary["updates"] == 1 and summary["global_step"] == batch
    assert capsys.readouterr().out.startswith("run docs: 1 process(es)")


def github_anchors(page: Path) -> set[str]:
    """The `#anchor`s GitHub gives a page's headings (lower case; punctuation other than '-' and
    '_' dropped; spaces as '-'; a repeated heading gets -1, -2, ...), and any explicit HTML ids."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    anchors, seen = set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", text)), collections.Counter()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        heading = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return anchors


def relative_links(page: Path) -> list[str]:
    """The targets of a page's Markdown links that stay in this repository (no scheme), code blocks
    and inline code left out."""
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
    targets = re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


LINKED_PAGES = sorted({*PAGES, ROOT / "benchmark" / "RESULTS.md"})


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and (target.suffix != ".md" or anchor not in github_anchors(target)):
            broken.append(f"{link}: no heading with that anchor in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchors_are_the_ones_github_makes(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Start-up and the compilation cache\n## `--norm-adv`, MuJoCo & Box (actions)\n"
                    "## Results\n## Results\n```\n# not a heading\n```\n## End-to-end ÷ limit: [x](y.md)\n")
    assert github_anchors(page) == {"start-up-and-the-compilation-cache", "--norm-adv-mujoco--box-actions", "results",
                                    "results-1", "end-to-end--limit-x"}


def test_the_resnets_work_against_the_nature_cnns_is_what_the_pages_say():
    """README, the PPO and the IMPALA pages compare the IMPALA ResNet (16, 32, 32) + 256 with the Nature CNN by
    the work a frame: XLA's flop count of each encoder's forward pass, on Atari's 84x84x4 frames (the Nature CNN with 512) and on
    Procgen's 64x64x3 (with 256, the StarPilot row's), rounded as the pages quote it."""
    from sebulba.networks import ImpalaEncoder, NatureEncoder

    def flops(encoder, shape):
        frames = jnp.zeros((1, *shape), jnp.uint8)
        params = jax.eval_shape(encoder.init, jax.random.PRNGKey(0), frames)
        return jax.jit(encoder.apply).lower(params, frames).cost_analysis()["flops"]

    atari = flops(ImpalaEncoder((16, 32, 32), (256,)), (4, 84, 84)) / flops(NatureEncoder((512,)), (4, 84, 84))
    procgen = flops(ImpalaEncoder((16, 32, 32), (256,)), (3, 64, 64)) / flops(NatureEncoder((256,)), (3, 64, 64))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"takes about {procgen:.0f}x its work a frame on Procgen's 64x64x3 frames, about {atari:.0f}x on "
            "Atari's 84x84x4") in readme
    ppo = " ".join((ROOT / "docs" / "ppo_envpool.md").read_text().split())
    assert f"the IMPALA ResNet's gradient takes about {atari:.0f}× the Nature CNN's work a frame" in ppo
    impala_page = " ".join((ROOT / "docs" / "impala_envpool.md").read_text().split())
    assert f"the row uses the Nature CNN, about {atari:.0f}× less work a frame" in impala_page


def test_the_pages_quote_no_line_counts():
    """A line count on a page goes stale with the next commit (`wc -l` gives it): README and docs/ give none."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = " ".join(page.read_text().split())
        assert not re.search(r"~\d+ lines|\| ~\d+ \|", text), page.name


def test_the_docs_site_builds_with_every_link_and_anchor_found(tmp_path, monkeypatch):
    """`mkdocs build --strict` over docs/, README.md as the landing page and benchmark/RESULTS.md as a page: a link
    to a page or an anchor that does not exist is a warning, and strict mode makes any warning fail the build."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(root)
    build(load_config(str(root / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site")))
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "results" / "index.html").exists()
    assert 'href="evaluation/#sharing-a-trained-agent"' in (site / "index.html").read_text()  # README's docs/ links
    assert (site / "img" / "env_throughput.png").exists() and 'src="../img/env_throughput.png"' in (
        site / "results" / "index.html").read_text()  # RESULTS.md's ../docs/img/ images


# A measured figure in the units of throughput, latency and memory, as the pages write them.
MEASURED = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?k?\s*(?:env steps/s|env steps per second|SPS|µs|ms\b|GiB|MiB|GFLOP/s|"
                      r"gradient steps/s|frames/s|samples/s)")
# Every such figure outside a block that benchmark/report.py generates, with what accounts for it: the test
# that recomputes it from benchmark/results/, or why it is not one of ours.
ACCOUNTED = {
    "README.md": {"1,230 env steps/s": "tests/test_benchmark.py::test_the_gpu_needs_quoted_in_readme_are_the_recorded_ones",
                  "19.0 GiB": "the same test", "0.30 GiB": "the same test", "0.20 GiB": "the same test",
                  "1.22 GiB": "the same test", "6.1k env steps/s": "Cleanba's published figure (its README)"},
    "benchmarks.md": {"24 GiB": "a machine's memory, not a measurement",
                      "6.1k env steps/s": "Cleanba's published figure (its README)"},
    "gpus.md": {"6.1k env steps/s": "Cleanba's published figure (its README)", "3.2 µs": "tests/test_benchmark.py's test of gpus.md's table, from stages.json",
                "3.4 µs": "the same test", "11.6 µs": "the same test", "544.6 µs": "the same test",
                "529.0 µs": "the same test", "6,484.7 µs": "the same test"},
    "ppo_envpool.md": {"24 GiB": "a machine's memory, not a measurement"},
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_measured_figure_on_the_pages_comes_from_the_results(page):
    """A throughput, latency or memory figure typed into README or docs/ goes stale when the results
    change: each one is generated from benchmark/results/ (between report.py's markers), recomputed
    from them by a test (ACCOUNTED names it), or not a measurement of ours (a peer's published
    figure, a machine's size). Anything else on a page fails here: link to RESULTS.md instead."""
    text = re.sub(r"<!-- presets:.*?<!-- /presets -->", "", page.read_text(), flags=re.S)
    found = set(MEASURED.findall(text))
    assert found <= set(ACCOUNTED.get(page.name, {})), sorted(found - set(ACCOUNTED.get(page.name, {})))


# A learning result as the pages write it: a number after the words that report one (a return, a last-20 mean,
# a final evaluation, a success rate, what a run reached, ended at or fell to), with the env steps it came at
# where they follow; any "mean ± std"; "N of M reached"; a run's wall clock ("54 s a run", "(3,984 s)",
# "takes about 400 s"); a range of env steps ("95k–121k env steps"). A bound ("≥ 450") is a target, not a result,
# and is not matched; nor is a bare 0 or a number that counts games or episodes.
_FIGURE = r"(?!0(?!\.\d|,\d|\d))[−-]?\d(?:,?\d)*(?:\.\d+)?"
_LEARNED_FIGURE = (_FIGURE + r"(?!\w|,\d|\.\d|-|\s*(?:finished |training |evaluation )?(?:games|episodes)\b)"
                   r"(?: (?:at|within|after|by|from) (?:about )?\d[\d,.]*[kM]?(?: env steps)?)?")
LEARNED = re.compile(
    r"\b(?:last-20 mean|mean return|returns?|final (?:greedy )?evaluations?|success rates?|end-of-run means?|"
    r"reached|reaches|reach|reaching|passed|touched|ended|ends|fell|rose|climbed|dropped|stayed|swung|settled|"
    r"scored|scores|measured|gives?|gave)"
    r"(?: (?:a|an|the|its|first|never|back|only|steadily|about|at|to|of|near|above|below|between|was|were|reads|"
    r"\*\*))* ?" + _LEARNED_FIGURE +
    r"|" + _FIGURE + r" ± \d(?:,?\d)*(?:\.\d+)?"
    r"|\b\d+ (?:runs |games |seeds )?of \d+(?: in all)? (?:reached|stayed|solved|succeeded|fell|ended)"
    r"|\bsucceeded in \d+"
    r"|\d[\d,.]*(?:–\d[\d,.]*)? ?(?:s|min|minutes|hours?)\b(?: each)?"
    r"(?: a run| per run| from launch| on 2 (?:CPU )?cores)"
    r"|\(\d(?:,?\d)* s\)"
    r"|\btakes? (?:about )?\d[\d,.]* ?(?:s|min|minutes|hours?)\b"
    r"|\d[\d.]*[kM](?:,? (?:and|to) |–|, )\d[\d.]*[kM]\b[^.;]{0,12}?env steps")
# Every such figure on a page, with why it is not a result of ours: a target or threshold, a task's maximum,
# an example of a console line, a peer's published figure (its source), a flag's value.
CONSOLE_EXAMPLE = "an example of the console line (its format, not a result)"
ACCOUNTED_LEARNING = {
    "README.md": {"return 500.0": CONSOLE_EXAMPLE},
    "architecture.md": {"2 minutes on 2 cores": "how long the test suite's fast tests take, not a run's result"},
    "benchmarks.md": {"4 min on 2 cores": "how long `run.py --quick` takes, not a run's result",
                      "last-20 mean of 10": "a learning row's target",
                      "reaches 475": "time_to_solve.py's definition of solved (a target)",
                      "return of 475": "the same definition",
                      "mean return of 200": "LunarLander's definition of solved (a threshold)",
                      "1M, 2M and 3M env steps": "where Cleanba's plot was read (env steps, not a result)"},
    "distributed.md": {"(45 s)": "`--coordinator-timeout-s`'s default, a flag's value"},
    "evaluation.md": {"500.0 ± 0.0": CONSOLE_EXAMPLE, "return 500.0": CONSOLE_EXAMPLE,
                      "return 1000.0": CONSOLE_EXAMPLE, "success rate 0.95": CONSOLE_EXAMPLE},
    "impala_envpool.md": {"last-20 mean of 475": "the test's threshold (tests/test_impala.py)",
                          "reaches 475": "the learning row's target, quoted",
                          "reaching 475": "the definition of falling back after solving (a threshold)",
                          "last-20 mean of 20": "the learning row's target"},
    "ppo_envpool.md": {"1442.6 ± 46.0": "CleanRL's published figure (its ppo_continuous_action.py benchmark)",
                       "2382.9 ± 271.7": "the same", "2288.0 ± 571.8": "the same",
                       "490.0 ± 6.1": "CleanRL's published figure (its ppo.py benchmark)",
                       "reaches 450 within 100k env steps": "the test's threshold (tests/test_envpool_runs.py)",
                       "reach 500": "CartPole-v1's maximum",
                       "return 202.9": CONSOLE_EXAMPLE},
    "ppo_lstm_envpool.md": {"last-20 mean of 475 within 150k env steps": "the test's threshold (tests/test_lstm.py)",
                            "reached 475": "the solved threshold"},
    "pqn_envpool.md": {"reaches 475": "the test's threshold (tests/test_pqn.py)", "reached 475": "the solved threshold",
                       "495.1 ± 6.9": "CleanRL's published figure (its pqn.py benchmark)",
                       "reaches 0.01 at 1M env steps": "ε's schedule (flags), not a result",
                       "reach 0.01 at 200k": "the same"},
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_learning_result_on_the_pages_comes_from_the_results(page):
    """A return, last-20 mean, final evaluation, success rate, env-step count or wall clock of a run typed into
    README or docs/ goes stale when the results change: the figure lives in benchmark/results/, shown in
    benchmark/RESULTS.md and README's presets table (generated between report.py's markers), and a page says in
    words what was found and links there. What the pattern still finds must be accounted for as not a result of
    ours (ACCOUNTED_LEARNING: a target, a task's maximum, an example console line, a peer's published figure)."""
    text = " ".join(re.sub(r"<!-- presets:.*?<!-- /presets -->", "", page.read_text(), flags=re.S).split())
    found = set(LEARNED.findall(text))
    accounted = set(ACCOUNTED_LEARNING.get(page.name, {}))
    assert found <= accounted, f"{page.name}: link to RESULTS.md instead of typing {sorted(found - accounted)}"


def test_the_learning_result_pattern_finds_what_the_pages_used_to_type():
    typed = ("every seed reached a last-20 mean of 475 (95k–121k env steps) and ended at 500 with a final "
             "evaluation of 500; 54 s a run. success rates **1.00, 1.00, 1.00**, about 14 min a run. The same with "
             "learning rate 1e-3 touched 480 at 46k and fell to 377 at the end; 339 ± 87 at the end; 5 of 5 reached "
             "475; the mean of the last 20 games stayed between 2.5 and 5.3, then climbed steadily to 15.1 at 2M "
             "(final evaluation 13.4 ± 2.0 over 10 games); one seed (3,984 s); a run takes about 400 s; "
             "the final evaluation reads about −122 ± 3")
    assert set(LEARNED.findall(typed)) == {
        "last-20 mean of 475", "95k–121k env steps", "ended at 500", "final evaluation of 500", "54 s a run",
        "success rates **1.00", "14 min a run", "touched 480 at 46k", "fell to 377", "339 ± 87", "5 of 5 reached",
        "stayed between 2.5", "climbed steadily to 15.1 at 2M", "final evaluation 13.4", "(3,984 s)",
        "takes about 400 s", "final evaluation reads about −122"}
    not_results = ("a last-20 mean ≥ 450 after 81,920 env steps; the last 20 finished games; the final evaluation, "
                   "10 games; the return was above 0; a 500-step limit; ε reaches 0 at the end; `--hiddens 64 64`")
    assert not LEARNED.findall(not_results)
