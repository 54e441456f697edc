"""Two GRPO training steps on the fixed tiny batch, in one process or as one rank of an FSDP2
group (run under torchrun), for each case asked. Used by tests/rl/test_fsdp.py:

    python tests/rl/fsdp_worker.py MODEL_DIR OUT_PREFIX full:float32,lora:float32,...  # one process
    python -m torch.distributed.run --nproc-per-node 2 tests/rl/fsdp_worker.py ...       # FSDP2, gloo

A case is MODE:DTYPE, MODE one of full, lora, micro and DTYPE the trainer's parameter dtype. Writes
(rank 0) OUT_PREFIX-MODE-DTYPE.pt = {"weights": whole weights + adapter after both steps,
"metrics": [m1, m2]} per case. Between the steps the optimizer state goes through a file and back
(per rank under FSDP), as a checkpoint resume does. Step 1 uses token-mean aggregation, step 2
sequence-mean. The cases share one process (group): each launch costs seconds of imports and
start-up, the cases' training a fraction of that."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from kiln.rl.fsdp import DataParallel  # noqa: E402
from kiln.rl.loop import train_on_batch  # noqa: E402
from kiln.rl.loss import LossConfig  # noqa: E402
from tests.rl.tiny import fixed_batch, tiny_trainer  # noqa: E402


def case_path(prefix: str, mode: str, dtype: str) -> str:
    return f"{prefix}-{mode}-{dtype}.pt"


def run_case(dp, model_dir: str, out: str, mode: str, dtype: str) -> None:
    torch.manual_seed(0)
    rank = 0 if dp is None else dp.rank
    # Adam's eps = 1 makes each update ~proportional to the gradient: with the default eps the first
    # step is ~lr * sign(grad) and would hide a wrongly scaled gradient.
    trainer = tiny_trainer(model_dir, dtype=getattr(torch, dtype), lr=0.5, eps=1.0)
    if mode == "lora":
        trainer.enable_lora(rank=4, alpha=8, seed=0)
    if dp is not None:
        trainer.shard()
    # "micro": 9 samples (shares of 5 and 4 under two ranks) in micro-batches of at most 2.
    samples, adv, keep = fixed_batch(n_groups=3, group=3) if mode == "micro" else fixed_batch()
    micro = 2 if mode == "micro" else 0
    m1, up1 = train_on_batch(trainer, samples, adv, keep, LossConfig(), 1.0, False, dp, micro)
    opt_file = f"{out}.opt{rank}"
    torch.save(trainer.optimizer.state_dict(), opt_file)
    trainer._build_optimizer()
    trainer.optimizer.load_state_dict(torch.load(opt_file, weights_only=False))
    m2, up2 = train_on_batch(trainer, samples, adv, keep, LossConfig(loss_agg="sequence"), 1.0, False, dp, micro)
    assert up1 and up2
    with trainer.gathered():
        if rank == 0:
            weights = {n: t.detach().clone() for n, t in trainer.named_weights_for_sync()}
            if mode == "lora":
                from kiln.rl.lora import lora_state_dict

                weights.update({k: v.detach().clone() for k, v in lora_state_dict(trainer.model).items()})
            torch.save({"weights": weights, "metrics": [m1, m2],
                        "sharded": trainer.sharded, "world": 1 if dp is None else dp.world_size}, out)


def main(model_dir: str, prefix: str, cases: str) -> None:
    dp = DataParallel.from_env("cpu")
    for case in cases.split(","):
        mode, dtype = case.split(":")
        run_case(dp, model_dir, case_path(prefix, mode, dtype), mode, dtype)
        # (the case's sharded model is gone with run_case's frame; DataParallel.close collects it)
    if dp is not None:
        dp.close()  # (frees the sharded models first: kiln.rl.fsdp.DataParallel.close says why)
    print(f"fsdp_worker rank {0 if dp is None else dp.rank}: done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
