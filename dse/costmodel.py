"""Per-chip work and the roofline (paper §3.3, Fig. 8), vectorised over batch x sequence length.

For an allocation (model, chip, pod shape, TP/PP/EP, batch B, sequence length S) this module
derives, per chip and per pipeline stage:

* FLOPs from the XLA-fitted component polynomials (:mod:`dse.xla_cost`), with causal block
  skipping applied to the attention S^2 terms (TPU flash/splash attention skips key blocks that
  lie entirely above the diagonal; XLA's count of the dense masked graph would double them);
* HBM bytes from a fused-op traffic model: every fused op reads its weights once per step, reads
  its input activations and writes its outputs once; attention reads the KV cache once in decode
  and once per 512-token query block in prefill (flash attention); MoE layers read only the
  weights of experts that receive at least one token;
* ICI time/bytes analytically: TP all-reduce (2 per layer), EP all-to-all (dispatch + combine per
  MoE layer), LM-head logit all-gather, PP activation send - ring algorithms per torus
  dimension, bidirectional where the slice has wrap-around links, plus a per-hop latency.

Roofline: every component takes ``max(FLOPs / peak, bytes / HBM BW)`` (one kernel each, as XLA
emits them), a stage adds its collectives, the slowest stage sets the pace. Pipelining splits the
batch into ``m = min(B, PP)`` micro-batches: prefill TTFT = the sum of the stage times + (m - 1)
slowest-stage slots, decode TPOT = max(sum of the stage times, m slowest-stage slots). Energy = dynamic per FLOP/byte (catalog) + static power x wall time for
every chip in the vPod; dollars = chips x price x wall time.

Memory feasibility per chip: weights + KV cache of all B sequences at length S + transient
activations <= ``HBM_USABLE_FRACTION`` of HBM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .catalog import ChipSpec
from .errors import NeuScaleError
from .models import BYTES_PER_PARAM, ModelArch
from .vpod import ICITopology, is_pow2
from .xla_cost import ComponentFit, FitCache, ShardDims, components_for, fit_key

PHASES = ("prefill", "decode")
METRICS = ("energy", "cost")

# vLLM reserves 10 % of device memory by default (gpu_memory_utilization=0.9, vLLM engine args).
HBM_USABLE_FRACTION = 0.9
# Query block of TPU flash/splash attention kernels (JAX Pallas splash attention default 512).
FLASH_Q_BLOCK = 512
# Chunked prefill: tokens processed per forward pass (vLLM engine arg max_num_batched_tokens,
# 8192 by default for the OpenAI server). Bounds activation memory; weights are re-read per chunk.
PREFILL_CHUNK_TOKENS = 8192
B2 = BYTES_PER_PARAM  # bf16 activations and KV cache
# Version of the cost model's physics: databases built by an older one are rebuilt (cache keys).
MODEL_VERSION = 2       # 2: prefill KV of every batch in flight in the pipeline

REASONS = ("weights", "kv_cache", "activations")
BOUNDS = ("compute", "memory", "ici")


@dataclass(frozen=True, order=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def chips(self) -> int:
        return self.tp * self.pp * self.ep

    def __str__(self) -> str:
        return f"tp{self.tp}-pp{self.pp}" + (f"-ep{self.ep}" if self.ep > 1 else "")


def validate_parallelism(arch: ModelArch, par: Parallelism) -> None:
    probs = []
    for n in ("tp", "pp", "ep"):
        if not is_pow2(getattr(par, n)):
            probs.append(f"{n}={getattr(par, n)} must be a power of two")
    if par.tp > arch.heads:
        probs.append(f"tp={par.tp} exceeds the model's {arch.heads} attention heads")
    if par.pp > arch.layers:
        probs.append(f"pp={par.pp} exceeds the model's {arch.layers} layers")
    if par.ep > 1 and not arch.is_moe:
        probs.append(f"ep={par.ep} needs a mixture-of-experts model ({arch.name} is dense)")
    if arch.is_moe and par.ep > arch.n_routed_experts:
        probs.append(f"ep={par.ep} exceeds the model's {arch.n_routed_experts} experts")
    if probs:
        raise NeuScaleError(f"invalid parallelism {par} for {arch.name}: " + "; ".join(probs))


def enumerate_parallelisms(arch: ModelArch, n_chips: int) -> list[Parallelism]:
    """All TP x PP (x EP) factorisations of ``n_chips`` valid for the model."""
    out = []
    tp = 1
    while tp <= min(n_chips, arch.heads):
        ep = 1
        while tp * ep <= n_chips and (ep == 1 or (arch.is_moe and ep <= arch.n_routed_experts)):
            pp = n_chips // (tp * ep)
            if tp * ep * pp == n_chips and pp <= arch.layers:
                out.append(Parallelism(tp, pp, ep))
            ep *= 2
            if not arch.is_moe:
                break
        tp *= 2
    return out


def stage_layout(arch: ModelArch, pp: int) -> list[tuple[int, int, bool, bool, int]]:
    """Distinct pipeline stages: (n_dense, n_moe, has_embed, has_lm_head, how_many)."""
    kinds = arch.layer_kinds()
    L = len(kinds)
    sizes = [L // pp + (1 if i < L % pp else 0) for i in range(pp)]
    stages: dict[tuple[int, int, bool, bool], int] = {}
    pos = 0
    for i, sz in enumerate(sizes):
        chunk = kinds[pos:pos + sz]
        pos += sz
        key = (chunk.count("dense"), chunk.count("moe"), i == 0, i == pp - 1)
        stages[key] = stages.get(key, 0) + 1
    return [(*k, v) for k, v in stages.items()]


# ---------------------------------------------------------------------------------------------
# Topology: how TP / EP / PP groups map onto torus dimensions, and collective cost coefficients
# ---------------------------------------------------------------------------------------------

def group_dims(topo: ICITopology, chip: ChipSpec, par: Parallelism
               ) -> dict[str, list[tuple[int, bool]]]:
    """Assign torus dimensions to the TP, then EP, then PP groups (largest dimensions first, so
    the most communication-heavy group gets the longest rings). Returns, per group, the
    (extent, has_wraparound) of each dimension it spans."""
    if topo.num_chips != par.chips:
        raise NeuScaleError(f"{par} uses {par.chips} chips but topology {topo} has "
                            f"{topo.num_chips}")
    wrap = topo.has_wraparound(chip)
    order = sorted(range(topo.ndim), key=lambda i: -topo.dims[i])
    remaining = {i: topo.dims[i] for i in order}
    out: dict[str, list[tuple[int, bool]]] = {"tp": [], "ep": [], "pp": []}
    for name, need in (("tp", par.tp), ("ep", par.ep), ("pp", par.pp)):
        for i in order:
            if need == 1:
                break
            f = min(need, remaining[i])
            if f > 1:
                out[name].append((f, wrap and f == topo.dims[i]))
                remaining[i] //= f
                need //= f
    return out


@dataclass(frozen=True)
class Collective:
    """time = alpha_s + beta_s_per_byte * M; ICI bytes sent per chip = gamma * M."""
    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0
    gamma: float = 0.0


def allreduce_cost(dims: list[tuple[int, bool]], chip: ChipSpec) -> Collective:
    """Ring reduce-scatter + all-gather, one torus dimension after another. With D dimensions the
    message is split into D parts that walk the dimensions in rotated orders at the same time
    (each part uses different links), so the bandwidth term is shared D ways."""
    a = b = g = 0.0
    frac = 1.0
    for k, wrap in dims:
        bw = chip.ici_link_bw_bytes_per_s * (2 if wrap else 1)
        a += 2 * (k - 1) * chip.ici_hop_latency_s
        b += 2 * (k - 1) / k * frac / bw
        g += 2 * (k - 1) / k * frac
        frac /= k
    return Collective(a, b / max(1, len(dims)), g)


def allgather_cost(dims: list[tuple[int, bool]], chip: ChipSpec) -> Collective:
    ar = allreduce_cost(dims, chip)
    return Collective(ar.alpha_s / 2, ar.beta_s_per_byte / 2, ar.gamma / 2)


def alltoall_cost(dims: list[tuple[int, bool]], chip: ChipSpec) -> Collective:
    """Dimension-ordered all-to-all; M = bytes one chip sends in total. On a ring of k chips each
    byte travels k/4 hops on average (k/3 without wrap-around) and the bisection limits the time
    to M*k/8 (M*k/4) per link bandwidth, or the injection limit M(k-1)/k per ring bandwidth."""
    a = b = g = 0.0
    lb = chip.ici_link_bw_bytes_per_s
    for k, wrap in dims:
        ring_bw = lb * (2 if wrap else 1)
        b += max((k - 1) / k / ring_bw, k / (8 if wrap else 4) / lb)
        a += (k - 1) * chip.ici_hop_latency_s
        g += max(1.0, k / (4 if wrap else 3))
    return Collective(a, b, g)


def p2p_cost(chip: ChipSpec) -> Collective:
    return Collective(chip.ici_hop_latency_s, 1.0 / chip.ici_link_bw_bytes_per_s, 1.0)


# ---------------------------------------------------------------------------------------------
# Per-chip work of one stage, vectorised over the (B, S) grid
# ---------------------------------------------------------------------------------------------

@dataclass
class StageWork:
    """Per chip, per micro-batch step of one stage kind."""
    n_stages: int
    comp_flops: list[np.ndarray]       # per component (already x layer count)
    comp_bytes: list[np.ndarray]
    coll: list[tuple[str, int, np.ndarray]]  # (kind, count, message bytes)
    weights_bytes: float
    kv_bytes: np.ndarray
    act_bytes: np.ndarray
    xla_bytes: np.ndarray


@dataclass
class Work:
    par: Parallelism
    phase: str
    B: np.ndarray          # [nB, 1]
    S: np.ndarray          # [1, nS]
    m: np.ndarray          # micro-batches [nB, 1]
    stages: list[StageWork]


def causal_fraction(s: np.ndarray) -> np.ndarray:
    """Share of the S x S score matrix a block-skipping causal kernel computes."""
    nq = np.ceil(s / FLASH_Q_BLOCK)
    return (nq + 1) / (2 * nq)


def weight_bytes(a: ModelArch, d: ShardDims) -> dict[str, float]:
    """Bytes of each weight group held by one chip under the shard ``d``."""
    H = d.hidden
    if d.is_mla:
        qk = d.nope + d.rope
        attn = (H * d.q_lora + d.q_lora + d.q_lora * d.heads * qk + H * (d.kv_lora + d.rope)
                + d.kv_lora + d.kv_lora * d.heads * (d.nope + d.v_dim) + d.heads * d.v_dim * H
                + H)
    else:
        attn = H * (d.heads + 2 * d.kv_heads) * d.head_dim + d.heads * d.head_dim * H + H
    w = {"attn": attn, "mlp": 3 * H * d.inter + H, "lm_head": d.vocab * H + H,
         "embed": d.vocab * H}
    if a.is_moe:
        w["moe_tok"] = H * d.n_experts_total * 2 + 3 * H * d.shared_inter + H  # fp32 router
        w["expert"] = 3 * H * d.moe_inter
    return {k: v * B2 for k, v in w.items()}


def _stage_weights(W: dict[str, float], d: ShardDims, n_dense: int, n_moe: int,
                   has_embed: bool, has_lm: bool) -> float:
    w = (n_dense + n_moe) * W["attn"] + n_dense * W["mlp"]
    if n_moe:
        w += n_moe * (W["moe_tok"] + d.experts * W["expert"])
    return w + (W["lm_head"] if has_lm else 0.0) + (W["embed"] if has_embed else 0.0)


def max_weights_bytes(a: ModelArch, par: Parallelism) -> float:
    """Weights held by one chip of the heaviest pipeline stage (cheap: no grid, no fits)."""
    d = ShardDims.of(a, par.tp, par.ep)
    W = weight_bytes(a, d)
    return max(_stage_weights(W, d, nd, nm, he, hl) for nd, nm, he, hl, _ in stage_layout(a, par.pp))


class CostModel:
    """Roofline cost model of one model, backed by its XLA fits."""

    def __init__(self, arch: ModelArch, fits: FitCache):
        self.arch = arch
        self.fits = fits
        self._work_cache: dict[tuple, Work] = {}

    # -- fits needed ------------------------------------------------------------------------
    @staticmethod
    def fit_keys(arch: ModelArch, pars: list[Parallelism], phases=PHASES):
        keys = []
        for par in pars:
            for ph in phases:
                for c in components_for(arch, ph):
                    keys.append((c, par.tp, par.ep))
        return keys

    def _fit(self, comp: str, par: Parallelism) -> ComponentFit:
        try:
            return self.fits.fits[fit_key(comp, par.tp, par.ep)]
        except KeyError:
            raise NeuScaleError(f"no XLA fit for {comp} at {par}; run the DSE build") from None

    # -- weights per chip -------------------------------------------------------------------
    def weight_bytes(self, d: ShardDims) -> dict[str, float]:
        return weight_bytes(self.arch, d)

    def max_weights_bytes(self, par: Parallelism) -> float:
        return max_weights_bytes(self.arch, par)

    # -- the work ---------------------------------------------------------------------------
    def work(self, par: Parallelism, phase: str, B: np.ndarray, S: np.ndarray) -> Work:
        key = (par, phase, B.tobytes(), S.tobytes())
        hit = self._work_cache.get(key)
        if hit is not None:
            return hit
        a = self.arch
        d = ShardDims.of(a, par.tp, par.ep)
        W = self.weight_bytes(d)
        H = d.hidden
        Bf = B.astype(np.float64).reshape(-1, 1)
        Sf = S.astype(np.float64).reshape(1, -1)
        m = np.minimum(Bf, par.pp)
        b_mb = np.ceil(Bf / m)
        b_loc = np.ceil(b_mb / par.ep)
        # KV of every sequence in flight stays resident. Decode: the B sequences of the batch.
        # Prefill: a batch enters every m slowest-stage slots (the cycle of _schedule) and
        # spends pp + m - 1 slots in the pipeline, so (pp + m - 1) / m batches are in flight,
        # each stage holding its layers' KV for all of them until hand-off (B = 1 on PP = 16:
        # 16 prompts; vLLM's PP virtual engines get 1/pp of the KV blocks each).
        inflight = Bf * (par.pp + m - 1) / m if phase == "prefill" else Bf
        seqs_chip = np.ceil(inflight / par.ep)
        prefill = phase == "prefill"
        q_tok = Sf if prefill else 1.0
        t_attn = b_loc * q_tok                          # tokens through this chip's attention
        ones = np.ones_like(Sf)
        # weights are streamed once per forward pass: once per prefill chunk
        n_pass = np.ceil(t_attn / PREFILL_CHUNK_TOKENS) if prefill else 1.0
        t_act = np.minimum(t_attn, PREFILL_CHUNK_TOKENS)  # tokens live in one pass

        # attention
        attn_name = "attn_prefill" if prefill else "attn_decode"
        fa = self._fit(attn_name, par)
        fl_attn = fa.flops_at(b_loc, Sf)
        xb_attn = fa.xla_bytes_at(b_loc, Sf)
        if prefill:  # causal block skipping on the S^2 terms
            s2 = fa.flops[0] * b_loc * Sf ** 2 + fa.flops[3] * Sf ** 2
            fl_attn = fl_attn - s2 * (1 - causal_fraction(Sf))
        if d.is_mla:
            qk = d.nope + d.rope
            act = t_attn * (3 * H + 2 * d.q_lora + 2 * d.heads * qk + 2 * (d.kv_lora + d.rope)
                            + 2 * d.heads * d.v_dim + (d.kv_lora + d.rope))
            if prefill:
                act = act + t_attn * 2 * d.heads * (d.nope + d.v_dim)
                kv_read = np.ceil(Sf / FLASH_Q_BLOCK) * b_loc * Sf * d.heads * (qk + d.v_dim)
            else:
                kv_read = b_loc * Sf * (d.kv_lora + d.rope)
            kv_elems = d.kv_lora + d.rope
        else:
            hd = d.head_dim
            act = t_attn * (3 * H + (d.heads + 2 * d.kv_heads) * hd + 3 * d.heads * hd
                            + 2 * d.kv_heads * hd)
            reread = np.ceil(Sf / FLASH_Q_BLOCK) if prefill else 1.0
            kv_read = reread * b_loc * Sf * 2 * d.kv_heads * hd
            kv_elems = 2 * d.kv_heads * hd
        by_attn = W["attn"] * n_pass + (act + kv_read) * B2

        # dense MLP
        fm = self._fit("mlp", par)
        fl_mlp = fm.flops_at(t_attn) * ones
        by_mlp = W["mlp"] * n_pass + t_attn * (3 * H + 2 * d.inter) * B2 * ones
        xb_mlp = fm.xla_bytes_at(t_attn) * ones

        # LM head (last token of each sequence in prefill, every token in decode)
        fl_ = self._fit("lm_head", par)
        t_lm = b_loc
        fl_lm = fl_.flops_at(t_lm) * ones
        by_lm = W["lm_head"] + t_lm * (H * B2 + d.vocab * 4) * ones
        xb_lm = fl_.xla_bytes_at(t_lm) * ones

        if a.is_moe:
            ft = self._fit("moe_tok", par)
            fe = self._fit("experts", par)
            fl_tok = ft.flops_at(t_attn) * ones
            by_tok = W["moe_tok"] * n_pass + t_attn * (5 * H + 4 * d.n_experts_total + 2 * d.shared_inter) \
                * B2 * ones
            routed = b_mb * q_tok * d.top_k                # expert assignments in the stage
            c = routed / d.n_experts_total                 # tokens per expert (mean)
            fl_exp = fe.flops_at(c) * ones
            p_active = 1.0 - np.power(1.0 - d.top_k / d.n_experts_total, b_mb * q_tok)
            by_exp = (d.experts * p_active * W["expert"] * n_pass
                      + d.experts * c * (2 * H + 2 * d.moe_inter) * B2) * ones
            xb_moe = (ft.xla_bytes_at(t_attn) + fe.xla_bytes_at(c)) * ones
            moe_act = d.experts * c * t_act / t_attn * (2 * H + 2 * d.moe_inter) * B2
        else:
            moe_act = 0.0

        if d.is_mla:
            attn_width = d.heads * (2 * (d.nope + d.rope) + d.nope + d.v_dim)
        else:
            attn_width = (d.heads + 2 * d.kv_heads) * d.head_dim
        act_peak = t_act * (4 * H + 2 * max(attn_width, 2 * d.inter, 2 * d.shared_inter)) * B2 \
            + t_lm * d.vocab * 4 + moe_act
        stages = []
        for n_dense, n_moe, has_embed, has_lm, count in stage_layout(a, par.pp):
            nl = n_dense + n_moe
            cf = [nl * fl_attn, n_dense * fl_mlp]
            cb = [nl * by_attn, n_dense * by_mlp]
            xb = nl * xb_attn + n_dense * xb_mlp
            weights = _stage_weights(W, d, n_dense, n_moe, has_embed, has_lm)
            coll: list[tuple[str, int, np.ndarray]] = []
            if n_moe:
                cf += [n_moe * fl_tok, n_moe * fl_exp]
                cb += [n_moe * by_tok, n_moe * by_exp]
                xb = xb + n_moe * xb_moe
                if par.ep > 1:
                    disp = t_attn * d.top_k * H * B2 * (par.ep - 1) / par.ep * ones
                    coll.append(("a2a", 2 * n_moe, disp))
            if has_lm:
                cf.append(fl_lm)
                cb.append(by_lm)
                xb = xb + xb_lm
                if par.tp > 1:
                    coll.append(("ag", 1, t_lm * a.vocab * B2 * ones))
            if par.tp > 1:
                coll.append(("ar", 2 * nl, t_attn * H * B2 * ones))
            if par.pp > 1 and not has_lm:
                coll.append(("p2p", 1, t_attn * H * B2 * ones))
            kv = nl * seqs_chip * Sf * kv_elems * B2
            stages.append(StageWork(count, cf, cb, coll, float(weights), kv,
                                    act_peak * ones, xb))
        w = Work(par, phase, Bf, Sf, m, stages)
        self._work_cache[key] = w
        return w


# ---------------------------------------------------------------------------------------------
# Roofline evaluation on one chip + topology
# ---------------------------------------------------------------------------------------------

@dataclass
class Roofline:
    latency_s: np.ndarray              # TTFT (prefill) or TPOT (decode)
    cycle_s: np.ndarray                # wall time per batch (prefill) / per iteration (decode)
    tokens: np.ndarray                 # tokens produced per cycle
    energy_j: np.ndarray               # per cycle, whole vPod
    cost_usd: np.ndarray               # per cycle, whole vPod
    flops: np.ndarray                  # per chip, bottleneck stage, per micro-batch step
    hbm_bytes: np.ndarray
    ici_bytes: np.ndarray
    xla_bytes: np.ndarray
    bound: np.ndarray                  # index into BOUNDS
    feasible: np.ndarray               # bool
    reason: np.ndarray                 # index into REASONS (valid where not feasible)
    mem_bytes: np.ndarray              # per chip peak
    weights_bytes: float

    @property
    def throughput_tok_per_s(self) -> np.ndarray:
        return self.tokens / self.cycle_s

    @property
    def energy_j_per_token(self) -> np.ndarray:
        return self.energy_j / self.tokens

    @property
    def usd_per_token(self) -> np.ndarray:
        return self.cost_usd / self.tokens


@dataclass
class StageOnChip:
    n_stages: int
    comp_t: np.ndarray      # sum of per-kernel roofline times (no ICI)
    tc: np.ndarray          # compute-only time
    tm: np.ndarray          # HBM-only time
    flops: np.ndarray
    hbm_bytes: np.ndarray
    xla_bytes: np.ndarray
    dyn_j: np.ndarray       # per chip, FLOP + HBM energy
    coll_n: dict[str, float]        # collective kind -> calls per step
    coll_m: dict[str, np.ndarray]   # collective kind -> sum of message bytes


@dataclass
class OnChip:
    """A :class:`Work` evaluated on one chip version: everything except the topology's ICI."""
    work: Work
    chip: ChipSpec
    stages: list[StageOnChip]
    mem_bytes: np.ndarray
    weights_bytes: float
    feasible: np.ndarray
    reason: np.ndarray


