"""Learning quality against published results: the scripts on the reference tasks, several seeds.

    python benchmark/learning.py                 # every task (about 26 h on 2 cores: each SAC 1M run ~1.5 h, each
                                                 # Breakout run 1.5-3 h)
    python benchmark/learning.py --only Hopper-v4/SAC/300k   # SAC at the horizon this box runs (~25 min a seed)
    python benchmark/learning.py --only CartPole-v1/PPO/100k     # one task
    python benchmark/learning.py --quick         # the pipeline at tiny budgets (~3 min), not for quoting
    python benchmark/learning.py --only Hopper-v4/SAC/1M --budget 200000  # cut short, and the report says so
    python benchmark/learning.py --only Breakout-v5/PPO/2M-cleanrl   # again later: resumes where it stopped

Each run lives in RUNS_DIR/<task>/seed<N>-<flags hash> (default ~/.cache/sebulba/learning,
or $SEBULBA_LEARNING_RUNS) and checkpoints as it goes, so the same command after a stop (a
session's end, Ctrl-C, a kill) resumes each unfinished run from its newest checkpoint and
takes finished ones as they are; the curve and the wall clock add up every session's
(`--fresh` starts them anew).

Each task is a command of a script, run once per seed in a fresh process (benchmark/common.py's
`run_script`, console line every update, the final evaluation on). Recorded per run: the curve
(env steps, mean raw return of the last 20 finished training games), the end-of-run return by
CleanRL's protocol (the mean episodic return of the training games at the end: the script's
`episodic_return_mean` in summary.json), the final evaluation (`final_eval`, sampled actions,
10 games on a separate pool, 100 on MiniGrid, with its success rate: games with a positive
return), and the wall clock. The report puts "ours vs
reference" in RESULTS.md, one PNG per task (mean ± std over seeds and each seed thin, against env steps, the
reference dashed). Writes benchmark/results/learning.json (or under --out).
"""

from __future__ import annotations

import json
import statistics

import hashlib
import os
import shutil
from pathlib import Path

from common import IMPALA_CARTPOLE, PPO_CARTPOLE, PPO_MUJOCO, cli_parser, logged_lines, machine, run_script, save

RUNS_DIR = Path(os.environ.get("SEBULBA_LEARNING_RUNS", "~/.cache/sebulba/learning")).expanduser()

# CleanRL ppo.py's CartPole settings: 4 envs x 128 steps, 4 minibatches x 4 epochs, lr 2.5e-4, entropy 0.01,
# and its synchronous loop: --max-policy-lag 0 (with the default lag of 1 the same run ended at 339 ± 87).
PPO_CARTPOLE_CLEANRL = ["--env-id", "CartPole-v1", "--total-timesteps", "500000", "--local-num-envs", "4",
                        "--num-steps", "128", "--num-actor-threads", "1", "--hiddens", "64", "64",
                        "--num-minibatches", "4", "--update-epochs", "4", "--learning-rate", "2.5e-4",
                        "--clip-coef", "0.2", "--ent-coef", "0.01", "--max-policy-lag", "0"]

# MiniGrid-MemoryS7-v0 (the agent must recall an object seen at the start): the LSTM preset of
# docs/ppo_lstm_envpool.md (4M env steps, entropy 0.03: with 0.01 one seed of three learned), and the
# feed-forward script with the same flags but entropy 0.01, which can only guess.
MEMORY_S7 = ["--env-id", "MiniGrid-MemoryS7-v0", "--total-timesteps", "4000000", "--local-num-envs", "16",
             "--num-steps", "64", "--num-actor-threads", "1", "--hiddens", "128", "--num-minibatches", "4",
             "--update-epochs", "4", "--learning-rate", "5e-4", "--clip-coef", "0.2"]

# Tasks whose mission names the goal. MiniGrid-GoToDoor-5x5-v0: 4 doors of different colours, the mission
# names one; success = `done` facing it. The preset is rl-starter-files' PPO defaults (16 processes x 128
# frames, 4 epochs of 256-transition minibatches, lr 1e-3, clip 0.2, entropy 0.01), which train this task
# with their text encoder in about 1M frames. 500k env steps of the 2M the target allows; the same
# flags with --read-mission False give the ceiling of an agent that cannot read (1 door in 4).
GOTO_DOOR = ["--env-id", "MiniGrid-GoToDoor-5x5-v0", "--total-timesteps", "500000", "--local-num-envs", "16",
             "--num-steps", "128", "--num-actor-threads", "1", "--hiddens", "128", "--num-minibatches", "8",
             "--update-epochs", "4", "--learning-rate", "1e-3", "--clip-coef", "0.2"]
