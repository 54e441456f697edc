"""DFlash: a standalone block drafter for any Kiln target (MODELS.md 4), in its own directory.

    DIR/config.json          {"model_type": "dflash", "target_layer_ids": [...], "num_layers": n,
                              "block_size": 16, "mask_token_id": m, "hidden_size": H, ...}
    DIR/model.safetensors    fc.weight, hidden_norm.weight, layers.{i}.*, norm.weight

z-lab's layout reads too: `architectures` naming DFlashDraftModel or DFlash2DraftModel, and the
drafter's fields under `dflash_config` (DFlash2's conv and candidate selector included,
kiln/models/dflash2.py).

Sizes the config leaves out default to the target's; `hidden_size` must be the target's. The
module is `kiln.models.block_drafter.BlockDrafter`; this file reads and writes the directory.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch

from kiln.models.block_drafter import BlockDrafter
from kiln.models.block_drafter_config import BlockDrafterConfig

logger = logging.getLogger(__name__)

MODEL_TYPE = "dflash"
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")  # z-lab's class names


def read_dflash_config(path: Optional[str], target_config: Any) -> BlockDrafterConfig:
    """The drafter config in `path`, checked against the target's; clear errors for a missing
    directory or config, another model_type, a hidden size other than the target's, bad layer ids
    and a missing mask token."""
    if not path:
        raise ValueError("--speculative-algorithm dflash needs --speculative-draft-model-path DIR "
                         "(a directory with the drafter's config.json and weights)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--speculative-draft-model-path {path}: no such directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"--speculative-draft-model-path {path} has no config.json (a DFlash "
                                f"drafter directory holds config.json with model_type {MODEL_TYPE!r} and "
                                f"*.safetensors weights)")
    with open(cfg_path) as f:
        d = json.load(f)
    # z-lab's checkpoints say what they are in `architectures` (their model_type is the body's, "qwen3")
    if d.get("model_type") != MODEL_TYPE and not set(d.get("architectures") or ()) & set(ARCHITECTURES):
        raise ValueError(f"{cfg_path}: model_type {d.get('model_type')!r} is not a DFlash drafter "
                         f"(expected model_type {MODEL_TYPE!r}, or architectures naming one of {ARCHITECTURES})")
    cfg = BlockDrafterConfig.from_dict(d, target_config, where=cfg_path)
    ignored = [k for k in ("is_causal", "use_sliding_window") if d.get(k)]
    if ignored:  # verification keeps the output exact; only acceptance can suffer
        logger.warning("%s: %s not supported by Kiln's block drafter (every block row sees the whole context "
                       "and the whole block); drafts may be accepted less often than with z-lab's code",
                       cfg_path, " and ".join(ignored))
    if cfg.mask_token_id is None:
        raise ValueError(f"{cfg_path}: needs mask_token_id (the token filling the block after the anchor)")
    return cfg


def load_dflash(path: Optional[str], target_config: Any, max_positions: int, device, dtype: torch.dtype,
                dummy_seed: Optional[int] = None) -> BlockDrafter:
    """The drafter in `path` on `device` in `dtype`. Without weight files it takes dummy weights
    when `dummy_seed` is given (the target itself runs with --load-format dummy), else errors."""
    from kiln.loader.source import _safetensors_files
    from kiln.loader.weights import init_dummy_weights

    cfg = read_dflash_config(path, target_config)
    with torch.device(device):
        model = BlockDrafter(cfg, max_positions)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    files = _safetensors_files(path)
    if files:
        from safetensors import safe_open

        def tensors():
            for f in files:
                with safe_open(f, framework="pt", device="cpu") as st:
                    for name in st.keys():
                        yield name, st.get_tensor(name)

        model.load_weights(tensors())
    elif dummy_seed is not None:
        init_dummy_weights(model, dummy_seed)
    else:
        raise FileNotFoundError(f"--speculative-draft-model-path {path} has no *.safetensors weights")
    return model.eval()


def save_dflash(drafter: BlockDrafter, out_dir: str, extra: Optional[dict] = None) -> None:
    """Write `drafter` as a DFlash directory (config.json + model.safetensors) that
    `load_dflash` reads back exactly; `extra` adds fields to config.json (e.g. training notes)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    dflash2 = drafter.config.conv_kernel_size or drafter.config.selector_rank
    config = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURES[1 if dflash2 else 0]],
              **drafter.config.to_dict(), **(extra or {})}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    sd = {k: v.cpu() for k, v in drafter.checkpoint_state_dict().items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"))
