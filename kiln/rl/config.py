"""`RLConfig`: every option of a GRPO run, read from a JSON/YAML file plus `--key value` overrides.

    cfg = RLConfig.from_file("examples/rl_arithmetic.json", overrides=["--num-steps", "5"])
    cfg = RLConfig(num_steps=5, lr=1e-5)               # or directly, in Python

The fields carry `opt()` metadata (help text, choices), like `EngineConfig`, so `kiln rl --help`
lists them and the file keys, the CLI flags and the Python keywords can never drift apart.
Nested options: `loss` holds `kiln.rl.loss.LossConfig` fields and `engine` holds `kiln.Engine`
options (`EngineConfig` fields); override one key of them with `--loss.eps_clip 0.28` or
`--engine.max_running_requests 64`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, get_args, get_origin, get_type_hints

from kiln.config import opt


@dataclass
class RLConfig:
    """Options of one GRPO run (rollouts in a colocated `kiln.Engine`, training in `PolicyTrainer`)."""

    # Model and task
    model_path: Optional[str] = opt(None, "HF directory or .gguf file of the policy (default: the embedded "
                                    "SmolLM2-135M-Instruct).")
    task: str = opt("arithmetic", "'arithmetic' (built-in generated sums) or a JSONL file of "
                    "{\"prompt\", \"answer\"} lines.")
    task_options: dict = opt({}, "ArithmeticTask options, e.g. {\"max_operand\": 20, \"ops\": [\"+\"]}.")
    reward: str = opt("math", "A name in kiln.rl.rewards.REWARDS ('math') or a function 'module:fn' / "
                      "'file.py:fn' called as fn(completion, answer) -> float.")
    chat_template: bool = opt(True, "Wrap each prompt as a user turn in the model's chat template.")
    # Rollouts
    num_steps: int = opt(10, "GRPO steps (one rollout batch + one optimizer step each).")
    prompts_per_step: int = opt(8, "Prompts per step (groups).")
    samples_per_prompt: int = opt(4, "Samples per prompt (the group size n).")
    max_new_tokens: int = opt(24, "Most tokens generated per sample.")
    temperature: float = opt(1.0, "Rollout sampling temperature (the trainer divides logits by it too).")
    top_p: float = opt(1.0, "Rollout nucleus sampling (1.0 keeps the policy's distribution exact).")
    rollout_urls: list[str] = opt([], "Base urls of `kiln serve` instances that do the rollouts (round-robin); "
                                  "the trainer pushes weights to them (weight_sync). Empty: a colocated engine.")
    weight_sync: str = opt("http", "How full weights reach the rollout_urls servers: 'http' (base64 buckets through "
                           "/update_weights_from_tensor) or 'distributed' (a weight update group, SGLang's "
                           "/update_weights_from_distributed: NCCL from a CUDA trainer, GPU to GPU; gloo from a "
                           "CPU one). A LoRA adapter goes through /load_lora_adapter either way.",
                           ["http", "distributed"])
    weight_sync_master: str = opt("", "distributed: the trainer's HOST:PORT that the servers connect to (the "
                                  "group's store); empty: 127.0.0.1 and a free port (servers on this machine).")
    # Training
    lr: float = opt(1e-5, "AdamW learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    lora_rank: int = opt(0, "LoRA rank; 0 trains every parameter.")
    lora_alpha: float = opt(32.0, "LoRA alpha (scale = alpha / rank).")
    loss: dict = opt({}, "LossConfig fields (kiln.rl.loss), e.g. {\"eps_clip\": 0.2, \"tis_clip\": 2.0}.")
    dynamic_sampling: bool = opt(False, "Drop groups whose rewards are all equal (zero advantage; DAPO).")
    routing_replay: bool = opt(True, "MoE: the trainer replays the experts the engine routed (R3).")
    grad_clip: float = opt(1.0, "Clip the gradient norm to this (0 disables).")
    micro_batch_size: int = opt(0, "Samples per recompute + backward, accumulated into the step's one optimizer "
                                   "step (less activation memory); 0: all of them (each FSDP rank's share) at once.")
    trainer_device: str = opt("auto", "Where the trainer runs: 'auto' (cuda if available, else cpu), 'cpu', "
                              "'cuda', 'cuda:N'. Under torchrun each rank uses cuda:LOCAL_RANK (auto) or this.")
    trainer_dtype: str = opt("auto", "The trainer's weights and compute: 'auto' is the colocated engine's dtype "
                             "(engine.dtype; its auto is bf16 on CUDA, fp32 on CPU), with rollout_urls bf16 on a "
                             "CUDA trainer and fp32 on a CPU one. bf16 / fp16 step through fp32 master weights "
                             "(master_weights).", ["auto", "float32", "bfloat16", "float16"])
    master_weights: bool = opt(True, "A bf16 / fp16 trainer's AdamW updates fp32 master copies of the weights "
                               "(kiln.rl.optimizer); false updates the low-precision weights directly, where "
                               "updates below half a bf16 ulp (lr 1e-6 on most weights) round away.")
    num_gpus: int = opt(1, "Trainer GPUs. > 1: `kiln rl` re-launches itself under torchrun with one FSDP2 rank "
                        "per GPU (rank 0 also runs the rollouts). Ignored inside torchrun.")
    launcher: str = opt("local", "'local': this process (or torchrun ranks, see num_gpus). 'ray': a Ray placement "
                        "group with the trainer and `kiln serve` engines as actors (kiln.rl.ray_launcher; "
                        "pip install ray).", ["local", "ray"])
    ray: dict = opt({}, "kiln.rl.ray_launcher.RayPlacement options, e.g. {\"trainer_gpus\": 4, "
                    "\"num_engines\": 2, \"gpus_per_engine\": 1}.")
    release_engine_memory: Optional[bool] = opt(None, "Free the colocated engine's KV cache and weights while "
                                                "the trainer runs, resume them before the weight sync. None: "
                                                "only when the engine is on CUDA. With rollout_urls, true "
                                                "calls the servers' /release_memory_occupation (same GPUs).")
    seed: int = opt(0, "Seed of prompts, sampling and initialisation.")
    # Output
    out_dir: str = opt("runs/rl", "Where metrics.jsonl, curves.png and ckpt-N/ go.")
    save_every: int = opt(0, "Checkpoint every this many steps (0: only at the end when > 0 steps).")
    save_final: bool = opt(True, "Also checkpoint after the last step.")
    resume: Optional[str] = opt(None, "A ckpt-N directory to resume from, or 'auto' (the newest in out_dir).")
    plot_every: int = opt(1, "Redraw curves.png every this many steps (0: only at the end).")
    progress: bool = opt(True, "Show a tqdm progress bar.")
    engine: dict = opt({}, "kiln.Engine options (EngineConfig fields), e.g. {\"cpu_kv_cache_gb\": 0.5}.")

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0: GRPO needs sampled rollouts and the trainer "
                             f"divides logits by it; got {self.temperature}")
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full parameters), got {self.lora_rank}")
        self.loss = dict(self.loss or {})
        self.engine = dict(self.engine or {})
        self.task_options = dict(self.task_options or {})
        self.ray = dict(self.ray or {})
        if self.launcher not in ("local", "ray"):
            raise ValueError(f"launcher must be 'local' or 'ray', got {self.launcher!r}")
        if isinstance(self.rollout_urls, str):
            self.rollout_urls = [u for u in self.rollout_urls.split(",") if u]
        self.rollout_urls = [str(u) for u in (self.rollout_urls or [])]
        if self.weight_sync not in ("http", "distributed"):
            raise ValueError(f"weight_sync must be 'http' or 'distributed', got {self.weight_sync!r}")
        if self.weight_sync_master and not re.fullmatch(r"[^:\s]+:\d+", self.weight_sync_master):
            raise ValueError(f"weight_sync_master must be HOST:PORT, got {self.weight_sync_master!r}")

    # ---- building --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RLConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k.replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown RL option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: Optional[str], overrides: Sequence[str] = ()) -> "RLConfig":
        """Read a JSON (always) or YAML (if PyYAML is installed) file, then apply `--key value` overrides."""
        d: dict = {}
        if path:
            d = load_config_file(path)
        return cls.from_dict(apply_overrides(d, overrides))

    # ---- CLI -------------------------------------------------------------------------------
    @classmethod
    def help_text(cls) -> str:
        hints = get_type_hints(cls)
        lines = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{f.name.replace('_', '-')} ({_type_name(hints[f.name])}, default {default!r}): "
                         f"{f.metadata.get('help', '')}")
        return "\n".join(lines)


def load_config_file(path: str) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"RL config file {path!r} does not exist.")
    with open(path) as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise ImportError(f"{path} is YAML but PyYAML is not installed; `pip install pyyaml` or use "
                              "a .json config.") from e
        d = yaml.safe_load(text) or {}
    else:
        d = json.loads(text)
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a mapping of RL options, got {type(d).__name__}")
    return d


def apply_overrides(d: dict, overrides: Sequence[str]) -> dict:
    """Apply `--key value`, `--key=value` and `--nested.key value` (loss / engine / task_options / ray)
    to a config dict.

    Values are typed by the RLConfig field (bool accepts true/false/1/0; a flag with no value means
    true); nested values and dict fields are parsed as JSON when they parse, else kept as strings.
    """
    d = dict(d)
    hints = get_type_hints(RLConfig)
    items = list(overrides)
    i = 0
    while i < len(items):
        tok = items[i]
        if not tok.startswith("--"):
            raise ValueError(f"Expected --key value, got {tok!r}")
        key, value = tok[2:], None
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            value = items[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        if "." in key:
            outer, inner = key.split(".", 1)
            if outer not in ("loss", "engine", "task_options", "ray"):
                raise ValueError(f"Only loss.*, engine.*, task_options.* and ray.* take nested keys, got --{key}")
            nested = dict(d.get(outer) or {})
            nested[inner] = True if value is None else _parse_json_or_str(value)
            d[outer] = nested
            continue
        if key not in hints:
            raise ValueError(f"Unknown RL option --{key}; valid options: "
                             f"{sorted(f.name for f in dataclasses.fields(RLConfig))}")
        d[key] = _convert(hints[key], value, key)
    return d


def _convert(typ: Any, value: Optional[str], key: str) -> Any:
    if get_origin(typ) is not None and type(None) in get_args(typ):
        if value is not None and value.lower() in ("none", "null"):
            return None
        typ = next(a for a in get_args(typ) if a is not type(None))
    if typ is bool:
        if value is None:
            return True
        low = value.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{key} takes true/false, got {value!r}")
    if value is None:
        raise ValueError(f"--{key} needs a value")
    if typ is dict:
        v = json.loads(value)
        if not isinstance(v, dict):
            raise ValueError(f"--{key} takes a JSON object, got {value!r}")
        return v
    if get_origin(typ) is list:  # --rollout-urls http://a:1,http://b:2 or a JSON list
        v = _parse_json_or_str(value)
        return v if isinstance(v, list) else [u for u in str(v).split(",") if u]
    if typ is int:
        return int(value)
    if typ is float:
        return float(value)
    return value


def _parse_json_or_str(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _type_name(typ: Any) -> str:
    if get_origin(typ) is not None:
        return "|".join(getattr(a, "__name__", str(a)) for a in get_args(typ))
    return getattr(typ, "__name__", str(typ))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """`kiln rl --config FILE [--key value ...]`: the overrides are parsed by `apply_overrides`."""
    parser.add_argument("--config", default=None, help="A JSON or YAML file of RL options.")
    parser.epilog = "Options (in the file or as --key value; --loss.KEY / --engine.KEY for nested ones):\n" + \
        RLConfig.help_text()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
