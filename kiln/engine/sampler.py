"""Token sampling: penalties, filtering, seeded per-row draws and logprobs, for a whole batch.

The scheduler builds a `SamplingBatch` once per step (`SamplingBatch.from_reqs`) and calls
`Sampler(logits, batch)` with the float32 logits `[B, V]` of the rows that sample.

Order of operations, per row:

1. Penalties on the raw logits.
   - repetition (HF / vLLM rule): every token seen in the prompt or the output has its logit
     divided by `r` when positive and multiplied by `r` otherwise;
   - frequency (OpenAI): subtract `f * count`, count = occurrences of the token in the output;
   - presence (OpenAI): subtract `p * (count > 0)`, output only.
2. `logit_bias` (OpenAI) values are added to their tokens' logits.
3. `suppress_ids` are set to -inf (EOS / stop ids while the output is shorter than min_tokens).
4. Greedy rows (temperature == 0, or top_k == 1) take the argmax; ties go to the lowest token id.
5. Other rows: divide by the temperature, softmax, then
   - top-k: keep the k most probable tokens (0 = disabled);
   - top-p: on the top-k renormalised distribution (as HF and vLLM chain them), keep the
     smallest set of most probable tokens whose mass is >= top_p, always at least one;
   - min-p: drop tokens with p < min_p * p_max (a ratio, so renormalising does not change it);
   renormalise, and sample. Ties in probability are ordered by token id (stable sort), so the
   kept set never depends on the batch.

Sampling is an exponential race: with `e ~ Exp(1)^V`, `argmax(probs / e)` is an exact draw from
`probs`. A seeded request's rows draw their `e` from its `SeededStream` (`kiln.engine.seeded_noise`:
values hashed from the seed and the draw index, every seeded row of the batch in one op), exactly
once per step, so a seeded stream is the same whatever else is in the batch, wherever the row sits,
whether the request was retracted and recomputed (the stream lives on the `Req`), and on the CPU
or CUDA. Rows without one draw from the sampler's shared generator; a caller may also pass a torch
generator per row (one draw each). Greedy rows draw nothing.

Logprobs are those of the *raw* model distribution: `log_softmax(logits / T)` of the logits
before penalties, suppression and filtering, with T = temperature and T = 0 treated as 1. This is
what an RL trainer recomputes from the same weights. The sampler returns the chosen token's
logprob and the top-Kmax (Kmax = the largest k asked by any row; rows asking fewer ignore the extra
columns); nothing is computed when no row asks.

`processed_probs` gives the distribution each row actually samples from (one-hot for greedy rows);
the sampler and speculative decoding use the same steps. Exact speculative verification also draws
its drafts with `Sampler.draw` (the same race, the same per-row streams) and its acceptance
uniforms with `Sampler.uniforms`.

Which code runs where:
- CPU (and any device without Triton): the torch reference below, `filtered_probs` with one
  stable sort of the vocabulary, then `argmax(probs / e)`.
- CUDA with Triton (`kiln.kernels.kernels_supported`): penalties and suppression are the same
  torch ops and the noise the same values (`kiln.kernels.seeded_noise`), but the softmax,
  filtering and the draw are `kiln.kernels.sampling`: the softmax in two launches (its values
  equal torch's to float rounding), a threshold search instead of the sort, fused with the
  exponential race (the filtered distribution is never written out); `processed_probs` uses the
  kernel's `filtered_probs`, and greedy rows and the race's argmax take Kiln's kernels
  (`greedy_ids`, `sampling.sample_from_probs`). The kept set is the reference's (ties by token
  id included) except that a token within float rounding of the top-p or min-p threshold may
  fall the other way (see that module). This path never waits for the device: row selection uses the host-side
  `SamplingBatch.greedy` list. A batch built without it (`greedy=None`, e.g. by hand) is not
  synced on CUDA either: every row draws noise and greedy rows take the argmax on the device
  (their own generator, if any, then advances; it is never used for anything else).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from kiln.engine import seeded_noise
from kiln.engine.batch import host_tensor
from kiln.engine.request import Req
from kiln.engine.seeded_noise import SeededStream
from kiln.kernels import kernels_supported


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: on CUDA through pinned memory.
    A copy from pageable memory can block until the stream drains, which would serialise the
    scheduler behind the forward it has just queued (overlap scheduling)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def list_to_device(data: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A (nested) Python list as a tensor on `device`, as `to_device` does but made in pinned
    memory at once (one host op fewer per call)."""
    return host_tensor(data, dtype, device).to(device, non_blocking=True)


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`x[rows]` without waiting for the device. Indexing a CUDA tensor with a Python list copies
    the index from pageable memory, which blocks the host until the stream drains: in the
    scheduler, until the forward it has just queued has run, so overlap scheduling is lost and the
    GPU idles while the host prepares the next step (`kiln.engine.host_sync_audit` finds these)."""
    if rows == list(range(x.shape[0])):
        return x  # every row in order (a decode step)
    return x.index_select(0, list_to_device(rows, torch.int64, x.device))


def make_generator(seed: int, device) -> torch.Generator:
    """A torch generator on `device` seeded with `seed` (the sampler's shared one; seeded requests
    draw from a `SeededStream`)."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, 0 = disabled
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32, 1 = off
    frequency_penalties: torch.Tensor  # [B] float32, 0 = off
    presence_penalties: torch.Tensor  # [B] float32, 0 = off
    generators: list  # per row: a SeededStream, a torch.Generator, or None (the sampler's shared generator)
    prompt_token_ids: list[list[int]]  # repetition penalty only
    output_token_ids: list[list[int]]  # all three penalties
    suppress_ids: list[list[int]]  # masked to -inf
    num_top_logprobs: list[int]  # -1 = no logprobs, k >= 0 = chosen + top k
    # Host copy of "temperature == 0 or top_k == 1" per row, so the sampler knows which rows draw
    # without a device -> host sync. None: derived from the tensors (one small sync) on the CPU
    # path; on the CUDA path every row draws instead (see the module docstring).
    greedy: Optional[list[bool]] = None
    # The rows that draw (not greedy) as a device int64 tensor, copied with top_ks in `from_reqs`
    # so that the sampler's call makes no host -> device copy. None: built in the call.
    draw_rows: Optional[torch.Tensor] = None
    # (row, token id) device tensors of the output / prompt / suppress lists, copied in
    # `from_reqs` with the other ints (None: no ids in that list); None: built in the call.
    id_pairs: Optional[dict[str, Optional[tuple[torch.Tensor, torch.Tensor]]]] = None
    # Host flag: whether a drawing row may have top-k (> 1) or top-p (< 1), whose kept set is
    # searched (`kiln.kernels.sampling` skips its chunked launches otherwise); True unless known.
    searches: bool = True
    # (rows, token ids, values) device tensors of the rows' logit_bias, added after the penalties;
    # None: no row has one.
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    @classmethod
    def from_reqs(cls, reqs: list[Req], device) -> "SamplingBatch":
        """Gather the sampling state of `reqs` (in row order) into tensors on `device`. Each is a
        `Req` or a view with the same fields the sampler reads (`sampling_row`, `params`, `generator`,
        `prompt_ids`, `output_ids`, `num_output`; `spec.sampled_verify.RowView`).

        Token-id lists are left empty for rows whose penalties are neutral (they would be an
        identity anyway), so long prompts are not copied every step for nothing. A request with a
        seed but no stream yet gets one here, stored on the `Req` so it survives retraction.
        """
        B = len(reqs)
        # Columns of the requests' constant rows (`SamplingRow`, computed once per request).
        (temps, top_ps, min_ps, reps, freqs, press, top_ks, greedy, num_top, need_prompt, need_output,
         min_tokens, suppress_ids, seeded, biases) = zip(*[r.sampling_row for r in reqs]) if B else ((),) * 15
        if any(seeded):
            for req in reqs:
                if req.generator is None and req.params.seed is not None:
                    req.generator = SeededStream(req.params.seed)
        gens = [req.generator for req in reqs]
        # Id lists only where a penalty or min_tokens reads them (the shared empty lists are only read).
        none: list[list[int]] = [[]] * B
        prompts = [r.prompt_ids if n else [] for r, n in zip(reqs, need_prompt)] if any(need_prompt) else none
        outputs = [r.output_ids if n else [] for r, n in zip(reqs, need_output)] if any(need_output) else none
        suppress = ([list(ids) if r.num_output < m else [] for r, m, ids in zip(reqs, min_tokens, suppress_ids)]
                    if any(min_tokens) else none)

        # One copy for the six float columns, one for top-k and the drawing rows, both from pinned
        # memory (see list_to_device).
        floats = list_to_device([temps, top_ps, min_ps, reps, freqs, press], torch.float32, device).reshape(6, -1)
        temps_t, top_ps_t, min_ps_t, reps_t, freqs_t, press_t = floats.unbind(0)
        draw = [i for i, g in enumerate(greedy) if not g]
        segments = [top_ks, draw]
        for lists in (outputs, prompts, suppress):
            if lists is none:
                segments += [[], []]
            else:
                segments += [[i for i, x in enumerate(lists) for _ in x], list(itertools.chain.from_iterable(lists))]
        ints = list_to_device(list(itertools.chain.from_iterable(segments)), torch.int64, device)
        parts, at = [], 0
        for seg in segments:
            parts.append(ints[at:at + len(seg)])
            at += len(seg)
        id_pairs = {name: (parts[2 + 2 * j], parts[3 + 2 * j]) if segments[3 + 2 * j] else None
                    for j, name in enumerate(("output", "prompt", "suppress"))}
        bias = None
        if any(biases):  # (rows, ids, values) of every request's logit_bias
            pairs = [(i, t, v) for i, b in enumerate(biases) for t, v in b]
            rows, ids, vals = zip(*pairs)
            bias_ids = list_to_device([rows, ids], torch.int64, device).reshape(2, -1)
            bias = (bias_ids[0], bias_ids[1], list_to_device(vals, torch.float32, device))
        return cls(
            temperatures=temps_t,
            top_ps=top_ps_t,
            top_ks=parts[0],
            draw_rows=parts[1],
            id_pairs=id_pairs,
            min_ps=min_ps_t,
            repetition_penalties=reps_t,
            frequency_penalties=freqs_t,
            presence_penalties=press_t,
            generators=gens,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            suppress_ids=suppress,
            logit_bias=bias,
            num_top_logprobs=list(num_top),
            greedy=list(greedy),
            searches=any(not g and (k > 1 or p < 1.0) for g, k, p in zip(greedy, top_ks, top_ps)),
        )


