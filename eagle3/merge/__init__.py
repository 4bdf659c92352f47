"""Merge + shuffle phase: tokenized JSONL datasets -> one capped, deduplicated, shuffled parquet dataset.

    from eagle3.merge import MergeConfig, run_merge, iter_rows
    from eagle3.sections import DataConfig, TargetConfig
    run_merge(MergeConfig(inputs=["runs/x/datagen"], output_dir="runs/x/merge", seed=0,
                          data=DataConfig(max_seq_len=4096), target=TargetConfig(model_path=...).resolved()))
    for global_row, sample_id, input_ids, loss_mask in iter_rows("runs/x/merge", 0, 10): ...
"""

from eagle3.merge.config import MergeConfig
from eagle3.merge.dataset import MergedDataset, iter_rows, read_merged
from eagle3.merge.run import run_merge
from eagle3.merge.stats import BadInputError

__all__ = ["MergeConfig", "run_merge", "read_merged", "iter_rows", "MergedDataset", "BadInputError"]
