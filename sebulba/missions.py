"""Missions as words: MiniGrid's and BabyAI's instruction (`mission`, the string's bytes in each
observation) turned on the host into a short sequence of word ids from a fixed vocabulary, before
anything stores it. Every pool and spec that `sebulba.envs` makes for these tasks serves the ids
(`MissionTokenizer`, `word_space`), so rollouts, the learner transfer and evaluation carry them.

The vocabulary is derived from the grammars that write the missions, as EnvPool 1.2.5 implements
them (envpool/minigrid/impl: `babyai_instr.cc`, `minigrid_task_utils.h`, the task files):

* BabyAI (Chevalier-Boisvert et al. 2019, section 3.1): an instruction is an action ("go to",
  "pick up", "open", "put ... next to") on an object description ("the"/"a", an optional colour,
  a type or "object", an optional location "on your left", "on your right", "in front of you",
  "behind you"); two of them joined by "and"; two of those by ", then" or "after you".
* MiniGrid: its tasks' fixed sentences and templates (GoToDoor, GoToObject, Fetch's five ways to
  say "fetch a", PutNear, LockedRoom, KeyCorridor's "pick up the ...").
"""

from __future__ import annotations

import re

import numpy as np

COLORS = ("red", "green", "blue", "purple", "yellow", "grey")  # envpool minigrid/impl/utils.h ColorName
OBJECTS = ("door", "key", "ball", "box", "object")  # TypeName's types in missions; "object": no type given
BABYAI_WORDS = ("go", "to", "pick", "up", "open", "put", "next", "and", "then", ",", "after", "you", "the", "a",
                "on", "your", "left", "right", "in", "front", "of", "behind")
MINIGRID_WORDS = ("get", "green", "goal", "square", "use", "key", "door", "avoid", "lava", "find", "opening",
                  "reach", "matching", "at", "end", "hallway", "traverse", "rooms", "maze", "fetch", "must",
                  "near", "from", "room", "unlock")
# Append only: a checkpoint's word embeddings are indexed by these ids.
VOCAB: tuple[str, ...] = ("<pad>",) + tuple(dict.fromkeys(BABYAI_WORDS + COLORS + OBJECTS + MINIGRID_WORDS))
WORD_ID = {w: i for i, w in enumerate(VOCAB)}

# Words per mission: the longest its grammar writes for the task (a BabyAI object description is
# at most 7 words, "the red ball in front of you"). The encoder scans every stored position, so a
# task stores no more than its own grammar needs.
MINIGRID_WIDTH = 18  # LockedRoom's "get the blue key from the green room, unlock the blue door and go to the goal"
BABYAI_WIDTH = 9  # one action without locations: "put the blue ball next to the green box"
WIDTHS = {  # tasks whose grammar writes fewer (MiniGrid) or more (BabyAI) words, by id prefix
    "MiniGrid-GoToDoor": 5, "MiniGrid-GoToObject": 5, "MiniGrid-Fetch": 6, "MiniGrid-PutNear": 8,
    "BabyAI-SynthLoc": 17,  # one action, locations on both objects: 1 + 7 + 2 + 7
    "BabyAI-OpenTwoDoors": 10, "BabyAI-OpenRedBlueDoors": 10,  # "open the red door, then open the blue door"
    "BabyAI-OpenDoorsOrder": 10,
    "BabyAI-MoveTwoAcross": 20,  # two "put ... next to ..." joined by ", then"
    "BabyAI-GoToSeq": 24,  # ("go to X and go to Y") ", then"/"after you" (the same), no locations
    "BabyAI-SynthSeq": 72, "BabyAI-MiniBossLevel": 72, "BabyAI-BossLevel": 72,  # and/seq, locations: 35 + 2 + 35
}

# Tasks with one mission, the same in every game: reading it can tell the agent nothing.
FIXED_MISSION = re.compile(
    r"MiniGrid-(Empty|DoorKey|DistShift|LavaCrossing|SimpleCrossing|LavaGap|Dynamic-Obstacles|FourRooms|Memory|"
    r"MultiRoom|ObstructedMaze|Playground|RedBlueDoors|Unlock-|WFC)"
    r"|BabyAI-(BlockedUnlockPickup|GoToRedBallGrey|GoToRedBallNoDists|KeyCorridor|KeyInBox|OneRoom|OpenRedBlueDoors|"
    r"OpenRedDoor|UnlockLocal|UnlockToUnlock)")


