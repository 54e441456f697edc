"""`TrainDraftConfig`: every option of `kiln train-draft`, and the CLI flags built from it.

    kiln train-draft --target MODEL --method mtp --out DIR [--num-mtp-layers 3 ...]
    cfg = TrainDraftConfig(target="DIR", method="mtp", out="runs/mtp", num_steps=100)   # Python

Like `EngineConfig`, the fields carry `opt()` metadata (help text, choices) and the flags are
generated from them, so the CLI and the Python keywords cannot drift apart. Fields without a
default (`target`, `method`, `out`) are required flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, get_args, get_origin, get_type_hints

from kiln.config import opt

METHODS = ("mtp", "dflash", "dspark")


def required(help: str, choices: Optional[list] = None):
    """A dataclass field without a default: a required CLI flag."""
    return field(metadata={"help": help, "choices": choices, "flag": None})


@dataclass
class TrainDraftConfig:
    """Options of one `kiln train-draft` run: data generation by the frozen target, then training
    of the drafter (MTP layers, or a DFlash drafter), then a servable checkpoint in `out`."""

    target: str = required("The frozen target: an HF directory or a .gguf file ('embedded': the embedded "
                           "SmolLM2-135M-Instruct).")
    method: str = required("What to train: 'mtp' (MTP layers added to the target's checkpoint), 'dflash' "
                           "(a standalone block drafter) or 'dspark' (a MiniMax-M3 target's built-in block "
                           "drafter: the DFlash design, written into a copy of its checkpoint).", list(METHODS))
    out: str = required("Output directory: the drafter checkpoint, plus data/ (cached generations) and "
                        "metrics.jsonl / loss.png.")
    # Data: the target's own continuations (self-distillation)
    prompts: Optional[str] = opt(None, "A JSONL file of prompts ({\"prompt\": text or chat messages} or "
                                 "{\"prompt_ids\": [...]} per line); default: Kiln's built-in prompt set.")
    num_prompts: int = opt(256, "Prompts to generate from (the first N of the file or the built-in set).")
    synthetic_prompts: int = opt(0, "Also have the target write this many prompts itself and continue them "
                                 "(Magpie: user turns sampled at temperature 1 from its chat template's user "
                                 "header; cut or duplicate ones dropped). More data without a dataset.")
    samples_per_prompt: int = opt(1, "Continuations per prompt.")
    max_new_tokens: int = opt(128, "Most tokens the target generates per continuation.")
    temperature: float = opt(0.0, "Sampling temperature of the data (0: greedy, the distribution greedy "
                             "serving verifies against).")
    chat_template: bool = opt(True, "Wrap text prompts as a user turn in the target's chat template.")
    # MTP
    num_mtp_layers: int = opt(3, "mtp: MTP layers to train (the draft length K they allow).")
    mtp_sliding_window: int = opt(256, "mtp: attention window of the MTP blocks (MODELS.md 2.4). Serving keeps "
                                  "this many tokens of MTP K/V per running request (the engine reserves it for "
                                  "--max-running-requests of them), so it stays small; training sequences are short.")
    mtp_intermediate_size: Optional[int] = opt(None, "mtp: SwiGLU width of the MTP blocks (default: the "
                                               "target's intermediate_size).")
    mtp_init: str = opt("identity", "mtp: 'identity' starts each MTP layer as a pass-through of h^{k-1} (zero "
                        "residual branches, random elsewhere); 'last-layer' also copies the target's last decoder "
                        "layer into the block; 'random' draws every matrix (kiln.spec_train.mtp.init_mtp).",
                        ["identity", "last-layer", "random"])
    mtp_labels: str = opt("tokens", "mtp: what each layer learns to predict. 'tokens': cross-entropy on the "
                          "continuation's tokens; 'target': cross-entropy against the target's whole next-token "
                          "distribution at that position (soft labels from its final hidden state: the ranking "
                          "of every token, not only the argmax). On SmolLM2 it did not raise acceptance, on "
                          "greedy or sampled data (docs/speculative.md, 'Soft labels'). Validation reports the "
                          "token cross-entropy either way.", ["tokens", "target"])
    # DFlash (and DSpark, the same drafter stored in a MiniMax-M3 checkpoint: the dflash_* options apply)
    dflash_num_layers: int = opt(1, "dflash: drafter layers.")
    dflash_block_size: int = opt(8, "dflash: block size B (the anchor + B-1 drafts; serve with K <= B-1).")
    dflash_layer_ids: Optional[list] = opt(None, "dflash: target layers whose input hidden state is tapped "
                                           "(JSON list; default: second, middle and last layer).")
    dflash_mask_token_id: Optional[int] = opt(None, "dflash: the token filling the block after the anchor "
                                              "(default: the last id of the vocabulary).")
    dflash_gamma: float = opt(7.0, "dflash: loss weight decay over block positions, exp(-(k-1)/gamma).")
    dflash_anchors_per_seq: int = opt(32, "dflash: random anchors per training sequence per step.")
    dflash_conv_kernel_size: int = opt(0, "dflash: DFlash2's grouped dynamic conv around each sublayer, kernel "
                                       "size (2 in DFlash2; 0: none).")
    dflash_conv_group_size: int = opt(16, "dflash: channels per group of the conv's dynamic taps.")
    dflash_selector_rank: int = opt(0, "dflash: DFlash2's candidate selector, rank (256 in DFlash2; 0: none); "
                                    "trained with --dflash-selector-weight x its cross-entropy.")
    dflash_selector_top_k: int = opt(16, "dflash: candidates per block position the selector re-ranks.")
    dflash_selector_weight: float = opt(1.0, "dflash: weight of the selector's loss beside the DFlash loss.")
    # Training
    num_steps: int = opt(200, "Optimizer steps.")
    batch_tokens: int = opt(1024, "Tokens per step (whole sequences packed up to this).")
    max_seq_len: int = opt(384, "Sequences (prompt + continuation) are cut to this many tokens.")
    lr: float = opt(1e-3, "AdamW peak learning rate (linear warmup, cosine decay).")
    warmup_steps: int = opt(10, "Linear warmup steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Clip the gradient norm to this (0: no clipping).")
    autocast_bf16: bool = opt(False, "Run the drafter's forward/backward under bfloat16 autocast (about 2-4x on "
                              "CPUs with bf16 matmuls, AVX512-BF16 or AMX; several times slower on CPUs "
                              "without them, which get a warning); weights and the optimizer stay fp32.")
    time_limit_s: float = opt(0.0, "mtp: stop training after this many seconds (steps and validations; 0: no "
                              "limit), with a final validation; the cosine decay then follows whichever of "
                              "--num-steps and the time limit runs out first, so a clock-bound run still ends at "
                              "the low rate.")
    keep_best: bool = opt(False, "mtp: export the MTP layers as they were at the lowest validation loss (checked "
                          "every --eval-every steps, at step 0 and at the end) instead of after the last step.")
    val_fraction: float = opt(0.05, "Fraction of sequences held out for the validation loss.")
    eval_every: int = opt(25, "Validation loss every this many steps (0: only at the end).")
    seed: int = opt(0, "Seed of prompt order, batching, sampling and initialisation.")
    threads: int = opt(1, "torch CPU threads (the engine and the trainer).")
    cache_hidden: bool = opt(True, "mtp: save the target's hidden states beside the data (data/hidden.pt, 4 bytes "
                             "x hidden size per token) so a second run skips that forward.")
    device: str = opt("cpu", "Where the target and the drafter run.", ["cpu", "cuda"])
    progress: bool = opt(True, "Show tqdm progress bars.")
    engine: dict = opt({}, "Extra kiln.Engine options for data generation (JSON), e.g. {\"max_running_requests\": 64}.")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {list(METHODS)}, got {self.method!r}")
        if self.method in ("dflash", "dspark") and (self.time_limit_s or self.keep_best or not self.cache_hidden):
            raise ValueError("--time-limit-s, --keep-best and --no-cache-hidden apply to --method mtp only")
        if self.synthetic_prompts < 0:
            raise ValueError(f"--synthetic-prompts must be >= 0, got {self.synthetic_prompts}")
        for name in ("num_prompts", "samples_per_prompt", "max_new_tokens", "num_mtp_layers", "batch_tokens",
                     "max_seq_len", "threads", "mtp_sliding_window", "dflash_num_layers",
                     "dflash_anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dflash_block_size < 2 or self.dflash_gamma <= 0:
            raise ValueError("--dflash-block-size must be >= 2 and --dflash-gamma > 0")
        if self.num_steps < 0 or self.temperature < 0 or self.time_limit_s < 0 or not 0 <= self.val_fraction < 1:
            raise ValueError("--num-steps, --temperature and --time-limit-s must be >= 0 and --val-fraction in [0, 1)")
        self.engine = dict(self.engine or {})

    # ---- CLI -------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            typ = hints[f.name]
            if get_origin(typ) is not None and type(None) in get_args(typ):
                typ = next(a for a in get_args(typ) if a is not type(None))
            kw: dict[str, Any] = {"dest": f.name, "help": meta.get("help")}
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kw.update(required=True, choices=meta.get("choices"))
            elif typ is bool:  # --progress / --no-progress
                kw.update(action=argparse.BooleanOptionalAction, default=f.default)
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                parse = {dict: _json_dict, list: _json_list}.get(typ, typ)
                kw.update(type=parse, default=default, choices=meta.get("choices"))
            parser.add_argument(flag, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "TrainDraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _json_of(kind: type):
    """An argparse type: the flag's text parsed as JSON, which must be a `kind` (dict or list)."""
    def parse(text: str):
        import json

        try:
            v = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(v, kind):
            raise argparse.ArgumentTypeError(f"expected a JSON {'object' if kind is dict else 'list'}")
        return v
    return parse


_json_dict, _json_list = _json_of(dict), _json_of(list)
