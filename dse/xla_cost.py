"""Per-chip FLOPs from XLA's HLO cost analysis of the sharded per-chip graph (paper §3.3).

The per-chip graph of one layer is split into *components* (attention for prefill or decode,
dense MLP, MoE router + shared expert, routed experts, LM head), each a JAX function of the
chip's shard of the weights (TP/EP already applied) and of its own size variables:

    attn_prefill(b, s)   b sequences of s tokens, causal self-attention
    attn_decode(b, l)    b sequences, one new token each, KV cache of length l
    mlp(t), moe_tok(t), lm_head(t)      t tokens
    experts(c)           the chip's E/ep experts with c tokens each

Each component is lowered on the CPU (``jax.jit(f).lower(...)``) and ``cost_analysis()`` read.
We use the *lowered* (pre-optimisation) module: it counts bf16 work as written, whereas the CPU
compiler upcasts bf16 and fuses for a CPU, neither of which a TPU does. The counts are integer
polynomials in the size variables (reported as float32), so a few lowered points determine the
polynomial; held-out points check it (max relative error is recorded) and the matmul-only analytic count is
compared too. Coefficients are cached on disk keyed by everything that decides them: the model
fingerprint, the shard, the JAX and jaxlib versions and the graph version (a hash of this
module's source: graphs, fit points, bases), so a rebuild lowers nothing and a changed graph
never reuses old counts. A cached fit is re-checked cheaply when read (finite, non-negative, and
as close to the matmul-only hand count as when it was made); a damaged one is lowered again.
Two overlapping builds merge their fits into the file (under a lock) instead of overwriting.

XLA's "bytes accessed" is recorded as well (an unfused upper bound used as a cross-check); the
HBM traffic the roofline uses comes from the fused-op model in :mod:`dse.costmodel`.

MoE traps avoided (see the issue's probe notes): experts are a dense einsum over the chip's
expert-capacity buffer ``[E_local, c, H]`` - no cumsum slotting (costed quadratically) and no
``ragged_dot`` (costed as dense over all groups). Collectives are not in these graphs at all;
they are costed analytically from the torus (cost_analysis has no communication key).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .cache import cache_path, locked, say_once
from .errors import NeuScaleError
from .files import MiB, read_text, write_atomic
from .models import ModelArch

COMPONENT_VARS: dict[str, tuple[str, ...]] = {
    "attn_prefill": ("b", "s"),
    "attn_decode": ("b", "l"),
    "mlp": ("t",),
    "moe_tok": ("t",),
    "experts": ("c",),
    "lm_head": ("t",),
}

# Monomial exponents per component (same order as COMPONENT_VARS).
COMPONENT_BASIS: dict[str, tuple[tuple[int, ...], ...]] = {
    "attn_prefill": ((1, 2), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)),
    "attn_decode": ((1, 1), (1, 0), (0, 1), (0, 0)),
    "mlp": ((1,), (0,)),
    "moe_tok": ((1,), (0,)),
    "experts": ((1,), (0,)),
    "lm_head": ((1,), (0,)),
}

# Points lowered to fit (one more than the basis has terms) and held out to verify. They span
# the range (lowering time does not depend on sizes) so float32 rounding of the reported counts
# is not amplified by extrapolation. Sizes of 1 are avoided: XLA drops size-1 dimensions (free reshapes), so byte counts at b=1 sit off the
# polynomial that holds for every b >= 2.
FIT_POINTS: dict[str, tuple[tuple[int, ...], ...]] = {
    "attn_prefill": ((2, 256), (3, 256), (2, 1024), (3, 2048), (2, 4096), (4, 3072), (5, 512)),
    "attn_decode": ((2, 256), (3, 256), (2, 2048), (3, 4096), (4, 1024)),
    "mlp": ((2,), (7,), (64,)),
    "moe_tok": ((2,), (7,), (64,)),
    "experts": ((2,), (3,), (8,)),
    "lm_head": ((2,), (5,), (32,)),
}
HELDOUT_POINTS: dict[str, tuple[tuple[int, ...], ...]] = {
    "attn_prefill": ((7, 1000),),
    "attn_decode": ((5, 3000),),
    "mlp": ((1000,),),
    "moe_tok": ((1000,),),
    "experts": ((100,),),
    "lm_head": ((300,),),
}

# bump when a graph changes: cached fits of older graphs are then ignored
FORMAT_VERSION = 4


def _pkg_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def jax_version() -> str:
    """Installed JAX version without importing JAX (keeps warm builds fast)."""
    return _pkg_version("jax")


@functools.lru_cache(maxsize=None)
def graph_version() -> str:
    """Hash of what decides the fitted numbers besides the model: this module's source (the
    graphs, fit and held-out points, bases, the hand count), :data:`FORMAT_VERSION`, the JAX
    and jaxlib versions (XLA's cost analysis is jaxlib's) and the platform lowered for."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"|{FORMAT_VERSION}|{jax_version()}|{_pkg_version('jaxlib')}"
             f"|{os.environ.get('JAX_PLATFORMS', 'cpu')}".encode())
    return h.hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Shard geometry: the chip-local sizes of a model under (tp, ep)
