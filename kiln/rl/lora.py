"""LoRA for Kiln's layers, in PEFT's semantics and file format.

    y = x W^T + (alpha / r) * (x A^T) B^T        A [r, in] kaiming-uniform(a=sqrt(5)), B [out, r] = 0

`apply_lora(model, r, alpha, target_modules)` adds `lora_A` / `lora_B` parameters to the matching
modules *in place* (their class is swapped for a LoRA subclass of itself), so parameter names,
`isinstance` checks and the on-disk exporters keep working, and freezes every base weight.
Covered:

- column/row-parallel linears (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, Inkling's
  `qkvr_proj`, ...) and the untied `lm_head`;
- routed MoE experts (`experts`): one adapter per expert for gate/up (stacked `w13`) and down
  (`w2`), applied by adding the batched delta `B_e @ A_e` to the expert weights in the forward.

Not covered yet: shared experts, routers, the embedding, a tied `lm_head` (its delta would also
change the embedding on the engine side), MTP / DSpark heads (not run by `forward`), the frozen
Inkling `rel_proj` and MiniMax indexer; tensor parallelism (tp_size 1 only).

PEFT layout (`lora_state_dict`, `save_adapter`): names `base_model.model.<hf module>.lora_A.weight`
/ `.lora_B.weight`. Kiln's stacked projections are split per projection: q/k/v (and gate/up)
share one input, so each gets its own copy of A and its row slice of B; `load_adapter` stacks them
back (and refuses adapters whose q/k/v A matrices differ, which the stacked layout cannot hold).
Experts are `...mlp.experts.{e}.{gate,up,down}_proj`, as in HF MoE models. `target_modules` may
name PEFT projections: `q_proj`, `k_proj` or `v_proj` adapts the whole stacked `qkv_proj` (and
`gate_proj` / `up_proj` the whole `gate_up_proj`), so all three (two) are exported.

`merged_delta(state, scaling)` turns a PEFT state dict into {on-disk weight name: scale * B @ A},
which the engine adds to its kept base weights (`EngineCore.load_lora_adapter`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.embedding import ParallelLMHead
from kiln.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                RowParallelLinear)
from kiln.layers.moe import Experts, swiglu
from kiln.ops import moe as ref_ops

DEFAULT_TARGETS = ("qkv_proj", "qkvr_proj", "o_proj", "gate_up_proj", "down_proj", "experts")
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

# PEFT (per-projection) module names -> the Kiln module that stacks them.
_PEFT_TO_KILN = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_SKIP_PREFIXES = ("mtp.", "dspark.")  # modules `forward` never runs


# ---- the LoRA modules ----------------------------------------------------------------------

def _init_pair(module: nn.Module, a_shape: tuple, b_shape: tuple, rank: int, alpha: float,
               suffix: str = "") -> None:
    """Register lora_A{suffix} (kaiming-uniform, as nn.Linear / PEFT) and lora_B{suffix} (zeros)."""
    w = next(module.parameters())
    a = torch.empty(*a_shape, device=w.device, dtype=w.dtype)
    if len(a_shape) == 3:  # one [r, in] matrix per expert
        for e in range(a_shape[0]):
            nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
    else:
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    setattr(module, f"lora_A{suffix}", nn.Parameter(a))
    setattr(module, f"lora_B{suffix}", nn.Parameter(torch.zeros(*b_shape, device=w.device, dtype=w.dtype)))
    module.lora_rank, module.lora_alpha = rank, alpha
    module.lora_scaling = alpha / rank


class LoRALinearMixin:
    """forward = base forward + scaling * (x A^T) B^T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.lora_scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)


class LoRALMHeadMixin:
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(h)
        delta = self.lora_scaling * F.linear(F.linear(h, self.lora_A), self.lora_B)
        return logits + delta[..., : logits.shape[-1]]


