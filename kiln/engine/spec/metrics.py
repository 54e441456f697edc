"""Acceptance counters for speculative decoding, per request and for the whole engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    """Counts over verify steps that had at least one draft token.

    Acceptance length tau = accepted drafts + 1 (the target's own token) per verify step, as in
    SGLang and DFlash; `proposed[i]` / `accepted[i]` count draft position i + 1 (a position is
    proposed when the draft reached it and accepted when it and every earlier one matched).
    Engine-wide only, `steps_by_length[k]` counts the steps whose decoding requests were offered k
    drafts (k < K only with --speculative-adaptive; a request short of pages or context may still
    verify fewer), and `verifies_queued_ahead` the verify forwards queued before the previous
    round's samples were read back (`kiln.engine.spec.verify_ahead`)."""

    verify_steps: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps_by_length: list[int] = field(default_factory=list)
    verifies_queued_ahead: int = 0

    def record_step(self, k: int) -> None:
        if k >= len(self.steps_by_length):
            self.steps_by_length += [0] * (k + 1 - len(self.steps_by_length))
        self.steps_by_length[k] += 1

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        grow = num_proposed - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        self.verify_steps += 1
        for i in range(num_proposed):
            self.proposed[i] += 1
            self.accepted[i] += int(i < num_accepted)

    def add(self, other: "SpecCounts") -> None:
        for i, (p, a) in enumerate(zip(other.proposed, other.accepted)):
            if i >= len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[i] += p
            self.accepted[i] += a
        self.verify_steps += other.verify_steps
        self.verifies_queued_ahead += other.verifies_queued_ahead
        grow = len(other.steps_by_length) - len(self.steps_by_length)
        self.steps_by_length += [0] * max(grow, 0)
        for k, n in enumerate(other.steps_by_length):
            self.steps_by_length[k] += n

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def accept_length(self) -> float:
        """Mean tokens produced per verify step (1 when nothing was verified yet)."""
        return 1.0 + self.accepted_tokens / max(1, self.verify_steps)

    @property
    def accept_rate_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def copy(self) -> "SpecCounts":
        return SpecCounts(self.verify_steps, list(self.proposed), list(self.accepted), list(self.steps_by_length),
                          self.verifies_queued_ahead)

    def to_dict(self) -> dict:
        return {"spec_verify_ct": self.verify_steps, "spec_accepted_tokens": self.accepted_tokens,
                "spec_accept_length": self.accept_length,
                "spec_accept_rate_per_position": self.accept_rate_per_position}
