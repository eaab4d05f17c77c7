"""The ``build`` stage's short-task families: one question each, answers computed exactly.

Each function takes a seeded ``random.Random`` and returns one schema row. Numbers are drawn
from ranges large enough that held-out splits rarely collide with train (collisions are
re-drawn, see ``generator.split_rows``).
"""

from __future__ import annotations

import datetime as dt
import random

from hobson.corpus.generator import Family, Row, distinct_ints, phrase, shuffled_options
from hobson.corpus.schema import NO, NOUL_OPTIONS, UNKNOWN, YES, make_row
from hobson.corpus.words import CATEGORIES, CATEGORY_NAMES, NAMES, WORDS

_OPS = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]


def _expr(rng: random.Random) -> tuple[str, int]:
    sym, fn = _OPS[rng.randrange(len(_OPS))]
    if sym == "*":
        a, b = rng.randint(2, 40), rng.randint(2, 40)
    else:
        a, b = rng.randint(10, 999), rng.randint(1, 999)
    return f"{a} {sym} {b}", fn(a, b)


def arith_compare(rng: random.Random) -> Row:
    (ex, x), (ey, y) = _expr(rng), _expr(rng)
    if rng.random() < 0.1:
        ey, y = f"{x} + 0", x  # an occasional tie keeps the "equal" option honest
    instr, variants = phrase(rng, [
        "Which expression has the larger value?",
        "Which of x and y is bigger?",
        "Pick the larger of x and y.",
        "Compare x and y: which is greater?",
    ])
    options = [["x", ex], ["y", ey], ["equal", "both have the same value"]]
    label = 0 if x > y else 1 if y > x else 2
    return make_row("choice", f"x = {ex}; y = {ey}", instr, options, label, "arith_compare", variants)


def ordering(rng: random.Random) -> Row:
    nums = rng.sample(range(1, 1000), 5)
    k = rng.randrange(5)
    ordinal = ["first", "second", "third", "fourth", "fifth"][k]
    asc = rng.random() < 0.5
    word = "ascending" if asc else "descending"
    target = sorted(nums, reverse=not asc)[k]
    instr, variants = phrase(rng, [
        f"Sorted in {word} order, which number comes {ordinal}?",
        f"Which number is {ordinal} when the list is put in {word} order?",
        f"Order the numbers {word}ly; what is in position {k + 1}?",
    ])
    options = [[str(n), ""] for n in nums]
    return make_row("choice", "Numbers: " + ", ".join(map(str, nums)), instr, options,
                    nums.index(target), "ordering", variants)


