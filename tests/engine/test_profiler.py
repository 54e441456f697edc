"""`kiln.engine.profiler` through `kiln.Engine`: a trace of whole steps, written at stop or after
`num_steps` steps, one at a time, with the errors a user can cause."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from kiln.engine.profiler import ProfileOptions


def trace_events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_options_check_their_fields():
    with pytest.raises(ValueError, match="activities must be"):
        ProfileOptions("d", activities=("CPU", "TPU"))
    with pytest.raises(ValueError, match="activities must be"):
        ProfileOptions("d", activities=())
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        ProfileOptions("d", num_steps=0)


def test_engine_profiles_its_steps(tmp_path):
    from kiln import Engine, SamplingParams
    from kiln.models.init_model import init_model

    init_model("inkling", "tiny", str(tmp_path / "m"), seed=0)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(str(tmp_path / "m"), device="cpu", max_total_tokens=1024) as llm:
        with pytest.raises(RuntimeError, match="no profile is running"):
            llm.stop_profile()
        path = llm.start_profile(str(tmp_path / "traces"), profile_prefix="run1")
        assert path == str(tmp_path / "traces" / "run1-TP-0.trace.json.gz") and not os.path.exists(path)
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile(str(tmp_path / "traces"))
        llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)
        assert llm.stop_profile() == path
        names = {e.get("name", "") for e in trace_events(path)}
        assert any(n.startswith("aten::") for n in names), sorted(names)[:20]  # the model's ops were recorded

        # num_steps: the trace ends by itself after that many steps (prefill + 1 decode here)
        path2 = llm.start_profile(str(tmp_path / "traces"), num_steps=2, profile_prefix="run2")
        llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)  # 6 steps
        assert os.path.exists(path2) and not llm.core.profiler.active
        with pytest.raises(RuntimeError, match="last one went to .*run2-TP-0"):
            llm.stop_profile()
        # an output_dir that cannot be made
        (tmp_path / "file").write_text("x")
        with pytest.raises(ValueError, match="cannot write traces"):
            llm.start_profile(str(tmp_path / "file" / "sub"))


@pytest.mark.gpu
def test_engine_profile_records_cuda_kernels(tmp_path):
    """On CUDA, "GPU" adds the kernels (CUPTI), graph replays included."""
    import json

    from kiln import Engine, SamplingParams
    from tests.engine.test_hybrid_engine import INKLING

    (tmp_path / "m").mkdir()  # a config alone (random weights, no tokenizer): GPU machines lack SmolLM2
    (tmp_path / "m" / "config.json").write_text(json.dumps(INKLING))
    with Engine(str(tmp_path / "m"), device="cuda", max_total_tokens=1024, load_format="dummy",
                skip_tokenizer_init=True) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm: graphs captured
        path = llm.start_profile(str(tmp_path / "traces"), activities=("CPU", "GPU"))
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.stop_profile()
        assert any(e.get("cat") == "kernel" for e in trace_events(path))
