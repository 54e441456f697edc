"""`kiln train-draft --method dflash`: a DFlash block drafter (MODELS.md 4) trained against any
frozen Kiln target on its own continuations, written as a directory that
`--speculative-algorithm dflash --speculative-draft-model-path DIR` serves. `--method dspark`
trains the same drafter against a MiniMax-M3 target and writes it the way MODELS.md 3.3 ships it:
a copy of the target's checkpoint with `dspark_config` and `dspark.*` weights (any drafter the
target had replaced), served with `--speculative-algorithm dspark`.

The data step is the MTP method's (`data.load_or_generate`, cached in DIR/data); the training
loop is `dflash.train_dflash` (random anchors, the block mask, loss weighted by
exp(-(k-1)/gamma) over block positions); this file only builds the target and the drafter's
config from the flags, reports progress, and writes DIR (config.json + model.safetensors,
metrics.jsonl, loss.png).
"""

from __future__ import annotations

import json
import logging
import os
import random

import torch

from kiln.models.block_drafter_config import BlockDrafterConfig
from kiln.spec_train.data import load_or_generate, target_path

logger = logging.getLogger("kiln.spec_train")


def load_target(source, device: str, max_positions: int):
    """The target model with its weights, frozen, in eval mode (any architecture Kiln serves)."""
    from kiln.models.registry import get_model_class, parse_model_config
    from kiln.spec_train.target import load_frozen

    config = parse_model_config(source.config)
    with torch.device(device):
        model = get_model_class(source.config["model_type"])(config, max_positions=max_positions)
    return load_frozen(model, source).eval(), config


