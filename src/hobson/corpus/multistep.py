"""The ``multistep`` stage's families: 2-3 hops over facts stated in the row's state."""

from __future__ import annotations

import datetime as dt
import random

from hobson.corpus.generator import Family, Row, distinct_ints, phrase, shuffled_options
from hobson.corpus.schema import NO, NOUL_OPTIONS, UNKNOWN, YES, make_row
from hobson.corpus.words import NAMES


def _people(rng: random.Random, k: int) -> list[str]:
    return rng.sample(NAMES, k)


def height_chain(rng: random.Random) -> Row:
    k = rng.randint(3, 4)  # 2 or 3 comparisons to chain
    order = _people(rng, k)  # tallest first
    adj, adj_less = [("taller", "shorter"), ("older", "younger"), ("faster", "slower")][rng.randrange(3)]
    facts = []
    for a, b in zip(order, order[1:], strict=False):
        facts.append(f"{a} is {adj} than {b}." if rng.random() < 0.5 else f"{b} is {adj_less} than {a}.")
    rng.shuffle(facts)
    want_top = rng.random() < 0.5
    target = order[0] if want_top else order[-1]
    word = {"taller": ("tallest", "shortest"), "older": ("oldest", "youngest"),
            "faster": ("fastest", "slowest")}[adj][0 if want_top else 1]
    names = sorted(order)
    instr, variants = phrase(rng, [f"Who is the {word}?", f"Which person is {word}?",
                                   f"Name the {word} of them."])
    return make_row("choice", " ".join(facts), instr, [[n, ""] for n in names], names.index(target),
                    "height_chain", variants)


# Chains of exact integer factors: 1 a = f1 b, 1 b = f2 c (units are made up so the row has to
# be read, not recalled).
_FAKE_UNITS = ["blip", "drop", "glim", "krat", "lume", "mote", "pent", "quib", "rund", "tosk", "vell", "zorn"]


