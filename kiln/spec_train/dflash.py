"""DFlash training (MODELS.md 4; notes/algorithms.md 3): a block drafter against a frozen target,
on target-generated sequences (self-distillation).

The frozen target's taps are computed once for every sequence (`context_taps`); per step the
drafter turns a batch's taps into context features c_j (with gradients through fc and hidden_norm)
and the K/V of every layer. Random anchors a are drawn inside each sequence's continuation; block a is
[t_a, MASK x (B-1)] at positions a .. a+B-1 and sees the context j < a plus its own rows
(bidirectional), nothing else: exactly what serving sees, because the block forward *is* the
serving path (`BlockDrafter.context_kv` + `forward_blocks`, a padded context per block with the
mask j < a). Block row k predicts t_{a+k}; the loss is sum_k exp(-(k-1)/gamma) * CE_k over
k = 1..B-1, CE_k the mean over the anchors whose label a+k lies inside the sequence.

`train_dflash` is the library entry point (the `kiln train-draft --method dflash` command wraps it:
data generation, checkpoint and plots live there); `save_dflash` (kiln.models.dflash) writes what
`--speculative-algorithm dflash` serves.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from kiln.models.block_drafter import BlockDrafter
from kiln.models.block_drafter_config import BlockDrafterConfig
from kiln.models.reference import packed_batch

# A training sequence: token ids (all of them continuation), or (ids, prompt length): anchors are
# then drawn so that every label is a token the target generated.
Sequence_ = Union[Sequence[int], tuple[Sequence[int], int]]


def _split(item: Sequence_) -> tuple[list[int], int]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], int):
        return list(item[0]), int(item[1])
    return list(item), 0


def sample_anchors(lens: list[int], prompt_lens: list[int], per_seq: int, rng: random.Random) -> list[tuple[int, int]]:
    """Up to `per_seq` distinct anchors (sequence index, position) per sequence, drawn uniformly
    from positions a with a label a + 1 in the continuation: max(p - 1, 0) <= a <= n - 2."""
    out = []
    for s, (n, p) in enumerate(zip(lens, prompt_lens)):
        valid = list(range(max(p - 1, 0), n - 1))
        out += [(s, a) for a in sorted(rng.sample(valid, min(per_seq, len(valid))))]
    return out


def target_taps(target, ids: torch.Tensor, lens: list[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """The frozen target's taps [N, len(layer_ids) * H] of packed sequences (no gradient)."""
    with torch.no_grad():
        batch = packed_batch(ids, lens)
        batch.capture_layers = tuple(layer_ids)
        target(batch)
        return batch.taps()


def block_logits(target, drafter: BlockDrafter, ids: torch.Tensor, lens: list[int], taps: torch.Tensor,
                 anchors: list[tuple[int, int]], with_hidden: bool = False):
    """Draft logits [R, B - 1, V] of block rows 1..B-1 for each anchor (sequence index, position)
    of the packed sequences `ids` / `lens`, with gradients into the drafter only; with
    `with_hidden`, (logits, those rows' hidden states [R, B - 1, H]) (DFlash2's selector reads them)."""
    dev, B = ids.device, drafter.config.block_size
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    ctx = drafter.context_features(taps)
    kv_all = drafter.context_kv(ctx, positions)
    R = len(anchors)
    C = max(max(a for _, a in anchors), 1)
    first = torch.tensor([starts[s] for s, _ in anchors], device=dev)
    anchor_pos = torch.tensor([a for _, a in anchors], device=dev)
    cols = torch.arange(C, device=dev)[None, :]
    mask = cols < anchor_pos[:, None]  # block a sees context j < a
    index = torch.where(mask, first[:, None] + cols, 0)
    ctx_kv = [(k[index], v[index]) for k, v in kv_all]
    mask_id = drafter.config.mask_token_id
    block_ids = torch.tensor([[int(ids[starts[s] + a])] + [mask_id] * (B - 1) for s, a in anchors], device=dev)
    with torch.no_grad():
        emb = target.model.embed_tokens(block_ids.view(-1)).view(R, B, -1)
    h = drafter.forward_blocks(emb, anchor_pos, ctx_kv, mask)
    logits = drafter.process_logits(target.lm_head.compute_logits(h[:, 1:]).float())
    return (logits, h[:, 1:]) if with_hidden else logits


