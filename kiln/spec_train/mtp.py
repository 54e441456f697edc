"""`kiln train-draft --method mtp`: train MTP layers (MODELS.md 2.4) against a frozen Llama-family
target on its own continuations, and write a checkpoint `--speculative-algorithm mtp` serves.

Training is teacher-forced with the masks serving uses: the chain is `kiln.models.mtp.
mtp_hidden_chain`, the function the engine's drafter is tested against, so query i of layer k sees
key j iff j == i or j <= i + 1 - k, within the MTP window, and rows keep their index i as RoPE
position. Layer k at row i predicts t_{i+k+1}; only labels inside the target's continuation count
(the prompt is context, not the target's own distribution). Loss = mean over layers of the mean CE
per layer, against the continuation's tokens or (`--mtp-labels target`) against the target's whole
distribution at each label. The target is frozen (only `mtp.*` trains) and runs once: its final
hidden states h^0 are computed up front and cached beside the data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

from kiln.models.mtp import mtp_hidden_chain
from kiln.models.reference import packed_batch
from kiln.spec_train.data import Sample, load_or_generate, target_path
from kiln.spec_train.plots import plot_losses

logger = logging.getLogger("kiln.spec_train")

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")


# ---- the model ---------------------------------------------------------------------------------
def build_model(cfg, source, device: str = "cpu"):
    """The target (weights loaded, frozen) with `cfg.num_mtp_layers` fresh MTP layers (`init_mtp`)."""
    from kiln.models.registry import get_model_class, parse_model_config
    from kiln.spec_train.target import load_frozen

    mtype = source.config.get("model_type")
    if mtype not in LLAMA_FAMILY:
        raise ValueError(f"--method mtp trains MTP layers for Llama-family targets ({', '.join(LLAMA_FAMILY)}); "
                         f"the target is {mtype!r}")
    config = mtp_config(source.config, cfg)
    with torch.device(device):
        model = get_model_class(mtype)(parse_model_config(config), max_positions=cfg.max_seq_len + 1)
    load_frozen(model, source)
    init_mtp(model, cfg.mtp_init, cfg.seed)
    for p in model.mtp.parameters():
        p.requires_grad_(True)
    return model


def mtp_config(target_config: dict, cfg) -> dict:
    """The target's config.json with the MTP fields of this run."""
    out = {k: v for k, v in target_config.items() if not k.startswith("mtp_")}
    out.update(num_mtp_layers=cfg.num_mtp_layers, mtp_sliding_window=cfg.mtp_sliding_window)
    if cfg.mtp_intermediate_size:
        out["mtp_intermediate_size"] = cfg.mtp_intermediate_size
    return out


@torch.no_grad()
def init_mtp(model, how: str, seed: int) -> None:
    """'random': matrices N(0, 0.02), norm gains 1. 'identity' (the default) and 'last-layer' start
    every layer as a pass-through, h^k = hnorm(h^{k-1}): eh_proj = [N(0, 0.02) | I] and the block's
    residual branches (o_proj, down_proj) zero, so layer k first predicts what layer k - 1 does,
    with calibrated logits (on SmolLM2 the first losses are ~9 nats instead of 13-50, and 15 steps
    reach ~5 instead of ~7); 'last-layer' also copies the target's last decoder layer into the
    block's other weights. final_norm starts at 1 (hnorm(h^0) . w_final == normalised h^0)."""
    g = torch.Generator().manual_seed(seed)
    last = dict(model.model.layers[-1].named_parameters())
    h = model.config.hidden_size
    for layer in model.mtp:
        for p in layer.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)
        if how == "random":
            continue
        if how == "last-layer":
            for name, p in layer.block.named_parameters():
                if last[name].shape != p.shape:
                    raise ValueError(f"--mtp-init last-layer: {name} is {tuple(p.shape)} in the MTP block but "
                                     f"{tuple(last[name].shape)} in the target (use --mtp-init identity)")
                p.copy_(last[name])
        layer.eh_proj.weight[:, h:] = torch.eye(h)
        layer.block.self_attn.o_proj.weight.zero_()
        layer.block.mlp.down_proj.weight.zero_()