# ---------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardDims:
    """Chip-local dimensions of ``arch`` under tensor parallelism ``tp`` and expert parallelism
    ``ep``. Heads and FFN widths are split ``tp`` ways (rounded up: padding); GQA KV heads are
    replicated when ``tp`` exceeds their number; experts are split ``ep`` ways."""

    tp: int
    ep: int
    hidden: int
    heads: int         # local query heads
    kv_heads: int      # local KV heads (GQA)
    head_dim: int
    inter: int         # local dense MLP width
    vocab: int         # local vocab rows of the LM head
    # MoE / MLA
    experts: int = 0   # local routed experts
    moe_inter: int = 0  # local expert width
    shared_inter: int = 0  # local shared-expert width
    n_experts_total: int = 0
    top_k: int = 0
    q_lora: int = 0
    kv_lora: int = 0
    nope: int = 0
    rope: int = 0
    v_dim: int = 0

    @classmethod
    def of(cls, a: ModelArch, tp: int, ep: int = 1) -> "ShardDims":
        kw: dict[str, Any] = dict(
            tp=tp, ep=ep, hidden=a.hidden, heads=cdiv(a.heads, tp),
            kv_heads=max(1, a.kv_heads // tp), head_dim=a.head_dim, inter=cdiv(a.intermediate, tp),
            vocab=cdiv(a.vocab, tp))
        if a.is_moe:
            kw.update(experts=cdiv(a.n_routed_experts, ep), moe_inter=cdiv(a.moe_intermediate, tp),
                      shared_inter=cdiv(a.n_shared_experts * a.moe_intermediate, tp),
                      n_experts_total=a.n_routed_experts, top_k=a.experts_per_token,
                      q_lora=a.q_lora_rank, kv_lora=a.kv_lora_rank, nope=a.qk_nope_head_dim,
                      rope=a.qk_rope_head_dim, v_dim=a.v_head_dim)
        return cls(**kw)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora > 0


def components_for(a: ModelArch, phase: str) -> list[str]:
    attn = "attn_prefill" if phase == "prefill" else "attn_decode"
    comps = [attn, "mlp", "lm_head"]
    if a.is_moe:
        comps += ["moe_tok", "experts"]
    return comps


def fit_key(component: str, tp: int, ep: int) -> str:
    # only the experts' shard depends on ep
    return f"{component}|tp={tp}" + (f"|ep={ep}" if component == "experts" else "")


# ---------------------------------------------------------------------------------------------
# Analytic matmul FLOPs (cross-check for the XLA count; elementwise work not included)
# ---------------------------------------------------------------------------------------------

def analytic_matmul_flops(d: ShardDims, component: str, v: Sequence[float]) -> float:
    H = d.hidden
    if component in ("attn_prefill", "attn_decode"):
        b, n = v
        if component == "attn_prefill":
            t, q_len, kv_len = b * n, n, n
        else:
            t, q_len, kv_len = b, 1, n
        if d.is_mla:
            qk = d.nope + d.rope
            proj = 2 * t * (H * d.q_lora + d.q_lora * d.heads * qk + H * (d.kv_lora + d.rope)
                            + d.heads * d.v_dim * H)
            if component == "attn_prefill":
                proj += 2 * t * d.kv_lora * d.heads * (d.nope + d.v_dim)
                core = 2 * b * d.heads * q_len * kv_len * (qk + d.v_dim)
            else:  # absorbed: q_nope -> latent, attend in latent space, latent -> v
                proj += 2 * t * d.heads * d.nope * d.kv_lora + 2 * t * d.heads * d.kv_lora * d.v_dim
                core = 2 * b * d.heads * q_len * kv_len * (d.kv_lora + d.rope + d.kv_lora)
            return proj + core
        hd = d.head_dim
        proj = 2 * t * H * (d.heads + 2 * d.kv_heads) * hd + 2 * t * d.heads * hd * H
        core = 2 * 2 * b * d.heads * q_len * kv_len * hd
        return proj + core
    (x,) = v
    if component == "mlp":
        return 2 * x * H * d.inter * 3
    if component == "moe_tok":
        return 2 * x * H * d.n_experts_total + 2 * x * H * d.shared_inter * 3
    if component == "experts":
        return 2 * d.experts * x * H * d.moe_inter * 3
    if component == "lm_head":
        return 2 * x * H * d.vocab
    raise KeyError(component)


# ---------------------------------------------------------------------------------------------
# JAX graphs (imported lazily: a warm build never imports JAX)
# ---------------------------------------------------------------------------------------------

def _jax():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    return jax, jnp


class _Ops:
    """The JAX building blocks the component graphs share (bf16 activations, fp32 reductions)."""

    def __init__(self):
        self.jax, self.jnp = jax, jnp = _jax()
        self.bf, self.f32 = jnp.bfloat16, jnp.float32

    def shape(self, *shape, dt=None):
        """An argument of the given shape, bf16 unless ``dt`` says otherwise."""
        return self.jax.ShapeDtypeStruct(tuple(int(x) for x in shape),
                                         self.bf if dt is None else dt)

    def rms(self, x, w):
        jax, jnp, f32 = self.jax, self.jnp, self.f32
        xf = x.astype(f32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
        return (y * w.astype(f32)).astype(self.bf)

    def rope(self, x, cos, sin):  # x [..., s, n, r]; cos/sin [s, r/2]
        jnp, bf = self.jnp, self.bf
        x1, x2 = jnp.split(x, 2, axis=-1)
        c = cos[:, None, :].astype(bf)
        s_ = sin[:, None, :].astype(bf)
        return jnp.concatenate([x1 * c - x2 * s_, x2 * c + x1 * s_], axis=-1)

    def softmax(self, x):
        jnp = self.jnp
        x = x.astype(self.f32)
        m = jnp.max(x, axis=-1, keepdims=True)
        e = jnp.exp(x - m)
        return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(self.bf)

    def swiglu(self, h, wg, wu, wd):
        return self.jnp.einsum("...i,ih->...h", self.jax.nn.silu(h @ wg) * (h @ wu), wd)


def _mla_attention(o: _Ops, d: ShardDims, prefill: bool, b: int, s: int, L: int
                   ) -> tuple[Callable, list]:
    """DeepSeek MLA: compressed latent + RoPE key; decode attends in the latent space
    (absorbed projections)."""
    jnp, S, f32 = o.jnp, o.shape, o.f32
    H, qk = d.hidden, d.nope + d.rope

    def f(x, nw, wqa, qn, wqb, wkva, kvn, wkvb, wo, cos, sin, *cache):
        h = o.rms(x, nw)                                      # [b,s,H]
        q = jnp.einsum("bsr,rnd->bsnd", o.rms(h @ wqa, qn), wqb)
        q_nope, q_pe = q[..., :d.nope], q[..., d.nope:]
        q_pe = o.rope(q_pe, cos[:s], sin[:s])
        ckv = h @ wkva                                        # [b,s,kv_lora+rope]
        c = o.rms(ckv[..., :d.kv_lora], kvn)
        k_pe = o.rope(ckv[..., None, d.kv_lora:], cos[:s], sin[:s])[..., 0, :]
        if prefill:
            kv = jnp.einsum("bsc,cnd->bsnd", c, wkvb)
            k_nope, val = kv[..., :d.nope], kv[..., d.nope:]
            sc = (jnp.einsum("bsnd,btnd->bnst", q_nope, k_nope)
                  + jnp.einsum("bsnr,btr->bnst", q_pe, k_pe)) * (qk ** -0.5)
            mask = jnp.tril(jnp.ones((s, s), bool))
            p = o.softmax(jnp.where(mask, sc, -1e30))
            out = jnp.einsum("bnst,btnd->bsnd", p, val)
        else:
            c_cache, pe_cache = cache                         # [b,L,kv_lora], [b,L,rope]
            w_uk, w_uv = wkvb[..., :d.nope], wkvb[..., d.nope:]
            q_lat = jnp.einsum("bsnd,cnd->bsnc", q_nope, w_uk)
            sc = (jnp.einsum("bsnc,blc->bnsl", q_lat, c_cache)
                  + jnp.einsum("bsnr,blr->bnsl", q_pe, pe_cache)) * (qk ** -0.5)
            p = o.softmax(sc)
            o_lat = jnp.einsum("bnsl,blc->bsnc", p, c_cache)
            out = jnp.einsum("bsnc,cnd->bsnd", o_lat, w_uv)
        # the new tokens' latent and rope key are outputs: they go to the cache
        return jnp.einsum("bsnd,ndh->bsh", out, wo) + x, c, k_pe

    args = [S(b, s, H), S(H), S(H, d.q_lora), S(d.q_lora), S(d.q_lora, d.heads, qk),
            S(H, d.kv_lora + d.rope), S(d.kv_lora),
            S(d.kv_lora, d.heads, d.nope + d.v_dim), S(d.heads, d.v_dim, H),
            S(max(s, 1), d.rope // 2, dt=f32), S(max(s, 1), d.rope // 2, dt=f32)]
    if not prefill:
        args += [S(b, L, d.kv_lora), S(b, L, d.rope)]
    return f, args


def _gqa_attention(o: _Ops, d: ShardDims, prefill: bool, b: int, s: int, L: int
                   ) -> tuple[Callable, list]:
    """Grouped-query attention over the chip's query and KV heads."""
    jnp, S, f32 = o.jnp, o.shape, o.f32
    H, hd, nq, nkv = d.hidden, d.head_dim, d.heads, d.kv_heads
    g = max(1, nq // nkv)

    def f(x, nw, wq, wk, wv, wo, cos, sin, *cache):
        h = o.rms(x, nw)
        q = o.rope(jnp.einsum("bsh,hnd->bsnd", h, wq), cos, sin)
        k = o.rope(jnp.einsum("bsh,hkd->bskd", h, wk), cos, sin)
        val = jnp.einsum("bsh,hkd->bskd", h, wv)
        q = q.reshape(b, s, nkv, g, hd)
        if prefill:
            sc = jnp.einsum("bskgd,btkd->bkgst", q, k) * (hd ** -0.5)
            mask = jnp.tril(jnp.ones((s, s), bool))
            p = o.softmax(jnp.where(mask, sc, -1e30))
            out = jnp.einsum("bkgst,btkd->bskgd", p, val)
        else:
            k_cache, v_cache = cache
            sc = jnp.einsum("bskgd,btkd->bkgst", q, k_cache) * (hd ** -0.5)
            p = o.softmax(sc)
            out = jnp.einsum("bkgst,btkd->bskgd", p, v_cache)
        out = out.reshape(b, s, nkv * g, hd)
        # new K/V are outputs (they are written to the cache)
        return jnp.einsum("bsnd,ndh->bsh", out, wo) + x, k, val

    args = [S(b, s, H), S(H), S(H, nq, hd), S(H, nkv, hd), S(H, nkv, hd), S(nq, hd, H),
            S(s, hd // 2, dt=f32), S(s, hd // 2, dt=f32)]
    if not prefill:
        args += [S(b, L, nkv, hd), S(b, L, nkv, hd)]
    return f, args


def _attention_graph(prefill: bool):
    """attn_prefill(b, s): causal self-attention of b prompts of s tokens; attn_decode(b, l):
    b sequences, one new token each, over a KV cache of length l."""
    def build(o: _Ops, d: ShardDims, v: Sequence[int]) -> tuple[Callable, list]:
        b, n = v
        attn = _mla_attention if d.is_mla else _gqa_attention
        return attn(o, d, prefill, b, n if prefill else 1, n)
    return build


def _mlp_graph(o: _Ops, d: ShardDims, v: Sequence[int]) -> tuple[Callable, list]:
    (t,), S, H = v, o.shape, d.hidden

    def f(x, nw, wg, wu, wd):
        return o.swiglu(o.rms(x, nw), wg, wu, wd) + x
    return f, [S(t, H), S(H), S(H, d.inter), S(H, d.inter), S(d.inter, H)]


def _moe_tok_graph(o: _Ops, d: ShardDims, v: Sequence[int]) -> tuple[Callable, list]:
    """Router (fp32, sigmoid scores, top-k) and the shared expert."""
    (t,), S, H = v, o.shape, d.hidden
    jax, jnp, f32 = o.jax, o.jnp, o.f32

    def f(x, nw, wr, wg, wu, wd):
        h = o.rms(x, nw)
        scores = jax.nn.sigmoid((h.astype(f32) @ wr))
        w, idx = jax.lax.top_k(scores, d.top_k)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        return o.swiglu(h, wg, wu, wd) + x, w, idx
    return f, [S(t, H), S(H), S(H, d.n_experts_total, dt=f32), S(H, d.shared_inter),
               S(H, d.shared_inter), S(d.shared_inter, H)]


def _experts_graph(o: _Ops, d: ShardDims, v: Sequence[int]) -> tuple[Callable, list]:
    """The chip's routed experts as one dense einsum over the [E_local, c, H] buffer."""
    (c,), S, H = v, o.shape, d.hidden
    jax, jnp = o.jax, o.jnp

    def f(x, gate_w, wg, wu, wd):
        hg = jnp.einsum("ech,ehi->eci", x, wg)
        hu = jnp.einsum("ech,ehi->eci", x, wu)
        y = jnp.einsum("eci,eih->ech", jax.nn.silu(hg) * hu, wd)
        return y * gate_w[..., None]
    E, I = d.experts, d.moe_inter
    return f, [S(E, c, H), S(E, c), S(E, H, I), S(E, H, I), S(E, I, H)]


def _lm_head_graph(o: _Ops, d: ShardDims, v: Sequence[int]) -> tuple[Callable, list]:
    (t,), S, H = v, o.shape, d.hidden

    def f(x, nw, w):
        return (o.rms(x, nw) @ w).astype(o.f32)
    return f, [S(t, H), S(H), S(H, d.vocab)]


# one graph builder per component (the keys of COMPONENT_VARS)
_GRAPHS: dict[str, Callable[[_Ops, ShardDims, Sequence[int]], tuple[Callable, list]]] = {
    "attn_prefill": _attention_graph(prefill=True),
    "attn_decode": _attention_graph(prefill=False),
    "mlp": _mlp_graph,
    "moe_tok": _moe_tok_graph,
    "experts": _experts_graph,
    "lm_head": _lm_head_graph,
}


def _graph(d: ShardDims, component: str, v: Sequence[int]) -> tuple[Callable, list]:
    """The JAX function and argument shapes of one component at sizes ``v``."""
    o = _Ops()
    try:
        build = _GRAPHS[component]
    except KeyError:
        raise KeyError(component) from None
    return build(o, d, v)


def lowered_cost(d: ShardDims, component: str, v: Sequence[int]) -> tuple[float, float]:
    """(flops, bytes accessed) of the lowered, unoptimised HLO of one component."""
    jax, _ = _jax()
    f, args = _graph(d, component, v)
    ca = jax.jit(f).lower(*args).cost_analysis()
    if isinstance(ca, (list, tuple)):  # older JAX returned one dict per computation
        ca = ca[0]
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


# ---------------------------------------------------------------------------------------------
# Polynomials
# ---------------------------------------------------------------------------------------------

def _design(basis: Sequence[Sequence[int]], pts: Sequence[Sequence[float]]) -> np.ndarray:
    P = np.asarray(pts, dtype=np.float64)
    return np.stack([np.prod(P ** np.asarray(e, dtype=np.float64), axis=1) for e in basis],
                    axis=1)


def fit_poly(basis, pts, values) -> np.ndarray:
    """Least-squares polynomial through the points.

    HLO cost counts are integer polynomials of the size variables, but ``cost_analysis()``
    reports them as float32 (7 significant digits), so points above 2^24 carry ~1e-7 relative
    rounding: the fit is exact to that precision, which the held-out check reports.
    """
    A = _design(basis, pts)
    y = np.asarray(values, dtype=np.float64)
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(A / scale, y, rcond=None)
    coef = coef / scale
    r = np.round(coef)
    snap = np.abs(coef - r) <= 1e-3 * np.maximum(1.0, np.abs(coef))
    return np.where(snap, r, coef)


def eval_poly(basis, coef, *xs):
    out = 0.0
    for e, c in zip(basis, coef):
        if c == 0:
            continue
        term = c
        for x, p in zip(xs, e):
            if p:
                term = term * (x ** p if p != 1 else x)
        out = out + term
    return out


@dataclass(frozen=True)
class ComponentFit:
    key: str
    component: str
    basis: tuple[tuple[int, ...], ...]
    flops: tuple[float, ...]
    xla_bytes: tuple[float, ...]
    heldout_max_rel_err: float
    analytic_max_rel_diff: float

    def flops_at(self, *xs):
        return eval_poly(self.basis, self.flops, *xs)

    def xla_bytes_at(self, *xs):
        return eval_poly(self.basis, self.xla_bytes, *xs)

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "basis": [list(e) for e in self.basis],
                "flops": list(self.flops), "xla_bytes": list(self.xla_bytes),
                "heldout_max_rel_err": self.heldout_max_rel_err,
                "analytic_max_rel_diff": self.analytic_max_rel_diff}

    @classmethod
    def from_json(cls, key: str, j: dict[str, Any]) -> "ComponentFit":
        return cls(key, j["component"], tuple(tuple(e) for e in j["basis"]), tuple(j["flops"]),
                   tuple(j["xla_bytes"]), float(j["heldout_max_rel_err"]),
                   float(j["analytic_max_rel_diff"]))


def extract_fit(arch: ModelArch, component: str, tp: int, ep: int) -> ComponentFit:
    """Lower the component at the fit points, fit, verify on held-out points."""
    d = ShardDims.of(arch, tp, ep)
    basis = COMPONENT_BASIS[component]
    pts = FIT_POINTS[component]
    fl, by = zip(*(lowered_cost(d, component, p) for p in pts))
    cf, cb = fit_poly(basis, pts, fl), fit_poly(basis, pts, by)
    err = 0.0
    for p in HELDOUT_POINTS[component]:
        f_true, _ = lowered_cost(d, component, p)
        err = max(err, abs(eval_poly(basis, cf, *p) - f_true) / max(f_true, 1.0))
    adiff = max(abs(f - analytic_matmul_flops(d, component, p)) / max(f, 1.0)
                for p, f in zip(pts, fl))
    return ComponentFit(fit_key(component, tp, ep), component, basis, tuple(map(float, cf)),
                        tuple(map(float, cb)), err, adiff)


def _extract_task(args: tuple[dict[str, Any], str, int, int]) -> dict[str, Any]:
    arch_json, component, tp, ep = args
    arch = ModelArch(**arch_json)
    return {"key": fit_key(component, tp, ep),
            "fit": extract_fit(arch, component, tp, ep).to_json()}


# ---------------------------------------------------------------------------------------------
# The on-disk cache
# ---------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """Directory of the XLA-fit cache (the layout is :mod:`dse.cache`'s)."""
    return cache_path("xla-costs")


MAX_CACHE_BYTES = 64 * MiB
_KEY_RE = re.compile(r"([a-z_]+)\|tp=([1-9][0-9]{0,5})(?:\|ep=([1-9][0-9]{0,5}))?")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def checked_fit(arch: ModelArch, key: str, j: Any) -> ComponentFit:
    """The fit stored under ``key`` for ``arch``, after a cheap sanity check; ValueError says
    what is wrong. Besides the shape and finiteness of every number, the polynomial is
    re-derived against the matmul-only hand count at the fit points: it must agree as closely
    as it did when it was made (``analytic_max_rel_diff``, recorded then), which a NaN, a
    negative count or a coefficient off by x1000 cannot."""
    if not isinstance(j, dict):
        raise ValueError("not a JSON object")
    comp = j.get("component")
    m = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if comp not in COMPONENT_BASIS or m is None or m[1] != comp:
        raise ValueError(f"key {key!r} does not name a fit of component {comp!r}")
    tp, ep = int(m[2]), int(m[3] or 1)
    if fit_key(comp, tp, ep) != key:
        raise ValueError(f"malformed key {key!r}")
    basis = COMPONENT_BASIS[comp]
    if j.get("basis") != [list(e) for e in basis]:
        raise ValueError("the polynomial basis differs from this version's")
    for name in ("flops", "xla_bytes"):
        c = j.get(name)
        if not (isinstance(c, list) and len(c) == len(basis) and all(map(_finite, c))):
            raise ValueError(f"{name} is not a list of {len(basis)} finite numbers")
    for name in ("heldout_max_rel_err", "analytic_max_rel_diff"):
        if not (_finite(j.get(name)) and j[name] >= 0):
            raise ValueError(f"{name} is not a number >= 0")
    fit = ComponentFit(key, comp, basis, tuple(map(float, j["flops"])),
                       tuple(map(float, j["xla_bytes"])), float(j["heldout_max_rel_err"]),
                       float(j["analytic_max_rel_diff"]))
    d = ShardDims.of(arch, tp, ep)
    for p in FIT_POINTS[comp]:
        f, b = fit.flops_at(*p), fit.xla_bytes_at(*p)
        if not (f >= -1.0 and b >= -1.0):
            raise ValueError(f"negative count at {p}")
        rel = abs(f - analytic_matmul_flops(d, comp, p)) / max(f, 1.0)
        if not rel <= fit.analytic_max_rel_diff + 1e-4:
            raise ValueError(f"FLOPs at {p} are {rel:.3g} off the matmul hand count (the fit "
                             f"recorded {fit.analytic_max_rel_diff:.3g})")
    return fit


def _slug(name: str) -> str:
    """``name`` made safe as part of a file name."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)[:64] or "model"


class FitCache:
    """Fits for one model, JAX version and graph version: one JSON file, written atomically
    and merged with what another run wrote meanwhile (see the module docstring)."""

    def __init__(self, arch: ModelArch, directory: Path | None = None):
        self.arch = arch
        self.jax_version = jax_version()
        self.graph_version = graph_version()
        d = Path(directory) if directory is not None else cache_dir()
        self.path = d / (f"{_slug(arch.name)}-{arch.fingerprint()}-jax{self.jax_version}"
                         f"-v{FORMAT_VERSION}-g{self.graph_version}.json")
        self._writable = True
        self.fits: dict[str, ComponentFit] = self._read()

    def _damaged(self, why: str) -> dict[str, ComponentFit]:
        say_once(f"note: the XLA-fit cache {str(self.path)!r} is damaged ({why}); lowering its "
                 "fits again", key=f"damaged:{self.path}")
        return {}

    def _read(self) -> dict[str, ComponentFit]:
        """The sound fits on disk ({} if there is no file); damaged ones are left out (and
        reported once): a cache is rebuilt, never trusted."""
        try:
            if not os.path.lexists(self.path):
                return {}
        except (OSError, ValueError):
            return {}
        try:
            data = json.loads(read_text(self.path, "XLA-fit cache", MAX_CACHE_BYTES))
        except NeuScaleError as e:
            return self._damaged(str(e))
        except (ValueError, RecursionError) as e:
            return self._damaged(f"not valid JSON: {e}")
        if not isinstance(data, dict):
            return self._damaged("not a JSON object")
        if (data.get("format_version"), data.get("model_fingerprint"),
                data.get("graph_version")) != (FORMAT_VERSION, self.arch.fingerprint(),
                                               self.graph_version):
            return self._damaged("written for another model or graph version")
        stored = data.get("fits")
        if not isinstance(stored, dict):
            return self._damaged("'fits' is not an object")
        fits, bad = {}, []
        for k, v in stored.items():
            try:
                fits[k] = checked_fit(self.arch, k, v)
            except (ValueError, TypeError, OverflowError, ZeroDivisionError) as e:
                bad.append(f"{k}: {e}")
        if bad:
            say_once(f"note: {len(bad)} fit(s) in the XLA-fit cache {str(self.path)!r} are "
                     f"damaged (first: {bad[0]}); lowering them again",
                     key=f"damaged:{self.path}")
        return fits

    def missing(self, keys: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """Distinct fits not yet cached (only the experts' shard depends on ep)."""
        norm = {(c, tp, ep if c == "experts" else 1) for c, tp, ep in keys}
        return sorted(k for k in norm if fit_key(*k) not in self.fits)

    def save(self) -> None:
        """Write the fits, merged with the sound ones another run wrote since this one read
        (read-merge-write under the cache directory's lock); ours win on a shared key. The
        merged-in fits are not added to :attr:`fits` (this run reports its own). A cache that
        cannot be written is left alone after one warning: the run goes on uncached."""
        if not self._writable:
            return
        try:
            with locked(self.path.parent):
                merged = {**self._read(), **self.fits}
                blob = {"format_version": FORMAT_VERSION, "model": self.arch.name,
                        "model_fingerprint": self.arch.fingerprint(),
                        "jax_version": self.jax_version, "graph_version": self.graph_version,
                        "fits": {k: v.to_json() for k, v in sorted(merged.items())}}
                write_atomic(self.path, json.dumps(blob), prefix=".tmp-")
        except OSError as e:
            self._writable = False
            say_once(f"warning: cannot write the XLA-fit cache in {str(self.path.parent)!r} "
                     f"({e.strerror or e}); running uncached (the fits are lowered again next "
                     "time)", key=f"unwritable:{self.path.parent}")

    def fill(self, keys: Iterable[tuple[str, int, int]], workers: int = 1,
             ray_address: str | None = None, progress: Callable[[int], None] | None = None
             ) -> int:
        """Extract every missing fit; returns how many were lowered."""
        todo = self.missing(keys)
        if not todo:
            return 0
        if jax_version() == "none":
            raise NeuScaleError("JAX is not installed: `pip install jax` (the DSE lowers "
                                "per-chip graphs with it)")
        tasks = [(self.arch.to_json(), c, tp, ep) for c, tp, ep in todo]
        done = 0
        for res in _run_tasks(tasks, workers, ray_address):
            self.fits[res["key"]] = ComponentFit.from_json(res["key"], res["fit"])
            done += 1
            if progress:
                progress(1)
            if done % 32 == 0:
                self.save()
        self.save()
        return done


def _run_tasks(tasks: list, workers: int, ray_address: str | None):
    if ray_address:
        try:
            import ray
        except ImportError:
            raise NeuScaleError("--ray needs Ray: pip install 'neuscale[ray]'") from None
        started = not ray.is_initialized()
        local = ray_address == "local"
        if not local:
            _check_reachable(ray_address)
        try:
            # ship this package to the workers, so a cluster needs only Ray and JAX installed;
            # a local instance stays on the loopback interface
            ray.init(address=None if local else ray_address,
                     _node_ip_address="127.0.0.1" if local else None,
                     ignore_reinit_error=True, log_to_driver=False, include_dashboard=False,
                     runtime_env={"py_modules": [str(Path(__file__).parent)]})
        except Exception as e:  # noqa: BLE001 - connection problems become one message
            raise NeuScaleError(f"cannot connect to the Ray cluster at {ray_address!r}: {e}") \
                from None
        try:
            remote = ray.remote(_extract_task)
            pending = [remote.remote(t) for t in tasks]
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                yield ray.get(ready[0])
        finally:
            if started:
                ray.shutdown()
        return
    if workers <= 1 or len(tasks) < 4:
        for t in tasks:
            yield _extract_task(t)
        return
    import concurrent.futures as cf
    import multiprocessing as mp
    import sys
    # fork is safe (and avoids re-running __main__) while this process has not loaded JAX,
    # which the DSE parent never does; otherwise spawn a clean interpreter.
    method = "spawn" if "jax" in sys.modules else "fork"
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method)) as ex:
        futs = [ex.submit(_extract_task, t) for t in tasks]
        for f in cf.as_completed(futs):
            yield f.result()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast with one message instead of Ray's minutes-long retry on a wrong address."""
    import socket
    hostport = address.split("://", 1)[-1]
    if hostport == "auto":
        return
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise NeuScaleError(f"--ray {address!r}: expected HOST:PORT, ray://HOST:PORT, auto or "
                            "local")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise NeuScaleError(f"cannot reach the Ray cluster at {address!r}: {e.strerror or e}") \
            from None


def default_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1)))


__all__ = ["ShardDims", "ComponentFit", "FitCache", "extract_fit", "lowered_cost",
           "analytic_matmul_flops", "components_for", "fit_key", "jax_version", "graph_version",
           "checked_fit", "cdiv",
           "default_workers"]