# BabyAI-GoToLocal-v0 (BabyAI's own level: 8 objects in one 8x8 room, "go to the/a <colour> <type>"): the
# same preset over 64 envs, 2M env steps (a mean return of 0.9 came at 360k).
GOTO_LOCAL = ["--env-id", "BabyAI-GoToLocal-v0", "--total-timesteps", "2000000", "--local-num-envs", "64",
              "--num-steps", "128", "--num-actor-threads", "1", "--hiddens", "128", "--num-minibatches", "32",
              "--update-epochs", "4", "--learning-rate", "1e-3", "--clip-coef", "0.2"]

# Breakout-v5 with IMPALA under Cleanba's protocol (sticky actions 0.25, the full 18 actions, <= 1 no-op, FIRE at
# reset, no life-loss signal; rewards clipped in training, raw returns reported). The 3M row ran under Machado et
# al.'s (the same without FIRE at reset), the scripts' protocol before the protocols were named: the two rows
# put the effect of fire reset alone on record. IMPALA learns more per hour of
# this box than PPO: with the Nature CNN (--atari-encoder nature --hiddens 512), 12 envs x 32 steps, it ran at
# ~300 env steps/s against PPO's ~134 (4 epochs x 4 minibatches: 16 gradient passes a frame to IMPALA's 1).
# 32 envs x 20 steps (IMPALA's batch of 640 transitions; TorchBeast's 8 x 80 is the same size), RMSProp
# (eps 0.01, clip 40) at TorchBeast's Atari learning rate 4.8e-4 and entropy cost 6e-4 (facebookresearch/
# torchbeast's defaults). With the script's entropy cost of 0.01 on these summed losses the policy stayed
# within 2 % of the uniform policy's entropy (ln 18) and the last-20 mean at 3.5-4 from 300k to 830k env
# steps (one run, stopped there). 1.5M env steps (6M frames) fit in ~90 minutes on 2 cores, of the 2M asked.
# The same flags with --episodic-life (a training episode ends at each life loss, as in CleanRL's and
# Cleanba's Atari scripts; returns still whole games), seed 1: last-20 mean 1.7 at 250k, 2.7 at 500k, 2.8 at
# 750k, 2.9 at 880k env steps (entropy 2.73), below the run without it; stopped there, not recorded. TF1's RMSProp,
# the script's default when these rows ran (now --optimizer rmsprop; the default is PyTorch's).
BREAKOUT_IMPALA = ["--env-id", "Breakout-v5", "--atari-protocol", "cleanba", "--total-timesteps", "1500000",
                   "--num-actor-threads", "1",
                   "--local-num-envs", "32", "--num-steps", "20", "--atari-encoder", "nature", "--hiddens", "512",
                   "--learning-rate", "4.8e-4", "--ent-coef", "6e-4", "--optimizer", "rmsprop"]
# On a 2-core AVX-512 EPYC (Zen 5, 2026-12-05) the same flags run at ~705 env steps/s (PPO, Nature CNN, 16 envs x
# 64 steps, 4 x 4 minibatches: ~241), so 3M env steps (12M frames) fit in the 90 minutes there.
BREAKOUT_IMPALA_3M = ["--env-id", "Breakout-v5", "--atari-protocol", "machado", "--total-timesteps", "3000000",
                      *BREAKOUT_IMPALA[6:]]

# Breakout-v5 with IMPALA as Cleanba's cleanba_impala.py trains it (its protocol; entropy 0.01, value 0.5, clip 40,
# learning rate 6e-4, which its 50M-step schedule keeps above 5.76e-4 over the first 2M, so held here; PyTorch's
# RMSProp, decay 0.99, eps 0.01 outside the root, accumulators from 0; one gradient step per 640 env steps, each on
# 32 envs x 20 steps, its minibatch) and its actor's synchronous pool (every env in every recv: the policy lag stays
# within --max-policy-lag; a half-pool recv lets envs drift apart by rollouts, docs/impala_envpool.md). The Nature
# CNN (--atari-encoder nature --hiddens 512) in place of Cleanba's ResNet: ~6x fewer multiply-adds a frame, so 2M env
# steps take about an hour on 2 cores instead of four or more. Reference: Cleanba's README curve (main_10CPU.png,
# 3 seeds, read off the plot at 2M env steps). A checkpoint every 50 updates (32k env steps).
BREAKOUT_IMPALA_CLEANBA = ["--env-id", "Breakout-v5", "--atari-protocol", "cleanba", "--total-timesteps", "2000000",
                           "--num-actor-threads", "1", "--local-num-envs", "32", "--async-batch-size", "32",
                           "--num-steps", "20", "--atari-encoder", "nature", "--hiddens", "512", "--optimizer",
                           "rmsprop-torch", "--learning-rate", "6e-4", "--no-anneal-lr", "--ent-coef", "0.01",
                           "--checkpoint-interval", "50"]