# (from unit, to unit, factor): value_in_to = value_in_from * factor, all exact integers
_UNITS = [("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("h", "min", 60),
          ("min", "s", 60), ("L", "mL", 1000), ("ft", "in", 12), ("day", "h", 24)]


def unit_conversion(rng: random.Random) -> Row:
    src, dst, factor = _UNITS[rng.randrange(len(_UNITS))]
    value = rng.randint(2, 9999)
    right = value * factor
    wrong = [value * factor * 10, value * factor // 10 if factor >= 100 else value * factor + factor,
             value + factor, value * (factor + 1) if factor < 100 else value * factor // 100]
    wrong = [w for i, w in enumerate(wrong) if w != right and w not in wrong[:i]][:3]
    options, label = shuffled_options(rng, [f"{right} {dst}", ""], [[f"{w} {dst}", ""] for w in wrong])
    instr, variants = phrase(rng, [
        f"How much is that in {dst}?",
        f"Convert the amount to {dst}.",
        f"Express it in {dst}.",
    ])
    return make_row("choice", f"Amount: {value} {src}", instr, options, label, "unit_conversion", variants)


_EPOCH = dt.date(1990, 1, 1)


def _date(rng: random.Random) -> dt.date:
    return _EPOCH + dt.timedelta(days=rng.randrange(365 * 60))


def date_reasoning(rng: random.Random) -> Row:
    start = _date(rng)
    n = rng.randint(2, 400)
    after = rng.random() < 0.5
    end = start + dt.timedelta(days=n if after else -n)
    wrong = [end + dt.timedelta(days=d) for d in (1, -1, 7 if after else -7)]
    options, label = shuffled_options(rng, [end.isoformat(), ""], [[w.isoformat(), ""] for w in wrong])
    rel = "after" if after else "before"
    instr, variants = phrase(rng, [
        f"What date is {n} days {rel} it?",
        f"Which date lies {n} days {rel} the given date?",
        f"Count {n} days {rel}: which date do you reach?",
    ])
    return make_row("choice", f"Date: {start.isoformat()}", instr, options, label, "date_reasoning", variants)


def rule_application(rng: random.Random) -> Row:
    name = NAMES[rng.randrange(len(NAMES))]
    threshold = rng.randint(10, 500)
    perk = ["a discount", "free shipping", "a gold badge", "early access"][rng.randrange(4)]
    case = rng.randrange(5)
    if case == 4:
        fact, label = f"{name} is a member.", UNKNOWN
    else:
        points = rng.choice([threshold + rng.randint(1, 200), max(0, threshold - rng.randint(1, 200))])
        fact, label = f"{name} has {points} points.", YES if points > threshold else NO
    state = f"Rule: members with more than {threshold} points get {perk}. {fact}"
    instr, variants = phrase(rng, [
        f"Does {name} get {perk}?",
        f"Under the rule, is {name} entitled to {perk}?",
        f"Apply the rule: does {name} qualify for {perk}?",
    ])
    return make_row("noul", state, instr, NOUL_OPTIONS, label, "rule_application", variants)


def set_membership(rng: random.Random) -> Row:
    members = sorted(rng.sample(range(1, 300), rng.randint(4, 7)))
    if rng.random() < 0.5:
        x, label = members[rng.randrange(len(members))], YES
    else:
        x = rng.randint(1, 299)
        while x in members:
            x = rng.randint(1, 299)
        label = NO
    instr, variants = phrase(rng, [
        f"Is {x} an element of S?",
        f"Does S contain {x}?",
        f"Is {x} in the set S?",
    ])
    state = "S = {" + ", ".join(map(str, members)) + "}"
    return make_row("noul", state, instr, NOUL_OPTIONS, label, "set_membership", variants)


def _letters(rng: random.Random, n: int, alphabet: str = "abcdeilmnorst") -> str:
    return "".join(alphabet[rng.randrange(len(alphabet))] for _ in range(n))


def string_properties(rng: random.Random) -> Row:
    # random strings, not dictionary words: the question space must outgrow --scale
    prop = rng.randrange(3)
    if prop == 0:
        half = _letters(rng, rng.randint(2, 4))
        word = half + _letters(rng, rng.randint(0, 1)) + half[::-1]
        if rng.random() < 0.5:
            i = rng.randrange(len(word))
            word = word[:i] + "u" + word[i + 1 :]
        label = YES if word == word[::-1] else NO
        qs = ["Does the string read the same backwards?", "Is the string a palindrome?",
              "Is the string unchanged when reversed?"]
    elif prop == 1:
        word = _letters(rng, rng.randint(4, 9))
        letter = "abcdeilmnorstu"[rng.randrange(14)]
        label = YES if letter in word else NO
        qs = [f"Does the string contain the letter '{letter}'?", f"Is there an '{letter}' in the string?",
              f"Does the letter '{letter}' occur in the string?"]
    else:
        word = _letters(rng, rng.randint(3, 10))
        n = len(word) + rng.choice([-1, 0, 0, 1])
        label = YES if len(word) == n else NO
        qs = [f"Does the string have exactly {n} letters?", f"Is the string {n} letters long?",
              f"Is the length of the string {n}?"]
    instr, variants = phrase(rng, qs)
    return make_row("noul", f"String: {word}", instr, NOUL_OPTIONS, label, "string_properties", variants)


def entailment(rng: random.Random) -> Row:
    cat = CATEGORY_NAMES[rng.randrange(len(CATEGORY_NAMES))]
    place = ["crate", "box", "room", "shelf", "bag"][rng.randrange(5)]
    num = rng.randint(1, 99)
    prop = ["is labelled", "is checked", "is counted", "is cleaned"][rng.randrange(4)]
    item = CATEGORIES[cat][rng.randrange(len(CATEGORIES[cat]))]
    case = rng.randrange(3)
    if case == 0:
        facts, label = f"Every {cat} in {place} {num} {prop}. The {item} is a {cat} in {place} {num}.", YES
    elif case == 1:
        facts, label = f"No {cat} in {place} {num} {prop}. The {item} is a {cat} in {place} {num}.", NO
    else:
        facts, label = f"Every {cat} in {place} {num} {prop}. The {item} is a {cat}.", UNKNOWN
    claim = f"The {item} {prop}."
    instr, variants = phrase(rng, [
        f"Given only the facts, is this true: {claim}",
        f"Do the facts entail: {claim}",
        f"Claim: {claim} Does it follow from the facts?",
    ])
    return make_row("noul", "Facts: " + facts, instr, NOUL_OPTIONS, label, "entailment", variants)


def divisibility(rng: random.Random) -> Row:
    d = rng.choice([2, 3, 4, 5, 6, 7, 9, 11])
    n = rng.randint(100, 99999)
    if rng.random() < 0.5:
        n -= n % d
    label = YES if n % d == 0 else NO
    instr, variants = phrase(rng, [
        f"Is n divisible by {d}?",
        f"Does {d} divide n evenly?",
        f"Is n a multiple of {d}?",
    ])
    return make_row("noul", f"n = {n}", instr, NOUL_OPTIONS, label, "divisibility", variants)


def counting(rng: random.Random) -> Row:
    # score: the options are ordered counts 0..5, so a near miss is a smaller error
    target = rng.randint(0, 5)
    letters = "bcdfghjklmnpqrstvwxz"
    letter = "aeiou"[rng.randrange(5)]
    others = [letters[rng.randrange(len(letters))] for _ in range(rng.randint(6, 14))]
    pos = sorted(rng.sample(range(len(others) + target), target))
    seq: list[str] = []
    it = iter(others)
    for i in range(len(others) + target):
        seq.append(letter if i in pos else next(it))
    text = "".join(seq)
    instr, variants = phrase(rng, [
        f"How many times does '{letter}' occur in the string?",
        f"Count the letter '{letter}' in the string.",
        f"What is the number of '{letter}' characters in it?",
    ])
    options = [[str(k), f"{k} occurrence" + ("" if k == 1 else "s")] for k in range(6)]
    return make_row("score", f"String: {text}", instr, options, target, "counting", variants)


def max_min(rng: random.Random) -> Row:
    nums = rng.sample(range(-500, 1000), rng.randint(4, 6))
    want_max = rng.random() < 0.5
    target = max(nums) if want_max else min(nums)
    word = "largest" if want_max else "smallest"
    instr, variants = phrase(rng, [
        f"Which number in the list is the {word}?",
        f"Pick the {word} value.",
        f"What is the {word} number given?",
    ])
    options = [[str(n), ""] for n in nums]
    return make_row("choice", "List: " + ", ".join(map(str, nums)), instr, options,
                    nums.index(target), "max_min", variants)


def _hhmm(minutes: int) -> str:
    minutes %= 24 * 60
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _time_options(rng: random.Random, right: int, offsets: list[int]) -> tuple[list[list[str]], int]:
    # compare on the clock face: offsets of whole days would show the same time
    wrong = distinct_ints(rng, right % 1440, offsets, 3, modulus=1440)
    return shuffled_options(rng, [_hhmm(right), ""], [[_hhmm(w), ""] for w in wrong])


def duration(rng: random.Random) -> Row:
    start = rng.randrange(24 * 60)
    length = rng.randint(5, 600)
    end = start + length
    options, label = _time_options(rng, end, [-60, 60, -10, 10, 30, -30, 120])
    instr, variants = phrase(rng, [
        "At what time does it end?",
        "When is it over (24-hour clock)?",
        "What is the finishing time?",
    ])
    state = f"A session starts at {_hhmm(start)} and lasts {length} minutes."
    return make_row("choice", state, instr, options, label, "duration", variants)


def timezone(rng: random.Random) -> Row:
    a, b = rng.sample(range(-10, 13), 2)
    t = rng.randrange(24 * 60)
    right = t + (b - a) * 60
    options, label = _time_options(rng, right, [(a - b) * 120, -60, 60, (a - b) * 120 - 60, 120, -120])
    za, zb = f"UTC{a:+d}", f"UTC{b:+d}"
    instr, variants = phrase(rng, [
        f"What time is it then in {zb}?",
        f"Convert that time to {zb}.",
        f"At that moment, what does a clock in {zb} show?",
    ])
    return make_row("choice", f"It is {_hhmm(t)} in {za}.", instr, options, label, "timezone", variants)


def anagram(rng: random.Random) -> Row:
    word = WORDS[rng.randrange(len(WORDS))]
    letters = list(word)
    rng.shuffle(letters)
    if rng.random() < 0.5:
        i = rng.randrange(len(letters))
        letters[i] = "abcdefghijklmnopqrstuvwxyz".replace(letters[i], "")[rng.randrange(25)]
    other = "".join(letters)
    label = YES if sorted(other) == sorted(word) else NO
    instr, variants = phrase(rng, [
        "Are the two strings anagrams of each other?",
        "Do both strings use exactly the same letters?",
        "Is the second string a rearrangement of the first?",
    ])
    state = f"First: {word}; second: {other}"
    return make_row("noul", state, instr, NOUL_OPTIONS, label, "anagram", variants)


_BANDS = [(0, 19), (20, 39), (40, 59), (60, 79), (80, 100)]


def grade_band(rng: random.Random) -> Row:
    # score: five ordered grades; the mark decides the band exactly
    name = NAMES[rng.randrange(len(NAMES))]
    total = rng.randrange(20, 201, 10)
    got = rng.randint(0, total)
    pct_floor = got * 100 // total
    label = next(i for i, (lo, hi) in enumerate(_BANDS) if lo <= pct_floor <= hi)
    options = [[str(i + 1), f"{lo}-{hi} percent"] for i, (lo, hi) in enumerate(_BANDS)]
    instr, variants = phrase(rng, [
        "Which grade (1-5) does the mark earn?",
        "Map the mark to its grade band.",
        "Grade the result on the 1 to 5 scale.",
    ])
    state = f"{name} scored {got} out of {total}. Grades by percent: " + ", ".join(
        f"{i + 1}: {lo}-{hi}" for i, (lo, hi) in enumerate(_BANDS)) + "."
    return make_row("score", state, instr, options, label, "grade_band", variants)


_COUNTS = {"train": 200, "eval": 80}

FAMILIES: list[Family] = [
    Family(f.__name__, f, _COUNTS)
    for f in (arith_compare, ordering, unit_conversion, date_reasoning, rule_application, set_membership,
              string_properties, entailment, divisibility, counting, max_min, duration, timezone, anagram,
              grade_band)
]