def on_chip(work: Work, chip: ChipSpec) -> OnChip:
    peak, bw = chip.peak_flops_per_s, chip.hbm_bw_bytes_per_s
    stages = []
    mem = None
    weights = 0.0
    kv = None
    for st in work.stages:
        tc = tm = comp_t = fl = by = 0.0
        for f, y in zip(st.comp_flops, st.comp_bytes):
            cft, cmt = f / peak, y / bw
            comp_t = comp_t + np.maximum(cft, cmt)
            tc, tm, fl, by = tc + cft, tm + cmt, fl + f, by + y
        cn: dict[str, float] = {}
        cm: dict[str, np.ndarray] = {}
        for kind, count, msg in st.coll:
            cn[kind] = cn.get(kind, 0) + count
            cm[kind] = cm.get(kind, 0.0) + count * msg
        dyn = fl * chip.e_flop_j + by * chip.e_hbm_j_per_byte
        stages.append(StageOnChip(st.n_stages, comp_t, tc, tm, fl, by, st.xla_bytes, dyn, cn, cm))
        mst = st.weights_bytes + st.kv_bytes + st.act_bytes
        mem = mst if mem is None else np.maximum(mem, mst)
        kv = st.kv_bytes if kv is None else np.maximum(kv, st.kv_bytes)
        weights = max(weights, st.weights_bytes)
    usable = HBM_USABLE_FRACTION * chip.hbm_bytes
    feasible = mem <= usable
    reason = np.where(weights > usable, 0, np.where(weights + kv > usable, 1, 2)).astype(np.int8)
    return OnChip(work, chip, stages, mem, weights, feasible, reason)