def unit_chain(rng: random.Random) -> Row:
    hops = rng.randint(2, 3)
    units = rng.sample(_FAKE_UNITS, hops + 1)
    factors = [rng.randint(2, 12) for _ in range(hops)]
    facts = [f"1 {units[i]} = {factors[i]} {units[i + 1]}." for i in range(hops)]
    rng.shuffle(facts)
    amount = rng.randint(2, 9)
    right = amount
    for f in factors:
        right *= f
    wrong = distinct_ints(rng, right, [-factors[-1], factors[-1], -amount, amount, right, -right // 2], 3)
    options, label = shuffled_options(
        rng, [f"{right} {units[-1]}", ""], [[f"{w} {units[-1]}", ""] for w in wrong]
    )
    instr, variants = phrase(rng, [f"How many {units[-1]} are {amount} {units[0]}?",
                                   f"Convert {amount} {units[0]} to {units[-1]}.",
                                   f"Express {amount} {units[0]} in {units[-1]}."])
    return make_row("choice", " ".join(facts), instr, options, label, "unit_chain", variants)


def kinship(rng: random.Random) -> Row:
    hops = rng.randint(2, 3)
    line = _people(rng, hops + 1)  # line[0] is the eldest
    facts = [f"{line[i]} is a parent of {line[i + 1]}." for i in range(hops)]
    rng.shuffle(facts)
    pairs = [(i, j) for i in range(hops + 1) for j in range(i + 1, hops + 1)]
    i, j = pairs[rng.randrange(len(pairs))]
    relations = ["parent", "grandparent", "great-grandparent", "child", "not related this way"]
    gap = j - i
    if rng.random() < 0.5:
        a, b, right = line[i], line[j], {1: "parent", 2: "grandparent", 3: "great-grandparent"}[gap]
    else:
        a, b, right = line[j], line[i], "child" if gap == 1 else "not related this way"
    options = [[r, ""] for r in relations]
    instr, variants = phrase(rng, [f"What is {a} to {b}?", f"How is {a} related to {b}?",
                                   f"{a} is {b}'s what?"])
    return make_row("choice", " ".join(facts), instr, options, relations.index(right), "kinship", variants)


def date_chain(rng: random.Random) -> Row:
    events = rng.sample(["the fair", "the launch", "the audit", "the race", "the recital", "the move",
                         "the sale", "the trip", "the exam", "the party"], 3)
    base = dt.date(2000, 1, 1) + dt.timedelta(days=rng.randrange(365 * 40))
    d1, d2 = rng.randint(1, 40), rng.randint(1, 40)
    s1, s2 = rng.choice([1, -1]), rng.choice([1, -1])
    second = base + dt.timedelta(days=s1 * d1)
    third = second + dt.timedelta(days=s2 * d2)
    rel = {1: "after", -1: "before"}
    facts = [f"{events[0].capitalize()} is on {base.isoformat()}.",
             f"{events[1].capitalize()} is {d1} days {rel[s1]} {events[0]}.",
             f"{events[2].capitalize()} is {d2} days {rel[s2]} {events[1]}."]
    wrong = [third + dt.timedelta(days=d) for d in (1, -1, 2 * s2 * d2 if d2 else 3)]
    options, label = shuffled_options(rng, [third.isoformat(), ""], [[w.isoformat(), ""] for w in wrong])
    instr, variants = phrase(rng, [f"On what date is {events[2]}?", f"When does {events[2]} take place?",
                                   f"Which date is {events[2]} on?"])
    return make_row("choice", " ".join(facts), instr, options, label, "date_chain", variants)


def variable_chain(rng: random.Random) -> Row:
    names = rng.sample("abcdfghkmnpqrtuvwxyz", 3)
    a0 = rng.randint(1, 30)
    k1, k2 = rng.randint(2, 9), rng.randint(1, 30)
    val_b = a0 * k1
    op = rng.randrange(2)
    val_c = val_b + k2 if op == 0 else val_b - k2
    facts = [f"{names[0]} = {a0}.", f"{names[1]} = {k1} * {names[0]}.",
             f"{names[2]} = {names[1]} {'+' if op == 0 else '-'} {k2}."]
    wrong = distinct_ints(rng, val_c, [1, -1, k2 * (2 if op == 0 else -2), a0 - val_b, 10, -10], 3)
    options, label = shuffled_options(rng, [str(val_c), ""], [[str(w), ""] for w in wrong])
    instr, variants = phrase(rng, [f"What is the value of {names[2]}?", f"Compute {names[2]}.",
                                   f"Work out {names[2]} from the definitions."])
    return make_row("choice", " ".join(facts), instr, options, label, "variable_chain", variants)


def syllogism_chain(rng: random.Random) -> Row:
    groups = rng.sample(["glims", "vorps", "trels", "bants", "quops", "drees", "snaps", "flots",
                         "mirks", "zents"], 3)
    x = _people(rng, 1)[0]
    case = rng.randrange(3)
    facts = [f"All {groups[0]} are {groups[1]}.", f"All {groups[1]} are {groups[2]}."]
    if case == 0:
        facts.append(f"{x} is one of the {groups[0]}.")
        claim, label = f"{x} is one of the {groups[2]}.", YES
    elif case == 1:
        facts = [f"All {groups[0]} are {groups[1]}.", f"No {groups[1]} are {groups[2]}.",
                 f"{x} is one of the {groups[0]}."]
        claim, label = f"{x} is one of the {groups[2]}.", NO
    else:
        facts.append(f"{x} is one of the {groups[2]}.")
        claim, label = f"{x} is one of the {groups[0]}.", UNKNOWN
    rng.shuffle(facts)
    instr, variants = phrase(rng, [f"Does it follow that {claim[:-1]}?",
                                   f"Is this true given the facts: {claim}",
                                   f"Claim: {claim} Follows from the facts?"])
    return make_row("noul", " ".join(facts), instr, NOUL_OPTIONS, label, "syllogism_chain", variants)


_COUNTS = {"train": 200, "eval": 60}

FAMILIES: list[Family] = [
    Family(f.__name__, f, _COUNTS)
    for f in (height_chain, unit_chain, kinship, date_chain, variable_chain, syllogism_chain)
]
