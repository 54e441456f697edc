"""The entropy metric: chunk-wise (logprobs, entropy) from one forward equals the direct
full-vocabulary computation, and the loop logs it."""

from __future__ import annotations

import pytest
import torch

from kiln.models.reference import packed_forward
from kiln.rl.loss import entropy_from_logits
from kiln.rl.trainer import chunked_logprobs_entropy
from tests.rl.tiny import fixed_batch, tiny_trainer, write_tiny_llama


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_chunked_entropy_and_logprobs_equal_direct(tmp_path, chunk):
    trainer = tiny_trainer(write_tiny_llama(str(tmp_path / "m")), logits_chunk=chunk)
    samples, _, _ = fixed_batch()
    temp = 0.7
    with torch.no_grad():
        lps, ents = trainer.sequence_logprobs_and_entropy(samples, temperature=temp)
    # Direct: the whole [T, V] logits of each sequence, then the output rows.
    want_lp, want_ent = [], []
    with torch.no_grad():
        for s in samples:
            seq = s["prompt_ids"] + s["output_ids"][:-1]
            logits, _ = packed_forward(trainer.model, torch.tensor(seq), [len(seq)])
            rows = logits[len(s["prompt_ids"]) - 1:] / temp
            want_ent.append(entropy_from_logits(rows))
            want_lp.append(torch.log_softmax(rows, -1).gather(1, torch.tensor(s["output_ids"])[:, None])[:, 0])
    assert [e.shape for e in ents] == [w.shape for w in want_ent]
    got, want = torch.cat(ents), torch.cat(want_ent)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert float(want.min()) > 0.5  # a near-uniform random model: far from a trivial 0
    assert torch.allclose(torch.cat(lps), torch.cat(want_lp), atol=1e-5)
    # sequence_logprobs is the same computation without the entropy.
    with torch.no_grad():
        assert torch.equal(torch.cat(trainer.sequence_logprobs(samples, temperature=temp)), torch.cat(lps))


def test_entropy_detached_unless_asked():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 8, generator=g, requires_grad=True)
    w = torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 11, (7,), generator=g)
    fn = lambda rows: h[rows] @ w.T  # noqa: E731
    rows = torch.arange(7)
    lp, ent = chunked_logprobs_entropy(fn, rows, targets, 1.3, chunk=3)
    assert lp.requires_grad and not ent.requires_grad
    lp2, ent2 = chunked_logprobs_entropy(fn, rows, targets, 1.3, chunk=3, entropy_grad=True)
    assert ent2.requires_grad and torch.allclose(ent2.detach(), ent)
    assert torch.allclose(ent, entropy_from_logits((h @ w.T) / 1.3).detach(), atol=1e-6)
    # The entropy bonus' gradient equals autograd through the direct formula.
    (g1,) = torch.autograd.grad(ent2.sum(), h)
    (g2,) = torch.autograd.grad(entropy_from_logits((h @ w.T) / 1.3).sum(), h)
    assert torch.allclose(g1, g2, atol=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        chunked_logprobs_entropy(fn, rows, targets, 1.0, chunk=0)
