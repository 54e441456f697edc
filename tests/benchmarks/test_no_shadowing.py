"""benchmarks/ is put on sys.path by its scripts (`python benchmarks/latency.py`) and by the
benchmark tests, so no folder in it may share a name with a package that a library imports: a
folder named `kernels` once answered transformers' probe for the Hugging Face `kernels` package
(transformers 5.25 imports names from it) and broke every later import of a model."""

import pathlib
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
# Top-level names that libraries Kiln uses probe for or import.
TAKEN = {"kernels", "transformers", "torch", "triton", "tokenizers", "safetensors", "accelerate", "gguf",
         "fastapi", "pydantic", "uvicorn", "zmq", "peft", "datasets", "numpy", "tqdm", "matplotlib"}


def test_no_benchmark_folder_shadows_a_library():
    names = {p.stem for p in BENCHMARKS.iterdir() if p.is_dir() or p.suffix == ".py"}
    assert not names & TAKEN, f"rename {sorted(names & TAKEN)} under benchmarks/: it shadows a library"


def test_transformers_imports_with_benchmarks_on_path():
    code = ("import sys; sys.path.insert(0, %r); import transformers.integrations.hub_kernels; "
            "from transformers import LlamaForCausalLM" % str(BENCHMARKS))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
