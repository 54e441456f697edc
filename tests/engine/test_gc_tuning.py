"""kiln.engine.gc_tuning: the startup heap frozen out of the collector, a higher young threshold,
and both undone by restore_gc (which the offline Engine's shutdown calls)."""

import gc
from types import SimpleNamespace

import pytest

from kiln.config import EngineConfig
from kiln.engine.gc_tuning import GEN0_THRESHOLD, restore_gc, tune_gc


@pytest.fixture
def clean_gc():
    before = gc.get_threshold()
    gc.unfreeze()
    yield before
    gc.unfreeze()
    gc.set_threshold(*before)


def test_tune_gc_freezes_and_raises_the_young_threshold_and_restore_undoes_both(clean_gc):
    gc.set_threshold(700, 10, 10)
    keep = [[i] for i in range(100)]  # tracked objects alive at the freeze
    previous = tune_gc()
    assert previous == (700, 10, 10)
    assert gc.get_freeze_count() >= len(keep)
    assert gc.get_threshold() == (GEN0_THRESHOLD, 10, 10)
    restore_gc(previous)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)


def test_tune_gc_never_lowers_a_threshold_set_higher(clean_gc):
    gc.set_threshold(GEN0_THRESHOLD * 2, 5, 5)
    previous = tune_gc()
    assert gc.get_threshold() == (GEN0_THRESHOLD * 2, 5, 5)
    restore_gc(previous)
    assert gc.get_threshold() == (GEN0_THRESHOLD * 2, 5, 5)


def test_offline_engine_tunes_at_start_and_restores_at_shutdown(clean_gc):
    from kiln.offline import Engine

    gc.set_threshold(700, 10, 10)
    core = SimpleNamespace(info=SimpleNamespace(vocab_size=10, context_length=16, eos_token_ids=[0]))
    llm = Engine.from_core(core, EngineConfig(skip_tokenizer_init=True))
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GEN0_THRESHOLD
    llm.shutdown()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)
    llm.shutdown()  # twice is harmless
    assert gc.get_threshold() == (700, 10, 10)
