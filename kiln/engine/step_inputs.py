"""`StepInputs`: the flat per-token inputs of one forward, built from the scheduler's plan.

The plan is a list of (request, start, end) position ranges. Each range becomes rows of the
forward: token ids, positions, KV slots (and a slot per windowed state space), the logit rows to
keep (sampling rows, prompt-logprob rows), and the rows whose input token is still on the device
(the previous step's sample under overlap scheduling, or a drafter's proposal), which the
scheduler fills on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.engine.cache.pools import position_slots
from kiln.engine.request import Req

# An output token sampled on the device but not yet read back (overlap scheduling).
PENDING = -1


@dataclass
class StepInputs:
    """Host lists of one forward's rows (see the module docstring)."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    locs: list[int] = field(default_factory=list)
    win_locs: dict[str, list[int]] = field(default_factory=dict)
    logit_rows: list[int] = field(default_factory=list)
    sample_reqs: list[Req] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # each sampling request's first index in logit_rows
    prompt_lp: list[tuple[Req, int, int]] = field(default_factory=list)  # (req, first position, first logit row)
    pending_at: list[int] = field(default_factory=list)  # rows whose input token is still on the device
    pending_src: list[int] = field(default_factory=list)  # ... and their rows in the previous step's sample
    draft_at: list[int] = field(default_factory=list)  # rows whose draft token is still on the device
    draft_src: list[int] = field(default_factory=list)  # ... and their index in the drafter's flat tokens
    row_starts: list[int] = field(default_factory=list)  # each plan entry's first row

    @classmethod
    def build(cls, plan: list[tuple[Req, int, int]], page_size: int, windows, pending_rows: Optional[dict],
              spec: Any = None) -> "StepInputs":
        """The rows of `plan`. `windows`: the windowed state spaces' names; `pending_rows`: the
        previous step's sample row of each request id (None without a step in flight); `spec`:
        the `SpecDecoder`, for ranges that run past a request's tokens into its drafts."""
        x = cls(win_locs={c: [] for c in windows})
        ids, pos, locs, win_locs, logit_rows = x.ids, x.pos, x.locs, x.win_locs, x.logit_rows
        ps, row = page_size, 0
        for r, start, end in plan:
            seq_len = r.seq_len
            x.row_starts.append(row)
            if end == seq_len == start + 1 and r.prompt_logprobs is None:
                # A plain decode row (most rows of most steps): the general path below, unrolled,
                # as this loop runs for every running request every step.
                out = r.output_ids
                t = out[-1] if out else r.prompt_ids[-1]
                ids.append(t)
                if t == PENDING:
                    x.pending_at.append(row)
                    x.pending_src.append(pending_rows[r.rid])
                pos.append(start)
                locs.append(r.pages[start // ps] * ps + start % ps)
                for c in windows:
                    win_locs[c].append(r.win_pages[c][start // ps] * ps + start % ps)
                x.sample_reqs.append(r)
                x.sample_rows.append(len(logit_rows))
                logit_rows.append(row)
                row += 1
                continue
            if end <= seq_len:
                ids.extend(r.token_ids(start, end))
            else:  # a speculative round: the last token, then the drafts to verify
                drafts, src_row = spec.draft_ids(r, end - seq_len)
                ids.extend(r.token_ids(start, seq_len) + drafts)
                if src_row is not None:
                    k = spec.flight.tokens.shape[1]
                    x.draft_at.extend(range(row + seq_len - start, row + end - start))
                    x.draft_src.extend(range(src_row * k, src_row * k + end - seq_len))
            if end <= seq_len and ids[-1] == PENDING:
                x.pending_at.append(row + end - 1 - start)
                x.pending_src.append(pending_rows[r.rid])
            pos.extend(range(start, end))
            locs.extend(position_slots(r.pages, start, end, ps))
            for c in windows:
                win_locs[c].extend(position_slots(r.win_pages[c], start, end, ps))
            if r.prompt_logprobs is not None and r.prompt_logprobs_done < len(r.prompt_ids) - 1:
                lo = max(start, r.prompt_logprobs_done)
                hi = min(end, len(r.prompt_ids) - 1)
                if hi > lo:
                    x.prompt_lp.append((r, lo, len(logit_rows)))
                    logit_rows.extend(range(row + lo - start, row + hi - start))
            if end >= seq_len:  # samples: the last token's row (and every draft's row)
                x.sample_reqs.append(r)
                x.sample_rows.append(len(logit_rows))
                logit_rows.extend(range(row + seq_len - 1 - start, row + end - start))
            row += end - start
        return x