def drafter_config(cfg, target_config) -> BlockDrafterConfig:
    """The drafter's shape from the flags; taps default to three target layers spread over the
    depth (first, middle, last: the residual entering each)."""
    layers = target_config.num_hidden_layers
    ids = cfg.dflash_layer_ids or sorted({1 if layers > 1 else 0, layers // 2, layers - 1})
    mask = cfg.dflash_mask_token_id if cfg.dflash_mask_token_id is not None else target_config.vocab_size - 1
    return BlockDrafterConfig.from_dict({"target_layer_ids": ids, "num_layers": cfg.dflash_num_layers,
                                         "block_size": cfg.dflash_block_size, "mask_token_id": mask,
                                         "conv_kernel_size": cfg.dflash_conv_kernel_size,
                                         "conv_group_size": cfg.dflash_conv_group_size,
                                         "selector_rank": cfg.dflash_selector_rank,
                                         "selector_top_k": cfg.dflash_selector_top_k},
                                        target_config, where=f"kiln train-draft --method {cfg.method}")


def check_target(cfg, source) -> None:
    """`--method dspark` needs a MiniMax-M3 target (MODELS.md 3.3): checked before any data is made."""
    model_type = source.config.get("model_type")
    if cfg.method == "dspark" and model_type != "minimax_m3":
        raise ValueError(f"--method dspark trains a MiniMax-M3 checkpoint's built-in drafter; the target is "
                         f"{model_type!r}: train a standalone block drafter with --method dflash")


def save_dspark(drafter, source, out: str) -> None:
    """`out` = the MiniMax-M3 target `source` with `drafter` as its DSpark drafter: the target's
    tensors but any old `dspark.*`, the drafter's under `dspark.`, and config.json with the
    drafter's config as `dspark_config` (as `save_dflash` writes it; the vocabulary is the
    target's own)."""
    from kiln.spec_train.mtp import write_checkpoint

    tensors = {f"dspark.{name}": t.detach() for name, t in drafter.checkpoint_state_dict().items()}
    fields = {k: v for k, v in drafter.config.to_dict().items() if k != "vocab_size"}
    config = {**source.config, "dspark_config": fields}
    write_checkpoint(source, tensors, config, out, prefix="dspark.")


def train_dflash_run(cfg) -> dict:
    """Generate (or reuse) the data, train (holding back `val_fraction` of the sequences for
    validation), write the drafter directory (`--method dspark`: the target's checkpoint with the
    drafter, `save_dspark`), metrics.jsonl and loss.png into cfg.out. Returns the
    last validation CE and accuracy per block position (without validation: the training loss and
    accuracy of the last steps)."""
    from tqdm import tqdm

    from kiln.loader import resolve_model
    from kiln.models.dflash import save_dflash
    from kiln.spec_train.dflash import train_dflash
    from kiln.spec_train.plots import plot_losses

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    source = resolve_model(target_path(cfg.target))
    check_target(cfg, source)
    os.makedirs(cfg.out, exist_ok=True)
    samples = [s for s in load_or_generate(cfg, os.path.join(cfg.out, "data")) if s.output_ids]
    data = [(s.ids[:cfg.max_seq_len], len(s.prompt_ids)) for s in samples]
    random.Random(cfg.seed).shuffle(data)
    n_val = int(round(cfg.val_fraction * len(data))) if len(data) > 1 else 0
    val, data = data[:n_val], data[n_val:]
    target, target_config = load_target(source, cfg.device, cfg.max_seq_len + 1)
    dcfg = drafter_config(cfg, target_config)
    batch_seqs = max(1, cfg.batch_tokens // cfg.max_seq_len)
    history: list[dict] = []
    bars: list = []  # made at the first step, after the target-taps bar of train_dflash
    with open(os.path.join(cfg.out, "metrics.jsonl"), "w") as mf:
        def on_step(row: dict) -> None:
            # plot_losses reads per-position CE as `loss_k` / `val_loss_k` (the MTP trainer's names)
            history.append({**row, **({"loss_k": row["ce_k"]} if "ce_k" in row else {}),
                            **({"val_loss_k": row["val_ce_k"]} if "val_ce_k" in row else {})})
            mf.write(json.dumps(row) + "\n")
            mf.flush()
            if "ce_k" not in row:  # the step-0 validation row
                return
            if not bars:
                bars.append(tqdm(total=cfg.num_steps, desc="train dflash", unit="step", disable=not cfg.progress))
            bar = bars[0]
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc_k'][0]:.2f}")
            if "val_ce_k" in row:  # a curve to look at while it runs
                plot_losses(history, os.path.join(cfg.out, "loss.png"))

        drafter, _ = train_dflash(target, dcfg, data, cfg.num_steps, lr=cfg.lr, gamma=cfg.dflash_gamma,
                                  batch_seqs=batch_seqs, anchors_per_seq=cfg.dflash_anchors_per_seq,
                                  grad_clip=cfg.grad_clip, weight_decay=cfg.weight_decay,
                                  warmup_steps=cfg.warmup_steps, seed=cfg.seed, max_positions=cfg.max_seq_len + 1,
                                  autocast_bf16=cfg.autocast_bf16, val_data=val, eval_every=cfg.eval_every,
                                  selector_weight=cfg.dflash_selector_weight,
                                  progress=cfg.progress, on_step=on_step)
    for bar in bars:
        bar.close()
    plot_losses(history, os.path.join(cfg.out, "loss.png"))
    if cfg.method == "dspark":
        save_dspark(drafter, source, cfg.out)
    else:
        save_dflash(drafter, cfg.out, extra={"trained_by": "kiln train-draft", "target": cfg.target})
    last = next((h for h in reversed(history) if "val_ce_k" in h), None)
    if last is not None:
        return {k: [round(x, 3) for x in last[k]] for k in ("val_ce_k", "val_acc_k")}
    tail = [h for h in history if "ce_k" in h][-10:]
    if not tail:
        return {}
    return {"loss": sum(r["loss"] for r in tail) / len(tail),
            "acc_k": [sum(r["acc_k"][k] for r in tail) / len(tail) for k in range(len(tail[0]["acc_k"]))]}