# ---- data --------------------------------------------------------------------------------------
@torch.no_grad()
def target_hidden(model, samples: list[Sample], max_seq_len: int, cache: str | None,
                  progress: bool) -> list[torch.Tensor]:
    """h^0 (the target's final hidden states, fp32, on the model's device) of every sample's first
    max_seq_len tokens, computed in packed batches and cached at `cache` (reused while it matches
    the samples; None: not cached)."""
    key = [len(s.prompt_ids) for s in samples] + [len(s.ids) for s in samples] + [max_seq_len]
    dev = next(model.parameters()).device
    if cache is not None and os.path.isfile(cache):
        saved = torch.load(cache, map_location=dev)
        if saved["key"] == key and saved["sum"] == sum(sum(s.ids[:max_seq_len]) for s in samples):
            return list(saved["hidden"].split(saved["lens"]))
    from tqdm import tqdm

    lens = [min(len(s.ids), max_seq_len) for s in samples]
    out: list[torch.Tensor] = []
    bar = tqdm(total=sum(lens), desc="target hidden states", unit="tok", disable=not progress)
    i = 0
    while i < len(samples):
        j, n = i, 0
        while j < len(samples) and (j == i or n + lens[j] <= 4096):
            n += lens[j]
            j += 1
        ids = torch.tensor([t for s, m in zip(samples[i:j], lens[i:j]) for t in s.ids[:m]], device=dev)
        # Kept on the model's device: the training batches are cut from it there.
        out += list(model(packed_batch(ids, lens[i:j])).float().split(lens[i:j]))
        bar.update(n)
        i = j
    bar.close()
    if cache is not None:  # gathered on the host: no second copy on the GPU
        torch.save({"key": key, "sum": sum(sum(s.ids[:max_seq_len]) for s in samples), "lens": lens,
                    "hidden": torch.cat([h.cpu() for h in out])}, cache)
    return out


def pack(seqs: list[int], batch_tokens: int, lens: list[int]) -> list[list[int]]:
    """Whole sequences (indices) packed in order into batches of at most batch_tokens tokens."""
    batches, cur, n = [], [], 0
    for i in seqs:
        if cur and n + lens[i] > batch_tokens:
            batches.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += lens[i]
    if cur:
        batches.append(cur)
    return batches


