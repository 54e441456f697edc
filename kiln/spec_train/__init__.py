"""`kiln train-draft`: train speculative-decoding drafters against a frozen target on the target's
own continuations (self-distillation): MTP layers (`mtp.py`) or a DFlash drafter (`dflash.py`).

    from kiln.spec_train import TrainDraftConfig, train_draft
    train_draft(TrainDraftConfig(target="embedded", method="mtp", out="runs/mtp"))
"""

from kiln.spec_train.cli import train_draft
from kiln.spec_train.config import TrainDraftConfig

__all__ = ["TrainDraftConfig", "train_draft"]
