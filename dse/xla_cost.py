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
compared too. Coefficients are cached on disk keyed by model fingerprint + shard + JAX version,
so a rebuild lowers nothing.

XLA's "bytes accessed" is recorded as well (an unfused upper bound used as a cross-check); the
HBM traffic the roofline uses comes from the fused-op model in :mod:`dse.costmodel`.

MoE traps avoided (see the issue's probe notes): experts are a dense einsum over the chip's
expert-capacity buffer ``[E_local, c, H]`` - no cumsum slotting (costed quadratically) and no
``ragged_dot`` (costed as dense over all groups). Collectives are not in these graphs at all;
they are costed analytically from the torus (cost_analysis has no communication key).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .errors import NeuScaleError
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


def jax_version() -> str:
    """Installed JAX version without importing JAX (keeps warm builds fast)."""
    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return "none"


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


def _graph(d: ShardDims, component: str, v: Sequence[int]) -> tuple[Callable, list]:
    """The JAX function and argument shapes of one component at sizes ``v``."""
    jax, jnp = _jax()
    bf, f32 = jnp.bfloat16, jnp.float32
    S = lambda *shape, dt=bf: jax.ShapeDtypeStruct(tuple(int(x) for x in shape), dt)  # noqa: E731
    H = d.hidden

    def rms(x, w):
        xf = x.astype(f32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
        return (y * w.astype(f32)).astype(bf)

    def rope(x, cos, sin):  # x [..., s, n, r]; cos/sin [s, r/2]
        x1, x2 = jnp.split(x, 2, axis=-1)
        c = cos[:, None, :].astype(bf)
        s_ = sin[:, None, :].astype(bf)
        return jnp.concatenate([x1 * c - x2 * s_, x2 * c + x1 * s_], axis=-1)

    def softmax(x):
        x = x.astype(f32)
        m = jnp.max(x, axis=-1, keepdims=True)
        e = jnp.exp(x - m)
        return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(bf)

    def swiglu(h, wg, wu, wd):
        return jnp.einsum("...i,ih->...h", jax.nn.silu(h @ wg) * (h @ wu), wd)

    if component in ("attn_prefill", "attn_decode"):
        b, n = v
        prefill = component == "attn_prefill"
        s = n if prefill else 1
        L = n
        if d.is_mla:
            qk = d.nope + d.rope

            def f(x, nw, wqa, qn, wqb, wkva, kvn, wkvb, wo, cos, sin, *cache):
                h = rms(x, nw)                                        # [b,s,H]
                q = jnp.einsum("bsr,rnd->bsnd", rms(h @ wqa, qn), wqb)
                q_nope, q_pe = q[..., :d.nope], q[..., d.nope:]
                q_pe = rope(q_pe, cos[:s], sin[:s])
                ckv = h @ wkva                                        # [b,s,kv_lora+rope]
                c = rms(ckv[..., :d.kv_lora], kvn)
                k_pe = rope(ckv[..., None, d.kv_lora:], cos[:s], sin[:s])[..., 0, :]
                if prefill:
                    kv = jnp.einsum("bsc,cnd->bsnd", c, wkvb)
                    k_nope, val = kv[..., :d.nope], kv[..., d.nope:]
                    sc = (jnp.einsum("bsnd,btnd->bnst", q_nope, k_nope)
                          + jnp.einsum("bsnr,btr->bnst", q_pe, k_pe)) * (qk ** -0.5)
                    mask = jnp.tril(jnp.ones((s, s), bool))
                    p = softmax(jnp.where(mask, sc, -1e30))
                    o = jnp.einsum("bnst,btnd->bsnd", p, val)
                else:
                    c_cache, pe_cache = cache                         # [b,L,kv_lora], [b,L,rope]
                    w_uk, w_uv = wkvb[..., :d.nope], wkvb[..., d.nope:]
                    q_lat = jnp.einsum("bsnd,cnd->bsnc", q_nope, w_uk)
                    sc = (jnp.einsum("bsnc,blc->bnsl", q_lat, c_cache)
                          + jnp.einsum("bsnr,blr->bnsl", q_pe, pe_cache)) * (qk ** -0.5)
                    p = softmax(sc)
                    o_lat = jnp.einsum("bnsl,blc->bsnc", p, c_cache)
                    o = jnp.einsum("bsnc,cnd->bsnd", o_lat, w_uv)
                # the new tokens' latent and rope key are outputs: they go to the cache
                return jnp.einsum("bsnd,ndh->bsh", o, wo) + x, c, k_pe

            args = [S(b, s, H), S(H), S(H, d.q_lora), S(d.q_lora), S(d.q_lora, d.heads, qk),
                    S(H, d.kv_lora + d.rope), S(d.kv_lora),
                    S(d.kv_lora, d.heads, d.nope + d.v_dim), S(d.heads, d.v_dim, H),
                    S(max(s, 1), d.rope // 2, dt=f32), S(max(s, 1), d.rope // 2, dt=f32)]
            if not prefill:
                args += [S(b, L, d.kv_lora), S(b, L, d.rope)]
            return f, args

        hd, nq, nkv = d.head_dim, d.heads, d.kv_heads
        g = max(1, nq // nkv)

        def f(x, nw, wq, wk, wv, wo, cos, sin, *cache):
            h = rms(x, nw)
            q = rope(jnp.einsum("bsh,hnd->bsnd", h, wq), cos, sin)
            k = rope(jnp.einsum("bsh,hkd->bskd", h, wk), cos, sin)
            val = jnp.einsum("bsh,hkd->bskd", h, wv)
            q = q.reshape(b, s, nkv, g, hd)
            if prefill:
                sc = jnp.einsum("bskgd,btkd->bkgst", q, k) * (hd ** -0.5)
                mask = jnp.tril(jnp.ones((s, s), bool))
                p = softmax(jnp.where(mask, sc, -1e30))
                o = jnp.einsum("bkgst,btkd->bskgd", p, val)
            else:
                k_cache, v_cache = cache
                sc = jnp.einsum("bskgd,btkd->bkgst", q, k_cache) * (hd ** -0.5)
                p = softmax(sc)
                o = jnp.einsum("bkgst,btkd->bskgd", p, v_cache)
            o = o.reshape(b, s, nkv * g, hd)
            # new K/V are outputs (they are written to the cache)
            return jnp.einsum("bsnd,ndh->bsh", o, wo) + x, k, val

        args = [S(b, s, H), S(H), S(H, nq, hd), S(H, nkv, hd), S(H, nkv, hd), S(nq, hd, H),
                S(s, hd // 2, dt=f32), S(s, hd // 2, dt=f32)]
        if not prefill:
            args += [S(b, L, nkv, hd), S(b, L, nkv, hd)]
        return f, args

    (x_,) = v
    if component == "mlp":
        def f(x, nw, wg, wu, wd):
            return swiglu(rms(x, nw), wg, wu, wd) + x
        return f, [S(x_, H), S(H), S(H, d.inter), S(H, d.inter), S(d.inter, H)]
    if component == "moe_tok":
        def f(x, nw, wr, wg, wu, wd):
            h = rms(x, nw)
            scores = jax.nn.sigmoid((h.astype(f32) @ wr))
            w, idx = jax.lax.top_k(scores, d.top_k)
            w = w / jnp.sum(w, axis=-1, keepdims=True)
            return swiglu(h, wg, wu, wd) + x, w, idx
        return f, [S(x_, H), S(H), S(H, d.n_experts_total, dt=f32), S(H, d.shared_inter),
                   S(H, d.shared_inter), S(d.shared_inter, H)]
    if component == "experts":
        def f(x, gate_w, wg, wu, wd):
            hg = jnp.einsum("ech,ehi->eci", x, wg)
            hu = jnp.einsum("ech,ehi->eci", x, wu)
            y = jnp.einsum("eci,eih->ech", jax.nn.silu(hg) * hu, wd)
            return y * gate_w[..., None]
        E, I = d.experts, d.moe_inter
        return f, [S(E, x_, H), S(E, x_), S(E, H, I), S(E, H, I), S(E, I, H)]
    if component == "lm_head":
        def f(x, nw, w):
            return (rms(x, nw) @ w).astype(f32)
        return f, [S(x_, H), S(H), S(H, d.vocab)]
    raise KeyError(component)


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
    env = os.environ.get("NEUSCALE_CACHE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) \
        / "neuscale"
    return base / "xla-costs"


class FitCache:
    """Fits for one model and JAX version, one JSON file, written atomically."""

    def __init__(self, arch: ModelArch, directory: Path | None = None):
        self.arch = arch
        self.jax_version = jax_version()
        d = directory or cache_dir()
        self.path = d / (f"{arch.name}-{arch.fingerprint()}-jax{self.jax_version}"
                         f"-v{FORMAT_VERSION}.json")
        self.fits: dict[str, ComponentFit] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if data.get("format_version") == FORMAT_VERSION and \
                        data.get("model_fingerprint") == arch.fingerprint():
                    self.fits = {k: ComponentFit.from_json(k, v) for k, v in data["fits"].items()}
            except (OSError, ValueError, KeyError):
                self.fits = {}  # a corrupt cache is rebuilt, never trusted

    def missing(self, keys: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """Distinct fits not yet cached (only the experts' shard depends on ep)."""
        norm = {(c, tp, ep if c == "experts" else 1) for c, tp, ep in keys}
        return sorted(k for k in norm if fit_key(*k) not in self.fits)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        blob = {"format_version": FORMAT_VERSION, "model": self.arch.name,
                "model_fingerprint": self.arch.fingerprint(), "jax_version": self.jax_version,
                "fits": {k: v.to_json() for k, v in sorted(self.fits.items())}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            json.dump(blob, fh)
        os.replace(tmp, self.path)

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
           "analytic_matmul_flops", "components_for", "fit_key", "jax_version", "cdiv",
           "default_workers"]