# Cleanba's IMPALA on Breakout-v5, the mean of 3 seeds in its README's main_10CPU.png (an A100, 10 CPU cores), read off
# the plot at 2M env steps (about 10 at 1M, 20 at 2M, 33 at 3M); its metric: the mean over envs of each env's latest game.
CLEANBA_IMPALA_BREAKOUT = (20.0, None, "Cleanba cleanba_impala.py, its README's curve (3 seeds) read at 2M env steps")
CLEANBA_IMPALA_BREAKOUT_CURVE = [(1_000_000, 10.0), (2_000_000, 20.0), (3_000_000, 33.0)]  # (env steps, return) read off
# The same with TF1's RMSProp (the paper's code's; the script's default until this row): the optimizer's form alone.
BREAKOUT_IMPALA_CLEANBA_TF1 = ["rmsprop" if flag == "rmsprop-torch" else flag for flag in BREAKOUT_IMPALA_CLEANBA]
# The same with Cleanba's network, the IMPALA ResNet 16-32-32 + 256: ~6x the Nature CNN's work a frame; it ran at ~75
# env steps/s on a 2-core Xeon (about 7.5 h for 2M env steps), so over several sittings (it resumes).
BREAKOUT_IMPALA_CLEANBA_RESNET = [*BREAKOUT_IMPALA_CLEANBA[:BREAKOUT_IMPALA_CLEANBA.index("--atari-encoder")],
                                  "--atari-encoder", "impala", "--channels", "16", "32", "32", "--hiddens", "256",
                                  *BREAKOUT_IMPALA_CLEANBA[BREAKOUT_IMPALA_CLEANBA.index("--optimizer"):]]

# CleanRL's ppo_atari_envpool.py, its protocol and hyperparameters: 8 envs x 128 steps, 4 minibatches x 4 epochs,
# lr 2.5e-4 annealed, clip 0.1, entropy 0.01, value 0.5, grad norm 0.5, the Nature CNN, and its synchronous loop
# (--max-policy-lag 0). Not the same: CleanRL clips the value loss (clip_vloss) and anneals over its 10M env steps,
# so its lr at 2M is still 0.8 x 2.5e-4; here the 2M-step run anneals to 0 at 2M. A checkpoint every 10 updates
# (10k env steps), so a stopped run loses little. Reference: CleanRL's docs' curve, about 40 at 2M env steps.
BREAKOUT_PPO_CLEANRL = ["--env-id", "Breakout-v5", "--atari-protocol", "cleanrl", "--atari-encoder", "nature",
                        "--hiddens", "512", "--total-timesteps", "2000000", "--local-num-envs", "8", "--num-steps",
                        "128", "--num-actor-threads", "1", "--num-minibatches", "4", "--update-epochs", "4",
                        "--learning-rate", "2.5e-4", "--clip-coef", "0.1", "--ent-coef", "0.01", "--vf-coef", "0.5",
                        "--max-grad-norm", "0.5", "--max-policy-lag", "0", "--checkpoint-interval", "10"]

# PQN: the README preset (CleanRL's pqn.py hyperparameters over purejaxql's CartPole batch layout), CleanRL's pqn.py
# as it is (4 envs x 128 steps, synchronous as its loop) and, on Breakout,
# the script's defaults (CleanRL's pqn_atari_envpool.py: its protocol, the Nature CNN with LayerNorm, 8 envs x 128
# steps, 4 x 4 minibatches) at 2M env steps with CleanRL's synchronous loop; checkpoints every 10 updates. Its
# reference is CleanRL's curve at 2M env steps of a 10M-step run, so the schedules follow that run's first 2M: epsilon
# from 1 to 0.01 over 1M env steps (CleanRL's 0.1 x 10M: --exploration-fraction 0.5 of 2M, not the default 0.1's
# 200k) and the learning rate held at 2.5e-4 (CleanRL's anneals over 10M, so it is still 2.0e-4 at 2M; annealing to 0
# at 2M would be a schedule the reference never ran).
PQN_CARTPOLE = ["--env-id", "CartPole-v1", "--total-timesteps", "500000", "--local-num-envs", "32", "--num-steps", "64",
                "--num-minibatches", "16", "--update-epochs", "4", "--hiddens", "120", "84", "--end-e", "0.05",
                "--exploration-fraction", "0.5"]