def is_babyai(env_id: str) -> bool:
    return env_id.startswith("BabyAI-")


def mission_width(env_id: str) -> int:
    """Word ids stored per mission for a MiniGrid or BabyAI task: the longest mission its grammar writes."""
    default = BABYAI_WIDTH if is_babyai(env_id) else MINIGRID_WIDTH
    return max([w for prefix, w in WIDTHS.items() if env_id.startswith(prefix)], default=default)


def mission_varies(env_id: str) -> bool:
    """Whether the task's mission can change from game to game (False: one fixed sentence)."""
    return FIXED_MISSION.match(env_id) is None


def reads_mission(env_id: str, read_mission: bool | None) -> bool:
    """--read-mission resolved: False on tasks without a mission (EnvPool's dictionary observations
    are MiniGrid's and BabyAI's); None reads it on the tasks whose mission varies (`mission_varies`)."""
    if not env_id.startswith(("MiniGrid-", "BabyAI-")):
        return False
    return mission_varies(env_id) if read_mission is None else read_mission


def split_words(text: str) -> list[str]:
    """'go to the red ball, then open a door' -> ['go', 'to', 'the', 'red', 'ball', ',', 'then', ...]."""
    return re.findall(r"[a-z]+|,", text.lower())


def join_words(words) -> str:
    """The inverse of `split_words` for the grammars' text (a comma follows its word)."""
    return " ".join(words).replace(" ,", ",")


def decode(ids) -> str:
    """The mission text of one row of word ids [W] (padding 0 dropped)."""
    return join_words(VOCAB[i] for i in np.asarray(ids) if i)


class MissionTokenizer:
    """Mission bytes [B, L] uint8 (EnvPool's zero-padded string) -> word ids [B, W] uint8, padded with 0
    (`VOCAB`, W = `mission_width(env_id)`). Missions repeat, so each distinct one is split once.

    Raises:
      ValueError: a word outside `VOCAB`, or a mission longer than W words, naming it and the task.
    """

    def __init__(self, env_id: str):
        self.env_id, self.width = env_id, mission_width(env_id)
        self.cache: dict[bytes, np.ndarray] = {}

    def encode(self, text: str) -> np.ndarray:
        words = split_words(text)
        unknown = [w for w in words if w not in WORD_ID]
        if unknown:
            raise ValueError(f"{self.env_id}: mission {text!r} has word {unknown[0]!r}, which is not in "
                             "sebulba/missions.py's VOCAB; append it there")
        if len(words) > self.width:
            raise ValueError(f"{self.env_id}: mission {text!r} has {len(words)} words, more than the {self.width} "
                             "that sebulba/missions.py's mission_width gives this task; raise it there")
        ids = np.zeros(self.width, np.uint8)
        ids[:len(words)] = [WORD_ID[w] for w in words]
        return ids

    def encode_all(self, texts) -> np.ndarray:
        """Word ids [len(texts), W] uint8 of mission texts."""
        return np.stack([self.encode(t) for t in texts]) if texts else np.zeros((0, self.width), np.uint8)

    def __call__(self, missions) -> np.ndarray:
        rows = []
        for row in np.asarray(missions):
            key = row.tobytes()
            if key not in self.cache:
                self.cache[key] = self.encode(key.rstrip(b"\0").decode("ascii", "replace"))
            rows.append(self.cache[key])
        return np.stack(rows) if rows else np.zeros((0, self.width), np.uint8)


def word_space(space, env_id: str):
    """MiniGrid's observation space with `mission` as word ids: Box(0, len(VOCAB) - 1, (W,), uint8)."""
    import gymnasium

    spaces = dict(space.spaces)
    spaces["mission"] = gymnasium.spaces.Box(0, len(VOCAB) - 1, (mission_width(env_id),), np.uint8)
    return gymnasium.spaces.Dict(spaces)
