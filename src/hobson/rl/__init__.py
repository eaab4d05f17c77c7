"""What trains: algorithms, objectives, the loop, trainer, checkpoints, data, rewards, config.

What generates (the engines, the rollout server, publications) is :mod:`hobson.rollout`, one layer down:
code here may import it, never the reverse (tests/test_import_boundaries.py).
"""