PQN_CARTPOLE_CLEANRL = ["--env-id", "CartPole-v1", "--total-timesteps", "500000", "--local-num-envs", "4",
                        "--num-steps", "128", "--num-minibatches", "4", "--update-epochs", "4", "--hiddens", "120", "84",
                        "--end-e", "0.05", "--exploration-fraction", "0.5", "--max-policy-lag", "0"]
BREAKOUT_PQN_CLEANRL = ["--env-id", "Breakout-v5", "--total-timesteps", "2000000", "--max-policy-lag", "0",
                        "--exploration-fraction", "0.5", "--no-anneal-lr", "--checkpoint-interval", "10"]

# SAC: the script's defaults are CleanRL's sac_continuous_action.py hyperparameters (1M env steps, buffer 1M,
# 5k random steps, batch 256, lr 3e-4 / 1e-3, policy frequency 2, tau 0.005, autotuned alpha). CleanRL's
# published SAC table is on the v2 tasks (MuJoCo-py); these rows run EnvPool's v4 (mujoco bindings). Their env steps
# count EnvPool's auto-reset steps, which store no transition (docs/sac_envpool.md: about 4 % of early Hopper's).
SAC_MUJOCO = ["--total-timesteps", "1000000"]
# The horizon this box runs (a 300k-step run takes about 30 minutes on 2 cores): the same flags cut at 300k env steps
# (nothing in SAC's hyperparameters depends on the budget). References: CleanRL's docs' curves of
# sac_continuous_action.py on the v2 tasks, read off at 300k env steps (Hopper about 2,350, HalfCheetah 7,700,
# Walker2d 3,000); a curve read by eye, no std.
SAC_MUJOCO_300K = ["--total-timesteps", "300000"]

# Task families beyond MuJoCo, Atari and MiniGrid (README.md#tasks), each the scripts' own defaults unless named.
# LunarLander-v2 (Box2D vectors, 4 actions; "solved" at a mean return of 200): PPO with rl-baselines3-zoo's tuned
# LunarLander hyperparameters (16 envs x 1024 steps, minibatches of 64 transitions: here 256 of 64, 4 epochs, gamma
# 0.999, GAE lambda 0.98, entropy 0.01, a constant lr 3e-4, 1M env steps) on the scripts' 64-64 tanh MLP, with
# SB3's synchronous loop (--max-policy-lag 0) and its way of judging, the greedy policy (--eval-greedy). The
# sampled policy of training games stays lower (entropy 0.01): its last-20 mean at 1M was ~140 whether the lr was
# annealed or not and with lag 0 or 1 (one seed each). PQN with the CartPole preset's batch layout and LayerNorm MLP,
# wider (256 256), epsilon 1 -> 0.05 over half the run, gamma 0.99.
LUNAR_PPO = ["--env-id", "LunarLander-v2", "--total-timesteps", "1000000", "--local-num-envs", "16", "--num-steps",
             "1024", "--num-actor-threads", "1", "--hiddens", "64", "64", "--num-minibatches", "256",
             "--update-epochs", "4", "--learning-rate", "3e-4", "--no-anneal-lr", "--gamma", "0.999", "--gae-lambda",
             "0.98", "--ent-coef", "0.01", "--clip-coef", "0.2", "--max-policy-lag", "0", "--eval-greedy"]
LUNAR_PQN = ["--env-id", "LunarLander-v2", "--total-timesteps", "1000000", "--local-num-envs", "32", "--num-steps",
             "64", "--num-minibatches", "16", "--update-epochs", "4", "--hiddens", "256", "256", "--end-e", "0.05",
             "--exploration-fraction", "0.5", "--learning-rate", "2.5e-4"]
# dm_control through EnvPool (its observation dict flattened in the task's key order; 1,000 steps a game, action
# repeat 1, so env steps are simulator control steps). SAC with the script's defaults (CleanRL's
# sac_continuous_action.py) at 500k env steps, against "State SAC" of Laskin et al. 2020 (CURL, Table 1, 500K step
# scores: env steps, action repeat 1): cheetah run 795 +- 30, walker walk 948 +- 54. PPO with the MuJoCo preset
# (observation and reward normalisation on, as MuJoCo's) at 1M env steps: a curve beside SAC's.
DMC_SAC = ["--total-timesteps", "500000"]

