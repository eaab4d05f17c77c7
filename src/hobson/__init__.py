"""hobson: the library behind the launcher — data, models, labelling, training, RL, records."""

__version__ = "0.1.0"