def collectives(topo: ICITopology, chip: ChipSpec, par: Parallelism) -> dict[str, Collective]:
    gd = group_dims(topo, chip, par)
    return {"ar": allreduce_cost(gd["tp"], chip), "ag": allgather_cost(gd["tp"], chip),
            "a2a": alltoall_cost(gd["ep"], chip), "p2p": p2p_cost(chip)}


def _stack_collectives(colls: list[dict[str, Collective]]) -> dict[str, Collective]:
    """Many topologies' tables as one table of [T, 1, 1] coefficient arrays."""
    return {k: Collective(*(np.array([getattr(c[k], a) for c in colls]).reshape(-1, 1, 1)
                            for a in ("alpha_s", "beta_s_per_byte", "gamma")))
            for k in colls[0]}


def _ici(st: StageOnChip, colls):
    t = b = 0.0
    for kind, n in st.coll_n.items():
        c, m = colls[kind], st.coll_m[kind]
        t = t + (c.alpha_s * n + c.beta_s_per_byte * m)
        b = b + c.gamma * m
    return t, b


def _timing(oc: OnChip, colls):
    """Slowest-stage time, its index per grid point, and per-stage ICI (time, bytes).

    ``colls`` is one topology's collective table, or a list of them: then every result gets a
    leading topology axis (the DSE evaluates all pod shapes of one split in one go)."""
    par = oc.work.par
    t_stage = None
    slow = None
    ici = []
    dyn_total = 0.0
    t_sum = 0.0
    for i, st in enumerate(oc.stages):
        it, ib = _ici(st, colls)
        ici.append((it, ib))
        t = st.comp_t + it
        t_sum = t_sum + st.n_stages * t
        dyn = st.dyn_j + ib * oc.chip.ici_j_per_byte
        dyn_total = dyn_total + dyn * (st.n_stages * par.tp * par.ep)
        if t_stage is None:
            t_stage, slow = t, np.zeros(np.shape(t), np.int64)
        else:
            later = t > t_stage
            slow = np.where(later, i, slow)
            t_stage = np.maximum(t_stage, t)
    return t_stage, slow, ici, dyn_total, t_sum