# Procgen StarPilot (Easy) with CleanRL's ppo_procgen.py hyperparameters (64 envs x 256 steps, 8 minibatches x 3
# epochs, lr 5e-4, gamma 0.999, GAE lambda 0.95, entropy 0.01, rewards scaled, its synchronous loop) on Cobbe et al.
# 2020's generalisation protocol (200 training levels; the final evaluation on the unbounded distribution), so train
# and test levels are both reported. The network is the Nature CNN + 256, not CleanRL's IMPALA ResNet 16-32-32 + 256:
# on 64x64x3 frames the ResNet takes about 8x its work (XLA's flop count), and on 2 cores one update of 16,384
# frames x 3 epochs through it took over 10 minutes beside another run (about 21 env steps/s: 2M env steps would be
# a day), where the Nature CNN fits 2M in a few sittings (it resumes). CleanRL's own runs train the ResNet on the unbounded level
# distribution (num_levels 0) for 25M env steps; its docs' table, the reference shown, is their end, for context only:
# its curve at 2M is a plot not read here, so the row has no target.
PROCGEN_PPO = ["--env-id", "StarpilotEasy-v0", "--total-timesteps", "2000000", "--local-num-envs", "64", "--num-steps",
               "256", "--num-actor-threads", "1", "--atari-encoder", "nature", "--hiddens", "256", "--num-minibatches",
               "8", "--update-epochs", "3", "--learning-rate", "5e-4", "--gamma", "0.999", "--gae-lambda", "0.95",
               "--ent-coef", "0.01", "--norm-reward", "True", "--max-policy-lag", "0", "--procgen-num-levels", "200",
               "--checkpoint-interval", "5", "--stall-timeout-s", "3600"]  # an update takes minutes here
# CarRacing-v2 from pixels (96x96x3, Box actions) with PPO and the Nature CNN: 8 envs x 512 steps, 10 epochs of
# minibatches of 128, lr 1e-4, as rl-baselines3-zoo's CarRacing PPO (without its grey-scale, resize and frame stack).
CARRACING_PPO = ["--env-id", "CarRacing-v2", "--total-timesteps", "1000000", "--local-num-envs", "8", "--num-steps",
                 "512", "--num-actor-threads", "1", "--atari-encoder", "nature", "--hiddens", "512",
                 "--num-minibatches", "32", "--update-epochs", "10", "--learning-rate", "1e-4", "--ent-coef", "0.0",
                 "--max-policy-lag", "0", "--checkpoint-interval", "5"]

# Added to every launch of a script and left out of the run's flags hash (they change no result): checkpoints often
# enough that a run killed outright (SIGKILL at a session's end, no SIGTERM to save on) loses minutes, not the ~17 of
# SAC's default 1000 updates. SAC's 100 updates are ~13k env steps (about a minute here); a checkpoint with the replay
# takes about a second.
RESUMABLE = {"sac_envpool.py": ["--checkpoint-interval", "100"]}

