"""`--speculative-token-map` (FR-Spec): a drafter's LM head scores the map's tokens only.

What must hold, on the tiny Inkling and Llama MTP targets and a DFlash drafter (CPU, fp32):
- every draft is a map token, and each draft's logits are the teacher-forced MTP reference on
  the map and -inf off it (eager passes and the chain graph, replayed by re-running it);
- greedy output with speculation still equals plain greedy output (the verify never trusts a
  draft), with drafts accepted where the target's token is in the map;
- sampled requests under exact verification get q = the processed map-restricted logits, 0 off
  the map;
- the draft head's copy of the hot rows follows weight updates;
- bad maps and flags fail with a clear message.
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine.spec.draft_vocab import hot_tokens, load_token_map, main
from kiln.models.mtp import forward_mtp_reference
from tests.engine.test_hybrid_engine import make_core, prompts
from tests.engine.test_speculative import (SPEC_ARCHS, assert_mtp_reference, copy_drafter, plain_core, run_plain,
                                           run_spec)

V = 512  # the tiny targets' vocabulary


def token_map(tmp_path, seed: int = 0) -> tuple[str, list[int]]:
    """Half the vocabulary, shuffled (the map's order is not the ids' order), as a .pt file."""
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:V // 2].tolist()
    path = tmp_path / "map.pt"
    torch.save(torch.tensor(ids), path)
    return str(path), ids


def mapped_core(model_dir: str, path: str, k: int, alpha: float, **kw):
    core = make_core(model_dir, speculative_algorithm="mtp", speculative_num_steps=k,
                     speculative_token_map=path, **kw)
    copy_drafter(core, alpha)
    core.scheduler.spec.drafter.on_weights_changed()  # the tests changed the weights in place
    return core


def masked_reference(ids: list[int]):
    """`forward_mtp_reference` with -inf off the map: what the drafts' logits must equal."""
    off = torch.ones(V, dtype=torch.bool)
    off[ids] = False

    def reference(model, tokens, lens, hidden):
        return [x.masked_fill(off, float("-inf")) for x in forward_mtp_reference(model, tokens, lens, hidden)]

    return reference


@pytest.mark.parametrize("arch", sorted(SPEC_ARCHS))
def test_drafts_come_from_the_map_and_greedy_stays_exact(arch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS[arch]))
    path, ids = token_map(tmp_path)
    ps = prompts(3, seed=4, lo=10, hi=40)
    core = mapped_core(str(tmp_path), path, 3, alpha=0.01, page_size=4)
    res, drafts, _ = run_spec(core, ps, max_tokens=16)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(str(tmp_path), alpha=0.01, page_size=4), ps)
    hot = set(ids)
    proposed = [d for rows in drafts.values() for _, ds, _ in rows for d in ds]
    assert proposed and set(proposed) <= hot
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < 3 * counts.verify_steps
    assert assert_mtp_reference(core, res, drafts, reference=masked_reference(ids)) > 0


def test_chain_graph_drafts_from_the_map(tmp_path):
    # The chain graph's logits are [K, n, N] over the map; its drafts map back to token ids on
    # the device, and the round stays plain greedy. (The Llama MTP target: the draft head is the
    # same code for Inkling, and the graph tests on the Triton interpreter are slow.)
    pytest.importorskip("triton")
    from tests.engine.test_graph_buffers import RecomputeCapturer
    from tests.engine.test_kernel_path import INTERP_CONTEXT

    (tmp_path / "config.json").write_text(json.dumps(SPEC_ARCHS["llama"]))
    path, ids = token_map(tmp_path, seed=1)
    ps = prompts(2, seed=5, lo=10, hi=30)
    core = mapped_core(str(tmp_path), path, 3, alpha=0.01, page_size=4, kernel_backend="triton",
                       cuda_graph_max_bs=2, context_length=INTERP_CONTEXT)  # graphs for the 2 requests
    runner, drafter = core.runner, core.scheduler.spec.drafter
    runner.graphs = runner._new_graphs()
    runner.graphs.capture(RecomputeCapturer())
    chain = RecomputeCapturer()
    drafter.use_graphs(2, chain)
    assert drafter.graph.graphs[1][1].shape[-1] == len(ids)  # the captured logits: the map's columns
    res, drafts, _ = run_spec(core, ps, max_tokens=6)
    assert chain.replays > 0
    want = run_plain(plain_core(str(tmp_path), alpha=0.01, page_size=4), ps, max_tokens=6)
    assert {rid: r[1] for rid, r in res.items()} == want
    assert {d for rows in drafts.values() for _, ds, _ in rows for d in ds} <= set(ids)
    assert assert_mtp_reference(core, res, drafts, reference=masked_reference(ids)) > 0
    # Weights moved (RL's release + resume of the weights alone): the next pass must capture again
    graph = drafter.graph
    assert graph._ptrs == graph._addresses()
    head = core.runner.model.lm_head.weight
    head.data = head.data.clone()
    assert graph._ptrs != graph._addresses()


