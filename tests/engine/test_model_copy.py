"""`kiln.engine.model_copy`: the colocated trainer's weights copied model to model (sync_full's
direct path; tests/rl/test_trainer_consistency.py checks the engine end to end)."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.model_copy import WeightLayoutMismatch, copy_weights, matched_weights

from tests.models.test_inkling import tiny_inkling


def _state(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_copy_makes_every_parameter_and_buffer_equal_and_casts():
    dst, src = tiny_inkling(seed=0), tiny_inkling(seed=1)
    src.to(torch.float64)  # another dtype: the copy casts to dst's
    assert any(not torch.equal(a, b.float()) for a, b in zip(_state(dst).values(), _state(src).values()))
    nbytes = copy_weights(dst, src)
    for name, t in dst.state_dict().items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, src.state_dict()[name].float(), atol=0, rtol=0, msg=name)
    assert nbytes == sum(d.numel() * d.element_size() for d, _ in matched_weights(dst, src))
    # buffers too: the routers' expert bias steers the selection
    assert any("expert_bias" in n for n in dst.state_dict())


def test_lora_tensors_are_left_out():
    dst, src = tiny_inkling(seed=0), tiny_inkling(seed=1)
    src.model.layers[0].register_parameter("lora_A", torch.nn.Parameter(torch.ones(2)))  # an adapter's
    src.register_parameter("lora_B", torch.nn.Parameter(torch.ones(3)))
    copy_weights(dst, src)
    src.model.layers[0].register_parameter("q_lora", torch.nn.Parameter(torch.ones(2)))  # not an adapter's
    with pytest.raises(WeightLayoutMismatch, match="extra"):
        matched_weights(dst, src)


def test_a_mismatch_copies_nothing():
    dst, src = tiny_inkling(seed=0), tiny_inkling(seed=1)
    before = _state(dst)
    name, p = next((n, p) for n, p in src.named_parameters() if p.dim() == 2)
    *path, leaf = name.split(".")
    setattr(src.get_submodule(".".join(path)), leaf, torch.nn.Parameter(p.detach()[:-1].clone()))  # one row short
    with pytest.raises(WeightLayoutMismatch, match="shape"):
        copy_weights(dst, src)
    after = _state(dst)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_tied_tensors_are_copied_once():
    dst, src = tiny_inkling(seed=0), tiny_inkling(seed=1)
    dst.lm_head.weight = dst.model.embed_tokens.weight  # tie both sides
    src.lm_head.weight = src.model.embed_tokens.weight
    pairs = matched_weights(dst, src)
    assert len({d.data_ptr() for d, _ in pairs}) == len(pairs)
    assert len(pairs) == len(dst.state_dict()) - 1


def test_engine_takes_a_model_or_its_adapter_only_with_the_weights_resident(arch_dir):
    """The engine's two model-to-model paths refuse while the weights are released (CUDA only in
    real use: here the flag is set by hand), and reject another layout before changing anything."""
    from kiln.rl.lora import apply_lora
    from tests.engine.test_hybrid_engine import make_core

    core, other = make_core(arch_dir), make_core(arch_dir)
    before = _state(core.runner.model)
    core.runner._weights_on_cpu = True
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        core.update_weights_from_model(other.runner.model)
    apply_lora(other.runner.model, rank=2, alpha=4.0, seed=0)
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        core.load_lora_from_model("a", other.runner.model)
    core.runner._weights_on_cpu = False
    small = make_core(arch_dir)
    w = small.runner.model.lm_head.weight
    small.runner.model.lm_head.weight = torch.nn.Parameter(w.detach()[:-1].clone())  # one row short
    apply_lora(small.runner.model, rank=2, alpha=4.0, target_modules=("lm_head",), seed=0)
    with pytest.raises(WeightLayoutMismatch):
        core.load_lora_from_model("a", small.runner.model)
    after = _state(core.runner.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    core.load_lora_from_model("a", other.runner.model)
    core.unload_lora_adapter("a")
    assert all(torch.equal(before[n], t) for n, t in _state(core.runner.model).items())