class LoRAExpertsMixin:
    """Per-expert adapters: w13_e += s * B13_e A13_e, w2_e += s * B2_e A2_e (batched over e)."""

    def forward(self, x, topk_ids, topk_weights, out_dtype=None):
        s = self.lora_scaling
        w13 = self.w13 + s * torch.bmm(self.lora_B13, self.lora_A13)
        w2 = self.w2 + s * torch.bmm(self.lora_B2, self.lora_A2)
        out = ref_ops.experts_torch(x, w13, w2, topk_ids, topk_weights, torch.float32, act=swiglu)
        if self.reduce_output:
            out = self.pc.all_reduce(out)
        return out.to(out_dtype or x.dtype)


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(cls: type, mixin: type) -> type:
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = type(f"LoRA{cls.__name__}", (mixin, cls), {})
    return _LORA_CLASSES[cls]


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _targets(model: nn.Module, target_modules: Sequence[str]) -> list[tuple[str, nn.Module]]:
    wanted = {_PEFT_TO_KILN.get(t, t) for t in target_modules}
    frozen = tuple(getattr(model, "frozen_in_training", ()))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = []
    for name, mod in model.named_modules():
        if _short(name) not in wanted or name.startswith(_SKIP_PREFIXES):
            continue
        if any(f in f".{name}." for f in frozen):
            continue
        if isinstance(mod, ParallelLMHead) and tied:
            continue  # documented: a tied head's delta would also move the embedding
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead, Experts)):
            out.append((name, mod))
    return out


def apply_lora(model: nn.Module, rank: int = 16, alpha: float = 32.0,
               target_modules: Sequence[str] = DEFAULT_TARGETS, seed: Optional[int] = None) -> list[str]:
    """Add LoRA adapters to the matching modules of `model` (in place), freeze everything else;
    returns the adapted module names. `target_modules` are Kiln or PEFT module names."""
    assert model.pc.tp_size == 1, "LoRA supports tp_size 1 only for now"
    for p in model.parameters():
        p.requires_grad_(False)
    gen_state = torch.random.get_rng_state()
    if seed is not None:
        torch.manual_seed(seed)
    names = []
    try:
        for name, mod in _targets(model, target_modules):
            if isinstance(mod, Experts):
                e, inter, hidden = mod.num_experts, mod.inter_per_rank, mod.w13.shape[-1]
                _init_pair(mod, (e, rank, hidden), (e, 2 * inter, rank), rank, alpha, "13")
                _init_pair(mod, (e, rank, inter), (e, hidden, rank), rank, alpha, "2")
                mod.__class__ = _lora_class(type(mod), LoRAExpertsMixin)
            else:
                out_f, in_f = mod.weight.shape
                _init_pair(mod, (rank, in_f), (out_f, rank), rank, alpha)
                mixin = LoRALMHeadMixin if isinstance(mod, ParallelLMHead) else LoRALinearMixin
                mod.__class__ = _lora_class(type(mod), mixin)
            names.append(name)
    finally:
        if seed is not None:
            torch.random.set_rng_state(gen_state)
    model.lora_targets = sorted({t for n in names for t in _peft_modules(model.get_submodule(n), n)})
    model.lora_rank, model.lora_alpha = rank, alpha
    return names


def is_lora_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (`lora_A`, `lora_B13`, ... on a module or the model)."""
    return ".lora_" in name or name.startswith("lora_")


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if is_lora_name(n)]


# ---- PEFT naming ---------------------------------------------------------------------------

def _peft_modules(mod: nn.Module, name: str) -> list[str]:
    if isinstance(mod, Experts):
        return ["gate_proj", "up_proj", "down_proj"]
    if isinstance(mod, QKVParallelLinear):
        return ["q_proj", "k_proj", "v_proj"]
    if isinstance(mod, MergedColumnParallelLinear) and _short(name) == "gate_up_proj":
        return ["gate_proj", "up_proj"]
    return [_short(name)]


def _pieces(mod: nn.Module, name: str) -> list[tuple[str, str, int, int, Optional[int]]]:
    """(PEFT module path, A/B param suffix, B row offset, B rows, expert or None) per projection."""
    parent = name.rsplit(".", 1)[0]
    if isinstance(mod, Experts):
        n, h = mod.inter_per_rank, mod.w13.shape[-1]
        out = []
        for e in range(mod.num_experts):
            out += [(f"{name}.{e}.gate_proj", "13", 0, n, e), (f"{name}.{e}.up_proj", "13", n, n, e),
                    (f"{name}.{e}.down_proj", "2", 0, h, e)]
        return out
    if isinstance(mod, QKVParallelLinear):
        q, kv = mod.q_size, mod.kv_size
        return [(f"{parent}.q_proj", "", 0, q, None), (f"{parent}.k_proj", "", q, kv, None),
                (f"{parent}.v_proj", "", q + kv, kv, None)]
    if isinstance(mod, MergedColumnParallelLinear) and _short(name) == "gate_up_proj":
        a, b = mod.out_sizes_per_rank
        return [(f"{parent}.gate_proj", "", 0, a, None), (f"{parent}.up_proj", "", a, b, None)]
    return [(name, "", 0, mod.lora_B.shape[0], None)]


def _lora_modules(model: nn.Module):
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_scaling"):
            yield name, mod


@torch.no_grad()
def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter in PEFT names (copies): `base_model.model.<module>.lora_{A,B}.weight`."""
    out = {}
    for name, mod in _lora_modules(model):
        for path, suf, off, rows, e in _pieces(mod, name):
            a, b = getattr(mod, f"lora_A{suf}"), getattr(mod, f"lora_B{suf}")
            if e is not None:
                a, b = a[e], b[e]
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().clone().contiguous()
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b[off:off + rows].detach().clone().contiguous()
    return out


