"""Small fixed vocabularies the generators draw from (ASCII, lower case, sorted lists)."""

from __future__ import annotations

NAMES = [
    "Ada", "Ben", "Cai", "Dev", "Eli", "Fay", "Gus", "Hal", "Ida", "Jon", "Kim", "Lev", "Mia",
    "Ned", "Ola", "Pam", "Quin", "Rex", "Sam", "Tia", "Uma", "Vic", "Wes", "Xia", "Yan", "Zoe",
    "Abe", "Bea", "Cy", "Dot", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jay", "Kai", "Liv", "Max",
    "Nia", "Otto", "Pia", "Ray", "Sue", "Tom", "Ugo", "Val", "Wyn", "Yuri", "Zed",
]

WORDS = [
    "apple", "arrow", "badge", "baker", "banana", "basket", "beach", "bird", "blanket", "bottle",
    "bridge", "bucket", "butter", "cabin", "camera", "candle", "carpet", "castle", "cattle",
    "chair", "cherry", "circle", "cloud", "coffee", "copper", "cotton", "desert", "dinner",
    "doctor", "dragon", "eagle", "earth", "engine", "feather", "finger", "flower", "forest",
    "garden", "garlic", "giant", "ginger", "glass", "guitar", "hammer", "harbor", "honey",
    "island", "jacket", "jungle", "kettle", "kitten", "ladder", "lemon", "letter", "level",
    "listen", "magnet", "maple", "marble", "meadow", "melon", "mirror", "monkey", "needle",
    "noon", "ocean", "orange", "oyster", "paddle", "panel", "parrot", "pebble", "pencil",
    "pepper", "pillow", "planet", "pocket", "potato", "puzzle", "rabbit", "radar", "ribbon",
    "river", "rocket", "saddle", "salmon", "silent", "silver", "spider", "spoon", "stone",
    "sugar", "summer", "table", "tiger", "timber", "tomato", "tunnel", "turtle", "valley",
    "velvet", "violin", "wagon", "walnut", "window", "winter", "wizard", "yellow", "zebra",
]

PALINDROMES = ["civic", "kayak", "level", "madam", "noon", "radar", "refer", "rotor", "stats", "tenet"]

CATEGORIES = {
    "fruit": ["apple", "banana", "cherry", "lemon", "mango", "melon", "orange", "peach", "pear", "plum"],
    "animal": [
        "eagle", "horse", "kitten", "monkey", "parrot", "rabbit", "spider", "tiger", "turtle", "zebra",
    ],
    "tool": ["chisel", "drill", "hammer", "ladder", "pliers", "saw", "shovel", "spanner", "trowel", "wrench"],
    "color": ["amber", "azure", "crimson", "indigo", "ivory", "maroon", "olive", "scarlet", "teal", "violet"],
}
CATEGORY_NAMES = sorted(CATEGORIES)

PLACES = ["the library", "the market", "the station", "the park", "the museum", "the office", "the harbor"]