def test_sampled_drafts_have_no_mass_off_the_map(tmp_path):
    from tests.engine.test_speculative import SPEC_INKLING
    from tests.engine.test_spec_sampled import FLAGS, assert_q_rows_are_processed_draft_logits, mixed_params, watch

    (tmp_path / "config.json").write_text(json.dumps(SPEC_INKLING))
    path, ids = token_map(tmp_path, seed=2)
    core = mapped_core(str(tmp_path), path, 3, alpha=0.01, page_size=4, **FLAGS["tokenwise"])
    passes, _ = watch(core)
    run_spec(core, prompts(4, seed=21, lo=20, hi=50), params=mixed_params())
    assert_q_rows_are_processed_draft_logits(passes)
    off = torch.ones(V, dtype=torch.bool)
    off[ids] = False
    qs = [q for *_, q in passes if q is not None]
    assert qs and all(float(q[:, off].abs().max()) == 0.0 for q in qs)


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_block_drafts_come_from_the_map(tmp_path, dflash2):
    # DFlash on the tiny Llama: its block's K rows go through the map's rows of the target's LM
    # head; greedy output stays plain greedy, and each draft's logits are the reference block's
    # on the map, -inf off it. DFlash2: the selector walks over the map's candidates only.
    from tests.engine.test_block_drafter import DFLASH2, assert_block_reference, dflash_dirs, spec_core as block_core

    model_dir, draft = dflash_dirs(tmp_path, DFLASH2 if dflash2 else None)
    path, ids = token_map(tmp_path, seed=4)
    target = (str(model_dir), {"speculative_algorithm": "dflash", "speculative_draft_model_path": str(draft),
                               "speculative_token_map": path})
    ps = prompts(3, seed=21, lo=10, hi=60)
    core = block_core(target, 3, page_size=4)
    core.scheduler.spec.drafter.on_weights_changed()  # make_core changed the weights in place
    res, drafts, _ = run_spec(core, ps, max_tokens=12)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(make_core(str(model_dir), page_size=4), ps, max_tokens=12)
    assert {d for rows in drafts.values() for _, ds, _ in rows for d in ds} <= set(ids)
    assert assert_block_reference(core, res, drafts, token_map=ids) > 0


def test_the_hot_rows_follow_weight_updates(tmp_path):
    from tests.engine.test_speculative import SPEC_INKLING

    (tmp_path / "config.json").write_text(json.dumps(SPEC_INKLING))
    path, ids = token_map(tmp_path)
    core = make_core(str(tmp_path), speculative_algorithm="mtp", speculative_token_map=path)
    vocab = core.scheduler.spec.drafter.vocab
    new = torch.randn_like(core.runner.model.lm_head.weight)
    core.update_weights_from_tensor([("lm_head.weight", new)])
    assert torch.equal(vocab.weight, new[ids])


def test_token_map_files_and_errors(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([5, 3, 9]))
    assert load_token_map(str(tmp_path / "a.json"), V) == [5, 3, 9]
    cases = {"missing.pt": "no such file", "b.txt": "use a .pt or .json", "c.json": "non-empty list",
             "d.json": "outside the vocabulary", "e.json": "repeat"}
    (tmp_path / "b.txt").write_text("1 2")
    (tmp_path / "c.json").write_text("[]")
    (tmp_path / "d.json").write_text(json.dumps([1, V]))
    (tmp_path / "e.json").write_text(json.dumps([1, 2, 1]))
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            load_token_map(str(tmp_path / name), V)
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        EngineConfig(speculative_token_map=str(tmp_path / "a.json"))


def test_hot_tokens_and_the_map_writer(tmp_path, capsys):
    assert hot_tokens([[3, 3, 1], [1, 2, 3]], 2) == [3, 1]  # by count, ties by id
    data = tmp_path / "generations.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_ids": [7, 7, 7], "output_ids": o}) for o in ([4, 4, 2], [2, 4])))
    main(["--data", str(data), "--size", "2", "--out", str(tmp_path / "m.pt")])
    assert load_token_map(str(tmp_path / "m.pt"), V) == [4, 2]
    main(["--data", str(data), "--size", "1", "--with-prompts", "--out", str(tmp_path / "m.json")])
    assert load_token_map(str(tmp_path / "m.json"), V) == [7]
    assert "cover" in capsys.readouterr().out


@pytest.mark.gpu
def test_token_map_rounds_with_cuda_graphs_equal_plain(tmp_path):
    # On the GPU the chain graph's draft head reads the map's rows; rounds fed on the device stay
    # plain greedy, with every draft a map token.
    from tests.engine.test_speculative import SPEC_INKLING

    (tmp_path / "config.json").write_text(json.dumps(SPEC_INKLING))
    path, ids = token_map(tmp_path, seed=3)
    ps = prompts(5, seed=5, lo=10, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=8)
    core = mapped_core(str(tmp_path), path, 3, alpha=0.01, **kw)
    chain = core.scheduler.spec.drafter.graph
    assert chain is not None and chain.graphs[1][1].shape[-1] == len(ids)
    res, drafts, _ = run_spec(core, ps, max_tokens=16)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(str(tmp_path), alpha=0.01, **kw), ps)
    assert {d for rows in drafts.values() for _, ds, _ in rows for d in ds} <= set(ids)
    counts = core.stats().spec
    assert 0 < counts.accepted_tokens < 3 * counts.verify_steps