@dataclass
class SampleOutput:
    """What the sampler chose for each row, plus logprobs when any row asked for them."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[torch.Tensor] = None  # [B] float32, chosen token
    top_ids: Optional[torch.Tensor] = None  # [B, Kmax] int64, most probable first
    top_logprobs: Optional[torch.Tensor] = None  # [B, Kmax] float32


def compute_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits / T)` per row, `[N, V]` float32, with T = 0 (greedy) treated as 1."""
    t = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    return torch.log_softmax(logits.float() / t.unsqueeze(1).float(), dim=-1)


def _flat_ids(lists: list[list[int]], vocab: int, device, pairs=False) -> Optional[torch.Tensor]:
    """Flat indices `row * V + id` of every id in `lists`, or None when all lists are empty.
    `pairs`: the batch's (rows, ids) already on the device (`SamplingBatch.id_pairs` entry, or
    None for empty lists); False: copy `lists` now."""
    if pairs is not False:
        return None if pairs is None else pairs[0] * vocab + pairs[1]
    lengths = [len(x) for x in lists]
    if sum(lengths) == 0:
        return None
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor(lengths))
    return to_device(rows * vocab + ids, device)


def _counts(flat: torch.Tensor, shape, device) -> torch.Tensor:
    """`[B, V]` float32 count of each token per row; counts are integers so atomics stay exact."""
    counts = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts.view(shape)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties; out of place."""
    B, V = logits.shape
    dev = logits.device
    pre = batch.id_pairs or {}
    out_flat = _flat_ids(batch.output_token_ids, V, dev, pre.get("output", False))
    prompt_flat = _flat_ids(batch.prompt_token_ids, V, dev, pre.get("prompt", False))
    if out_flat is None and prompt_flat is None:
        return logits
    out_counts = _counts(out_flat, (B, V), dev) if out_flat is not None else None
    # Rows with neutral penalties go through the same math: it is an exact identity for them.
    seen = torch.zeros(B * V, dtype=torch.bool, device=dev)
    if prompt_flat is not None:
        seen.index_fill_(0, prompt_flat, True)
    seen = seen.view(B, V)
    if out_counts is not None:
        seen |= out_counts > 0
    r = batch.repetition_penalties.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if out_counts is not None:
        logits = logits - batch.frequency_penalties.unsqueeze(1) * out_counts
        logits = logits - batch.presence_penalties.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_suppression(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set `suppress_ids` to -inf; out of place."""
    B, V = logits.shape
    flat = _flat_ids(batch.suppress_ids, V, logits.device, (batch.id_pairs or {}).get("suppress", False))
    if flat is None:
        return logits
    return logits.reshape(-1).index_fill(0, flat, float("-inf")).view(B, V)


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Add each row's `logit_bias` values to their tokens' logits; out of place."""
    if batch.logit_bias is None:
        return logits
    B, V = logits.shape
    rows, ids, values = batch.logit_bias
    return logits.reshape(-1).index_add(0, rows * V + ids, values.to(logits.dtype)).view(B, V)


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, logit bias, then suppression: the logits greedy rows take the argmax of."""
    return apply_suppression(apply_logit_bias(apply_penalties(logits.float(), batch), batch), batch)


