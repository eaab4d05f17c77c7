"""Recurrent-policy RL: objectives and advantage estimators (``hobson.rl.objectives``)."""