# name: (script, flags, seeds, reference (mean, std, source) or None, target (description, test on the seed means))
TASKS = {
    "HalfCheetah-v4/PPO/1M": ("ppo_envpool.py", ["--env-id", "HalfCheetah-v4", *PPO_MUJOCO], 3,
                              (1442.6, 46.0, "CleanRL ppo_continuous_action.py, 3 seeds"), "mean ≥ ref − 1 std"),
    "Hopper-v4/PPO/1M": ("ppo_envpool.py", ["--env-id", "Hopper-v4", *PPO_MUJOCO], 3,
                         (2382.9, 271.7, "CleanRL ppo_continuous_action.py, 3 seeds"), "mean ≥ ref − 1 std"),
    "Walker2d-v4/PPO/1M": ("ppo_envpool.py", ["--env-id", "Walker2d-v4", *PPO_MUJOCO], 3,
                           (2288.0, 571.8, "CleanRL ppo_continuous_action.py, 3 seeds"), "mean ≥ ref − 1 std"),
    "HalfCheetah-v4/SAC/1M": ("sac_envpool.py", ["--env-id", "HalfCheetah-v4", *SAC_MUJOCO], 3,
                              (9634.9, 1423.7, "CleanRL sac_continuous_action.py, 3 seeds, on HalfCheetah-v2"),
                              "mean ≥ ref − 1 std"),
    "Hopper-v4/SAC/1M": ("sac_envpool.py", ["--env-id", "Hopper-v4", *SAC_MUJOCO], 3,
                         (2310.5, 342.8, "CleanRL sac_continuous_action.py, 3 seeds, on Hopper-v2"), "mean ≥ ref − 1 std"),
    "Walker2d-v4/SAC/1M": ("sac_envpool.py", ["--env-id", "Walker2d-v4", *SAC_MUJOCO], 3,
                           (3591.5, 911.3, "CleanRL sac_continuous_action.py, 3 seeds, on Walker2d-v2"),
                           "mean ≥ ref − 1 std"),
    "Hopper-v4/SAC/300k": ("sac_envpool.py", ["--env-id", "Hopper-v4", *SAC_MUJOCO_300K], 3,
                           (2350.0, None, "CleanRL sac_continuous_action.py, its docs' curve on Hopper-v2 at 300k"),
                           "mean ≥ 2000"),
    "HalfCheetah-v4/SAC/300k": ("sac_envpool.py", ["--env-id", "HalfCheetah-v4", *SAC_MUJOCO_300K], 1,
                                (7700.0, None, "CleanRL sac_continuous_action.py, its docs' curve on HalfCheetah-v2 "
                                 "at 300k"), "mean ≥ 6000"),
    "Walker2d-v4/SAC/300k": ("sac_envpool.py", ["--env-id", "Walker2d-v4", *SAC_MUJOCO_300K], 1,
                             (3000.0, None, "CleanRL sac_continuous_action.py, its docs' curve on Walker2d-v2 at 300k"),
                             "mean ≥ 2000"),
    "CartPole-v1/PPO/500k": ("ppo_envpool.py", PPO_CARTPOLE_CLEANRL, 3, (490.0, 6.1, "CleanRL ppo.py"), "mean ≥ 480"),
    "CartPole-v1/PPO/100k": ("ppo_envpool.py", PPO_CARTPOLE, 5, None, "every seed ends ≥ 475, final eval too"),
    "CartPole-v1/IMPALA": ("impala_envpool.py", IMPALA_CARTPOLE, 5, None,
                           "every seed reaches ≥ 475 and the last-20 mean stays ≥ 450 after"),
    "CartPole-v1/PQN/500k": ("pqn_envpool.py", PQN_CARTPOLE, 5, (495.1, 6.9, "CleanRL pqn.py"),
                             "every seed reaches ≥ 475"),
    "CartPole-v1/PQN/500k-cleanrl": ("pqn_envpool.py", PQN_CARTPOLE_CLEANRL, 5, (495.1, 6.9, "CleanRL pqn.py"),
                                     "every seed reaches ≥ 475"),
    # The preset with exact Q(λ) bootstraps: at the default --max-policy-lag 1 they come from params up to one update
    # older than the learner's (a target network refreshed every update); at 0 from the learner's own.
    "CartPole-v1/PQN/500k-lag0": ("pqn_envpool.py", [*PQN_CARTPOLE, "--max-policy-lag", "0"], 5,
                                  (495.1, 6.9, "CleanRL pqn.py"), "every seed reaches ≥ 475"),
    "MiniGrid-MemoryS7-v0/PPO-LSTM/4M": ("ppo_lstm_envpool.py", [*MEMORY_S7, "--ent-coef", "0.03", "--lstm-size", "128"],
                                         3, None, "every seed's final success rate ≥ 0.9"),
    "MiniGrid-MemoryS7-v0/PPO/4M": ("ppo_envpool.py", [*MEMORY_S7, "--ent-coef", "0.01"], 3, None,
                                    "final success rate near guessing (≤ 0.7)"),
    "MiniGrid-GoToDoor-5x5-v0/PPO/500k": ("ppo_envpool.py", GOTO_DOOR, 3, None,
                                          "every seed's final success rate ≥ 0.9"),
    "MiniGrid-GoToDoor-5x5-v0/PPO-mission-hidden/500k": ("ppo_envpool.py", [*GOTO_DOOR, "--read-mission", "False"],
                                                         3, None, "final success rate near its ceiling (≤ 0.35)"),
    "BabyAI-GoToLocal-v0/PPO/2M": ("ppo_envpool.py", GOTO_LOCAL, 1, None, None),
    "Breakout-v5/IMPALA/1.5M": ("impala_envpool.py", BREAKOUT_IMPALA, 1, None, "last-20 mean ≥ 10 (random play ≈ 1.5)"),
    "Breakout-v5/IMPALA/3M": ("impala_envpool.py", BREAKOUT_IMPALA_3M, 1, None, "last-20 mean ≥ 10 (random play ≈ 1.5)"),
    "Breakout-v5/IMPALA/2M-cleanba": ("impala_envpool.py", BREAKOUT_IMPALA_CLEANBA, 1,
                                      CLEANBA_IMPALA_BREAKOUT, "last-20 mean ≥ 20 (random play ≈ 1.5)"),
    # The same with TF1's RMSProp (the script's default before): what the optimizer's form alone does.
    "Breakout-v5/IMPALA/2M-cleanba-tf1-rmsprop": ("impala_envpool.py", BREAKOUT_IMPALA_CLEANBA_TF1, 1, None, None),
    "Breakout-v5/IMPALA/2M-cleanba-resnet": ("impala_envpool.py", BREAKOUT_IMPALA_CLEANBA_RESNET, 1,
                                             CLEANBA_IMPALA_BREAKOUT, "last-20 mean ≥ 20 (random play ≈ 1.5)"),
    "LunarLander-v2/PPO/1M": ("ppo_envpool.py", LUNAR_PPO, 3, (200.0, 0.0, "the task's 'solved' threshold"),
                              "greedy final eval ≥ 200 (solved)"),
    "LunarLander-v2/PQN/1M": ("pqn_envpool.py", LUNAR_PQN, 3, (200.0, 0.0, "the task's 'solved' threshold"),
                              "last-20 mean ≥ 200 (solved)"),
    "CheetahRun-v1/SAC/500k": ("sac_envpool.py", ["--env-id", "CheetahRun-v1", *DMC_SAC], 1,
                               (795.0, 30.0, "State SAC, Laskin et al. 2020 (CURL) Table 1, 500k env steps"),
                               "mean ≥ ref − 1 std"),
    "WalkerWalk-v1/SAC/500k": ("sac_envpool.py", ["--env-id", "WalkerWalk-v1", *DMC_SAC], 1,
                               (948.0, 54.0, "State SAC, Laskin et al. 2020 (CURL) Table 1, 500k env steps"),
                               "mean ≥ ref − 1 std"),
    "CheetahRun-v1/PPO/1M": ("ppo_envpool.py", ["--env-id", "CheetahRun-v1", *PPO_MUJOCO], 1, None, None),
    "StarpilotEasy-v0/PPO/2M-nature": ("ppo_envpool.py", PROCGEN_PPO, 1,
                                (30.99, 1.96, "CleanRL ppo_procgen.py, its docs' table at 25M env steps: context, "
                                 "not this budget"), None),
    "CarRacing-v2/PPO/1M": ("ppo_envpool.py", CARRACING_PPO, 1, None, None),
    "Breakout-v5/PPO/2M-cleanrl": ("ppo_envpool.py", BREAKOUT_PPO_CLEANRL, 1,
                                   (40.0, None, "CleanRL ppo_atari_envpool.py, its docs' curve at 2M env steps"),
                                   "last-20 mean ≥ 30 (random play ≈ 1.5)"),
    "Breakout-v5/PQN/2M-cleanrl": ("pqn_envpool.py", BREAKOUT_PQN_CLEANRL, 1,
                                   (40.0, None, "CleanRL pqn_atari_envpool.py, its docs' curve at 2M env steps"),
                                   "last-20 mean ≥ 30 (random play ≈ 1.5)"),
}
EVAL_EPISODES = {name: 100 for name in TASKS if name.startswith(("MiniGrid", "BabyAI"))}  # others: 10
QUICK_STEPS = {"HalfCheetah-v4/PPO/1M": 8192, "CartPole-v1/PPO/100k": 10240}  # --quick: these two, one seed


