"""The architecture matrix: every (architecture, backend) pair either serves exactly or is refused at start-up.

Small random-weight models are built here from configs (no hub). "serves": ``full``'s cache path (prefill,
then decode through kvserve's attention, batched with a second sequence) gives the model's own logits and the
same greedy tokens as ``generate()``, and each compressed backend at its lossless setting (``int8`` and
``int4`` (rotated) with every token in their full-precision window, ``gqa`` with G = num_key_value_heads,
``mla`` at full rank, ``dca`` with threshold above 1) gives ``full``'s logits; each in every precision under
test, within its tolerance (:mod:`tests.precision`: in fp32 about 1e-4; greedy tokens up to a near-tie).
"refused": building or preparing the backend raises one line naming the unsupported feature (``kvserve serve``
prints it and exits 2 or 1). The sliding-window models have windows of 8 tokens, shorter than the prompts (14 and
21 tokens), so their windows mask. The matrix in docs/own-model.md is :func:`render` of :data:`EXPECTED`; a test keeps
them equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, Phi3Config, Qwen2Config, Qwen3Config)

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.store_path import StorePath

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = {
    "Llama (GQA)": lambda: LlamaConfig(**COMMON),
    "Mistral (no sliding window, v0.2+)": lambda: MistralConfig(**COMMON, sliding_window=None),
    "Mistral (sliding window, v0.1)": lambda: MistralConfig(**COMMON, sliding_window=8),
    "Qwen2 (q/k/v biases)": lambda: Qwen2Config(**COMMON),
    "Qwen3 (q/k norms)": lambda: Qwen3Config(**COMMON, head_dim=16),
    "Gemma 2 (soft-capping, sliding window)": lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=64),
    "Gemma 3 (sliding and global layers)": lambda: Gemma3TextConfig(
        **COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "Phi-3 (fused qkv)": lambda: Phi3Config(**COMMON),
    # Every token goes to all 4 experts: top-k routing is discontinuous, so in fp16 a rounding-level difference
    # flipped one expert choice and moved one position's logits by 0.05 (MoE, not the KV cache).
    "DeepSeek-V3 (native MLA)": lambda: DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
}
BACKENDS = ["full", "int8", "int4", "gqa", "mla", "dca"]
SERVES = "serves"
SOFTCAP = "refused: soft-capping"
WINDOW = "refused: sliding window"
ROPE = "refused: RoPE per layer type"
EXPECTED = {
    "Llama (GQA)": dict.fromkeys(BACKENDS, SERVES),
    "Mistral (no sliding window, v0.2+)": dict.fromkeys(BACKENDS, SERVES),
    "Mistral (sliding window, v0.1)": {**dict.fromkeys(BACKENDS, SERVES), "dca": WINDOW},
    "Qwen2 (q/k/v biases)": dict.fromkeys(BACKENDS, SERVES),
    "Qwen3 (q/k norms)": dict.fromkeys(BACKENDS, SERVES),
    "Gemma 2 (soft-capping, sliding window)": {**dict.fromkeys(BACKENDS, SOFTCAP), "dca": WINDOW},
    "Gemma 3 (sliding and global layers)": {**dict.fromkeys(BACKENDS, SERVES), "gqa": ROPE, "mla": ROPE, "dca": WINDOW},
    "Phi-3 (fused qkv)": {**dict.fromkeys(BACKENDS, SERVES), "dca": "refused: fused qkv_proj"},
    "DeepSeek-V3 (native MLA)": {"full": SERVES, "int8": "refused: native MLA latent",
                                 "int4": "refused: native MLA latent", "gqa": "refused: native MLA latent",
                                 "mla": "serves (absorbed)", "dca": "refused: native MLA latent"},
}
# What each refusal's one line must name.
REFUSAL_WORDS = {WINDOW: ["sliding window"], SOFTCAP: ["soft-capping"], ROPE: ["different RoPE parameters"],
                 "refused: fused qkv_proj": ["q_proj"], "refused: native MLA latent": ["natively MLA"]}


def lossless_options(name: str, geometry: ModelGeometry) -> dict:
    return {"full": {}, "int8": {"residual": 64}, "int4": {"residual": 64, "rotate": True},
            "gqa": {"groups": geometry.num_key_value_heads},
            "mla": {"rank": 2 * geometry.num_key_value_heads * geometry.head_dim} if not geometry.kv_lora_rank else {},
            "dca": {"threshold": 1.01}}[name]


def render(expected: dict = EXPECTED) -> str:
    """The matrix of docs/own-model.md (markdown)."""
    lines = ["| architecture | " + " | ".join(f"`{b}`" for b in BACKENDS) + " |", "|---|" + "---|" * len(BACKENDS)]
    lines += [f"| {arch} | " + " | ".join(row[b] for b in BACKENDS) + " |" for arch, row in expected.items()]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def models(precision):
    """Each architecture's model (weights drawn in fp32 with seed 0) on the device and in the dtype under test."""
    built = {}
    for arch, make_config in ARCHS.items():
        torch.manual_seed(0)
        built[arch] = AutoModelForCausalLM.from_config(make_config()).eval().to(precision.device, precision.dtype)
    return built


def cache_path(model, backend, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of the last 6 positions of each prompt: prefill all but 6 tokens, then 6 batched decode steps."""
    runner = StorePath(model, backend.geometry.num_layers)
    stores = [backend.new_store() for _ in prompts]
    rows = [[runner.prefill(p[:-6], s)[-1]] for p, s in zip(prompts, stores)]
    for k in range(6, 1, -1):
        out = runner.decode([p[-k] for p in prompts], stores)
        for row, logits in zip(rows, out):
            row.append(logits)
    return torch.stack([torch.stack(r) for r in rows])  # (batch, 6, vocab)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_row(models, precision, arch):
    model = models[arch]
    geometry = ModelGeometry.from_config(model.config, model.dtype)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (14, 21)]
    calibration = torch.randint(3, 128, (700,), generator=gen).tolist()
    full = None
    for name in BACKENDS:
        want = EXPECTED[arch][name]
        try:
            backend = create(name, geometry, **lossless_options(name, geometry))
            backend.prepare(model, calibration)
            logits = cache_path(model, backend, prompts)
        except ValueError as exc:
            assert want.startswith("refused"), (arch, name, str(exc))
            assert "\n" not in str(exc) and all(w in str(exc) for w in REFUSAL_WORDS[want]), (arch, name, str(exc))
            continue
        assert want.startswith("serves"), (arch, name, "served but expected", want)
        if name == "full":
            full = logits
            for p, row in zip(prompts, logits):
                with torch.no_grad():
                    own = model(torch.tensor([p], device=precision.device)).logits[0, -7:-1]
                precision.assert_close(row, own, what=f"{arch}: full vs the model's own logits")
            ids = torch.tensor([prompts[0]], device=precision.device)
            ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
            runner, store = StorePath(model, geometry.num_layers), backend.new_store()
            token, ours = int(runner.prefill(prompts[0], store)[-1].argmax()), []
            for _ in range(8):
                ours.append(token)
                token = int(runner.decode([token], [store])[0].argmax())
            precision.assert_greedy_agrees(model, prompts[0], ours, ref[0, ids.shape[1]:].tolist())
        else:
            precision.assert_close(logits, full, what=f"{arch}: {name} vs full")


def test_docs_carry_the_matrix():
    page = (Path(__file__).resolve().parents[1] / "docs" / "own-model.md").read_text()
    assert render() in page, "docs/own-model.md's architecture matrix differs from tests/test_arch_matrix.py::render()"
