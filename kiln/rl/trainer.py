"""`PolicyTrainer`: the trainable copy of the served model (same class, same checkpoint).

The engine and the trainer build the *same* module tree from the same checkpoint; the trainer runs
it on packed sequences (`kiln.models.reference.packed_forward`) under autograd. Logprobs are
recomputed exactly as the engine's sampler reports them (`log_softmax(logits / T)`, T = 0 -> 1),
and MoE models replay the experts the rollout used (R3): the discrete top-k comes from the rollout,
the gate weights from the live router (so the router still gets gradients).

    trainer = PolicyTrainer(model_path, lr=1e-6)
    lps = trainer.sequence_logprobs(samples, temperature=1.0)      # list of [len(output)] fp32
    trainer.step(loss_fn(lps, ...))                                # backward, clip, AdamW, zero
    sync_full(trainer, engine)                                     # kiln.rl.sync

One process, or FSDP2 data parallelism over several (`shard`, `gathered`; see kiln.rl.fsdp).
Tensor parallel training is future work.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from kiln.dist.parallel import SINGLE
from kiln.loader import ModelSource, cast_parameters, init_dummy_weights, iter_weights, resolve_model
from kiln.models.reference import packed_batch
from kiln.models.registry import get_model_class, parse_model_config
from kiln.rl.optimizer import MixedPrecisionAdamW
from kiln.rl.sync import checkpoint_views


def _as_long(x: Any) -> torch.Tensor:
    return x.long() if isinstance(x, torch.Tensor) else torch.as_tensor(x).long()


def _with_rows(batch: Any, rows: torch.Tensor) -> Any:
    """`batch` with `logits_indices` set to `rows` (the field compute_logits gathers by; a training
    batch is never a decode graph's nor on the decode GEMV path, `kiln.layers.decode_gemv.decode_logits`)."""
    batch.logits_indices = rows
    return batch


def chunked_logprobs_entropy(logits_fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor,
                             targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024,
                             entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of `targets` [N], entropy [N]) of softmax(logits / temperature), where
    `logits_fn(rows[i:j])` gives the fp32 logits [j - i, V] of those rows; `chunk` rows at a time.

    logprobs: log_softmax(z / T)[target], exactly the unchunked formula (rows are independent),
    under the caller's grad mode. entropy: -sum(p * log p) from the same log-softmax, computed
    under no_grad unless `entropy_grad`, so each chunk's [chunk, V] temporaries die with the chunk
    (autograd keeps only the log-softmax outputs the logprob gradient needs)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    picked, ents = [], []
    for i in range(0, rows.numel(), chunk):
        logp = torch.log_softmax(logits_fn(rows[i:i + chunk]).float() / temperature, dim=-1)
        picked.append(logp.gather(1, targets[i:i + chunk, None]).squeeze(1))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            lp = logp if entropy_grad else logp.detach()
            ents.append(-(lp.exp() * lp).sum(dim=-1))
        del logp
    if not picked:
        empty = torch.zeros(0, dtype=torch.float32, device=targets.device)
        return empty, empty
    return torch.cat(picked), torch.cat(ents)


class PolicyTrainer:
    """A trainable model + AdamW. `model` is the Kiln model (parameters trainable except the
    model's `frozen_in_training` fragments; buffers never train)."""

    def __init__(self, model_path: Optional[str] = None, *, source: Optional[ModelSource] = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, lr: float = 1e-6,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, max_grad_norm: float = 1.0, max_positions: Optional[int] = None,
                 load_format: str = "auto", seed: int = 0, logits_chunk: int = 1024,
                 master_weights: bool = True):
        """`load_format="dummy"` (benchmarks, config-only dirs): no checkpoint read; the weights are
        `kiln.loader.init_dummy_weights(model, seed)`, the engine's dummy init, so a trainer and an
        engine built with the same seed and dtype start from the same tensors. `logits_chunk`: rows
        of [rows, vocab] logits computed at a time in the recompute (bounds its peak memory).
        `master_weights`: a bf16 / fp16 trainer steps through fp32 master copies
        (`kiln.rl.optimizer.MixedPrecisionAdamW`); False updates the low-precision weights directly,
        where small updates round away."""
        source = source or resolve_model(model_path, load_format)
        self.source = source
        self.device = torch.device(device)
        self.config = parse_model_config(source.config)
        cls = get_model_class(self.config.model_type)
        with torch.device(self.device):
            model = cls(self.config, SINGLE, max_positions=max_positions)
        cast_parameters(model, dtype)  # as in the engine: routers and buffers stay fp32
        if source.load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            model.load_weights(iter_weights(source))
        self.model = model.train()
        frozen = tuple(getattr(model, "frozen_in_training", ()))
        for name, p in model.named_parameters():
            p.requires_grad_(not any(f in f".{name}" for f in frozen))
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.max_grad_norm = max_grad_norm
        self.logits_chunk = logits_chunk
        self.master_weights = master_weights
        self.sharded = False  # FSDP2 (see shard)
        self.replicated: list[torch.nn.Parameter] = []  # params FSDP cannot shard (0-dim)
        self._build_optimizer()

    # ---- parameters ------------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _build_optimizer(self) -> None:
        self._optimizer = None  # built on first use (`optimizer`)

    @property
    def optimizer(self) -> MixedPrecisionAdamW:
        """AdamW over the trainable parameters, built on first use: after `enable_lora` and `shard`
        have settled what trains, so that a bf16 trainer's fp32 masters (4 bytes a parameter,
        made when it is built) are only ever made for the adapters, or for this rank's shards."""
        if self._optimizer is None:
            # fused: one kernel for the whole update, no full-size temporaries (foreach's sqrt of
            # the second moments is a copy of them); DTensor shards keep the default
            fused = True if self.device.type == "cuda" and not self.sharded else None
            self._optimizer = MixedPrecisionAdamW(self.trainable_parameters(), self.master_weights, lr=self.lr,
                                                  betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                                  fused=fused)
        return self._optimizer

    def enable_lora(self, rank: int = 16, alpha: float = 32.0, target_modules: Optional[Sequence[str]] = None,
                    seed: Optional[int] = None) -> list[str]:
        """Switch to LoRA training: add adapters (`kiln.rl.lora.apply_lora`), freeze the base, and
        rebuild the optimizer over the adapter parameters only. Returns the adapted modules."""
        from kiln.rl.lora import DEFAULT_TARGETS, apply_lora

        names = apply_lora(self.model, rank, alpha, target_modules or DEFAULT_TARGETS, seed=seed)
        self._build_optimizer()
        return names

    @property
    def uses_lora(self) -> bool:
        return hasattr(self.model, "lora_targets")

    def shard(self, mesh: Any = None) -> None:
        """FSDP2-shard the model over the default process group (`kiln.rl.fsdp.shard_model`: one
        unit per decoder layer, then the root) and rebuild the optimizer over the shards. Call
        after `enable_lora` and after loading any checkpoint weights."""
        from kiln.rl.fsdp import shard_model

        self.replicated = shard_model(self.model, mesh)
        self.sharded = True
        self._build_optimizer()

    def gathered(self) -> Any:
        """Context manager: whole weights inside (`kiln.rl.fsdp.full_weights`; every rank must
        enter), so `named_weights_for_sync` and the LoRA export see whole tensors. A no-op unless
        the trainer is sharded."""
        from contextlib import nullcontext

        if not self.sharded:
            return nullcontext(self.model)
        from kiln.rl.fsdp import full_weights

        return full_weights(self.model)

    # ---- forward ---------------------------------------------------------------------------

    def sequence_logprobs(self, samples: Sequence[dict], temperature: float = 1.0,
                          replay: bool = True) -> list[torch.Tensor]:
        """Per sample, the fp32 logprobs [len(output_ids)] of its output tokens under the current
        weights, as the engine's sampler defines them. Runs under the caller's grad mode.

        Each sample: `prompt_ids`, `output_ids` and, for MoE replay, `routed_experts` (int32
        [len(prompt) + len(output) - 1, num_moe_layers, k], as the engine returns it). With
        `replay` and routed experts on every sample, MoE layers use the rollout's expert ids."""
        return self.sequence_logprobs_and_entropy(samples, temperature, replay)[0]

    def sequence_logprobs_and_entropy(self, samples: Sequence[dict], temperature: float = 1.0,
                                      replay: bool = True, entropy_grad: bool = False
                                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`sequence_logprobs` plus, per sample, the entropy [len(output_ids)] of the policy's
        next-token distribution softmax(logits / T) at each output position (fp32).

        Both come from one forward: the logits are computed `logits_chunk` rows at a time and the
        entropy of each chunk is taken from that chunk's log-softmax before the next chunk, so no
        [tokens, vocab] tensor beyond what autograd keeps for the logprobs is ever alive. The
        entropy is detached (a metric) unless `entropy_grad` (an entropy bonus in the loss)."""
        batch, hidden, targets = self._forward_outputs(samples, replay)
        t = 1.0 if temperature == 0 else float(temperature)
        picked, ent = chunked_logprobs_entropy(
            lambda rows: self.model.compute_logits(hidden, _with_rows(batch, rows)),
            batch.logits_indices, targets, t, self.logits_chunk, entropy_grad)
        sizes = [len(s["output_ids"]) for s in samples]
        return list(picked.split(sizes)), list(ent.split(sizes))

    def _forward_outputs(self, samples: Sequence[dict], replay: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Pack `samples`, run the model; (batch with logits_indices = the output rows, hidden
        states [T, H], target token ids [N_out])."""
        seqs, lens, out_rows, routed = [], [], [], []
        offset = 0
        for s in samples:
            prompt, output = list(s["prompt_ids"]), list(s["output_ids"])
            assert prompt and output, "every sample needs a prompt and at least one output token"
            seq = prompt + output[:-1]
            seqs.append(torch.tensor(seq, dtype=torch.long))
            lens.append(len(seq))
            # Output token j is predicted by the row of sequence position len(prompt) - 1 + j.
            out_rows.append(torch.arange(len(prompt) - 1, len(seq)) + offset)
            offset += len(seq)
            routed.append(s.get("routed_experts"))
        replay_ids = None
        have = [r is not None for r in routed]
        if replay and any(have):
            if not all(have):
                raise ValueError("routing replay needs `routed_experts` on every sample (or none)")
            rows = [_as_long(r) for r in routed]
            for r, n in zip(rows, lens):
                assert r.shape[0] == n, f"routed_experts has {r.shape[0]} rows for {n} tokens"
            cat = torch.cat(rows).to(self.device)  # [T, L_moe, k]
            replay_ids = {i: cat[:, i] for i in range(cat.shape[1])}
        input_ids = torch.cat(seqs).to(self.device)
        batch = packed_batch(input_ids, lens, replay_ids)
        # Only the output rows need logits (the prompt rows would be most of a [T, V] tensor).
        batch.logits_indices = torch.cat(out_rows).to(self.device)
        hidden = self.model(batch)
        targets = torch.cat([torch.as_tensor(list(s["output_ids"]), dtype=torch.long) for s in samples])
        return batch, hidden, targets.to(self.device)

    # ---- update ----------------------------------------------------------------------------

    def step(self, loss: Optional[torch.Tensor] = None) -> dict[str, float]:
        """backward (unless `loss` is None: gradients accumulated by the caller), clip the grad
        norm to `max_grad_norm`, AdamW step, zero grads. Returns {"grad_norm", "lr"}."""
        if loss is not None:
            loss.backward()
        if self.sharded:  # DTensor grad shards (+ replicated scalars): kiln.rl.fsdp's reduction
            from kiln.rl.fsdp import clip_grad_norm, reduce_replicated_grads

            world = torch.distributed.get_world_size()
            reduce_replicated_grads([p for p in self.replicated if p.requires_grad], world)
        params = self.optimizer.grads_to_masters()  # what AdamW steps: fp32 masters and fp32 params
        if self.sharded:
            norm = clip_grad_norm(params, self.max_grad_norm)
        elif self.max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        from kiln.rl.fsdp import scalar

        return {"grad_norm": scalar(norm), "lr": self.optimizer.param_groups[0]["lr"]}

    # ---- export ----------------------------------------------------------------------------

    def named_weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(on-disk name, tensor view) for every weight, as the engine's `load_weights` expects
        (stacked q/k/v, gate/up and experts split back; LoRA adapters excluded: see
        `kiln.rl.lora.lora_state_dict` for those). A sharded trainer must be inside `gathered()`."""
        if self.sharded:
            from kiln.rl.fsdp import is_sharded

            if is_sharded(self.model):
                raise RuntimeError("named_weights_for_sync on an FSDP-sharded trainer: call it inside "
                                   "`with trainer.gathered():` (on every rank)")
        return checkpoint_views(self.model)
