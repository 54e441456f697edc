"""Two-launch exact verification (`kiln.kernels.spec_verify`) against the reference
(`kiln.engine.spec.verify.verify_tokenwise` / `verify_block`, then the emitted row of
`sampled_verify._emitted`): the same accepted counts, next tokens and emitted rows on random
rounds, residuals that are all zero, drafts the drafter gave no mass, the bonus row and rounds
without drafts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.engine.spec.sampled_verify import _emitted  # noqa: E402
from kiln.engine.spec.verify import verify_block, verify_tokenwise  # noqa: E402
from kiln.kernels import spec_verify  # noqa: E402
from tests.kernels.devices import DEVICES, count_compiles  # noqa: E402


def _rounds(B: int, k: int, V: int, seed: int, sharp: float = 2.0):
    """Random rounds whose drafts are mostly drawn from q (so runs of acceptance vary), with
    tokens off the support (p and q zero) and q rows close to p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, k + 1, V, generator=g) * sharp
    logits[..., V // 3: V // 3 + V // 5] = float("-inf")  # a filtered band: zero mass in p
    p = torch.softmax(logits, -1)
    q_logits = logits[:, :k] + torch.randn(B, k, V, generator=g) * 0.5
    q = torch.softmax(q_logits, -1)
    drafts = torch.zeros(B, 0, dtype=torch.long)
    if k:
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, k)
    u = torch.rand(B, k + 1, generator=g)
    return p, q, drafts, u


def _check(p, q, drafts, u, block, device):
    ref = verify_block if block else verify_tokenwise
    k = drafts.shape[1]
    n_ref, y_ref = ref(p, q, drafts, u[:, :k], u[:, k])
    dev = [t.to(device) for t in (p, q, drafts, u)]
    n, y, out = spec_verify.verify(dev[0], dev[1], dev[2], dev[3][:, :k], dev[3][:, k], block=block)
    assert n.cpu().tolist() == n_ref.tolist()
    assert y.cpu().tolist() == y_ref.tolist()
    assert torch.equal(out.cpu(), _emitted(drafts, n_ref, y_ref))
    return n_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
@pytest.mark.parametrize("B,k,V", [(6, 3, 37), (5, 1, 5000), (3, 5, 9001), (2, 0, 300), (2, 3, 49216)])
def test_verify_equals_the_reference(device, block, B, k, V):
    seen = set()
    for seed in range(4):
        p, q, drafts, u = _rounds(B, k, V, seed=seed + 10 * k + V)
        seen.update(_check(p, q, drafts, u, block, device).tolist())
    if k and V < 40000:
        assert len(seen) > 1, seen  # the rounds stopped at different places


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
def test_verify_edge_rows(device, block):
    # round 0: q equal to p on rows 0 and 1, the second draft off both supports: the run stops
    # (token-wise at 1, block at 0: w_2 = 0 / 0 := 0) where the residual is all zero, so the
    # replacement is drawn from p itself;
    # round 1: a draft where q has no mass (block: x / 0 -> 1), a one-hot p row;
    # round 2: one-hot q rows at the drafts (a greedy round verified exactly);
    # round 3: every draft rejected (u = 1 - tiny), a residual with one positive token;
    # a strided q (rows of a larger buffer) and uniforms as views of one [B, k + 1] tensor.
    B, k, V = 4, 3, 6000
    p, q, drafts, u = _rounds(B, k, V, seed=3)
    q[0, :2] = p[0, :2]
    drafts[0, 1] = V // 3 + 1
    drafts[1, 0] = V // 3 + 2  # inside the band: p and q are 0 there
    p[1, 2] = 0.0
    p[1, 2, 17] = 1.0
    q[1, 1, drafts[1, 1]] = 0.0
    q[2] = torch.zeros(k, V).scatter_(1, drafts[2].unsqueeze(1), 1.0)
    u[3, :k] = 1 - 2 ** -24
    p[3, 0] = 0.0
    p[3, 0, [5, 4000]] = 0.5
    q[3, 0] = 0.0
    q[3, 0, 5] = 1.0
    drafts[3, 0] = 5  # residual max(0, p - q) is 0.5 at token 4000 alone
    wide = torch.zeros(B, k, 2 * V)
    wide[:, :, :V] = q
    _check(p, wide[:, :, :V], drafts, u, block, device)
    n, _ = (verify_block if block else verify_tokenwise)(p, q, drafts, u[:, :k], u[:, k])
    assert n[0] == (0 if block else 1)
    if not block:
        assert n[3] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
def test_verify_on_cuda_at_serving_shapes(block):
    # batch 64, K = 3, Inkling's vocabulary; and Llama-3's 128K vocabulary at batch 8
    for B, k, V, seed in ((64, 3, 49216, 1), (8, 4, 128256, 2)):
        p, q, drafts, u = _rounds(B, k, V, seed=seed)
        _check(p, q, drafts, u, block, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["tokenwise", "block"])
def test_one_variant_for_the_host_path_and_the_device_round_at_every_batch(monkeypatch, block):
    # The host path passes contiguous drafts [b, k]; a device round the chain graph's [K, bs]
    # drafts transposed (a column of stride bs, 1 at batch 1); both slice the uniforms [b, k + 1].
    # One compiled variant of each kernel for all of them: the forty-fourth pass saw the first
    # sampled rounds at batch 8 stall 0.3 s compiling another (compile_log.py).
    partials = count_compiles(monkeypatch, "_partials_kernel")
    sample = count_compiles(monkeypatch, "_sample_kernel")
    # a vocabulary no other test here uses (its chunk is a constexpr of its own), so that the
    # variants counted are compiled in this test whatever ran before it in this process; a
    # multiple of 16, so that p's and q's strides are too in either layout
    k, V = 3, 160
    for B in (1, 8, 2):
        p, q, drafts, u = _rounds(B, k, V, seed=B)
        _check(p, q, drafts, u, block, "cuda")  # host layout
        d_dev = torch.empty(k, B, dtype=drafts.dtype, device="cuda")  # device layout: [B, k] of strides (1, B)
        d_dev = d_dev.copy_(drafts.t()).t()
        assert d_dev.stride() == (1, B)
        n, y, out = spec_verify.verify(p.cuda(), q.cuda(), d_dev, u.cuda()[:, :k], u.cuda()[:, k], block=block)
        n_ref, y_ref = (verify_block if block else verify_tokenwise)(p, q, drafts, u[:, :k], u[:, k])
        assert n.cpu().tolist() == n_ref.tolist() and y.cpu().tolist() == y_ref.tolist()
    assert len(partials) <= 1 and len(sample) <= 1, (len(partials), len(sample))