def with_budget(flags: list[str], steps: int) -> list[str]:
    i = flags.index("--total-timesteps")
    return [*flags[:i + 1], str(steps), *flags[i + 2:]]


def met(target: str, runs: list[dict], reference) -> bool | None:
    """Whether the runs meet the task's target (None: nothing to judge, or no target: a curve to show)."""
    if target is None:
        return None
    ends = [r["end_return"] for r in runs if r["end_return"] is not None]
    if len(ends) < len(runs) or not ends:
        return False
    if target.startswith("mean ≥ ref"):
        return statistics.fmean(ends) >= reference[0] - reference[1]
    if target in ("mean ≥ 480", "mean ≥ 2000", "mean ≥ 6000"):  # the mean over seeds of each run's end return
        return statistics.fmean(ends) >= float(target.split()[-1])
    if target.startswith("every seed ends ≥ 475"):
        return min(ends) >= 475 and all((r["final_eval"] or 0) >= 475 for r in runs)
    if target.startswith("every seed's final success rate ≥ 0.9"):
        return all((r.get("final_success") or 0) >= 0.9 for r in runs)
    if target.startswith("final success rate near guessing"):
        return all(r.get("final_success") is not None and r["final_success"] <= 0.7 for r in runs)
    if target.startswith("final success rate near its ceiling"):
        return all(r.get("final_success") is not None and r["final_success"] <= 0.35 for r in runs)
    if target.startswith("greedy final eval ≥ "):
        return all((r["final_eval"] or -float("inf")) >= float(target.split()[4]) for r in runs)
    if target.startswith("last-20 mean ≥ "):
        return min(ends) >= float(target.split()[3])
    if target == "every seed reaches ≥ 475":  # the last-20 mean, at any point of the run
        return all(max((ret for _, ret in r["curve"] if ret is not None), default=0) >= 475 for r in runs)
    if target.startswith("every seed reaches ≥ 475"):
        for r in runs:
            returns = [ret for _, ret in r["curve"] if ret is not None]
            first = next((i for i, ret in enumerate(returns) if ret >= 475), None)
            if first is None or min(returns[first:]) < 450:
                return False
        return True
    return None


