r"""Verifiable rewards: final-answer extraction, the math reward and loading custom reward functions.

A reward function is any callable ``(prompt: str, completion: str, sample: dict) -> float`` where
``sample`` is the prompt record (from ``kiln.rl.data``: at least ``"prompt"`` and usually
``"answer"``). Built-ins live in ``REWARDS``; ``load_reward_fn`` also accepts
``"package.module:function"`` or ``"path/to/file.py:function"``.

Answer extraction (``extract_final_number``), in order of precedence:

1. the content of the last ``\boxed{...}`` (nested braces allowed; ``\frac{a}{b}`` -> ``a/b``);
2. the text after the last ``#### `` (GSM8K style);
3. otherwise the last number anywhere in the text.

Numbers may carry thousands separators (``1,234``), a sign (``-3``; a minus directly after a digit
is subtraction, not a sign), decimals (``3.5``, ``.5``) and be simple fractions (``3/4``). The
result is normalised: no commas, no spaces, e.g. ``"1234"``, ``"-3.5"``, ``"3/4"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = [
    "REWARDS",
    "RewardFn",
    "extract_final_number",
    "load_reward_fn",
    "math_reward",
    "math_reward_fn",
    "parse_number",
]


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, sample: dict) -> float: ...


# A number: optional sign (not right after a word character, closing bracket or '.'), digits with
# optional thousands groups, optional decimals, optional "/ denominator".
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(rf"(?:(?<![\w)\].])-)?(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with brace matching; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return text[i + 1 :]  # unbalanced: take the rest


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\u2013", "-")  # unicode minus / en dash
    text = _FRAC_RE.sub(r"(\1)/(\2)", text)
    text = text.replace("\\!", "").replace("\\,", "").replace("{,}", ",").replace("$", "")
    # "(3)/(4)" from \frac -> "3/4" when both parts are plain numbers.
    return re.sub(r"\(\s*(-?[\d.,]+)\s*\)\s*/\s*\(\s*([\d.,]+)\s*\)", r"\1/\2", text)


def _numbers(text: str) -> list[str]:
    return [re.sub(r"[,\s]", "", m.group(0)) for m in _NUMBER_RE.finditer(_normalise(text))]


def extract_final_number(text: str) -> str | None:
    """The final answer of a completion as a normalised number string, or None (see module doc)."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        nums = _numbers(boxed)
        if nums:
            return nums[-1]
    idx = text.rfind("####")
    if idx >= 0:
        nums = _numbers(text[idx + 4 :])
        if nums:
            return nums[0]
    nums = _numbers(text)
    return nums[-1] if nums else None


def parse_number(s: str | int | float) -> float | None:
    """float of a normalised number string ("1234", "-3.5", "3/4"); None if unparseable."""
    if isinstance(s, bool):
        return None
    if isinstance(s, (int, float)):
        return float(s)
    s = s.strip().replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            d = float(den)
            return float(num) / d if d != 0 else None
        return float(s)
    except ValueError:
        return None


def math_reward(completion: str, answer: str | int | float) -> float:
    """1.0 if the completion's final number equals the answer within 1e-6 (relative for large
    values), else 0.0. ``answer`` may be a number, a number string or a GSM8K-style solution
    ending in ``#### N``."""
    pred = extract_final_number(completion)
    if pred is None:
        return 0.0
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        gold = float(answer)
    else:
        gold_s = str(answer)
        gold = parse_number(gold_s)
        if gold is None:
            extracted = extract_final_number(gold_s)
            gold = parse_number(extracted) if extracted is not None else None
    p = parse_number(pred)
    if gold is None or p is None or not math.isfinite(gold):
        return 0.0
    return 1.0 if math.isclose(p, gold, rel_tol=1e-9, abs_tol=1e-6) else 0.0


def math_reward_fn(prompt: str, completion: str, sample: dict) -> float:
    """``RewardFn`` wrapper of ``math_reward`` using ``sample["answer"]``."""
    if "answer" not in sample:
        raise KeyError("the 'math' reward needs an 'answer' field in each prompt record (see --answer-key)")
    return math_reward(completion, sample["answer"])


REWARDS: dict[str, RewardFn] = {"math": math_reward_fn}

_SPEC_HELP = (
    'expected a built-in name ({builtins}), "package.module:function" (importable, e.g. on PYTHONPATH) '
    'or "path/to/file.py:function"'
)


def _spec_error(spec: str, why: str) -> ValueError:
    return ValueError(f"bad reward function {spec!r}: {why}; " + _SPEC_HELP.format(builtins=", ".join(sorted(REWARDS))))


def load_reward_fn(spec: str | Callable[..., float]) -> RewardFn:
    """Resolve a reward function: a callable (returned as is), a ``REWARDS`` name,
    ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    if callable(spec):
        return spec  # type: ignore[return-value]
    if not isinstance(spec, str) or not spec.strip():
        raise _spec_error(str(spec), "empty or not a string")
    spec = spec.strip()
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise _spec_error(spec, "no ':function' part and not a built-in name")
    target, func_name = spec.rsplit(":", 1)
    if not target or not func_name.isidentifier():
        raise _spec_error(spec, f"{func_name!r} is not a function name" if target else "missing module or file")

    is_file = target.endswith(".py") or "/" in target or "\\" in target
    if is_file:
        path = Path(target).expanduser()
        if not path.is_file():
            raise _spec_error(spec, f"file {str(path)!r} does not exist (relative paths are from {Path.cwd()})")
        mod_name = f"kiln_reward_{abs(hash(str(path.resolve())))}"
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        if mspec is None or mspec.loader is None:
            raise _spec_error(spec, f"cannot load {str(path)!r} as a Python file")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        try:
            mspec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name and (target == e.name or target.startswith(e.name + ".")):
                raise _spec_error(spec, f"module {target!r} not found (is it installed or on PYTHONPATH?)") from e
            raise  # the module exists but one of its own imports failed: show the real error

    fn: Any = getattr(module, func_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise _spec_error(spec, f"{target!r} has no attribute {func_name!r} (callables there: {', '.join(public) or 'none'})")
    if not callable(fn):
        raise _spec_error(spec, f"{target}:{func_name} is not callable")
    return fn
