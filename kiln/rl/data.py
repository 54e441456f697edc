"""Prompt data for RL: JSONL prompt files, a built-in arithmetic task and a resumable batch iterator.

A prompt record is a dict with at least ``"prompt"`` (a string, or a list of chat messages
``{"role", "content"}``) and ``"answer"``; other fields of the source line are kept and reach the
reward function as its ``sample`` argument.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = ["ArithmeticTask", "PromptIterator", "load_jsonl_prompts"]


def load_jsonl_prompts(
    path: str | Path, prompt_key: str = "prompt", answer_key: str | None = "answer"
) -> list[dict]:
    """Read one JSON object per line. Returns records with ``"prompt"`` and ``"answer"`` set from
    ``prompt_key`` / ``answer_key`` (pass ``answer_key=None`` for reward functions that need no
    answer) plus the line's other fields. Blank lines are skipped. Raises FileNotFoundError for a
    missing file and ValueError, naming the file and line, for bad JSON or missing keys."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {str(p)!r} not found (relative paths are from {Path.cwd()})")
    records: list[dict] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
            for key, flag in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
                if key is not None and key not in obj:
                    raise ValueError(
                        f"{p}:{lineno}: missing key {key!r} (keys present: {', '.join(map(repr, obj)) or 'none'}); "
                        f"choose the field with {flag}"
                    )
            prompt = obj[prompt_key]
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
                raise ValueError(
                    f"{p}:{lineno}: {prompt_key!r} must be a string or a list of chat messages, got {type(prompt).__name__}"
                )
            rec = dict(obj)
            rec["prompt"] = prompt
            if answer_key is not None:
                rec["answer"] = obj[answer_key]
            records.append(rec)
    if not records:
        raise ValueError(f"prompt file {str(p)!r} has no records")
    return records


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _evaluate(terms: Sequence[int], ops: Sequence[str]) -> int:
    """Integer value of terms[0] ops[0] terms[1] ... with the usual precedence (* before + and -)."""
    # Fold multiplications first, then the left-to-right sum.
    values = [terms[0]]
    signs: list[str] = []
    for op, t in zip(ops, terms[1:]):
        if op == "*":
            values[-1] = values[-1] * t
        else:
            signs.append(op)
            values.append(t)
    total = values[0]
    for op, v in zip(signs, values[1:]):
        total = _OPS[op](total, v)
    return total


class ArithmeticTask:
    """A built-in verifiable task: integer arithmetic questions with exact answers.

    ``sample(n)`` returns ``[{"prompt": "What is 17 + 25? Answer with just the number.",
    "answer": "42"}, ...]``; answers are integer strings (``math_reward`` checks them). The
    stream is deterministic given the seed; successive calls continue it.
    """

    def __init__(
        self,
        seed: int = 0,
        min_operand: int = 1,
        max_operand: int = 50,
        ops: Sequence[str] = ("+", "-", "*"),
        num_terms: int = 2,
    ) -> None:
        ops = tuple(ops)
        if not ops or any(op not in _OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {tuple(_OPS)}, got {ops}")
        if min_operand > max_operand:
            raise ValueError(f"min_operand ({min_operand}) > max_operand ({max_operand})")
        if num_terms < 2:
            raise ValueError(f"num_terms must be >= 2, got {num_terms}")
        self.seed, self.min_operand, self.max_operand = seed, min_operand, max_operand
        self.ops, self.num_terms = ops, num_terms
        self._rng = random.Random(seed)

    def sample(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            terms = [self._rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_terms)]
            ops = [self._rng.choice(self.ops) for _ in range(self.num_terms - 1)]
            expr = str(terms[0]) + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:]))
            out.append(
                {"prompt": f"What is {expr}? Answer with just the number.", "answer": str(_evaluate(terms, ops))}
            )
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rng_state": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        version, internal, gauss = state["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss))


class PromptIterator:
    """Endless batches of prompts: each epoch is a fresh shuffle (seeded by ``(seed, epoch)``);
    a batch that crosses an epoch boundary is completed from the next epoch, so every batch has
    ``batch_size`` records.

    ``state_dict()`` holds the epoch, the position in it and the RNG state of the epoch's
    shuffle; after ``load_state_dict`` the iterator yields exactly the batches the saved one
    would have yielded next. The state is JSON-serialisable.
    """

    def __init__(self, prompts: Sequence[Any], batch_size: int, seed: int = 0) -> None:
        if len(prompts) == 0:
            raise ValueError("PromptIterator needs at least one prompt")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        rng = random.Random(f"kiln.rl.PromptIterator:{self.seed}:{epoch}")
        self._rng_state = rng.getstate()  # the state this epoch's shuffle started from
        self._order = list(range(len(self.prompts)))
        rng.shuffle(self._order)

    def __iter__(self) -> Iterator[list]:
        return self

    def __next__(self) -> list:
        return self.next_batch()

    def next_batch(self) -> list:
        """The next ``batch_size`` records (the iterator never ends)."""
        batch = []
        while len(batch) < self.batch_size:
            if self.position >= len(self._order):
                self._start_epoch(self.epoch + 1)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch.extend(self.prompts[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict:
        version, internal, gauss = self._rng_state
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_prompts": len(self.prompts),
            "rng_state": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"cannot resume: the saved iterator had {state['num_prompts']} prompts, this one has "
                f"{len(self.prompts)} (use the same prompt file as the run being resumed)"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        version, internal, gauss = state["rng_state"]
        rng = random.Random()
        rng.setstate((version, tuple(internal), gauss))
        self._rng_state = rng.getstate()
        self._order = list(range(len(self.prompts)))
        rng.shuffle(self._order)
        if not 0 <= state["position"] <= len(self._order):
            raise ValueError(f"bad position {state['position']} for {len(self._order)} prompts")
        self.position = state["position"]