def _schedule(oc: OnChip, t_stage, dyn_total, t_sum):
    """Pipeline schedule of m micro-batches over stages of unequal length: the first
    micro-batch passes every stage once (``t_sum``), the others follow one slowest-stage slot
    apart; a decode iteration ends when every micro-batch has passed every stage."""
    w, par, chip = oc.work, oc.work.par, oc.chip
    m = w.m
    if w.phase == "prefill":
        latency = t_sum + (m - 1) * t_stage
        cycle = m * t_stage
        tokens = w.B * w.S
    else:
        cycle = np.maximum(t_sum, m * t_stage)
        latency = cycle
        tokens = w.B * np.ones_like(w.S)
    energy = dyn_total * m + chip.static_power_w * par.chips * cycle
    cost = par.chips * chip.price_usd_per_chip_hour / 3600.0 * cycle
    return latency, cycle, tokens, energy, cost


def latency_efficiency(oc: OnChip, colls, metric: str):
    """Fast path for the DSE sweep: (latency_s, tokens per J or per USD); ``colls`` may be a
    list of topologies' collective tables (results then have a leading topology axis)."""
    if isinstance(colls, list):
        colls = _stack_collectives(colls)
    t_stage, _, _, dyn, t_sum = _timing(oc, colls)
    latency, cycle, tokens, energy, cost = _schedule(oc, t_stage, dyn, t_sum)
    return latency, tokens / (energy if metric == "energy" else cost)


