"""Model sizes `kiln init-model` creates (MODELS.md 7): `PRESETS[arch][preset]` config.json dicts.

Every dict lists every config.json field of its architecture (defaults written out), except
`torch_dtype`, `eos_token_id` and `bos_token_id`, which `kiln.models.init_model` adds. The vocab
is SmolLM2's 49152 tokens plus the 5 special tokens of MODELS.md 6 (`<think>`, `</think>`,
`<minimax:tool_call>`, `</minimax:tool_call>`, `<|image|>`), rounded up to a multiple of 64.

Parameter counts (`param_counts`; total, and active per token = without the MTP layers and the
E - k routed experts a token does not use; embedding and LM head counted, untied):

    arch        preset   total       active
    inkling     tiny     6.80 M      6.54 M     (embedding + LM head: 6.30 M)
    inkling     small    49.6 M      32.6 M
    inkling     bench    5.76 B      1.10 B
    minimax_m3  tiny     6.55 M      6.44 M
    minimax_m3  small    46.6 M      31.4 M
    minimax_m3  bench    5.25 B      1.05 B     (with its DSpark drafter, `with_dspark`: 5.50 B)

`tiny` runs the test suite on a CPU in seconds (both sliding and full layers, MSA selection from
32 tokens on, attention scaling from position 31 on); `small` is for CPU demos; `bench` is sized
for one H200 with real head sizes (D=128, W=4096, R=1024, B=128, N=16, DI=128). `bench` uses
moe_intermediate_size 512 (not 1024) so that it stays "a few billion" parameters: with 64 experts
of 1024 over 23 MoE layers Inkling would have 10.3 B.
"""

from __future__ import annotations

from typing import Any

from kiln.models.inkling_config import default_layer_types

ARCHS = ("inkling", "minimax_m3")
PRESET_NAMES = ("tiny", "small", "bench")

SMOLLM2_VOCAB = 49152
NUM_ADDED_TOKENS = 5  # MODELS.md 6: <think> </think> <minimax:tool_call> </minimax:tool_call> <|image|>


def round_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


VOCAB_SIZE = round_vocab(SMOLLM2_VOCAB + NUM_ADDED_TOKENS)  # 49216

# Default weight dtype written to config.json (`torch_dtype`) and to the safetensors.
DEFAULT_DTYPE = {"tiny": "float32", "small": "float32", "bench": "bfloat16"}
# Whether `kiln init-model` writes weights unless told otherwise (bench: config + tokenizer only,
# served with --load-format dummy; pass --with-weights for a real file of several GB).
DEFAULT_WITH_WEIGHTS = {"tiny": True, "small": True, "bench": False}