def filtered_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """Temperature, softmax, top-k, top-p, min-p and renormalise, `[N, V]` (no greedy rows;
    a temperature of 0 is treated as 1 here)."""
    N, V = logits.shape
    t = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / t.unsqueeze(1), dim=-1)
    # One stable sort serves all three filters; equal probabilities stay in token-id order.
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device).unsqueeze(0)
    k = torch.where((top_ks <= 0) | (top_ks > V), torch.full_like(top_ks, V), top_ks)
    keep = rank < k.unsqueeze(1)
    in_k = sorted_p * keep
    # Top-p on the top-k renormalised distribution: mass before token < top_p * (top-k mass).
    mass_before = torch.cumsum(in_k, dim=-1) - in_k
    # top_p >= 1 skips the test: float rounding of the cumsum would otherwise cut the tiny tail.
    top_p_mass = top_ps.unsqueeze(1) * in_k.sum(dim=-1, keepdim=True)
    keep &= (mass_before < top_p_mass) | (top_ps >= 1).unsqueeze(1)
    keep &= sorted_p >= min_ps.unsqueeze(1) * sorted_p[:, :1]
    keep[:, 0] = True  # the most probable token always survives
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
    return kept / kept.sum(dim=-1, keepdim=True)


def _greedy_mask(batch: SamplingBatch) -> torch.Tensor:
    return (batch.temperatures == 0) | (batch.top_ks == 1)


