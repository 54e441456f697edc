"""Gradient accumulation in the GRPO step (`train_on_batch(..., micro_batch=k)`): recomputing and
back-propagating k samples at a time, then one optimizer step, gives the step of the whole batch
at once (weights and metrics), for token- and sequence-mean losses and with the entropy term."""

from __future__ import annotations

import pytest
import torch

from kiln.rl.loop import train_on_batch
from kiln.rl.loss import LossConfig
from tests.rl.tiny import fixed_batch, tiny_trainer, write_tiny_llama


def _step(model_dir, loss_cfg, micro_batch):
    torch.manual_seed(0)
    # Adam's eps = 1 makes the update ~proportional to the gradient (see tests/rl/fsdp_worker.py).
    trainer = tiny_trainer(model_dir, lr=0.5, eps=1.0)
    samples, adv, keep = fixed_batch(n_groups=3, group=3)
    m, updated = train_on_batch(trainer, samples, adv, keep, loss_cfg, 1.0, False, None, micro_batch)
    assert updated
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, m


@pytest.mark.parametrize("loss_cfg", [LossConfig(), LossConfig(loss_agg="sequence"),
                                      LossConfig(entropy_coef=0.01)], ids=["token", "sequence", "entropy"])
def test_micro_batches_give_the_whole_batch_step(tmp_path, loss_cfg):
    d = write_tiny_llama(str(tmp_path / "m"))
    whole, m_whole = _step(d, loss_cfg, 0)
    for k in (2, 4):  # 9 samples: uneven parts, the last group (dropped by keep) split across parts
        parts, m_parts = _step(d, loss_cfg, k)
        moved = max((whole[n] - parts[n]).abs().max().item() for n in whole)
        assert moved < 1e-5, (k, moved)
        for key in ("loss", "train_rollout_kl", "entropy", "grad_norm", "clip_frac"):
            assert m_parts[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), (k, key)


def test_a_wrong_part_scale_moves_the_weights(tmp_path, monkeypatch):
    """The check above can fail: dropping the parts' scaling changes the step."""
    import kiln.rl.fsdp as fsdp

    d = write_tiny_llama(str(tmp_path / "m"))
    whole, _ = _step(d, LossConfig(), 0)
    monkeypatch.setattr(fsdp, "loss_scale", lambda local, glob, world: 1.0)
    parts, _ = _step(d, LossConfig(), 2)
    assert max((whole[n] - parts[n]).abs().max().item() for n in whole) > 1e-3


def test_micro_batches_are_even_and_the_same_count_on_every_rank():
    from kiln.rl.fsdp import shard_range
    from kiln.rl.loop import micro_batches

    assert micro_batches(range(9), 0, 9, 1) == [slice(0, 9)]
    assert [s.stop - s.start for s in micro_batches(range(9), 4, 9, 1)] == [3, 3, 3]
    for n, world, size in ((9, 2, 2), (10, 3, 2), (7, 2, 1), (64, 4, 5)):
        parts = [micro_batches(shard_range(n, r, world), size, n, world) for r in range(world)]
        assert len({len(p) for p in parts}) == 1, (n, world, size, parts)  # one backward count
        for r, p in enumerate(parts):
            mine = shard_range(n, r, world)
            assert p[0].start == mine.start and p[-1].stop == mine.stop
            assert all(a.stop == b.start for a, b in zip(p, p[1:]))
            assert all(1 <= s.stop - s.start <= size + 1 for s in p)


def test_out_of_memory_names_the_micro_batch_option(tmp_path, monkeypatch):
    d = write_tiny_llama(str(tmp_path / "m"))
    trainer = tiny_trainer(d)
    samples, adv, keep = fixed_batch()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 576.00 MiB.")

    monkeypatch.setattr(trainer, "sequence_logprobs_and_entropy", oom)
    with pytest.raises(torch.OutOfMemoryError, match="micro-batch-size.*576"):
        train_on_batch(trainer, samples, adv, keep, LossConfig(), 1.0, False)