def roofline(work: Work, chip: ChipSpec, topo: ICITopology, oc: OnChip | None = None
             ) -> Roofline:
    """Full roofline of one allocation (every quantity, per grid point)."""
    oc = oc or on_chip(work, chip)
    par = work.par
    t_stage, slow, ici, dyn, t_sum = _timing(oc, collectives(topo, chip, par))
    latency, cycle, tokens, energy, cost = _schedule(oc, t_stage, dyn, t_sum)
    shape = np.broadcast_shapes(work.B.shape, work.S.shape)
    bc = lambda x: np.broadcast_to(x, shape)  # noqa: E731

    def pick(vals):
        out = bc(vals[0]).copy()
        for i in range(1, len(vals)):
            out = np.where(slow == i, bc(vals[i]), out)
        return out

    sts = oc.stages
    fl = pick([s.flops for s in sts])
    by = pick([s.hbm_bytes for s in sts])
    xb = pick([s.xla_bytes for s in sts])
    ici_t = pick([it for it, _ in ici])
    ici_b = pick([ib for _, ib in ici])
    tc, tm = pick([s.tc for s in sts]), pick([s.tm for s in sts])
    bound = np.where((ici_t >= tc) & (ici_t >= tm), 2, np.where(tc >= tm, 0, 1))
    return Roofline(bc(latency), bc(cycle), bc(tokens), bc(energy), bc(cost), fl, by, ici_b, xb,
                    bound, bc(oc.feasible), bc(oc.reason), bc(oc.mem_bytes), oc.weights_bytes)


def infeasible_message(r: "Roofline | OnChip", chip: ChipSpec, i: Any = ()) -> str:
    usable = HBM_USABLE_FRACTION * chip.hbm_bytes
    reason = REASONS[int(r.reason[i])]
    return (f"{reason}: needs {float(r.mem_bytes[i]) / 1e9:.2f} GB per chip "
            f"(weights {r.weights_bytes / 1e9:.2f} GB) but {chip.name} has "
            f"{usable / 1e9:.2f} GB usable ({HBM_USABLE_FRACTION:.0%} of {chip.hbm_bytes / 1e9:g} GB)")


__all__ = ["Parallelism", "CostModel", "Roofline", "roofline", "on_chip", "OnChip",
           "collectives", "latency_efficiency", "enumerate_parallelisms",
           "validate_parallelism", "group_dims", "stage_layout", "PHASES", "METRICS", "REASONS",
           "BOUNDS", "infeasible_message", "HBM_USABLE_FRACTION"]