def _inkling(*, hidden, layers, heads, kv_heads, head_dim, intermediate, experts, top_k, shared,
             moe_intermediate, kernel, window, rel_dim, rel_extent, floor, mtp, max_pos) -> dict:
    return {
        "model_type": "inkling",
        "architectures": ["InklingForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "first_k_dense_layers": 1,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "num_shared_experts": shared,
        "moe_intermediate_size": moe_intermediate,
        "route_scale": 1.0,
        "shortconv_kernel_size": kernel,
        "layer_types": default_layer_types(layers),
        "sliding_window": window,
        "rel_dim": rel_dim,
        "rel_extent": rel_extent,
        "attn_scale_beta": 0.1,
        "attn_scale_floor": floor,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "num_mtp_layers": mtp,
        "max_position_embeddings": max_pos,
    }


def _minimax(*, hidden, layers, heads, kv_heads, head_dim, intermediate, experts, top_k,
             moe_intermediate, index_dim, block, topk_blocks, rope_theta, max_pos) -> dict:
    return {
        "model_type": "minimax_m3",
        "architectures": ["MiniMaxM3ForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-6,
        "index_head_dim": index_dim,
        "index_block_size": block,
        "index_topk_blocks": topk_blocks,
        "intermediate_size": intermediate,
        "first_k_dense_layers": 1,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_intermediate,
        "routed_scaling_factor": 1.0,
        "num_shared_experts": 1,
        "tie_word_embeddings": False,
        "max_position_embeddings": max_pos,
    }


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "inkling": {
        # L=6: layers 0-4 sliding (W=16), layer 5 full; R=24 > W so the bias reaches past the window
        # on the full layer; floor 32 so the full layer's attention scaling starts at position 31.
        "tiny": _inkling(hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                         experts=8, top_k=2, shared=2, moe_intermediate=32, kernel=4, window=16,
                         rel_dim=8, rel_extent=24, floor=32, mtp=2, max_pos=4096),
        "small": _inkling(hidden=256, layers=12, heads=8, kv_heads=2, head_dim=32, intermediate=768,
                          experts=16, top_k=2, shared=2, moe_intermediate=128, kernel=4, window=128,
                          rel_dim=16, rel_extent=256, floor=1024, mtp=2, max_pos=8192),
        # 24 layers = 4 x [5 sliding + 1 full].
        "bench": _inkling(hidden=2048, layers=24, heads=16, kv_heads=4, head_dim=128, intermediate=6144,
                          experts=64, top_k=6, shared=2, moe_intermediate=512, kernel=4, window=4096,
                          rel_dim=32, rel_extent=1024, floor=8192, mtp=8, max_pos=131072),
    },
    "minimax_m3": {
        # MSA blocks of 8 with 4 selected: selection starts after 32 tokens.
        "tiny": _minimax(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                         experts=8, top_k=2, moe_intermediate=32, index_dim=16, block=8,
                         topk_blocks=4, rope_theta=10000.0, max_pos=4096),
        "small": _minimax(hidden=256, layers=12, heads=8, kv_heads=2, head_dim=32, intermediate=768,
                          experts=16, top_k=2, moe_intermediate=128, index_dim=32, block=32,
                          topk_blocks=8, rope_theta=10000.0, max_pos=8192),
        "bench": _minimax(hidden=2048, layers=24, heads=16, kv_heads=4, head_dim=128, intermediate=6144,
                          experts=64, top_k=6, moe_intermediate=512, index_dim=128, block=128,
                          topk_blocks=16, rope_theta=1000000.0, max_pos=131072),
    },
}


# MiniMax-M3's DSpark drafter per preset (MODELS.md 3.3: the DFlash design of MODELS.md 4), added by
# `kiln init-model --dspark` and `preset:minimax_m3/PRESET+dspark`. Sizes not listed are the
# target's (16 / 4 heads of 128 at `bench`); the taps follow SGLang's default [2, L // 2, L - 3],
# each shifted by one (a tap is the residual entering the layer); five layers and B = 16 as
# z-lab's DFlash2 configuration, `tiny` as small as the CPU tests' drafters.
DSPARK_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"target_layer_ids": [1, 3], "num_layers": 2, "block_size": 8, "intermediate_size": 96},
    "small": {"target_layer_ids": [3, 7, 10], "num_layers": 2, "block_size": 16, "intermediate_size": 768},
    "bench": {"target_layer_ids": [3, 13, 22], "num_layers": 5, "block_size": 16, "intermediate_size": 6144},
}
DSPARK_SUFFIX = "+dspark"  # `preset:minimax_m3/bench+dspark` in the benchmarks


def with_dspark(config: dict[str, Any], preset: str) -> dict[str, Any]:
    """`config` (a MiniMax-M3 preset dict) with `dspark_config`: `DSPARK_PRESETS[preset]`, its
    mask token the vocabulary's last id (a padding id past the tokenizer's tokens, as
    `kiln train-draft`'s DFlash default). Call it after the vocabulary is final."""
    if config.get("model_type") != "minimax_m3":
        raise ValueError(f"a DSpark drafter belongs to MiniMax-M3 checkpoints (MODELS.md 3.3), not "
                         f"{config.get('model_type')!r}; for a block drafter on another model train a DFlash "
                         "drafter (`kiln train-draft --method dflash`)")
    drafter = dict(DSPARK_PRESETS[preset], mask_token_id=int(config["vocab_size"]) - 1)
    drafter["target_layer_ids"] = list(drafter["target_layer_ids"])
    return {**config, "dspark_config": drafter}


def get_preset(arch: str, preset: str, dspark: bool = False) -> dict[str, Any]:
    """A copy of `PRESETS[arch][preset]` (with `dspark`, plus its DSpark drafter: `with_dspark`);
    ValueError naming the choices otherwise."""
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS[arch])}")
    config = {k: (list(v) if isinstance(v, list) else v) for k, v in PRESETS[arch][preset].items()}
    return with_dspark(config, preset) if dspark else config


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    value = getattr(config, name, None)
    return default if value is None else value


