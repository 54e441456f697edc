"""RL checkpoints: `ckpt-N/` directories (trainer weights in engine checkpoint names or a PEFT
adapter, optimizer state per rank, prompt iterator, RNG states, step) written atomically and read
back so that a resumed run reproduces the next steps exactly; and `export_hf`, a Hugging Face
directory Kiln can serve."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Optional

import torch

from kiln.rl.config import RLConfig


def _ckpt_dirs(out_dir: str) -> list[tuple[int, str]]:
    found = []
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            mt = re.fullmatch(r"ckpt-(\d+)", name)
            if mt and os.path.exists(os.path.join(out_dir, name, "state.json")):
                found.append((int(mt.group(1)), os.path.join(out_dir, name)))
    return sorted(found)


def _optimizer_file(dp: Any) -> str:
    # Under FSDP each rank's optimizer state holds only its shards.
    return "optimizer.pt" if dp is None else f"optimizer-rank{dp.rank}.pt"


def save_checkpoint(path: str, step: int, trainer: Any, iterator: Any, cfg: RLConfig, dp: Any = None) -> None:
    """Write ckpt-N/ atomically (a temp dir renamed into place). Under FSDP every rank calls it:
    rank 0 writes the gathered weights, each rank its optimizer shard."""
    main = dp is None or dp.is_main
    tmp = path + ".tmp"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dp is not None:
        dp.barrier()
    with trainer.gathered():
        if main and cfg.lora_rank > 0:
            from kiln.rl.lora import save_adapter

            save_adapter(trainer.model, os.path.join(tmp, "adapter"))
        elif main:
            from safetensors.torch import save_file

            state = {name: t.detach().to("cpu").contiguous() for name, t in trainer.named_weights_for_sync()}
            save_file(state, os.path.join(tmp, "model.safetensors"))
    torch.save(trainer.optimizer.state_dict(), os.path.join(tmp, _optimizer_file(dp)))
    if main:
        torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, os.path.join(tmp, "rng.pt"))
        with open(os.path.join(tmp, "state.json"), "w") as fh:
            json.dump({"step": step, "iterator": iterator.state_dict(), "config": cfg.to_dict(),
                       "world_size": 1 if dp is None else dp.world_size}, fh, indent=1)
    if dp is not None:
        dp.barrier()
    if main:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    if dp is not None:
        dp.barrier()


def load_checkpoint_weights(path: str, trainer: Any, cfg: RLConfig) -> None:
    """The weights (or adapter) of a ckpt-N/ into an unsharded trainer (before `trainer.shard`)."""
    if cfg.lora_rank > 0:
        from kiln.rl.lora import load_adapter

        load_adapter(trainer.model, os.path.join(path, "adapter"))
    else:
        from safetensors.torch import load_file

        _load_full_weights(trainer, load_file(os.path.join(path, "model.safetensors")))


def load_checkpoint_state(path: str, trainer: Any, iterator: Any, dp: Any = None) -> int:
    """The optimizer (this rank's shard under FSDP), RNG and prompt-iterator state of a ckpt-N/;
    returns the number of steps already done."""
    with open(os.path.join(path, "state.json")) as fh:
        state = json.load(fh)
    world = 1 if dp is None else dp.world_size
    if state.get("world_size", 1) != world:
        raise ValueError(f"{path} was written by {state.get('world_size', 1)} trainer rank(s), this run has "
                         f"{world}: resume with the same number of ranks (the optimizer state is sharded)")
    opt = torch.load(os.path.join(path, _optimizer_file(dp)), weights_only=False)
    trainer.optimizer.load_state_dict(opt)
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    iterator.load_state_dict(state["iterator"])
    return int(state["step"])


def load_checkpoint(path: str, trainer: Any, iterator: Any, cfg: RLConfig) -> int:
    """Restore a ckpt-N/ into an unsharded trainer and the iterator; returns the steps already done."""
    load_checkpoint_weights(path, trainer, cfg)
    return load_checkpoint_state(path, trainer, iterator)


def _load_full_weights(trainer: Any, state: dict) -> None:
    """Copy engine-named (checkpoint-named) tensors back into the trainer's parameters."""
    with torch.no_grad():
        trainer.model.load_weights(iter(state.items()))


def export_hf(trainer: Any, out_dir: str, model_path: Optional[str] = None) -> str:
    """Write a servable HF directory: config.json, model.safetensors, tokenizer files.

    LoRA adapters are merged first when the trainer's `named_weights_for_sync` yields merged
    weights (it does for the engine's full sync). `kiln serve --model-path out_dir` serves it.
    """
    from safetensors.torch import save_file

    from kiln.loader.source import TOKENIZER_FILES, resolve_model

    src = resolve_model(model_path) if model_path is not None else trainer.source
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, name))
    shutil.copy(os.path.join(src.model_dir, "config.json"), os.path.join(out_dir, "config.json"))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        p = os.path.join(src.model_dir, name)
        if os.path.exists(p):
            shutil.copy(p, os.path.join(out_dir, name))
    state = {name: t.detach().to("cpu").float().clone() for name, t in trainer.named_weights_for_sync()}
    if getattr(trainer, "uses_lora", False):  # merge the adapter: scale * B @ A onto the base
        from kiln.rl.lora import adapter_config, lora_state_dict, merged_delta, scaling_of

        delta = merged_delta(lora_state_dict(trainer.model), scaling_of(adapter_config(trainer.model)))
        for name, d in delta.items():
            state[name] = state[name] + d.to(state[name].dtype)
    dtype = next(iter(trainer.model.parameters())).dtype
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
