"""Model architectures read from a Hugging Face ``config.json``.

Two families are understood:

* dense Llama-family decoders with grouped-query attention (``llama``, ``mistral``, ``qwen2``,
  ``qwen3``): RMSNorm, GQA attention, SwiGLU MLP;
* DeepSeek-V2/V3 MoE decoders (``deepseek_v2``, ``deepseek_v3``): multi-head latent attention
  (MLA: low-rank Q, compressed KV latent + decoupled RoPE key), the first ``first_k_dense_replace``
  layers with a dense SwiGLU MLP, the rest with shared + routed SwiGLU experts.

Weights are bf16 (2 bytes/parameter). The multi-token-prediction module of DeepSeek-V3
(``num_nextn_predict_layers``) is not part of serving without speculative decoding and is left out.
``--model`` accepts a preset name (``llama3-8b``, ``llama3-70b``, ``llama3.1-405b``,
``deepseek-v3``) or a path to a ``config.json``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .errors import NeuScaleError

BYTES_PER_PARAM = 2  # bf16

DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
MLA_MOE_TYPES = {"deepseek_v2", "deepseek_v3"}
PRESETS = ("llama3-8b", "llama3-70b", "llama3.1-405b", "deepseek-v3")


@dataclass(frozen=True)
class ModelArch:
    name: str
    family: str                  # "dense" or "mla_moe"
    hidden: int
    intermediate: int            # dense MLP width (DeepSeek: the first dense layers)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int                # GQA head dim (dense family)
    vocab: int
    tie_embeddings: bool
    max_context: int
    # MoE
    moe_intermediate: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    experts_per_token: int = 0
    first_dense_layers: int = 0
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # ---- structure ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.family == "mla_moe"

    @property
    def dense_layers(self) -> int:
        return self.first_dense_layers if self.is_moe else self.layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.first_dense_layers if self.is_moe else 0

    def layer_kinds(self) -> list[str]:
        """Kind of each layer in order: "dense" or "moe"."""
        return ["dense"] * self.dense_layers + ["moe"] * self.moe_layers

    # ---- parameter counts (unsharded) --------------------------------------------------------
    def attn_params(self) -> int:
        h = self.hidden
        if self.is_moe:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * qk
            else:
                q = h * self.heads * qk
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim))
            o = self.heads * self.v_head_dim * h
            return q + kv + o + h  # + input norm
        d = self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + h

    def mlp_params(self, width: int | None = None) -> int:
        return 3 * self.hidden * (width or self.intermediate) + self.hidden  # + post-attn norm

    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def moe_params(self) -> int:
        return (self.n_routed_experts + self.n_shared_experts) * self.expert_params() \
            + self.hidden * self.n_routed_experts + self.hidden

    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden

    def total_params(self) -> int:
        return (self.layers * self.attn_params() + self.dense_layers * self.mlp_params()
                + self.moe_layers * self.moe_params() + self.embed_params())

    def weight_bytes(self) -> int:
        return self.total_params() * BYTES_PER_PARAM

    def kv_elems_per_token_per_layer(self, tp: int = 1) -> int:
        """KV-cache elements one token adds to one layer on one chip of a TP group.

        GQA: K and V for the chip's KV heads (replicated when tp > kv_heads). MLA: the compressed
        latent plus the RoPE key, which every TP rank holds in full (heads share it).
        """
        if self.is_moe:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * max(1, self.kv_heads // tp) * self.head_dim

    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_elems_per_token_per_layer(1) * BYTES_PER_PARAM

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _req(cfg: Mapping[str, Any], key: str, origin: str) -> Any:
    if key not in cfg:
        raise NeuScaleError(f"{origin}: config.json lacks {key!r}")
    return cfg[key]


def arch_from_config(cfg: Mapping[str, Any], name: str, origin: str = "config.json") -> ModelArch:
    mtype = str(cfg.get("model_type", "")).lower()
    if mtype not in DENSE_TYPES | MLA_MOE_TYPES:
        raise NeuScaleError(
            f"{origin}: model_type {mtype or '(missing)'!r} is not supported; supported: "
            f"{', '.join(sorted(DENSE_TYPES | MLA_MOE_TYPES))}")
    g = lambda k: _req(cfg, k, origin)  # noqa: E731
    heads = int(g("num_attention_heads"))
    hidden = int(g("hidden_size"))
    common = dict(
        name=name, hidden=hidden, intermediate=int(g("intermediate_size")),
        layers=int(g("num_hidden_layers")), heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), vocab=int(g("vocab_size")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_context=int(cfg.get("max_position_embeddings") or 0),
    )
    if mtype in DENSE_TYPES:
        arch = ModelArch(family="dense", **common)
    else:
        arch = ModelArch(
            family="mla_moe", **common,
            moe_intermediate=int(g("moe_intermediate_size")),
            n_routed_experts=int(g("n_routed_experts")),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            experts_per_token=int(g("num_experts_per_tok")),
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(g("kv_lora_rank")),
            qk_nope_head_dim=int(g("qk_nope_head_dim")),
            qk_rope_head_dim=int(g("qk_rope_head_dim")), v_head_dim=int(g("v_head_dim")),
        )
    _validate(arch, origin)
    return arch


def _validate(a: ModelArch, origin: str) -> None:
    vals = {k: v for k, v in asdict(a).items() if isinstance(v, int) and not isinstance(v, bool)}
    need_pos = ["hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"]
    if a.is_moe:
        need_pos += ["moe_intermediate", "n_routed_experts", "experts_per_token", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    bad = [k for k in need_pos if vals.get(k, 0) <= 0]
    if bad:
        raise NeuScaleError(f"{origin}: these fields must be positive integers: {bad}")
    if not a.is_moe and a.heads % a.kv_heads:
        raise NeuScaleError(f"{origin}: num_attention_heads ({a.heads}) must be a multiple of "
                            f"num_key_value_heads ({a.kv_heads})")
    if a.is_moe and a.experts_per_token > a.n_routed_experts:
        raise NeuScaleError(f"{origin}: num_experts_per_tok exceeds n_routed_experts")
    if a.first_dense_layers > a.layers:
        raise NeuScaleError(f"{origin}: first_k_dense_replace exceeds num_hidden_layers")


def load_model(spec: str) -> ModelArch:
    """A preset name or a path to a Hugging Face ``config.json`` (or a folder holding one)."""
    s = str(spec).strip()
    if s.lower() in PRESETS:
        text = resources.files("dse.presets").joinpath(f"{s.lower()}.json").read_text()
        return arch_from_config(json.loads(text), s.lower(), origin=f"preset {s.lower()}")
    p = Path(s).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise NeuScaleError(f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) "
                            "and no such config.json file")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NeuScaleError(f"cannot read model config {str(p)!r}: {e}") from None
    if not isinstance(cfg, Mapping):
        raise NeuScaleError(f"model config {str(p)!r} must be a JSON object")
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    return arch_from_config(cfg, name, origin=str(p))
