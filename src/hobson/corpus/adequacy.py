"""The ``adequacy`` stage: is this response adequate for the request?

Requests are checkable (a sum, a sorted list, items with a property), so adequacy is
computed, not judged. ``noul`` rows ask yes/no/unknown (unknown when the response rests on
facts the row does not give); ``score`` rows grade how much of a multi-part request was met.
"""

from __future__ import annotations

import random

from hobson.corpus.generator import Family, Row, phrase
from hobson.corpus.schema import NO, NOUL_OPTIONS, UNKNOWN, YES, make_row
from hobson.corpus.words import NAMES, WORDS

_NOUL_QUESTIONS = [
    "Is the response adequate for the request?",
    "Does the response do what was asked?",
    "Does the response satisfy the request?",
]
_REFUSALS = ["I cannot help with that.", "Please ask someone else.", "That is not something I do."]


def _noul(rng: random.Random, request: str, response: str, label: int, task: str) -> Row:
    instr, variants = phrase(rng, _NOUL_QUESTIONS)
    state = f"Request: {request}\nResponse: {response}"
    return make_row("noul", state, instr, NOUL_OPTIONS, label, task, variants)


def sum_answer(rng: random.Random) -> Row:
    a, b = rng.randint(10, 9999), rng.randint(10, 9999)
    case = rng.randrange(4)
    if case == 0:
        response, label = f"{a + b}", YES
    elif case == 1:
        response, label = f"The sum is {a + b}.", YES
    elif case == 2:
        response, label = f"The sum is {a + b + rng.choice([-100, -10, -1, 1, 10, 100])}.", NO
    else:
        response, label = rng.choice(_REFUSALS), NO
    return _noul(rng, f"Add {a} and {b}.", response, label, "sum_answer")


def sort_answer(rng: random.Random) -> Row:
    nums = rng.sample(range(1, 1000), rng.randint(3, 6))
    asc = rng.random() < 0.5
    right = sorted(nums, reverse=not asc)
    case = rng.randrange(3)
    if case == 0:
        shown, label = right, YES
    elif case == 1:
        shown = list(right)
        i = rng.randrange(len(shown) - 1)
        shown[i], shown[i + 1] = shown[i + 1], shown[i]
        label = NO
    else:
        shown, label = right[:-1], NO  # dropped an item
    order = "ascending" if asc else "descending"
    request = f"Sort in {order} order: " + ", ".join(map(str, nums))
    return _noul(rng, request, ", ".join(map(str, shown)), label, "sort_answer")


def fact_lookup(rng: random.Random) -> Row:
    # the response asserts a fact the row cannot check: neither adequate nor inadequate is known
    name = NAMES[rng.randrange(len(NAMES))]
    thing = ["library card number", "order status", "account balance", "seat number"][rng.randrange(4)]
    value = rng.randint(100, 99999)
    case = rng.randrange(3)
    if case == 0:
        response, label = f"{name}'s {thing} is {value}.", UNKNOWN
    elif case == 1:
        response, label = rng.choice(_REFUSALS), NO
    else:
        response, label = f"The weather is nice today ({value}).", NO
    return _noul(rng, f"What is {name}'s {thing}?", response, label, "fact_lookup")


_SCORE_OPTIONS = [
    ["1", "ignores the request"],
    ["2", "meets little of it"],
    ["3", "meets about half"],
    ["4", "meets most of it"],
    ["5", "fully adequate"],
]


def _score(rng: random.Random, request: str, response: str, met: int, asked: int, task: str) -> Row:
    # score level = share of the request met, mapped onto 1..5 (index 0..4)
    label = round(4 * met / asked)
    instr, variants = phrase(rng, [
        "How adequate is the response, from 1 to 5?",
        "Rate the response's adequacy on a 1-5 scale.",
        "Grade how well the response meets the request (1-5).",
    ])
    return make_row("score", f"Request: {request}\nResponse: {response}", instr, _SCORE_OPTIONS, label,
                    task, variants)


def list_even(rng: random.Random) -> Row:
    asked = 4
    met = rng.randint(0, asked)
    evens = [2 * rng.randint(1, 499) for _ in range(met)]
    odds = [2 * rng.randint(0, 499) + 1 for _ in range(asked - met)]
    shown = evens + odds
    rng.shuffle(shown)
    return _score(rng, f"List {asked} even numbers.", ", ".join(map(str, shown)), met, asked, "list_even")


def words_with_letter(rng: random.Random) -> Row:
    asked = 4
    letter = "abcdeilmnoprst"[rng.randrange(14)]
    good = [w for w in WORDS if w.startswith(letter)]
    bad = [w for w in WORDS if not w.startswith(letter)]
    met = rng.randint(0, min(asked, len(good)))
    shown = rng.sample(good, met) + rng.sample(bad, asked - met)
    rng.shuffle(shown)
    request = f"Give {asked} different words starting with '{letter}'."
    return _score(rng, request, ", ".join(shown), met, asked, "words_with_letter")


_COUNTS = {"train": 200, "eval": 60}

FAMILIES: list[Family] = [
    Family(f.__name__, f, _COUNTS)
    for f in (sum_answer, sort_answer, fact_lookup, list_even, words_with_letter)
]