def param_counts(config: Any) -> tuple[int, int]:
    """(total, active per token) parameter counts of an Inkling or MiniMax-M3 config (a config.json
    dict or a config object), counted from the shapes of MODELS.md 2 and 3.

    total: every parameter (router bias buffers excluded; a tied head counted once).
    active: what one token's forward through the main model reads: total minus the MTP layers
    (Inkling) or the DSpark drafter (MiniMax-M3's `dspark_config`) and minus the E - k routed
    experts of every MoE layer a token skips.
    """
    g = lambda name, default=None: _get(config, name, default)  # noqa: E731
    arch = g("model_type")
    v, h, layers = int(g("vocab_size")), int(g("hidden_size")), int(g("num_hidden_layers"))
    hq = int(g("num_attention_heads"))
    hkv = int(g("num_key_value_heads", hq))
    d = int(g("head_dim", h // hq))
    inter, moe_inter = int(g("intermediate_size")), int(g("moe_intermediate_size"))
    e, k = int(g("num_experts")), int(g("num_experts_per_tok"))
    dense_layers = min(int(g("first_k_dense_layers", 1)), layers)
    moe_layers = layers - dense_layers
    tied = bool(g("tie_word_embeddings", False))
    embed = v * h * (1 if tied else 2) + h  # embedding, LM head, final norm
    swiglu = lambda width: 3 * h * width  # noqa: E731
    expert = swiglu(moe_inter)

    if arch == "inkling":
        dr, r = int(g("rel_dim", 32)), int(g("rel_extent", 1024))
        kk = int(g("shortconv_kernel_size", 4))
        s = int(g("num_shared_experts", 2))
        attn = h * (hq * d + 2 * hkv * d + hq * dr) + r * dr + hq * d * h + 2 * d  # qkvr, rel, o, q/k norm
        convs = 2 * hkv * d * kk + 2 * h * kk  # k, v, o, out ShortConv
        norms = 2 * h
        moe = (e + s) * h + 1 + (e + s) * expert  # router, global_scale, routed + shared experts
        body = layers * (attn + convs + norms) + dense_layers * swiglu(inter) + moe_layers * moe
        mtp_layer = 3 * h + 2 * h * h + attn + norms + swiglu(inter)  # enorm, hnorm, final_norm, eh_proj, block
        total = embed + body + int(g("num_mtp_layers", 8)) * mtp_layer
        active = embed + body - moe_layers * (e - k) * expert
        return total, active
    if arch == "minimax_m3":
        di = int(g("index_head_dim", 128))
        s = int(g("num_shared_experts", 1))
        attn = 2 * hq * d * h + 2 * hkv * d * h + 2 * d + 2 * hkv * di * h  # q, o, k, v, q/k norm, indexer
        moe = e * h + e * expert + swiglu(s * moe_inter)  # gate, routed experts, the shared expert
        body = layers * (attn + 2 * h) + dense_layers * swiglu(inter) + moe_layers * moe
        active = embed + body - moe_layers * (e - k) * expert
        return embed + body + _dspark_count(g("dspark_config"), config), active
    raise ValueError(f"param_counts: unsupported model_type {arch!r}")


def _dspark_count(drafter: Any, target: Any) -> int:
    """Parameters of a DSpark drafter (`dspark_config`: a dict or a parsed config; None: 0), the
    layout of `kiln.models.block_drafter`: fc and the context norm, per layer the attention (q, k,
    v, o, q/k norm), two norms and a SwiGLU MLP, then the final norm. It shares the target's
    embedding and LM head, so they are not counted again."""
    if drafter is None:
        return 0
    if not isinstance(drafter, dict):
        drafter = vars(drafter)
    if drafter.get("conv_kernel_size") or drafter.get("selector_rank"):
        raise ValueError("param_counts does not count DFlash2's conv or candidate selector")
    t = lambda name, default=None: _get(target, name, default)  # noqa: E731
    h = int(t("hidden_size"))
    hq = int(drafter.get("num_attention_heads") or t("num_attention_heads"))
    hkv = int(drafter.get("num_key_value_heads") or t("num_key_value_heads", hq))
    d = int(drafter.get("head_dim") or t("head_dim", h // hq))
    inter = int(drafter.get("intermediate_size") or t("intermediate_size"))
    taps = len(drafter["target_layer_ids"])
    layer = h * (hq * d + 2 * hkv * d) + hq * d * h + 2 * d + 2 * h + 3 * h * inter
    return taps * h * h + h + int(drafter.get("num_layers", 1)) * layer + h


def format_count(n: int) -> str:
    """Three significant digits in millions or billions: 6.80 M, 49.6 M, 5.76 B."""
    value, unit = (n / 1e9, "B") if n >= 1e9 else (n / 1e6, "M")
    decimals = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{decimals}f} {unit}"
