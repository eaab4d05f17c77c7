"""The ``generated`` stage: questions with paraphrased instructions, plus paired eval sets.

Every family builds an :class:`Item`: one state and options, and two opposite questions
(e.g. "largest" / "smallest"), each with 3-4 paraphrases and its own right answer. From an
item the stage makes

- a plain row (one random paraphrase of one question) for train/eval;
- a consistency pair: the same question in two different paraphrases (same right answer);
- a flip pair: the same state with the question flipped, so the right answer changes.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass

from hobson.corpus.generator import Family, Row
from hobson.corpus.schema import NO, NOUL_OPTIONS, YES, make_row
from hobson.corpus.words import CATEGORIES, CATEGORY_NAMES, WORDS


@dataclass(frozen=True)
class Item:
    kind: str
    state: str
    options: list[list[str]]
    task: str
    questions: tuple[list[str], list[str]]  # paraphrases of the question and of its flip
    labels: tuple[int, int]


def _row(item: Item, side: int, phrasing: int) -> Row:
    qs = item.questions[side]
    return make_row(item.kind, item.state, qs[phrasing], item.options, item.labels[side], item.task,
                    qs[:phrasing] + qs[phrasing + 1 :])


def larger_smaller(rng: random.Random) -> Item:
    nums = rng.sample(range(1, 5000), rng.randint(3, 5))
    return Item("choice", "Values: " + ", ".join(map(str, nums)), [[str(n), ""] for n in nums],
                "larger_smaller",
                (["Which value is the largest?", "Pick the biggest number.", "Which number is greatest?"],
                 ["Which value is the smallest?", "Pick the least number.", "Which number is lowest?"]),
                (nums.index(max(nums)), nums.index(min(nums))))


_EVENTS = ["concert", "audit", "wedding", "trip", "exam", "launch", "meeting", "opening", "review"]


def earliest_latest(rng: random.Random) -> Item:
    names = rng.sample(_EVENTS, rng.randint(3, 4))
    base = dt.date(1995, 1, 1) + dt.timedelta(days=rng.randrange(365 * 40))
    days = rng.sample(range(0, 400), len(names))
    dates = [base + dt.timedelta(days=d) for d in days]
    state = " ".join(f"The {n} is on {d.isoformat()}." for n, d in zip(names, dates, strict=True))
    return Item("choice", state, [[n, ""] for n in names], "earliest_latest",
                (["Which event comes first?", "Which event is the earliest?", "What happens soonest?"],
                 ["Which event comes last?", "Which event is the latest?", "What happens last of all?"]),
                (days.index(min(days)), days.index(max(days))))


def true_false(rng: random.Random) -> Item:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    right = a + b
    shown = right if rng.random() < 0.5 else right + rng.choice([-10, -2, -1, 1, 2, 10])
    holds = shown == right
    return Item("noul", f"Statement: {a} + {b} = {shown}", NOUL_OPTIONS, "true_false",
                (["Is the statement true?", "Is the statement correct?", "Does the statement hold?"],
                 ["Is the statement false?", "Is the statement wrong?", "Does the statement fail?"]),
                (YES if holds else NO, NO if holds else YES))


def longest_shortest(rng: random.Random) -> Item:
    while True:
        words = rng.sample(WORDS, rng.randint(3, 5))
        lengths = [len(w) for w in words]
        if lengths.count(max(lengths)) == 1 and lengths.count(min(lengths)) == 1:
            break
    tag = rng.randrange(1000)  # list number: keeps states apart across the small word list
    return Item("choice", f"Words (list {tag}): " + ", ".join(words), [[w, ""] for w in words],
                "longest_shortest",
                (["Which word is the longest?", "Pick the word with the most letters.",
                  "Which word has the greatest length?"],
                 ["Which word is the shortest?", "Pick the word with the fewest letters.",
                  "Which word has the least length?"]),
                (lengths.index(max(lengths)), lengths.index(min(lengths))))


def warm_cold(rng: random.Random) -> Item:
    # score: five ordered levels; the flipped question reverses the scale
    temp = rng.randint(-20, 39)
    level = min(4, (temp + 20) // 12)
    while level == 2:  # the middle level reads the same both ways; a flip pair needs a change
        temp = rng.randint(-20, 39)
        level = min(4, (temp + 20) // 12)
    city = f"station {rng.randint(1, 99999)}"
    options = [[str(i + 1), f"level {i + 1} of 5"] for i in range(5)]
    return Item("score", f"Noon temperature at {city}: {temp} C (scale spans -20 to 39 C).", options,
                "warm_cold",
                (["How warm is it, from 1 (not at all) to 5 (very)?", "Rate the warmth on a 1-5 scale.",
                  "On 1 to 5, how hot is it?"],
                 ["How cold is it, from 1 (not at all) to 5 (very)?", "Rate the coldness on a 1-5 scale.",
                  "On 1 to 5, how chilly is it?"]),
                (level, 4 - level))


def category_pick(rng: random.Random) -> Item:
    c1, c2 = rng.sample(CATEGORY_NAMES, 2)
    others = [c for c in CATEGORY_NAMES if c not in (c1, c2)]
    picks = [rng.choice(CATEGORIES[c]) for c in [c1, c2] + others]
    order = list(range(len(picks)))
    rng.shuffle(order)
    items = [picks[j] for j in order]
    tag = rng.randrange(1000)
    return Item("choice", f"Items (set {tag}): " + ", ".join(items), [[w, ""] for w in items],
                "category_pick",
                ([f"Which item is a {c1}?", f"Pick the {c1}.", f"Which one of these is a kind of {c1}?"],
                 [f"Which item is a {c2}?", f"Pick the {c2}.", f"Which one of these is a kind of {c2}?"]),
                (order.index(0), order.index(1)))


ITEM_MAKERS: list[Callable[[random.Random], Item]] = [
    larger_smaller, earliest_latest, true_false, longest_shortest, warm_cold, category_pick,
]


def _plain(maker: Callable[[random.Random], Item]) -> Callable[[random.Random], Row]:
    def make(rng: random.Random) -> Row:
        item = maker(rng)
        side = rng.randrange(2)
        return _row(item, side, rng.randrange(len(item.questions[side])))
    return make


def _consistency(maker: Callable[[random.Random], Item]) -> Callable[[random.Random], list[Row]]:
    def make(rng: random.Random) -> list[Row]:
        item = maker(rng)
        side = rng.randrange(2)
        p, q = rng.sample(range(len(item.questions[side])), 2)
        return [_row(item, side, p), _row(item, side, q)]
    return make


def _flip(maker: Callable[[random.Random], Item]) -> Callable[[random.Random], list[Row]]:
    def make(rng: random.Random) -> list[Row]:
        item = maker(rng)
        first = rng.randrange(2)
        return [_row(item, first, rng.randrange(len(item.questions[first]))),
                _row(item, 1 - first, rng.randrange(len(item.questions[1 - first])))]
    return make


_COUNTS = {"train": 150, "eval": 50, "consistency": 40, "flip": 40}

FAMILIES: list[Family] = [Family(m.__name__, _plain(m), _COUNTS) for m in ITEM_MAKERS]
CONSISTENCY_FAMILIES: list[Family] = [Family(m.__name__, _consistency(m), _COUNTS) for m in ITEM_MAKERS]
FLIP_FAMILIES: list[Family] = [Family(m.__name__, _flip(m), _COUNTS) for m in ITEM_MAKERS]