def run_dir(name: str, flags: list[str], seed: int) -> Path:
    """Where one seed of a task runs and stays (RUNS_DIR): named by the task, the seed and a hash of the flags, so
    changed flags start a new run instead of resuming one they do not match."""
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]
    return RUNS_DIR / name.replace("/", "_") / f"seed{seed}-{digest}"


def run(quick: bool, only: list[str] | None, budget: int | None = None, fresh: bool = False) -> dict:
    here, results = machine(), {}
    commit, cpu = here["commit"], here["cpu"]  # the code the runs start on (the tree may move on during hours of runs)
    for name, (script, flags, seeds, reference, target) in TASKS.items():
        if (only and name not in only) or (quick and name not in QUICK_STEPS):
            continue
        if quick:
            flags, seeds = with_budget(flags, QUICK_STEPS[name]), 1
        elif budget:  # recorded in the flags; the report says the run was cut
            flags = with_budget(flags, budget)
        runs = []
        for seed in range(1, seeds + 1):
            workdir = None if quick else run_dir(name, flags, seed)  # --quick: a pipeline check, in a temporary dir
            if fresh and workdir and workdir.exists():
                shutil.rmtree(workdir)
            result = run_script(script, [*flags, *RESUMABLE.get(script, []), "--seed", str(seed)], timeout=7200 * 3,
                                eval_episodes=EVAL_EPISODES.get(name, 10), workdir=workdir)
            summary, lines = result["summary"], logged_lines(workdir) if workdir else result["lines"]  # every session's
            wall = lines[-1][0] if lines else result["wall_s"]
            runs.append({"seed": seed, "wall_s": wall, "end_return": summary.get("episodic_return_mean"),
                         "global_step": summary.get("global_step"),  # short of the budget: stopped, to be resumed
                         "unfinished": "interrupted_by" in summary,
                         "final_eval": (summary.get("final_eval") or {}).get("episodic_return_mean"),
                         "final_eval_std": (summary.get("final_eval") or {}).get("episodic_return_std"),
                         "final_success": (summary.get("final_eval") or {}).get("success_rate"),
                         "curve": [(step, ret if ret is None else round(ret, 1)) for _, step, _, ret in lines],
                         "wall_curve": [round(t, 1) for t, *_ in lines]})  # seconds at each curve point
            print(f"{name} seed {seed}: end return {runs[-1]['end_return']}, final eval {runs[-1]['final_eval']} "
                  f"(success {runs[-1]['final_success']}; {wall:.0f} s)", flush=True)
        results[name] = {"script": script, "flags": flags, "reference": reference, "target": target, "runs": runs,
                         "met": None if any(r["unfinished"] for r in runs) else met(target, runs, reference),
                         "commit": commit, "cpu": cpu,
                         "budget": budget if not quick else None}  # --only merges tasks
    return results


if __name__ == "__main__":
    parser = cli_parser(__doc__, "learning", "two tasks at tiny budgets, one seed: the pipeline, not the figures")
    parser.add_argument("--only", nargs="+", choices=list(TASKS), help="tasks to run")
    parser.add_argument("--budget", type=int, help="env steps per run instead of each task's own (the report says so)")
    parser.add_argument("--fresh", action="store_true", help=f"start every run anew instead of resuming (in {RUNS_DIR})")
    cli = parser.parse_args()
    results = run(cli.quick, cli.only, cli.budget, cli.fresh)
    previous = cli.out / "learning.json"
    if cli.only and previous.exists():  # keep the other tasks' results
        kept = json.loads(previous.read_text())
        if kept.get("quick") == cli.quick:
            results = {**kept["results"], **results}
    print("written:", save("learning", {"quick": cli.quick, "results": results}, cli.out))
