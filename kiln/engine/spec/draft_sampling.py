"""`DraftSampling`: sampled requests' drafts drawn on the device (inside the MTP chain graph, or
right after a block drafter's paged pass), so that their rounds stay on the device.

Under `--speculative-use-rejection-sampling` / `--speculative-use-block-verification` a sampled
request's draft d_k is a draw from q_k, the drafter's final sampling distribution processed like
the target's rows (`sampled_verify`). The eager pass (`MTPDrafter.run`) draws each layer's drafts
through the sampler's host-side views, so a round with such a request used to leave the chain
graph, and with it the round on the device (`SpecDecoder._device_round`): a rollout at
temperature 1 paid the eager pass (several milliseconds of host launches at batch 1) every round.

The graph draws them itself when every sampled request's processing reads nothing but its
constants (`eligible`): temperature, top-k, top-p and min-p, no penalty (which would count the
earlier drafts as output) and no min_tokens suppression left. Its static inputs per request are
those constants, whether it draws (greedy requests and padding take the argmax), and the
(seed, draw index) keys of its K draws; layer k computes q_k, the filter of its logits (what
`processed_probs` gives a drawing row when nothing reads the output), and draws
d_k = argmax(q_k / e) with e hashed from key k (`seeded_noise.exponentials`), which is what
`Sampler.draw` does for a seeded stream. So a seeded request's drafts and q rows are the
eager pass's bit for bit, its stream advances by K draws per pass as the eager one does, and q
lands in a static [K, n, V] tensor for the next verify. A block drafter's positions do not depend
on each other's drafts, so a graph replayed after its paged pass's (`PagedBlockPass`) draws the
K positions from the block's logits in one filter and one race (`draw_block`), where its host
path draws them one by one.

Unseeded requests take their keys from the drafter's own stream (`shared`, seeded from the
engine's `--seed`) rather than the sampler's shared torch generator: a replay draws fresh noise
only through inputs that change, and the keys are inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from kiln.engine import seeded_noise
from kiln.engine.batch import int64_to_device
from kiln.engine.request import Req
from kiln.engine.sampler import _race, filter_fn, list_to_device
from kiln.engine.seeded_noise import SeededStream

# Added to the engine seed for the stream of unseeded requests' draft keys, so that it is not the
# stream of a request whose own seed equals the engine's.
_SHARED_STREAM_SALT = 0x5EED_D4AF


def eligible(r: Req) -> bool:
    """Whether the chain graph can draw `r`'s drafts: greedy, or sampled with a processing that
    reads no output (no repetition, frequency or presence penalty), no EOS / stop ids suppressed
    any more (min_tokens reached), and a seeded stream or none (not a caller's torch generator)."""
    if r.params.greedy:
        return True
    row = r.sampling_row
    return (not row.needs_output_ids and not row.needs_prompt_ids
            and (not row.suppress_ids or r.num_output >= row.min_tokens)
            and (r.generator is None or isinstance(r.generator, SeededStream)))


def verifies_on_device(sampling: Optional["DraftSampling"], r: Req, k: int) -> bool:
    """Whether sampled request `r`, under exact verification, can verify its k drafts and have its
    next ones drawn on the device by a drafter holding `sampling` (None: it draws on the host): its
    processing reads only constants (`eligible`) and its k q rows are at hand."""
    return sampling is not None and eligible(r) and r.spec.q is not None and r.spec.q.shape[0] >= k


class DraftSampling:
    """Static sampling inputs for up to `max_bs` requests and `K` draws each (the chain graph's,
    or a block drafter's), and the draw of one draft position (`draw`)."""

    def __init__(self, max_bs: int, K: int, device, seed: int):
        self.K = K
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        # per request: temperature, top-p, min-p; top-k; 1 if it draws (0: argmax); K draw keys
        self.temps, self.top_ps, self.min_ps = (torch.zeros(max_bs, **f32) for _ in range(3))
        self.top_ks, self.draws = torch.zeros(max_bs, **i64), torch.zeros(max_bs, **i64)
        self.keys = torch.zeros(max_bs, K, 2, **i64)
        self.shared = SeededStream(seed + _SHARED_STREAM_SALT)

    def fill(self, reqs: Optional[list[Req]], bs: int) -> None:
        """Set the first len(reqs) requests' inputs (each drawing request's stream gives K draws,
        as K eager layers take them) and make the rest up to `bs` argmax rows. `reqs` None: every
        row takes the argmax (a catch-up replay whose drafts nobody reads draws nothing)."""
        reqs = reqs or []
        n, K = len(reqs), self.K
        floats, ints = [[], [], []], {"top_ks": [], "draws": [], "keys": []}
        for r in reqs:
            draws = not r.params.greedy
            row = r.sampling_row
            floats[0].append(row.temperature if draws else 0.0)
            floats[1].append(row.top_p)
            floats[2].append(row.min_p)
            ints["top_ks"].append(row.top_k)
            ints["draws"].append(int(draws))
            if not draws:
                ints["keys"] += [0] * (2 * K)
                continue
            if r.generator is None and r.params.seed is not None:
                r.generator = SeededStream(r.params.seed)
            stream = r.generator if r.generator is not None else self.shared
            ints["keys"] += [v for _ in range(K) for v in stream.take()]
        if n:
            dev = self.temps.device
            f = list_to_device(floats, torch.float32, dev).view(3, n)
            t = int64_to_device(ints, dev)
            torch._foreach_copy_([self.temps[:n], self.top_ps[:n], self.min_ps[:n], self.top_ks[:n], self.draws[:n],
                                  self.keys[:n]],
                                 [f[0], f[1], f[2], t["top_ks"], t["draws"], t["keys"].view(n, K, 2)])
        if bs > n:
            torch._foreach_zero_([self.temps[n:bs], self.draws[n:bs]])

    def draw(self, k: int, logits: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer k's (0-based) drafts and q rows of the first bs = len(logits) requests, in the
        graph: `logits` [bs, V] fp32 over the whole vocabulary (-inf off a token map), `argmax`
        [bs] the greedy draft of each row. Returns (tokens [bs], q [bs, V]). The q rows of argmax
        rows (greedy requests, padding) are left as they come: nobody reads them (a greedy round
        is verified with one-hot rows at its drafts), so they cost no one-hot launches."""
        bs, V = logits.shape
        # an eligible request's processing reads no output: penalties and suppression are off, so
        # its q is the filter alone, as `processed_probs` computes it for a row that draws
        q = filter_fn(logits.device)(logits, self.temps[:bs], self.top_ks[:bs], self.top_ps[:bs], self.min_ps[:bs])
        drawn = _race(q, seeded_noise.exponentials(self.keys[:bs, k], V))
        return torch.where(self.draws[:bs].bool(), drawn, argmax), q

    def draw_block(self, logits: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`draw` for all K positions of a block at once, where no position depends on another's
        draft (a block drafter's pass): `logits` [bs, K, V], `argmax` [bs, K] -> (tokens [bs, K],
        q [bs, K, V]). Each row is filtered and raced with its own key as `draw(k, ...)` does, but
        over the bs * K rows in one launch per kernel: at a few rows those launches cost about
        their latency whatever the rows, so K calls paid it K times (a batch-8 DFlash round's
        sampling kernels: 86 -> 53 us on an H100, docs/benchmarks.md, forty-first pass)."""
        bs, K, V = logits.shape
        assert K == self.K, (K, self.K)
        per_row = lambda t: t[:bs].repeat_interleave(K)  # noqa: E731  (request -> its K rows, contiguous)
        q = filter_fn(logits.device)(logits.reshape(bs * K, V), per_row(self.temps), per_row(self.top_ks),
                                     per_row(self.top_ps), per_row(self.min_ps))
        drawn = _race(q, seeded_noise.exponentials(self.keys[:bs].reshape(bs * K, 2), V)).view(bs, K)
        return torch.where(self.draws[:bs, None].bool(), drawn, argmax), q.view(bs, K, V)
