"""The ``catchall`` stage: rows whose right answer is "none of these".

Every row lists candidates that all fail the question, then the ``NONE_OF_THESE`` option
last (its conventional place), which is the label. A model that always picks some listed
candidate gets these wrong.
"""

from __future__ import annotations

import datetime as dt
import random

from hobson.corpus.generator import Family, Row, phrase
from hobson.corpus.schema import NONE_OF_THESE, make_row
from hobson.corpus.words import CATEGORIES, CATEGORY_NAMES, WORDS


def _row(rng: random.Random, state: str, candidates: list[str], phrasings: list[str], task: str) -> Row:
    options = [[c, ""] for c in candidates] + [list(NONE_OF_THESE)]
    instr, variants = phrase(rng, phrasings)
    return make_row("choice", state, instr, options, len(options) - 1, task, variants)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(n**0.5) + 1))


def none_prime(rng: random.Random) -> Row:
    nums: list[int] = []
    while len(nums) < 4:
        n = rng.randint(4, 999)
        if not _is_prime(n) and n not in nums:
            nums.append(n)
    return _row(rng, "Candidates: " + ", ".join(map(str, nums)), list(map(str, nums)),
                ["Which candidate is a prime number?", "Pick the prime.", "Which of these numbers is prime?"],
                "none_prime")


def none_sum(rng: random.Random) -> Row:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    wrong = sorted({a + b + d for d in rng.sample([-20, -11, -10, -2, -1, 1, 2, 9, 10, 100], 3)})
    return _row(rng, f"a = {a}; b = {b}", list(map(str, wrong)),
                ["Which value equals a + b?", "Pick the sum of a and b.", "What is a plus b?"], "none_sum")


_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def none_weekday(rng: random.Random) -> Row:
    day = rng.randrange(7)
    dates: list[dt.date] = []
    while len(dates) < 3:
        d = dt.date(1990, 1, 1) + dt.timedelta(days=rng.randrange(365 * 60))
        if d.weekday() != day and d not in dates:
            dates.append(d)
    name = _WEEKDAYS[day]
    return _row(rng, "Dates: " + ", ".join(d.isoformat() for d in dates), [d.isoformat() for d in dates],
                [f"Which date is a {name}?", f"Pick the date that falls on a {name}.",
                 f"Which of the dates was or will be a {name}?"], "none_weekday")


def none_category(rng: random.Random) -> Row:
    cat = CATEGORY_NAMES[rng.randrange(len(CATEGORY_NAMES))]
    pool = [w for c in CATEGORY_NAMES if c != cat for w in CATEGORIES[c]]
    items = rng.sample(pool, 4)
    tag = rng.randrange(1000)  # list number: keeps states apart across the small vocabulary
    return _row(rng, f"Items (box {tag}): " + ", ".join(items), items,
                [f"Which item is a {cat}?", f"Pick the {cat}.", f"Which one is a kind of {cat}?"],
                "none_category")


def none_anagram(rng: random.Random) -> Row:
    word = WORDS[rng.randrange(len(WORDS))]
    cands: list[str] = []
    while len(cands) < 3:
        letters = list(word)
        rng.shuffle(letters)
        i = rng.randrange(len(letters))
        letters[i] = "abcdefghijklmnopqrstuvwxyz".replace(letters[i], "")[rng.randrange(25)]
        c = "".join(letters)
        if c not in cands:
            cands.append(c)
    return _row(rng, f"Word: {word}; candidates: " + ", ".join(cands), cands,
                [f"Which candidate is an anagram of '{word}'?", f"Pick the rearrangement of '{word}'.",
                 f"Which candidate uses exactly the letters of '{word}'?"], "none_anagram")


_COUNTS = {"train": 150, "eval": 50}

FAMILIES: list[Family] = [
    Family(f.__name__, f, _COUNTS) for f in (none_prime, none_sum, none_weekday, none_category, none_anagram)
]
