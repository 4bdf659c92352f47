"""What the training tests and the evaluation tests share: the capture layers and a small training config."""

from __future__ import annotations
from tests.support.configs import phase

CAPTURE = [2, 15, 27]  # default_capture_layers(30)


def small_config(shards, out, **kw):
    from eagle3.train.config import TrainConfig

    base = dict(shard_dirs=[str(s) for s in shards], model_path=str(kw.pop("model_path")), output_dir=str(out),
                batch_size=4, max_steps=24, lr=3e-3, warmup_ratio=0.1, checkpoint_every=4, ttt_steps=3, seed=7)
    base.update(kw)
    return phase(TrainConfig, **base)