def filter_fn(device):
    """`filtered_probs` for logits on `device`: the Triton kernel on CUDA, the reference elsewhere."""
    if kernels_supported(device):
        from kiln.kernels import sampling  # the CPU build of torch ships without Triton

        return sampling.filtered_probs
    return filtered_probs


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from, `[B, V]`: one-hot at the argmax for greedy rows."""
    x = processed_logits(logits, batch)
    probs = filter_fn(x.device)(x, batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps)
    if batch.greedy is not None and not any(batch.greedy):  # the host knows no row is greedy
        return probs
    one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids(x).unsqueeze(1), 1.0)
    return torch.where(_greedy_mask(batch).unsqueeze(1), one_hot, probs)


def _race(probs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """`argmax(probs / e)` with `e ~ Exp(1)`: an exact draw from each row of `probs`. On CUDA with
    Triton, `sampling.sample_from_probs` (the same IEEE division and first-index argmax in two
    launches; torch's argmax alone took 13 us per 49K-token row on an H100, thirty-ninth pass)."""
    if probs.is_cuda and probs.dtype == e.dtype == torch.float32 and kernels_supported(probs.device):
        from kiln.kernels import sampling

        return sampling.sample_from_probs(probs.contiguous(), e.contiguous())
    # Exp(1) can round to 0 on some backends; a 0 would turn 0/0 into a NaN argmax.
    return (probs / e.clamp_min(torch.finfo(e.dtype).tiny)).argmax(dim=-1)


def attach_logprobs(out: SampleOutput, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Fill `out`'s logprobs (chosen = `out.token_ids`, and the top-Kmax) when any row asks."""
    kmax = max(batch.num_top_logprobs, default=-1)
    if kmax >= 0:
        lp = compute_logprobs(logits, batch.temperatures)
        out.logprobs = lp.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
        out.top_logprobs, out.top_ids = torch.topk(lp, min(kmax, logits.shape[1]), dim=-1)
    return out


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # exact in the kernel's fp32


def greedy_ids(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (first index of each row's maximum). On a GPU with Triton it runs as
    `kiln.kernels.argmax` (two short launches: torch's reduction took 13 us per 49K-token row on an
    H200, five times per speculative round), else as torch.argmax. The kernel counts NaN as +inf
    (torch ranks it above); logits hold neither."""
    if x.is_cuda and x.numel() and x.dtype in _ARGMAX_DTYPES and kernels_supported(x.device):
        from kiln.kernels.argmax import argmax

        return argmax(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])
    return x.argmax(dim=-1)


class Sampler:
    """Samples one token per row from a batch of logits (see the module docstring)."""

    def __init__(self, seed: int = 0, device="cpu"):
        # Shared by every row without its own generator (unseeded requests).
        self.generator = make_generator(seed, device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        B, V = logits.shape
        dev = logits.device
        fast = kernels_supported(dev)
        x = processed_logits(logits, batch)
        token_ids = greedy_ids(x)  # final for greedy rows
        greedy = batch.greedy
        if greedy is None and not fast:
            greedy = _greedy_mask(batch).tolist()
        # greedy None here: CUDA without the host list; every row draws, see the module docstring.
        rows = list(range(B)) if greedy is None else [i for i in range(B) if not greedy[i]]
        if rows:
            params = tuple(t.to(dev, non_blocking=True)
                           for t in (batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps))
            if len(rows) == B:
                xs, idx = x, None
            else:
                # from_reqs copied these rows already (they come from the same host greedy list)
                idx = batch.draw_rows if batch.draw_rows is not None else \
                    list_to_device(rows, torch.int64, dev)
                xs = x.index_select(0, idx)
                params = tuple(t.index_select(0, idx) for t in params)
            e = self._exponentials([batch.generators[i] for i in rows], V, dev)
            if fast:
                from kiln.kernels import sampling

                drawn = sampling.sample(xs, *params, e, searches=batch.searches)  # filter + race, fused
            else:
                drawn = _race(filtered_probs(xs, *params), e)
            if greedy is None:
                token_ids = torch.where(_greedy_mask(batch).to(dev, non_blocking=True), token_ids, drawn)
            elif idx is None:
                token_ids = drawn
            else:
                token_ids = token_ids.index_copy(0, idx, drawn)
        return attach_logprobs(SampleOutput(token_ids=token_ids), logits, batch)

    def draw(self, probs: torch.Tensor, generators: list) -> torch.Tensor:
        """One token per row of `probs` `[S, V]` (final distributions, e.g. `processed_probs`),
        by the same exponential race and per-row generators as `__call__` (speculative decoding
        samples its drafts with it)."""
        return _race(probs, self._exponentials(generators, probs.shape[1], probs.device))

    def uniforms(self, generators: list, counts: list[int], dev) -> torch.Tensor:
        """`[S, max(counts)]` float32 U(0, 1): row i's first `counts[i]` values come from its own
        stream (the rest of the row is padding), so a seeded stream does not depend on the batch;
        rows without one share one draw from the shared generator."""
        width = max(counts, default=0)
        return self._noise(generators, width, dev, counts, seeded_noise.uniforms,
                           lambda n: torch.rand(n, width, device=dev, generator=self.generator),
                           lambda g, c: torch.rand(c, device=dev, generator=g))

    def _exponentials(self, gens: list, V: int, dev) -> torch.Tensor:
        """`[S, V]` Exp(1) noise: one draw of V from each row's own stream; the rows without one
        share a single draw from the shared generator (their stream needs no stability)."""
        f32 = torch.float32
        return self._noise(gens, V, dev, [V] * len(gens), seeded_noise.exponentials,
                           lambda n: torch.empty(n, V, dtype=f32, device=dev).exponential_(generator=self.generator),
                           lambda g, c: torch.empty(c, dtype=f32, device=dev).exponential_(generator=g))

    @staticmethod
    def _noise(gens: list, width: int, dev, counts: list[int], hashed, shared_draw, own_draw) -> torch.Tensor:
        """Rows of noise in row order: `SeededStream` rows in one hashed draw (`kiln.engine.
        seeded_noise`), rows without a stream from one shared draw, and rows holding a
        `torch.Generator` (callers that pass their own) one draw each of their count."""
        if not gens:
            return torch.zeros(0, width, device=dev)
        streams = [g for g in gens if isinstance(g, SeededStream)]
        n_shared = sum(g is None for g in gens)
        seeded = hashed(seeded_noise.stream_keys(streams, dev), width) if streams else None
        shared = shared_draw(n_shared) if n_shared else None
        if len(streams) == len(gens):
            return seeded
        if n_shared == len(gens):
            return shared
        # Stacked in row order (no list-indexed assignment: that would copy an index to the device
        # synchronously).
        rows, seeded_rows, shared_rows = [], iter(seeded if seeded is not None else ()), iter(
            shared if shared is not None else ())
        for g, c in zip(gens, counts):
            if g is None:
                rows.append(next(shared_rows))
            elif isinstance(g, SeededStream):
                rows.append(next(seeded_rows))
            else:
                own = own_draw(g, c)
                rows.append(torch.cat([own, own.new_zeros(width - c)]) if c < width else own)
        return torch.stack(rows)
