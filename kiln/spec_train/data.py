"""Training data for drafters: the frozen target's own continuations of a prompt set
(self-distillation), generated with Kiln's offline engine and cached in the output directory.

Prompts come from a JSONL file (`{"prompt": text or chat messages}` or `{"prompt_ids": [...]}` per
line) or from the built-in set (`builtin_prompts`): instruction templates crossed with topics, plus
arithmetic questions from `kiln.rl.data.ArithmeticTask`. The built-in set has a held-out split
(other topics, other numbers) for measuring acceptance on prompts the drafter never saw. Beyond
those, the target can write user turns itself (`synthesize_prompts`, Magpie): as many prompts as
the data needs, in the target's own distribution, without a dataset.

The cache (`DIR/data/generations.jsonl` + `meta.json`) is reused when the target, the prompts and
the sampling options are the same, so a second training run skips generation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Optional, Union

logger = logging.getLogger("kiln.spec_train")

Prompt = Union[str, list, list[int]]  # text, chat messages, or token ids

_TEMPLATES = (
    "Explain {t} to a curious teenager.",
    "Write a short essay about {t}.",
    "What are the most important facts about {t}?",
    "Give me three tips related to {t}.",
    "Write a short story that involves {t}.",
    "Summarize the history of {t} in a paragraph.",
    "What are the pros and cons of {t}?",
    "Describe {t} in simple words.",
    "Write a poem about {t}.",
    "How would you teach a beginner about {t}?",
)
_TRAIN_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "the Roman Empire", "machine learning", "bread baking",
    "the solar system", "climate change", "the human heart", "honey bees", "electric cars", "the internet",
    "chess", "the French Revolution", "recycling", "coffee", "rainforests", "earthquakes", "vaccines",
    "the moon landing", "healthy sleep", "learning a new language", "gardening", "the stock market",
    "dinosaurs", "renewable energy", "the printing press", "ocean tides", "friendship", "time management",
    "the Great Wall of China", "black holes", "jazz music", "public speaking", "birds migrating",
    "the immune system", "ancient Egypt", "soccer", "saving money", "mountains", "programming in Python",
    "the Olympic Games", "cats", "electricity", "the brain", "deserts", "writing a resume", "penguins",
)
_EVAL_TOPICS = (
    "glaciers", "the Renaissance", "octopuses", "solar panels", "the piano", "recycling plastic bottles",
    "the Amazon river", "meditation", "bicycles", "the periodic table", "wolves", "cooking pasta",
    "the Silk Road", "hurricanes", "libraries", "origami",
)


def builtin_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """Kiln's default prompt set, shuffled by `seed`: 'train' (480 template x topic prompts + 60
    arithmetic questions) or 'eval' (held out: 160 + 20, other topics and numbers)."""
    from kiln.rl.data import ArithmeticTask

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    topics = _TRAIN_TOPICS if split == "train" else _EVAL_TOPICS
    out = [tpl.format(t=t) for t in topics for tpl in _TEMPLATES]
    # Different seeds give different numbers; the eval questions draw from a disjoint seed.
    task = ArithmeticTask(seed=1000 + seed if split == "train" else 9000 + seed, max_operand=99)
    out += [s["prompt"] for s in task.sample(len(out) // 8)]
    random.Random(f"kiln.spec_train:{split}:{seed}").shuffle(out)
    return out


def load_prompt_file(path: str) -> list[Prompt]:
    """Prompts of a JSONL file: the `prompt` (text or chat messages) or `prompt_ids` of each line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} not found")
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if isinstance(obj, dict) and "prompt_ids" in obj:
                ids = obj["prompt_ids"]
                if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                    raise ValueError(f"{path}:{lineno}: prompt_ids must be a non-empty list of ints")
                out.append(ids)
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), (str, list)):
                out.append(obj["prompt"])
            else:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ...}} or {{\"prompt_ids\": [...]}}")
    if not out:
        raise ValueError(f"prompt file {path!r} has no prompts")
    return out


def write_prompt_file(path: str, prompts: list[Prompt]) -> None:
    """`prompts` as a JSONL file `load_prompt_file` reads back (`{"prompt": ...}` per line)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


@dataclass
class Sample:
    """One training sequence: the prompt's token ids and the target's continuation."""

    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def _meta(cfg, prompts: list[Prompt]) -> dict:
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]
    return {"target": os.path.abspath(os.path.expanduser(cfg.target)) if cfg.target != "embedded" else "embedded",
            "prompts_sha": digest, "num_prompts": len(prompts), "samples_per_prompt": cfg.samples_per_prompt,
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "chat_template": cfg.chat_template, "seed": cfg.seed,
            # only when used, so caches written before the option existed still match
            **({"synthetic_prompts": cfg.synthetic_prompts} if getattr(cfg, "synthetic_prompts", 0) else {})}


def target_path(target: str) -> Optional[str]:
    """`--target` as a model path for `resolve_model` ('embedded' -> None, the embedded SmolLM2)."""
    return None if target == "embedded" else target


def base_prompts(cfg) -> list[Prompt]:
    """The run's given prompts: the first `num_prompts` of the file, or of the built-in set."""
    prompts = load_prompt_file(cfg.prompts) if cfg.prompts else builtin_prompts("train", cfg.seed)
    return prompts[:cfg.num_prompts]


def load_or_generate(cfg, data_dir: str) -> list[Sample]:
    """The cached generations in `data_dir` if they match `cfg`, else generate and cache them.
    With `cfg.synthetic_prompts`, the target first writes that many more prompts itself (kept in
    `data_dir/synthetic_prompts.jsonl`); the cache key covers their count and seed, not their text."""
    prompts = base_prompts(cfg)
    cached = load_cached(cfg, data_dir, prompts)
    if cached is not None:
        return cached
    n_synth = getattr(cfg, "synthetic_prompts", 0)
    if n_synth:
        with open_target(cfg) as llm:  # one engine writes the prompts and continues them
            synth = synthesize_prompts(cfg, n_synth, llm)
            os.makedirs(data_dir, exist_ok=True)
            write_prompt_file(os.path.join(data_dir, "synthetic_prompts.jsonl"), synth)
            samples = continue_prompts(llm, cfg, prompts + as_user_turns(synth))
    else:
        samples = generate(cfg, prompts)
    save_generations(cfg, data_dir, prompts, samples)
    return samples


def as_user_turns(texts: list[str]) -> list[list[dict]]:
    """Synthetic prompts as chat messages: they were written as user turns, so they go through the
    chat template even under --no-chat-template."""
    return [[{"role": "user", "content": t}] for t in texts]


def _paths(data_dir: str) -> tuple[str, str]:
    return os.path.join(data_dir, "generations.jsonl"), os.path.join(data_dir, "meta.json")


def load_cached(cfg, data_dir: str, prompts: list[Prompt]) -> Optional[list[Sample]]:
    """The generations cached in `data_dir` for exactly these prompts and options, else None."""
    gen_path, meta_path = _paths(data_dir)
    if not (os.path.isfile(gen_path) and os.path.isfile(meta_path)):
        return None
    with open(meta_path) as f:
        if json.load(f) != _meta(cfg, prompts):
            return None
    with open(gen_path) as g:
        samples = [Sample(**json.loads(line)) for line in g if line.strip()]
    logger.info("reusing %d cached generations from %s", len(samples), gen_path)
    return samples


def save_generations(cfg, data_dir: str, prompts: list[Prompt], samples: list[Sample]) -> None:
    """Cache `samples` (generated from `prompts` with `cfg`'s options) in `data_dir`; written to
    a temporary file and renamed, so an interrupted run never leaves a half-written cache."""
    gen_path, meta_path = _paths(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    with open(gen_path + ".tmp", "w") as g:
        for s in samples:
            g.write(json.dumps({"prompt_ids": s.prompt_ids, "output_ids": s.output_ids}) + "\n")
    os.replace(gen_path + ".tmp", gen_path)
    with open(meta_path, "w") as f:
        json.dump(_meta(cfg, prompts), f, indent=2)


def engine_options(cfg, **extra: Any) -> dict:
    """kiln.Engine options for the target: the run's device, quiet logs, no tokenizer when the
    target directory has none (then prompts must be token ids)."""
    from kiln.loader import has_tokenizer_files, resolve_model

    src = resolve_model(target_path(cfg.target))
    opts = {"device": cfg.device, "log_level": "warning", "seed": cfg.seed,
            "skip_tokenizer_init": not has_tokenizer_files(src.model_dir)}
    opts.update(cfg.engine)
    opts.update(extra)
    return opts


def tokenize_prompts(llm, prompts: list[Prompt], chat_template: bool) -> list[list[int]]:
    """Token ids of each prompt (text through the chat template when asked, chat messages always)."""
    out = []
    for p in prompts:
        if isinstance(p, list) and all(isinstance(i, int) for i in p):
            out.append(list(p))
            continue
        if llm.tokenizer is None:
            raise ValueError("the target has no tokenizer files: give prompts as {\"prompt_ids\": [...]}")
        if isinstance(p, list):
            out.append(llm.apply_chat_template(p))
        elif chat_template:
            out.append(llm.apply_chat_template([{"role": "user", "content": p}]))
        else:
            out.append(llm.tokenizer.encode(p))
    return out


def open_target(cfg):
    """Kiln's offline engine on the frozen target, with `engine_options(cfg)` (a context manager)."""
    from kiln.offline import Engine

    return Engine(model_path=target_path(cfg.target), **engine_options(cfg))


def generate(cfg, prompts: list[Prompt]) -> list[Sample]:
    """The target's continuations of `prompts` (`samples_per_prompt` each) with Kiln's engine."""
    with open_target(cfg) as llm:
        return continue_prompts(llm, cfg, prompts)


def continue_prompts(llm, cfg, prompts: list[Prompt]) -> list[Sample]:
    """The continuations of `prompts` by an open engine `llm`, with `cfg`'s sampling options."""
    from kiln.engine.request import SamplingParams

    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, n=cfg.samples_per_prompt,
                            seed=cfg.seed if cfg.temperature > 0 else None)
    ids = tokenize_prompts(llm, prompts, cfg.chat_template)
    outs = llm.generate(ids, params, use_tqdm=cfg.progress)
    return [Sample(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]


# Magpie (Xu et al., 2024): an aligned chat model, given its template up to where a user's message
# starts, writes a plausible user message. Sampled at temperature 1 so the prompts spread over what
# the model expects to be asked; messages cut by the token cap or too short to be a request are
# dropped, and duplicates kept once.
SYNTH_MAX_TOKENS = 96
SYNTH_MIN_CHARS = 12


def user_turn_prefix(llm) -> list[int]:
    """Token ids of the chat template up to the first character of a user message (with the
    template's default system turn, if it has one)."""
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("--synthetic-prompts needs a target with a tokenizer and a chat template")
    marker = "\u2063KILN_USER_TURN\u2063"
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise ValueError("the target's chat template does not show the user's message verbatim; "
                         "--synthetic-prompts cannot find where a user turn starts")
    return llm.tokenizer.encode(text[:text.index(marker)], add_special_tokens=False)


def synthesize_prompts(cfg, n: int, llm) -> list[str]:
    """Up to `n` distinct user messages written by the target (open engine `llm`) itself from its
    chat template's user-turn header (Magpie), sampled at temperature 1 with `cfg.seed`."""
    from kiln.engine.request import SamplingParams

    prefix = user_turn_prefix(llm)
    params = SamplingParams(max_tokens=SYNTH_MAX_TOKENS, temperature=1.0, n=n, seed=cfg.seed)
    out = llm.generate([prefix], params, use_tqdm=False)[0].outputs
    seen, prompts = set(), []
    for c in out:
        text = c.text.strip()
        if c.finish_reason == "stop" and len(text) >= SYNTH_MIN_CHARS and text not in seen:
            seen.add(text)
            prompts.append(text)
    logger.info("the target wrote %d distinct prompts of %d asked", len(prompts), n)
    return prompts
