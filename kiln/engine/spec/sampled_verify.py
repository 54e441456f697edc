"""Exact verification of sampled drafts (`--speculative-use-rejection-sampling`,
`--speculative-use-block-verification`), drafter-agnostic.

The contract with a drafter: per request, `drafts` d_1..d_k (list[int]) and, for a sampled request,
`q` `[k, V]`: row i is the distribution d_{i+1} was drawn from, the drafter's *final* sampling
distribution processed exactly like the target's (`draft_probs`: temperature, top-k, top-p,
min-p, penalties and min_tokens, with d_1..d_i counted as output), drawn with `draw_drafts` (the
request's own seeded stream, or the sampler's shared generator). A drafter that gives no q
(greedy drafts) is verified by the point-mass rule in `SpecDecoder` instead, which is exact for
deterministic drafts.

`verify_rounds` is the engine's verification stage for such requests, vectorised over requests:
p rows from the target logits through the sampler's `processed_probs` (row i sees d_1..d_i as
output), uniforms from each request's stream (k + 1 per round: k acceptance draws, then the
residual/bonus draw), `verify.verify_tokenwise` or `verify.verify_block` per group of equal k,
and the emitted tokens d_1..d_n, y laid out per verify row. See docs/speculative.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine.request import SamplingRow
from kiln.engine.sampler import SampleOutput, SamplingBatch, attach_logprobs, processed_probs
from kiln.engine.seeded_noise import SeededStream
from kiln.engine.spec.verify import verify_block, verify_tokenwise
from kiln.kernels import kernels_supported

METHODS = {"tokenwise": verify_tokenwise, "block": verify_block}


def verify_method(config) -> Optional[str]:
    """'tokenwise', 'block', or None (point-mass verification) from the engine's flags."""
    if config.speculative_use_block_verification:
        return "block"
    if config.speculative_use_rejection_sampling:
        return "tokenwise"
    return None


class RowView:
    """What the sampler reads of a request for one row (a draft's or a verify row's): the drafts
    before that row count as output (penalties, min_tokens).

    The output with those drafts is built only when read (`output_ids`: repetition, frequency and
    presence penalties); a round makes K + 1 views per request, and copying a long output for
    each would cost the host O(K x output length) per request per round for nothing when the
    penalties are off. `num_output` (min_tokens) needs no copy."""

    __slots__ = ("params", "prompt_ids", "eos_token_ids", "generator", "sampling_row", "_output", "_drafts")

    def __init__(self, params, prompt_ids: list[int], output_ids: list[int], eos_token_ids: tuple, generator,
                 drafts_before: list[int] = (), sampling_row: Optional[SamplingRow] = None):
        self.params, self.prompt_ids, self.eos_token_ids, self.generator = params, prompt_ids, eos_token_ids, generator
        self.sampling_row = sampling_row or SamplingRow.of(params, eos_token_ids)
        self._output, self._drafts = output_ids, list(drafts_before)

    @property
    def output_ids(self) -> list[int]:
        return self._output + self._drafts if self._drafts else self._output

    @property
    def num_output(self) -> int:
        return len(self._output) + len(self._drafts)


def row_view(req, drafts_before: list[int], device) -> RowView:
    """The sampler's view of `req` with `drafts_before` appended to its output. Creates the
    request's seeded stream first when it has a seed (on the Req, not on the view)."""
    if req.generator is None and req.params.seed is not None:
        req.generator = SeededStream(req.params.seed)
    return RowView(req.params, req.prompt_ids, req.output_ids, req.eos_token_ids, req.generator, drafts_before,
                   req.sampling_row)


def verify_views(req, drafts: list[int], device) -> list[RowView]:
    """The sampler's views of a round's k + 1 verify rows: row i counts d_1..d_i as output."""
    return [row_view(req, drafts[:i], device) for i in range(len(drafts) + 1)]


def draft_probs(logits: torch.Tensor, views: list) -> torch.Tensor:
    """q `[B, V]`: the final distribution each draft row samples from (the sampler's own
    processing, `processed_probs`), for draft logits `[B, V]` and one view per row."""
    return processed_probs(logits, SamplingBatch.from_reqs(views, logits.device))


def draw_drafts(sampler, logits: torch.Tensor, views: list) -> tuple[list[int], torch.Tensor]:
    """Sample one draft per row from q = `draft_probs(logits, views)` with each row's generator
    (the sampler's exponential race). Returns (tokens, q `[B, V]`)."""
    q = draft_probs(logits, views)
    return sampler.draw(q, [v.generator for v in views]).tolist(), q


