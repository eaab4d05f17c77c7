"""Option labelling: prompts, batching, sharded scoring, shard files and the merge.

``label_rows`` labels one shard with any ``RowScorer`` (the teacher's ``LMOptionScorer`` is one);
``merge_shards`` reproduces the one-process file from the shards.
"""

from hobson.labels.batching import plan_batches
from hobson.labels.label import RowScorer, ShardResult, label_rows, shard_done
from hobson.labels.merge import MergeResult, merge_shards, train_path
from hobson.labels.prompt import check_option_counts, letter_token_ids, render_prompt
from hobson.labels.shardfile import format_label_line

__all__ = [
    "MergeResult",
    "RowScorer",
    "ShardResult",
    "check_option_counts",
    "format_label_line",
    "label_rows",
    "letter_token_ids",
    "merge_shards",
    "plan_batches",
    "render_prompt",
    "shard_done",
    "train_path",
]
