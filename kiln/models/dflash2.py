"""DFlash2's two additions to the block drafter (MODELS.md 4; notes/algorithms.md 3), each
behind its config fields (`BlockDrafterConfig.conv_kernel_size`, `.selector_rank`):

- `GroupedDynamicConv`: a causal conv along the block's rows around each sublayer of a drafter
  layer. "prepare" convolves the normed sublayer input, "finish" the sublayer's output, each
  with kernel taps
      w_t[o, c] = base[o, c] + dyn_t[o, g(c)],   o = 0..K-1, g(c) = c // group_size,
      y_t[c] = sum_o w_t[o, c] * x_{t-o}[c]      (x before the block's first row reads 0)
  where dyn_t (both sets, 2 x K x groups values) is a linear map of the sublayer's normed input
  at row t. Taps never leave the block, so the conv keeps no state across rounds: the engine's
  context cache (the drafter's K/V of context features) is unchanged.
- `CandidateSelector`: re-ranks the top-k draft candidates of each block position with a
  low-rank bigram term and walks the block from the anchor:
      S_t(b) = U_t(b) + < A[a_{t-1}] * P h_t , Bc[b] >   for b among the top-k of U_t
  (U_t the draft logits, A and Bc vocab x rank codebooks, P: hidden -> rank), a_t = argmax S_t
  (greedy; ties to the lower token id) or a draw from S_t's processed distribution. Its draft
  distribution q_t is S_t on the candidates and 0 elsewhere, conditioned on a_{t-1}: drafts
  are drawn position by position, which is how the engine draws sampled drafts anyway.

Parameter names follow z-lab's `DFlash2DraftModel` (`layers.{i}.attention_conv.base_kernel`,
`.kernel_projection.weight`, `candidate_selector.{predecessor,successor}_codebook` (stored
without `.weight` in its checkpoints), `candidate_selector.hidden_projection.weight`), so its
checkpoints load as they are.
"""

from __future__ import annotations

import torch
from torch import nn


def grouped_dynamic_conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """y [R, B, H] for x [R, B, H] (R blocks of B rows), dyn [R, B, K, G] (per-row taps per channel
    group), base [K, H]: y_t = sum_o (base[o] + dyn_t[o, group]) * x_{t-o}, zero before row 0."""
    R, B, H = x.shape
    K, G = base.shape[0], H // group_size
    xg = x.view(R, B, G, group_size)
    y = torch.zeros_like(xg)
    for o in range(min(K, B)):  # taps at o >= B read only zeros
        shifted = xg if o == 0 else torch.cat([xg.new_zeros(R, o, G, group_size), xg[:, :B - o]], dim=1)
        w = base[o].view(G, group_size).to(x.dtype) + dyn[:, :, o, :, None].to(x.dtype)  # [R, B, G, gs]
        y = y + w * shifted
    return y.view(R, B, H)


class GroupedDynamicConv(nn.Module):
    """The conv around one sublayer: `prepare` before it (returns the finish taps too, computed
    from the same input), `finish` after it. Inputs are [R, B, H]: R blocks of B rows."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        assert hidden_size % group_size == 0, \
            f"hidden_size {hidden_size} is not a multiple of group_size {group_size}"
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [prepare/finish, K, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return grouped_dynamic_conv(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size), dyn[..., 1, :, :]

    def finish(self, x: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(x, dyn, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):
    """The low-rank candidate re-ranking of DFlash2 (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, token ids) [..., top_k] of the top_k draft logits [..., V]."""
        return torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)

    def scores(self, proj: torch.Tensor, prev: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor
               ) -> torch.Tensor:
        """S [n, top_k] of one block position: proj [n, rank] = P h_t, prev [n] the token before it,
        unary / cand [n, top_k] its candidates' draft logits and ids."""
        pair = self.predecessor_codebook(prev).float() * proj.float()  # [n, rank]
        return unary.float() + torch.einsum("nr,nkr->nk", pair, self.successor_codebook(cand).float())

    @staticmethod
    def scatter(s: torch.Tensor, cand: torch.Tensor, vocab: int) -> torch.Tensor:
        """S as logits over the whole vocabulary [n, V]: -inf off the candidates (q is 0 there)."""
        return torch.full((s.shape[0], vocab), float("-inf"), device=s.device).scatter(1, cand, s)

    def prepare(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What every position's scores start from, computed once per block: (unary, candidate
        ids) [n, k, top_k] of the draft logits [n, k, V], and P h [n, k, rank] of hidden [n, k, H]."""
        unary, cand = self.candidates(logits)
        return unary, cand, self.hidden_projection(hidden)

    def position_logits(self, prepared: tuple[torch.Tensor, ...], t: int, rows, prev: torch.Tensor,
                        vocab: int) -> torch.Tensor:
        """The selector's logits [len(rows), vocab] at block position t for `rows` (an index into
        n) whose previous tokens are prev."""
        unary, cand, proj = (x[rows, t] for x in prepared)
        return self.scatter(self.scores(proj, prev, unary, cand), cand, vocab)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
             prepared: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy walk over k positions: hidden [n, k, H], logits [n, k, V] (the draft logits U),
        anchors [n] -> (tokens [n, k], the selector's logits [n, k, V] along the walk).
        `prepared`: `prepare(hidden, logits)` when the caller has it already."""
        prepared = prepared if prepared is not None else self.prepare(hidden, logits)
        every = slice(None)
        prev, tokens, rows = anchors, [], []
        for t in range(hidden.shape[1]):
            full = self.position_logits(prepared, t, every, prev, logits.shape[-1])
            prev = full.argmax(dim=-1)  # the lowest id among equal scores
            tokens.append(prev)
            rows.append(full)
        return torch.stack(tokens, dim=1), torch.stack(rows, dim=1)

    def loss(self, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor,
             valid: torch.Tensor) -> torch.Tensor:
        """DFlash2's selector term: cross-entropy of S over the top_k candidates of each position
        given the true predecessor (the anchor, then the labels), over the positions whose label is
        a candidate. hidden [n, k, H], logits [n, k, V] (both detached here: the drafter's body and
        head learn from the DFlash loss alone), prev / labels / valid [n, k]."""
        unary, cand = self.candidates(logits.detach())
        proj = self.hidden_projection(hidden.detach())
        pair = self.predecessor_codebook(prev).float() * proj.float()
        s = unary.float() + torch.einsum("nkr,nkcr->nkc", pair, self.successor_codebook(cand).float())
        hit = cand == labels[..., None]
        use = valid & hit.any(-1)
        if not use.any():
            return s.sum() * 0.0
        target = hit.float().argmax(-1)
        return torch.nn.functional.cross_entropy(s[use], target[use])