def verify_rounds(sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
                  q: torch.Tensor, generators: list, method: str) -> tuple[SampleOutput, list[int]]:
    """Verify B rounds of sampled drafts.

    logits `[R, V]`: the target rows of every round, round b's k_b + 1 rows in order (row i
    predicts the token after d_1..d_i); `batch`: the sampler's batch of those rows (row i counts
    d_1..d_i as output); `drafts[b]` = d_1..d_{k_b} (k_b >= 0); q `[sum k_b, V]`: the rounds' q rows
    concatenated in the same order; `generators[b]`: round b's generator (None: the sampler's
    shared one); method 'tokenwise' or 'block'.

    Returns (out, num_accepted): `out.token_ids[R]` holds, at round b's rows 0..n_b, the emitted
    tokens d_1..d_{n_b}, y (0 beyond), with logprobs when the batch asks; num_accepted[b] = n_b."""
    dev = logits.device
    p = processed_probs(logits, batch)
    ks = [len(d) for d in drafts]
    B = len(ks)
    k_t = torch.tensor(ks, dtype=torch.long)
    starts = torch.cumsum(k_t + 1, 0) - (k_t + 1)  # first row of each round
    q_starts = torch.cumsum(k_t, 0) - k_t
    u = sampler.uniforms(generators, [k + 1 for k in ks], dev)  # k acceptance draws + 1 residual
    tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=dev)
    accepted = torch.zeros(B, dtype=torch.long)
    for k in sorted(set(ks)):
        idx = torch.nonzero(k_t == k).squeeze(1)
        rows = (starts[idx].unsqueeze(1) + torch.arange(k + 1)).to(dev)  # [b, k + 1]
        q_rows = (q_starts[idx].unsqueeze(1) + torch.arange(k)).to(dev)  # [b, k]
        d = torch.tensor([drafts[i] for i in idx.tolist()], dtype=torch.long, device=dev).reshape(len(idx), k)
        ui = u[idx.to(dev)]
        n, _, emitted = verify_drafts(method, p[rows], q[q_rows], d, ui[:, :k], ui[:, k])
        tokens[rows.reshape(-1)] = emitted.reshape(-1)
        accepted[idx] = n.cpu()
    return attach_logprobs(SampleOutput(token_ids=tokens), logits, batch), accepted.tolist()


def verify_on_device(sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: torch.Tensor, q: torch.Tensor,
                     generators: list, method: str) -> tuple[SampleOutput, torch.Tensor]:
    """`verify_rounds` for B rounds of k drafts each, with nothing read back: drafts [B, k] and q
    [B, k, V] on the device (a round on the device, `SpecDecoder._device_round`, where the drafts
    are still the chain graph's). A greedy round passes one-hot q rows at its drafts: it is then
    verified exactly as by point masses (accepted while the draft is the argmax; the residual
    max(0, p - q) and the bonus are the argmax). Returns (out, num_accepted [B] on the device);
    the uniforms are drawn as `verify_rounds` draws them."""
    B, k = drafts.shape
    p = processed_probs(logits, batch).view(B, k + 1, -1)
    u = sampler.uniforms(generators, [k + 1] * B, logits.device)
    n, _, emitted = verify_drafts(method, p, q, drafts, u[:, :k], u[:, k])
    return attach_logprobs(SampleOutput(token_ids=emitted.reshape(-1)), logits, batch), n


def verify_drafts(method: str, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor,
                  residual_uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`METHODS[method]` for rounds of k drafts (p [b, k + 1, V], q [b, k, V]), plus the emitted
    rows [b, k + 1] (`_emitted`): (num_accepted, next_token, emitted). On CUDA with Triton, the
    two launches of `kiln.kernels.spec_verify` instead of ~30 torch ops (the host path and the
    device round take the same one, so they emit the same tokens)."""
    if p.is_cuda and p.dtype == q.dtype == torch.float32 and kernels_supported(p.device):
        from kiln.kernels import spec_verify

        return spec_verify.verify(p, q, drafts, uniforms, residual_uniform, block=method == "block")
    n, y = METHODS[method](p, q, drafts, uniforms, residual_uniform)
    return n, y, _emitted(drafts, n, y)


def _emitted(d: torch.Tensor, n: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[b, k + 1] rows d_1..d_n, y, 0.. of rounds with drafts d [b, k], n accepted and next token y."""
    emitted = torch.cat([d, y.unsqueeze(1)], 1)  # d_1..d_k, y ...
    j = torch.arange(d.shape[1] + 1, device=d.device).unsqueeze(0)
    emitted = torch.where(j < n.unsqueeze(1), emitted, 0)
    return emitted.scatter(1, n.unsqueeze(1), y.unsqueeze(1))  # ... is d_1..d_n, y, 0..