def block_labels(ids: torch.Tensor, lens: list[int], anchors: list[tuple[int, int]], K: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, valid, predecessors) [R, K] of block rows 1..K: the tokens at a + k, whether a + k
    lies inside the sequence, and the true token before each (the anchor's, then the labels)."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    dev = ids.device
    label_pos = torch.tensor([[a + k for k in range(1, K + 1)] for _, a in anchors], device=dev)
    seq_len = torch.tensor([lens[s] for s, _ in anchors], device=dev)[:, None]
    first = torch.tensor([starts[s] for s, _ in anchors], device=dev)[:, None]
    labels = ids[first + label_pos.clamp(max=seq_len - 1)]
    prev = torch.cat([ids[first + label_pos[:, :1] - 1], labels[:, :-1]], dim=1)
    return labels, label_pos < seq_len, prev


def dflash_loss(logits: torch.Tensor, ids: torch.Tensor, lens: list[int], anchors: list[tuple[int, int]],
                gamma: float) -> tuple[torch.Tensor, list[float], list[float]]:
    """(loss = sum_k exp(-(k-1)/gamma) * CE_k, CE_k per position, top-1 accuracy per position);
    position k counts the anchors whose label a + k lies inside their sequence."""
    R, K, _ = logits.shape
    dev = logits.device
    labels, valid, _ = block_labels(ids, lens, anchors, K)
    ce = F.cross_entropy(logits.reshape(R * K, -1), labels.reshape(-1), reduction="none").view(R, K)
    hit = (logits.argmax(-1) == labels).float()
    counts = valid.sum(0).clamp(min=1)
    ce_k = (ce * valid).sum(0) / counts
    acc_k = (hit * valid).sum(0) / counts
    w = torch.exp(-torch.arange(K, device=dev, dtype=torch.float32) / gamma)
    return (w * ce_k).sum(), ce_k.tolist(), acc_k.tolist()


def fresh_drafter(drafter_cfg: BlockDrafterConfig, max_positions: int, seed: int, device) -> BlockDrafter:
    """A new drafter with Kiln's dummy initialisation from `seed` (norm gains 1, matrices
    N(0, 0.02)); `train_dflash` then calibrates its output scale (`calibrate_output_gain`).
    DFlash2's parts start neutral: each conv passes its input through (tap 0 = 1, no dynamic
    taps) and the selector adds nothing (zero hidden projection), so training starts from a
    plain DFlash drafter and learns how far to use them."""
    from kiln.loader.weights import init_dummy_weights

    with torch.device(device):
        drafter = BlockDrafter(drafter_cfg, max_positions)
    init_dummy_weights(drafter, seed)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.base_kernel.zero_()[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
        if drafter.candidate_selector is not None:
            drafter.candidate_selector.hidden_projection.weight.zero_()
    return drafter


@torch.no_grad()
def calibrate_output_gain(target, drafter: BlockDrafter, ids: torch.Tensor, lens: list[int], taps: torch.Tensor,
                          anchors: list[tuple[int, int]], max_std: float = 1.0) -> float:
    """Scale the drafter's final norm gain so that its logits on this batch have a standard
    deviation over the vocabulary (mean over rows) of at most `max_std`; returns the factor (1 when
    they already do).

    Why: the output goes through the target's LM head. An untrained drafter's output is a vector
    of norm ~sqrt(H) in no useful direction, and a trained model's embedding rows are large and
    share a common direction (SmolLM2-135M: row norms ~3, mean cosine with the mean row 0.66), so
    with gain 1 its logits reach +-70 (std 7.5) and it starts at ~67 nats per block position, where
    a uniform guess costs ln V = 10.8: the first steps only undo the scale, under gradient norms in
    the thousands. Calibrated, it starts at ~15 nats. A target whose LM head is small already
    gives unit-scale logits and keeps gain 1 (LSUV-style: measure, then rescale)."""
    drafter.eval()
    std = float(block_logits(target, drafter, ids, lens, taps.to(drafter.fc.weight.dtype), anchors).std(-1).mean())
    factor = min(1.0, max_std / std) if std > 0 else 1.0
    drafter.norm.weight.mul_(factor)
    return factor


def context_taps(target, seqs: list[list[int]], layer_ids: Sequence[int], chunk_tokens: int = 4096,
                 progress: bool = False) -> list[torch.Tensor]:
    """The frozen target's taps of every sequence ([n_i, len(layer_ids) * H] each), computed once
    in packed chunks of about `chunk_tokens`: a training step then runs only the drafter (on
    SmolLM2, the target's forward over 8 sequences took 3.4 s, the drafter's bf16 step 1.4 s)."""
    from tqdm import tqdm

    dev = next(target.parameters()).device
    out: list[torch.Tensor] = []
    bar = tqdm(total=sum(len(s) for s in seqs), desc="target taps", unit="tok", disable=not progress)
    i = 0
    while i < len(seqs):
        j, n = i, 0
        while j < len(seqs) and (j == i or n + len(seqs[j]) <= chunk_tokens):
            n += len(seqs[j])
            j += 1
        lens = [len(s) for s in seqs[i:j]]
        ids = torch.tensor([t for s in seqs[i:j] for t in s], device=dev)
        out += list(target_taps(target, ids, lens, layer_ids).split(lens))
        bar.update(n)
        i = j
    bar.close()
    return out


def _batch(seqs, taps, pick, dev):
    lens = [len(seqs[i][0]) for i in pick]
    ids = torch.tensor([t for i in pick for t in seqs[i][0]], device=dev)
    return ids, lens, [seqs[i][1] for i in pick], torch.cat([taps[i] for i in pick])


@torch.no_grad()
def evaluate_dflash(target, drafter: BlockDrafter, seqs: list[tuple[list[int], int]], taps: list[torch.Tensor],
                    anchors_per_seq: int, batch_seqs: int, autocast_bf16: bool = False) -> dict:
    """Validation CE and top-1 accuracy per block position (teacher forced: the accuracy at position
    k is the acceptance rate of draft k when drafts 1..k-1 were right), over the same anchors at
    every call (drawn with a fixed seed, up to `anchors_per_seq` per sequence)."""
    drafter.eval()
    dev, K = next(target.parameters()).device, drafter.config.block_size - 1
    rng = random.Random(1234)
    ce_sum, hit_sum, count = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    for b in range(0, len(seqs), batch_seqs):
        ids, lens, plens, tap = _batch(seqs, taps, range(b, min(b + batch_seqs, len(seqs))), dev)
        anchors = sample_anchors(lens, plens, anchors_per_seq, rng)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = block_logits(target, drafter, ids, lens, tap.to(drafter.fc.weight.dtype), anchors)
        _, ce_k, acc_k = dflash_loss(logits.float(), ids, lens, anchors, 1.0)
        n = torch.tensor([sum(a + k < lens[s] for s, a in anchors) for k in range(1, K + 1)], dtype=torch.float32)
        ce_sum += torch.tensor(ce_k) * n
        hit_sum += torch.tensor(acc_k) * n
        count += n
    count = count.clamp(min=1)
    return {"val_ce_k": (ce_sum / count).tolist(), "val_acc_k": (hit_sum / count).tolist()}


def train_dflash(target, drafter_cfg: BlockDrafterConfig, data: Sequence[Sequence_], steps: int, *,
                 lr: float = 1e-3, gamma: float = 7.0, batch_seqs: int = 8, anchors_per_seq: int = 32,
                 grad_clip: float = 1.0, weight_decay: float = 0.0, warmup_steps: int = 0, seed: int = 0,
                 drafter: Optional[BlockDrafter] = None, max_positions: Optional[int] = None,
                 autocast_bf16: bool = False, val_data: Sequence[Sequence_] = (), eval_every: int = 0,
                 selector_weight: float = 1.0, progress: bool = False,
                 on_step: Optional[Callable[[dict], None]] = None
                 ) -> tuple[BlockDrafter, list[dict]]:
    """Train a DFlash drafter against the frozen `target` (any Kiln model, on its device).

    data: target-generated sequences, each token ids or (ids, prompt length); steps: optimizer
    steps, each over `batch_seqs` sequences (reshuffled every epoch) with up to `anchors_per_seq`
    random anchors each. gamma: the loss decay over block positions (DFlash uses 7 for B = 16).
    drafter: continue training this one (else `fresh_drafter(drafter_cfg, ..., seed)` with its
    output scale calibrated on a first batch: `calibrate_output_gain`). The target's taps are
    computed once for every sequence. AdamW with linear warmup and cosine decay; `autocast_bf16`
    runs the drafter's forward/backward under bf16 autocast (fp32 weights and optimizer).
    val_data: held-out sequences, evaluated (`evaluate_dflash`) before the first step, every
    `eval_every` steps and after the last. `on_step(row)` sees every history row: the step-0
    validation row, then {"step", "loss", "ce_k", "acc_k", "grad_norm", "lr", "anchors",
    "elapsed_s"} (+ "val_ce_k", "val_acc_k" at evaluations; + "selector_loss" for a DFlash2
    drafter with a candidate selector, whose cross-entropy enters the loss x `selector_weight`).
    Returns (the drafter in eval mode, the history)."""
    if drafter_cfg.mask_token_id is None:
        raise ValueError("train_dflash: drafter_cfg needs mask_token_id")

    def usable(items) -> list[tuple[list[int], int]]:
        return [(ids, p) for ids, p in map(_split, items) if len(ids) - max(p - 1, 0) >= 2]

    seqs, val = usable(data), usable(val_data)
    if not seqs:
        raise ValueError("train_dflash: no sequence has a continuation of at least two tokens")
    dev = next(target.parameters()).device
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    layer_ids = drafter_cfg.target_layer_ids
    taps = context_taps(target, [ids for ids, _ in seqs], layer_ids, progress=progress)
    val_taps = context_taps(target, [ids for ids, _ in val], layer_ids, progress=progress) if val else []
    if drafter is None:
        longest = max(len(ids) for ids, _ in seqs + val)
        drafter = fresh_drafter(drafter_cfg, max_positions or longest + 1, seed, dev)
        first = range(min(batch_seqs, len(seqs)))  # a batch of its own rng: the training stream is unchanged
        ids, lens, plens, tap = _batch(seqs, taps, first, dev)
        calibrate_output_gain(target, drafter, ids, lens, tap, sample_anchors(lens, plens, anchors_per_seq,
                                                                              random.Random(seed + 1)))
    params = list(drafter.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    def evaluate() -> dict:
        out = evaluate_dflash(target, drafter, val, val_taps, anchors_per_seq, batch_seqs, autocast_bf16)
        drafter.train()
        return out

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    rng = random.Random(seed)
    order: list[int] = []
    history: list[dict] = []
    if val:  # where the curve starts
        history.append({"step": 0, **evaluate()})
        if on_step is not None:
            on_step(history[-1])
    drafter.train()
    t0 = time.time()
    for step in range(1, steps + 1):
        if len(order) < batch_seqs:  # a new epoch
            more = list(range(len(seqs)))
            rng.shuffle(more)
            order += more
        pick, order = order[:batch_seqs], order[batch_seqs:]
        ids, lens, plens, tap = _batch(seqs, taps, pick, dev)
        anchors = sample_anchors(lens, plens, anchors_per_seq, rng)
        selector = drafter.candidate_selector
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            logits, hid = block_logits(target, drafter, ids, lens, tap.to(drafter.fc.weight.dtype), anchors,
                                       with_hidden=True)
        loss, ce_k, acc_k = dflash_loss(logits.float(), ids, lens, anchors, gamma)
        sel_loss = None
        if selector is not None:  # DFlash2: re-rank the candidates given the true predecessor
            labels, valid, prev = block_labels(ids, lens, anchors, logits.shape[1])
            sel_loss = selector.loss(hid, logits.float(), prev, labels, valid)
            loss = loss + selector_weight * sel_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf))
        opt.step()
        sched.step()
        row = {"step": step, "loss": loss.item(), "ce_k": ce_k, "acc_k": acc_k, "grad_norm": gnorm,
               "lr": sched.get_last_lr()[0], "anchors": len(anchors), "elapsed_s": round(time.time() - t0, 2)}
        if sel_loss is not None:
            row["selector_loss"] = sel_loss.item()
        if val and (step == steps or (eval_every and step % eval_every == 0)):
            row.update(evaluate())
        history.append(row)
        if on_step is not None:
            on_step(row)
    for p in params:
        p.requires_grad_(False)  # engine convention: the trainer enables what it trains
    return drafter.eval(), history