# ---- the loss ----------------------------------------------------------------------------------
def label_rows(lens: list[int], prompt_lens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of layer k (over the packed sequences) that have a label inside the continuation, and
    the packed index of that label: row i of a sequence predicts its token i + k + 1."""
    rows, labels, row0, tok0 = [], [], 0, 0
    for n, p in zip(lens, prompt_lens):
        for i in range(max(p - k - 1, 0), n - k - 1):
            rows.append(row0 + i)
            labels.append(tok0 + i + k + 1)
        row0 += max(n - k, 0)
        tok0 += n
    return torch.tensor(rows, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def teacher_forced_logits(model, ids: torch.Tensor, lens: list[int], hidden: torch.Tensor,
                          num_layers: int | None = None) -> list[torch.Tensor]:
    """Per MTP layer, fp32 logits of every row (as `forward_mtp_reference`), through exactly the
    code path the loss uses."""
    chain = mtp_hidden_chain(model, ids, lens, hidden, num_layers)
    return [_head(model, k, h) for k, h in enumerate(chain, start=1)]


def _head(model, k: int, h: torch.Tensor) -> torch.Tensor:
    return model.lm_head.compute_logits(model.mtp[k - 1].final_norm(h)).float()


@torch.no_grad()
def target_label_probs(model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The target's distribution over each label token (packed indices `labels`): the softmax of
    lm_head(h^0) at the label's previous position (h^0 is after the final norm), fp32."""
    return model.lm_head.compute_logits(hidden[(labels - 1).to(hidden.device)]).float().softmax(-1)


def mtp_losses(model, ids: torch.Tensor, lens: list[int], prompt_lens: list[int], hidden: torch.Tensor,
               soft: bool = False) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Per layer: the mean CE over rows with a label in the continuation, and (correct top-1, rows).
    `soft`: the CE is taken against the target's distribution for that label instead of the token
    (the target's logits at the label's previous position: lm_head(h^0), h^0 being post-norm)."""
    chain = mtp_hidden_chain(model, ids, lens, hidden)
    losses, acc = [], []
    for k, h in enumerate(chain, start=1):
        rows, labels = label_rows(lens, prompt_lens, k)
        if not len(rows):
            losses.append(h.sum() * 0.0)
            acc.append((0, 0))
            continue
        logits = _head(model, k, h[rows.to(h.device)])
        target = ids[labels.to(ids.device)]
        if soft:
            p = target_label_probs(model, hidden, labels)
            losses.append(-(p * logits.float().log_softmax(-1)).sum(-1).mean())
        else:
            losses.append(F.cross_entropy(logits, target))
        acc.append((int((logits.argmax(-1) == target).sum()), len(rows)))
    return losses, acc


def _batch(samples, hidden, idx, max_seq_len, dev):
    lens = [min(len(samples[i].ids), max_seq_len) for i in idx]
    ids = torch.tensor([t for i, n in zip(idx, lens) for t in samples[i].ids[:n]], device=dev)
    h0 = torch.cat([hidden[i][:n] for i, n in zip(idx, lens)]).to(dev)
    return ids, lens, [min(len(samples[i].prompt_ids), n) for i, n in zip(idx, lens)], h0


# ---- the run -----------------------------------------------------------------------------------
def train_mtp(cfg) -> dict:
    """Generate (or reuse) the data, train, write the checkpoint, metrics.jsonl and loss.png into
    cfg.out. Returns the final validation metrics."""
    from tqdm import tqdm

    from kiln.loader import resolve_model

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    source = resolve_model(target_path(cfg.target))
    samples = [s for s in load_or_generate(cfg, os.path.join(cfg.out, "data")) if s.output_ids]
    dev = cfg.device
    model = build_model(cfg, source, dev)
    cache = os.path.join(cfg.out, "data", "hidden.pt") if cfg.cache_hidden else None
    hidden = target_hidden(model, samples, cfg.max_seq_len, cache, cfg.progress)
    order = list(range(len(samples)))
    random.Random(cfg.seed).shuffle(order)
    n_val = int(round(cfg.val_fraction * len(order))) if len(order) > 1 else 0
    val, train = order[:n_val], order[n_val:]
    lens = [min(len(s.ids), cfg.max_seq_len) for s in samples]
    params = [p for p in model.mtp.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    history: list[dict] = []
    rng = random.Random(cfg.seed + 1)
    batches: list[list[int]] = []
    t0, tokens = time.time(), 0
    autocast = torch.autocast(device_type=torch.device(dev).type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16)
    best: dict = {}  # --keep-best: the validated row with the lowest loss, and the MTP weights then

    def keep_if_best(row: dict) -> None:
        if cfg.keep_best and "val_loss" in row and ("row" not in best or row["val_loss"] < best["row"]["val_loss"]):
            best.update(row=row, state={k: v.detach().clone() for k, v in model.mtp.state_dict().items()})

    with open(metrics_path, "w") as mf:
        if val:  # the untrained drafter's validation loss: where the curve starts
            with autocast:
                history.append({"step": 0, **evaluate(model, samples, hidden, val, cfg)})
            mf.write(json.dumps(history[-1]) + "\n")
            keep_if_best(history[-1])
        bar = tqdm(range(1, cfg.num_steps + 1), desc="train mtp", unit="step", disable=not cfg.progress)
        for step in bar:
            if not batches:  # a new epoch: reshuffle, repack
                rng.shuffle(train)
                batches = pack(train, cfg.batch_tokens, lens)
            ids, blens, plens, h0 = _batch(samples, hidden, batches.pop(), cfg.max_seq_len, dev)
            model.mtp.train()
            with autocast:
                losses, _ = mtp_losses(model, ids, blens, plens, h0, soft=cfg.mtp_labels == "target")
                loss = torch.stack(losses).float().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
            # Under --time-limit-s the schedule decays by whichever runs out first, steps or time,
            # so a run stopped by the clock still ends at the low learning rate (one clock read
            # for both: the step that stops the run is the one taken at the floor).
            now = time.time()
            time_frac = (now - t0) / cfg.time_limit_s if cfg.time_limit_s else 0.0
            out_of_time = bool(cfg.time_limit_s) and now - t0 > cfg.time_limit_s
            lr = cfg.lr * _lr_factor(step - 1, cfg.warmup_steps, cfg.num_steps, time_frac)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            tokens += len(ids)
            row = {"step": step, "loss": loss.item(), "loss_k": [x.item() for x in losses], "grad_norm": gnorm,
                   "lr": lr, "tokens": tokens, "elapsed_s": round(time.time() - t0, 2)}
            if val and (step == cfg.num_steps or out_of_time or (cfg.eval_every and step % cfg.eval_every == 0)):
                with autocast:
                    row.update(evaluate(model, samples, hidden, val, cfg))
            history.append(row)
            keep_if_best(row)
            mf.write(json.dumps(row) + "\n")
            mf.flush()
            if "val_loss" in row and step < cfg.num_steps:  # a curve to look at while it runs
                plot_losses(history, os.path.join(cfg.out, "loss.png"))
            bar.set_postfix(loss=" ".join(f"{x:.2f}" for x in row["loss_k"]))
            if out_of_time and step < cfg.num_steps:
                logger.warning("--time-limit-s %s reached: training stopped at step %d of %d",
                               cfg.time_limit_s, step, cfg.num_steps)
                break
        bar.close()
    plot_losses(history, os.path.join(cfg.out, "loss.png"))
    if best:
        model.mtp.load_state_dict(best["state"])
        logger.info("--keep-best: exporting the MTP layers of step %d (validation loss %.4f)",
                    best["row"]["step"], best["row"]["val_loss"])
    export_checkpoint(model, source, cfg)
    if best:
        return {**{k: v for k, v in best["row"].items() if k.startswith("val_")}, "val_step": best["row"]["step"]}
    last = next((h for h in reversed(history) if "val_loss_k" in h), history[-1] if history else {})
    return {k: v for k, v in last.items() if k.startswith("val_")}


@torch.no_grad()
def evaluate(model, samples, hidden, idx: list[int], cfg) -> dict:
    """Validation CE and top-1 accuracy per layer (teacher forced: layer k's accuracy is the
    acceptance rate of draft k given drafts 1..k-1 were right)."""
    model.mtp.eval()
    lens = [min(len(samples[i].ids), cfg.max_seq_len) for i in idx]
    tot = [0.0] * cfg.num_mtp_layers
    hits, rows = [0] * cfg.num_mtp_layers, [0] * cfg.num_mtp_layers
    for b in pack(idx, cfg.batch_tokens, {i: n for i, n in zip(idx, lens)}):
        ids, blens, plens, h0 = _batch(samples, hidden, b, cfg.max_seq_len, cfg.device)
        losses, acc = mtp_losses(model, ids, blens, plens, h0)
        for k, (loss, (hit, n)) in enumerate(zip(losses, acc)):
            tot[k] += loss.item() * n
            hits[k] += hit
            rows[k] += n
    val_k = [t / max(n, 1) for t, n in zip(tot, rows)]
    return {"val_loss": sum(val_k) / len(val_k), "val_loss_k": val_k,
            "val_acc_k": [h / max(n, 1) for h, n in zip(hits, rows)]}


def _lr_factor(step: int, warmup: int, total: int, time_frac: float = 0.0) -> float:
    """Linear warmup, then cosine decay to 10% of the peak over the steps after it, or over
    `time_frac` (the share of the time limit spent) when that is further along."""
    by_time = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(time_frac, 1.0)))
    if step < warmup:  # a clock running out during the warmup still pulls the rate down
        return min((step + 1) / warmup, by_time)
    frac = max((step - warmup) / max(total - warmup, 1), time_frac)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def export_checkpoint(model, source, cfg) -> None:
    """cfg.out becomes a servable checkpoint: the target's tensors as they are on disk plus the
    trained `mtp.{k}.*`, config.json with the MTP fields, tokenizer and generation config."""
    from kiln.rl.sync import checkpoint_views

    mtp = {name: t.detach() for name, t in checkpoint_views(model) if name.startswith("mtp.")}
    write_checkpoint(source, mtp, mtp_config(source.config, cfg), cfg.out)


def write_checkpoint(source, added: dict, config: dict, out: str, prefix: str = "mtp.") -> None:
    """Write `out` as a servable checkpoint: the target `source`'s tensors as they are on disk but
    those under `prefix`, the drafter's tensors `added` ({"mtp.{k}...": tensor}, or DSpark's
    "dspark...."; cast to the target's dtype), `config` as config.json, and the target's tokenizer
    and generation config."""
    from safetensors.torch import save_file

    from kiln.loader import iter_weights
    from kiln.loader.source import TOKENIZER_FILES

    if not added or not all(n.startswith(prefix) for n in added):
        raise ValueError(f"write_checkpoint: expected a non-empty set of {prefix}* tensors")
    os.makedirs(out, exist_ok=True)
    state = {n: t.contiguous() for n, t in iter_weights(source) if not n.startswith(prefix)}
    dtype = next(iter(state.values())).dtype
    for name, t in added.items():
        state[name] = t.to("cpu", dtype).contiguous().clone()
    for name in os.listdir(out):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(out, name))
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    mask = os.umask(0)  # safetensors writes owner-only files; the rest of the checkpoint follows the umask
    os.umask(mask)
    os.chmod(os.path.join(out, "model.safetensors"), 0o666 & ~mask)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES + ("generation_config.json",):
        p = os.path.join(source.model_dir, name)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(out, name))