def adapter_config(model: nn.Module) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": model.lora_rank,
            "lora_alpha": model.lora_alpha, "target_modules": list(model.lora_targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "inference_mode": False}


def save_adapter(model: nn.Module, out_dir: str) -> None:
    """Write `adapter_model.safetensors` + `adapter_config.json` (PEFT's adapter directory)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(lora_state_dict(model), os.path.join(out_dir, ADAPTER_WEIGHTS))
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config(model), f, indent=2)


def read_adapter(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT state dict, adapter config) of an adapter directory."""
    from safetensors.torch import load_file

    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    return load_file(os.path.join(path, ADAPTER_WEIGHTS)), config


@torch.no_grad()
def load_adapter(model: nn.Module, path_or_state) -> None:
    """Copy an adapter (directory, or PEFT state dict) into the LoRA parameters of `model`
    (made by `apply_lora` with the same rank and targets)."""
    state = read_adapter(path_or_state)[0] if isinstance(path_or_state, str) else path_or_state
    used = set()
    for name, mod in _lora_modules(model):
        a_done: dict[tuple[str, Optional[int]], torch.Tensor] = {}
        for path, suf, off, rows, e in _pieces(mod, name):
            ka, kb = f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight"
            a_src, b_src = state[ka], state[kb]
            a, b = getattr(mod, f"lora_A{suf}"), getattr(mod, f"lora_B{suf}")
            if e is not None:
                a, b = a[e], b[e]
            prev = a_done.get((suf, e))
            if prev is not None and not torch.equal(prev, a_src):
                raise ValueError(f"{ka}: projections stacked in Kiln ({name}) need one shared lora_A")
            a.copy_(a_src)
            a_done[(suf, e)] = a_src
            b[off:off + rows].copy_(b_src)
            used |= {ka, kb}
    unused = set(state) - used
    if unused:
        raise KeyError(f"adapter tensors with no LoRA module here: {sorted(unused)[:4]}")


def adapted_tensors(model: nn.Module) -> list[str]:
    """In-memory names of the tensors a LoRA model's adapter changes: each stacked tensor once
    (`...qkv_proj.weight`, `...experts.w13`), where PEFT names one per projection and expert."""
    out = []
    for name, mod in _lora_modules(model):
        out += [f"{name}.w13", f"{name}.w2"] if isinstance(mod, Experts) else [f"{name}.weight"]
    return out


@torch.no_grad()
def lora_delta(model: nn.Module, tensor: str) -> torch.Tensor:
    """scaling * B @ A in fp32 for one of `adapted_tensors(model)` (batched over experts): the
    stacked form of `merged_delta`, whose per-projection deltas are its row blocks."""
    module, kind = tensor.rsplit(".", 1)
    mod = model.get_submodule(module)
    suffix = {"w13": "13", "w2": "2"}.get(kind, "")
    a, b = getattr(mod, f"lora_A{suffix}").float(), getattr(mod, f"lora_B{suffix}").float()
    return mod.lora_scaling * (torch.bmm(b, a) if suffix else b @ a)


def merged_delta(state: dict[str, torch.Tensor], scaling: float,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{on-disk weight name: scaling * B @ A} for a PEFT state dict (fp32 by default)."""
    out = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[len(PEFT_PREFIX):-len(".lora_A.weight")] if key.startswith(PEFT_PREFIX) \
            else key[:-len(".lora_A.weight")]
        b = state[key.replace(".lora_A.weight", ".lora_B.weight")]
        out[f"{path}.weight"] = scaling * (b.to(dtype) @ a.to(dtype))
    return out


def scaling_of(config: dict) -> float:
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
