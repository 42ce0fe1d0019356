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
``deepseek-v3``) or a path to a ``config.json`` (a regular UTF-8 file of at most 16 MiB).

Every key the loader reads is checked - type (a whole number, not a string, bool, list, NaN or
a fraction), range (far above any real model at most), consistency (heads divisible by KV heads,
hidden size by heads unless ``head_dim`` is given, even RoPE dimensions, first dense layers
within the layer count) - and a bad one raises one :class:`NeuScaleError` naming the key. An
optional key that is absent or null takes its default (Hugging Face writes null for "not set").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .errors import NeuScaleError
from .files import read_text

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


# Upper bounds far above any real model: a value past one is a typo (or a unit mix-up), and
# letting it through would only produce absurd numbers (or shapes JAX cannot lower) later.
_MAX_WIDTH = 1 << 20          # hidden / FFN widths, latent ranks
_MAX_COUNT = 1 << 16          # layers, heads, experts, per-head dims
_MAX_VOCAB = 1 << 24
_MAX_CONTEXT = 1 << 40
MAX_CONFIG_BYTES = 16 << 20   # a real config.json is a few KiB


def _kind(v: Any) -> str:
    """How a JSON value reads in an error message."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    if isinstance(v, Mapping):
        return "an object"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v).replace("inf", "Infinity").replace("nan", "NaN")
    return repr(v) if isinstance(v, (int, float)) else type(v).__name__


class _Fields:
    """Typed, range-checked reads of a config mapping; every refusal names the config key."""

    def __init__(self, cfg: Mapping[str, Any], origin: str):
        self.cfg, self.origin = cfg, origin

    def fail(self, msg: str) -> NeuScaleError:
        return NeuScaleError(f"{self.origin}: {msg}")

    def int(self, key: str, lo: int = 1, hi: int = _MAX_COUNT, default: int | None = None,
            hi_is: str = "") -> int:
        """An integer in [lo, hi] (``hi_is``: the key that sets hi). ``default`` None: required;
        else the value of an absent or null key (Hugging Face writes null for "not set")."""
        v = self.cfg.get(key)
        if v is None:
            if default is not None:
                return default
            if key in self.cfg:
                raise self.fail(f"{key} is null; it must be an integer from {lo} to {hi:,}")
            raise self.fail(f"config.json lacks {key!r}")
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)                      # 4096.0 is 4096; 4096.5 is refused below
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"{key} must be a whole number from {lo} to {hi:,}, not {_kind(v)}")
        if not lo <= v <= hi:
            bound = f"{hi:,} ({hi_is})" if hi_is else f"{hi:,}"
            raise self.fail(f"{key} must be from {lo} to {bound} (got {v:,})")
        return v

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(f"{key} must be true or false, not {_kind(v)}")
        return v


def arch_from_config(cfg: Mapping[str, Any], name: str, origin: str = "config.json") -> ModelArch:
    """The architecture described by a Hugging Face config mapping. Every key read is checked
    for type, range and consistency; a bad one raises :class:`NeuScaleError` naming it. Optional
    keys that are absent or null take their default (Hugging Face writes null for "not set")."""
    if not isinstance(cfg, Mapping):
        raise NeuScaleError(f"{origin}: a model config must be a JSON object, not {_kind(cfg)}")
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise NeuScaleError(f"{origin}: model_type must be a string, not {_kind(mt)}")
    mtype = (mt or "").lower()
    if mtype not in DENSE_TYPES | MLA_MOE_TYPES:
        raise NeuScaleError(
            f"{origin}: model_type {mtype or '(missing)'!r} is not supported; supported: "
            f"{', '.join(sorted(DENSE_TYPES | MLA_MOE_TYPES))}")
    f = _Fields(cfg, origin)
    moe = mtype in MLA_MOE_TYPES
    hidden = f.int("hidden_size", hi=_MAX_WIDTH)
    heads = f.int("num_attention_heads")
    layers = f.int("num_hidden_layers")
    kv_heads = f.int("num_key_value_heads", hi=heads, default=heads, hi_is="num_attention_heads")
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        head_dim = f.int("head_dim")
    elif not moe and hidden % heads:
        raise f.fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}):"
                     " fix one of them or give head_dim explicitly")
    else:
        head_dim = hidden // heads      # MLA models do not use it (their head dims are below)
    if not moe:
        if heads % kv_heads:
            raise f.fail(f"num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
        if head_dim % 2:
            raise f.fail(f"head_dim ({head_dim}) must be even: RoPE rotates pairs of dimensions")
    common = dict(
        name=name, hidden=hidden, intermediate=f.int("intermediate_size", hi=_MAX_WIDTH),
        layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=f.int("vocab_size", hi=_MAX_VOCAB),
        tie_embeddings=f.bool("tie_word_embeddings"),
        max_context=f.int("max_position_embeddings", hi=_MAX_CONTEXT, default=0),
    )
    if not moe:
        return ModelArch(family="dense", **common)
    freq = f.int("moe_layer_freq", default=1)
    if freq != 1:
        raise f.fail(f"moe_layer_freq {freq} is not supported: only models whose every layer "
                     "after the first_k_dense_replace dense ones is MoE (moe_layer_freq 1)")
    n_routed = f.int("n_routed_experts")
    rope = f.int("qk_rope_head_dim")
    if rope % 2:
        raise f.fail(f"qk_rope_head_dim ({rope}) must be even: RoPE rotates pairs of dimensions")
    return ModelArch(
        family="mla_moe", **common,
        moe_intermediate=f.int("moe_intermediate_size", hi=_MAX_WIDTH),
        n_routed_experts=n_routed,
        n_shared_experts=f.int("n_shared_experts", lo=0, default=0),
        experts_per_token=f.int("num_experts_per_tok", hi=n_routed, hi_is="n_routed_experts"),
        first_dense_layers=f.int("first_k_dense_replace", lo=0, hi=layers, default=0,
                                 hi_is="num_hidden_layers"),
        q_lora_rank=f.int("q_lora_rank", lo=0, hi=_MAX_WIDTH, default=0),
        kv_lora_rank=f.int("kv_lora_rank", hi=_MAX_WIDTH),
        qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=rope,
        v_head_dim=f.int("v_head_dim"),
    )


def load_model(spec: str) -> ModelArch:
    """A preset name or a path to a Hugging Face ``config.json`` (or a folder holding one)."""
    s = str(spec).strip()
    if s.lower() in PRESETS:
        text = resources.files("dse.presets").joinpath(f"{s.lower()}.json").read_text()
        return arch_from_config(json.loads(text), s.lower(), origin=f"preset {s.lower()}")
    unknown = NeuScaleError(f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) "
                            "and no such config.json file")
    if not s:
        raise unknown
    p = Path(s).expanduser()
    try:
        if p.is_dir():
            p = p / "config.json"
        os.stat(p)
    except (FileNotFoundError, ValueError):   # ValueError: a NUL byte in the path
        raise unknown from None
    except OSError:
        pass                              # read_text words the problem
    text = read_text(p, "model config", MAX_CONFIG_BYTES)
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise NeuScaleError(f"model config {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, Mapping):
        raise NeuScaleError(f"model config {str(p)!r} must be a JSON object, not {_kind(cfg)}")
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    return arch_from_config(cfg, name, origin=str(p))
