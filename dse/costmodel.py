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
* ICI time/bytes analytically (TP all-reduces hide under the stage's compute but for the first
  of their ``tp`` pieces, as XLA's collective matmul overlaps them): TP all-reduce (2 per layer), EP all-to-all (dispatch + combine per
  MoE layer), LM-head logit all-gather, PP activation send - ring algorithms per torus
  dimension, bidirectional where the slice has wrap-around links, plus a per-hop latency
  (coefficients from :mod:`dse.torus`; the split and its stages from :mod:`dse.parallel`).

Roofline: every component takes ``max(FLOPs / peak, bytes / HBM BW)`` (one kernel each, as XLA
emits them), a stage adds its collectives, the slowest stage sets the pace. Pipelining splits the
batch into ``m = min(B, PP)`` micro-batches: prefill TTFT = the sum of the stage times + (m - 1)
slowest-stage slots, decode TPOT = max(sum of the stage times, m slowest-stage slots); each step adds the
serving stack's host time for the sequences of its micro-batch (:mod:`dse.stacks`,
``step_s + per_seq_s x B/m``, or the longer of it and the device time with ``overlap``; the attention-kernel efficiency of a profile is a chip-model
matter: the roofline's ``attn`` component holds the projections too). Energy = dynamic per FLOP/byte (catalog) + static power x wall time for
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
# The split of a model over chips and the torus collectives live in their own modules (the chip
# model uses them too); the names are re-exported here, where callers have always found them.
from .stacks import StackProfile, get_stack
from .parallel import (ATTN_LAYOUTS, LAYOUT_SUFFIX, MOE_HOT_FACTOR, Parallelism,
                       busiest_active_experts, busiest_expert_tokens, dispatch_tokens,
                       enumerate_parallelisms, max_weights_bytes, runs_on, stage_layout, stage_weights,
                       validate_parallelism, weight_bytes)
from .torus import (Collective, allgather_cost, allreduce_cost, alltoall_cost, collectives,
                    group_dims, p2p_cost, stack_collectives)
from .vpod import ICITopology
from .xla_cost import ComponentFit, FitCache, ShardDims, components_for

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
MODEL_VERSION = 6       # 2: prefill KV in flight; 3: stack time; 4: overlap, measured power;
#                         5: the tensor-parallel-attention MoE layout (Parallelism.attn);
#                         6: the hybrid MoE layout, layouts per serving stack, the hot
#                            expert in the roofline

REASONS = ("weights", "kv_cache", "activations")
BOUNDS = ("compute", "memory", "ici")


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
    # share of the stage's weights in the matmuls whose outputs the TP all-reduces carry
    # (o_proj, down_proj, the shared expert's down): the compute a reduction can hide under
    pair_frac: float = 0.0


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
                    keys.append((c, *par.fit_shard(c)))
        return keys

    def _fit(self, comp: str, par: Parallelism) -> ComponentFit:
        try:
            return self.fits.fits[par.fit_key(comp)]
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
        d = par.shard(self.arch)
        W = self.weight_bytes(d)
        g = _Grid.of(par, phase, B, S)
        L = self._layers(par, g, d, W)
        stages = [self._stage(par, g, d, W, L, *st) for st in stage_layout(self.arch, par.pp)]
        w = Work(par, phase, g.B, g.S, g.m, stages)
        self._work_cache[key] = w
        return w

    def _layers(self, par: Parallelism, g: "_Grid", d: ShardDims, W: dict[str, float]
                ) -> "_Layers":
        """Per-layer work of every component on the grid, and the activation peak."""
        L = _Layers({}, {}, {}, 0.0, 0.0)
        self._attention(par, g, d, W, L)
        H, ones = d.hidden, g.ones
        # dense MLP
        fm = self._fit("mlp", par)
        L.flops["mlp"] = fm.flops_at(g.t_attn) * ones
        L.hbm_bytes["mlp"] = W["mlp"] * g.n_pass + g.t_attn * (3 * H + 2 * d.inter) * B2 * ones
        L.xla_bytes["mlp"] = fm.xla_bytes_at(g.t_attn) * ones
        # LM head (last token of each sequence in prefill, every token in decode)
        fl_ = self._fit("lm_head", par)
        L.flops["lm_head"] = fl_.flops_at(g.t_lm) * ones
        L.hbm_bytes["lm_head"] = W["lm_head"] + g.t_lm * (H * B2 + d.vocab * 4) * ones
        L.xla_bytes["lm_head"] = fl_.xla_bytes_at(g.t_lm) * ones
        moe_act = self._moe(par, g, d, W, L) if self.arch.is_moe else 0.0
        if d.is_mla:
            attn_width = d.heads * (2 * (d.nope + d.rope) + d.nope + d.v_dim)
        else:
            attn_width = (d.heads + 2 * d.kv_heads) * d.head_dim
        L.act_peak = g.t_act * (4 * H + 2 * max(attn_width, 2 * d.inter, 2 * d.shared_inter)) \
            * B2 + g.t_lm * d.vocab * 4 + moe_act
        return L

    def _attention(self, par: Parallelism, g: "_Grid", d: ShardDims, W: dict[str, float],
                   L: "_Layers") -> None:
        """Attention: XLA FLOPs with causal block skipping, fused activation and KV traffic."""
        H, Sf, b_loc, t_attn = d.hidden, g.S, g.b_loc, g.t_attn
        fa = self._fit("attn_prefill" if g.prefill else "attn_decode", par)
        fl_attn = fa.flops_at(b_loc, Sf)
        if g.prefill:  # causal block skipping on the S^2 terms
            s2 = fa.flops[0] * b_loc * Sf ** 2 + fa.flops[3] * Sf ** 2
            fl_attn = fl_attn - s2 * (1 - causal_fraction(Sf))
        if d.is_mla:
            qk = d.nope + d.rope
            act = t_attn * (3 * H + 2 * d.q_lora + 2 * d.heads * qk + 2 * (d.kv_lora + d.rope)
                            + 2 * d.heads * d.v_dim + (d.kv_lora + d.rope))
            if g.prefill:
                act = act + t_attn * 2 * d.heads * (d.nope + d.v_dim)
                kv_read = np.ceil(Sf / FLASH_Q_BLOCK) * b_loc * Sf * d.heads * (qk + d.v_dim)
            else:
                kv_read = b_loc * Sf * (d.kv_lora + d.rope)
            L.kv_elems = d.kv_lora + d.rope
        else:
            hd = d.head_dim
            act = t_attn * (3 * H + (d.heads + 2 * d.kv_heads) * hd + 3 * d.heads * hd
                            + 2 * d.kv_heads * hd)
            reread = np.ceil(Sf / FLASH_Q_BLOCK) if g.prefill else 1.0
            kv_read = reread * b_loc * Sf * 2 * d.kv_heads * hd
            L.kv_elems = 2 * d.kv_heads * hd
        L.flops["attn"] = fl_attn
        L.hbm_bytes["attn"] = W["attn"] * g.n_pass + (act + kv_read) * B2
        L.xla_bytes["attn"] = fa.xla_bytes_at(b_loc, Sf)

    def _moe(self, par: Parallelism, g: "_Grid", d: ShardDims, W: dict[str, float],
             L: "_Layers") -> np.ndarray:
        """Router + shared expert and routed experts (only experts that receive a token are
        read, on the busiest expert group: :func:`dse.parallel.busiest_active_experts`);
        returns the routed experts' live activations."""
        H, ones, t_attn = d.hidden, g.ones, g.t_attn
        ft = self._fit("moe_tok", par)
        fe = self._fit("experts", par)
        L.flops["moe_tok"] = ft.flops_at(t_attn) * ones
        L.hbm_bytes["moe_tok"] = W["moe_tok"] * g.n_pass \
            + t_attn * (5 * H + 4 * d.n_experts_total + 2 * d.shared_inter) * B2 * ones
        routed = g.b_mb * g.q_tok * d.top_k            # expert assignments in the stage
        c_mean = routed / d.n_experts_total            # tokens per expert (mean)
        # per expert on the chip that sets the pace (the hottest expert's): its mean share
        # unless the hot expert alone is more (fewer experts per chip than MOE_HOT_FACTOR)
        c = busiest_expert_tokens(d.experts, c_mean, g.b_mb * g.q_tok) / max(d.experts, 1)
        L.flops["experts"] = fe.flops_at(c) * ones
        p_active = 1.0 - np.power(1.0 - d.top_k / d.n_experts_total, g.b_mb * g.q_tok)
        active = busiest_active_experts(d.experts, d.n_experts_total, p_active)
        L.hbm_bytes["experts"] = (active * W["expert"] * g.n_pass
                                  + d.experts * c * (2 * H + 2 * d.moe_inter) * B2) * ones
        L.xla_bytes["moe"] = (ft.xla_bytes_at(t_attn) + fe.xla_bytes_at(c)) * ones
        return d.experts * c * g.t_act / t_attn * (2 * H + 2 * d.moe_inter) * B2

    def _stage(self, par: Parallelism, g: "_Grid", d: ShardDims, W: dict[str, float],
               L: "_Layers", n_dense: int, n_moe: int, has_embed: bool, has_lm: bool,
               count: int) -> StageWork:
        """One pipeline stage kind: its layers' components, collectives, weights and KV."""
        F, Y = L.flops, L.hbm_bytes
        nl = n_dense + n_moe
        cf = [nl * F["attn"], n_dense * F["mlp"]]
        cb = [nl * Y["attn"], n_dense * Y["mlp"]]
        xb = nl * L.xla_bytes["attn"] + n_dense * L.xla_bytes["mlp"]
        if n_moe:
            cf += [n_moe * F["moe_tok"], n_moe * F["experts"]]
            cb += [n_moe * Y["moe_tok"], n_moe * Y["experts"]]
            xb = xb + n_moe * L.xla_bytes["moe"]
        if has_lm:
            cf.append(F["lm_head"])
            cb.append(Y["lm_head"])
            xb = xb + L.xla_bytes["lm_head"]
        weights = stage_weights(W, d, n_dense, n_moe, has_embed, has_lm)
        kv = nl * g.seqs_chip * g.S * L.kv_elems * B2
        if d.is_mla:
            o_proj = d.heads * d.v_dim * d.hidden
        else:
            o_proj = d.heads * d.head_dim * d.hidden
        paired = (nl * o_proj + n_dense * d.hidden * d.inter
                  + n_moe * d.hidden * d.shared_inter) * B2
        return StageWork(count, cf, cb, self._stage_collectives(par, g, d, nl, n_moe, has_lm),
                         float(weights), kv, L.act_peak * g.ones, xb,
                         float(paired / weights) if weights else 0.0)

    def _stage_collectives(self, par: Parallelism, g: "_Grid", d: ShardDims, nl: int,
                           n_moe: int, has_lm: bool) -> list[tuple[str, int, np.ndarray]]:
        """(kind, calls, message bytes) of a stage of ``nl`` layers, ``n_moe`` of them MoE."""
        H, ones = d.hidden, g.ones
        coll: list[tuple[str, int, np.ndarray]] = []
        if n_moe and par.moe_ep > 1:
            n = par.moe_ep
            disp = dispatch_tokens(par, g.t_attn) * d.top_k * H * B2 * (n - 1) / n * ones
            coll.append(("a2a", 2 * n_moe, disp))
        if has_lm and par.attn_tp > 1:
            coll.append(("ag", 1, g.t_lm * self.arch.vocab * B2 * ones))
        if par.attn_tp > 1:
            # per layer: attention output; per dense layer: MLP output; per MoE layer: the
            # experts' TP partial sums and the shared expert's ("dp" layout), or the shared
            # expert's only ("tp" layout: whole experts, the routed outputs come back by the
            # combine all-to-all and are added into it)
            moe_ar = n_moe if (par.moe_tp > 1 or d.shared_inter) else 0
            n_ar = nl + (nl - n_moe) + moe_ar
            if n_ar:
                coll.append(("ar", n_ar, g.t_attn * H * B2 * ones))
        if par.pp > 1 and not has_lm:
            coll.append(("p2p", 1, g.t_attn * H * B2 * ones))
        return coll


@dataclass
class _Grid:
    """The (B, S) grid of one split and phase, with the per-chip counts derived from it."""
    prefill: bool
    B: np.ndarray          # batch [nB, 1]
    S: np.ndarray          # sequence length [1, nS]
    m: np.ndarray          # micro-batches [nB, 1]
    b_mb: np.ndarray       # sequences per micro-batch
    b_loc: np.ndarray      # sequences per micro-batch on one EP group's chip
    seqs_chip: np.ndarray  # sequences whose KV one chip holds
    q_tok: Any             # new tokens per sequence: S (prefill) or 1
    t_attn: np.ndarray     # tokens through this chip's attention
    n_pass: Any            # forward passes per step (weights re-read once each)
    t_act: np.ndarray      # tokens live in one pass
    t_lm: np.ndarray       # tokens through the LM head
    ones: np.ndarray       # [1, nS] broadcaster

    @classmethod
    def of(cls, par: Parallelism, phase: str, B: np.ndarray, S: np.ndarray) -> "_Grid":
        Bf = B.astype(np.float64).reshape(-1, 1)
        Sf = S.astype(np.float64).reshape(1, -1)
        m = np.minimum(Bf, par.pp)
        b_mb = np.ceil(Bf / m)
        b_loc = np.ceil(b_mb / par.dp)
        # KV of every sequence in flight stays resident. Decode: the B sequences of the batch.
        # Prefill: a batch enters every m slowest-stage slots (the cycle of _schedule) and
        # spends pp + m - 1 slots in the pipeline, so (pp + m - 1) / m batches are in flight,
        # each stage holding its layers' KV for all of them until hand-off (B = 1 on PP = 16:
        # 16 prompts; vLLM's PP virtual engines get 1/pp of the KV blocks each).
        inflight = Bf * (par.pp + m - 1) / m if phase == "prefill" else Bf
        # Tensor-parallel attention (par.dp = 1) keeps every sequence's KV on every chip: MLA's
        # latent is shared by all heads and cannot be split by them (GQA heads are split).
        seqs_chip = np.ceil(inflight / par.dp)
        prefill = phase == "prefill"
        q_tok = Sf if prefill else 1.0
        t_attn = b_loc * q_tok
        # weights are streamed once per forward pass: once per prefill chunk
        n_pass = np.ceil(t_attn / PREFILL_CHUNK_TOKENS) if prefill else 1.0
        t_act = np.minimum(t_attn, PREFILL_CHUNK_TOKENS)
        return cls(prefill, Bf, Sf, m, b_mb, b_loc, seqs_chip, q_tok, t_attn, n_pass, t_act,
                   b_loc, np.ones_like(Sf))


@dataclass
class _Layers:
    """Per chip, per layer and micro-batch step: each component's FLOPs, fused HBM bytes and
    XLA's unfused bytes (``attn``, ``mlp``, ``lm_head``; MoE: ``moe_tok``, ``experts``, XLA
    bytes of both as ``moe``), KV elements per token, and the activation peak."""
    flops: dict[str, np.ndarray]
    hbm_bytes: dict[str, np.ndarray]
    xla_bytes: dict[str, np.ndarray]
    kv_elems: float
    act_peak: Any


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
    pair_frac: float = 0.0          # see StageWork


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
        stages.append(StageOnChip(st.n_stages, comp_t, tc, tm, fl, by, st.xla_bytes, dyn, cn, cm,
                                  st.pair_frac))
        mst = st.weights_bytes + st.kv_bytes + st.act_bytes
        mem = mst if mem is None else np.maximum(mem, mst)
        kv = st.kv_bytes if kv is None else np.maximum(kv, st.kv_bytes)
        weights = max(weights, st.weights_bytes)
    usable = HBM_USABLE_FRACTION * chip.hbm_bytes
    feasible = mem <= usable
    reason = np.where(weights > usable, 0, np.where(weights + kv > usable, 1, 2)).astype(np.int8)
    return OnChip(work, chip, stages, mem, weights, feasible, reason)


def _ici(st: StageOnChip, colls, tp: int = 1):
    """A stage's exposed ICI time and bytes. TP all-reduces overlap the matmuls that feed them
    (XLA's async collectives / collective matmul; simple form): their transfer hides under
    the stage's compute time times the share of its weights in those matmuls, except the
    first of ``tp`` pieces; hop latency stays exposed. The chip model pairs each all-reduce
    with its own matmul (:mod:`sim.chip`)."""
    t = b = 0.0
    for kind, n in st.coll_n.items():
        c, m = colls[kind], st.coll_m[kind]
        transfer = c.beta_s_per_byte * m
        if kind == "ar" and tp > 1:
            transfer = np.maximum(transfer / tp, transfer - st.comp_t * st.pair_frac)
        t = t + (c.alpha_s * n + transfer)
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
        it, ib = _ici(st, colls, par.attn_tp)
        ici.append((it, ib))
        t = st.comp_t + it
        t_sum = t_sum + st.n_stages * t
        dyn = st.dyn_j + ib * oc.chip.ici_j_per_byte
        dyn_total = dyn_total + dyn * (st.n_stages * par.stage_chips)
        if t_stage is None:
            t_stage, slow = t, np.zeros(np.shape(t), np.int64)
        else:
            later = t > t_stage
            slow = np.where(later, i, slow)
            t_stage = np.maximum(t_stage, t)
    return t_stage, slow, ici, dyn_total, t_sum


def _schedule(oc: OnChip, t_stage, dyn_total, t_sum, stack: StackProfile):
    """Pipeline schedule of m micro-batches over stages of unequal length: the first
    micro-batch passes every stage once (``t_sum``), the others follow one slowest-stage slot
    apart; a decode iteration ends when every micro-batch has passed every stage. The serving
    stack's step time (for the micro-batch's sequences) is paid once per fill and per cycle,
    as the chip model's :meth:`sim.chip.ChipModel.step` does."""
    w, par, chip = oc.work, oc.work.par, oc.chip
    m = w.m
    b_mb = np.ceil(w.B / m)

    def step(device):
        return stack.step_time_s(device, b_mb)
    if w.phase == "prefill":
        latency = step(t_sum) + (m - 1) * t_stage
        cycle = step(m * t_stage)
        tokens = w.B * w.S
    else:
        cycle = np.maximum(step(t_sum), step(m * t_stage))
        latency = cycle
        tokens = w.B * np.ones_like(w.S)
    # bounded by the chip's measured maximum power where one is published (v4)
    energy = chip.power_capped_j(dyn_total * m + chip.static_power_w * par.chips * cycle,
                                 par.chips, cycle)
    cost = chip.vpod_usd(par.chips, cycle)
    return latency, cycle, tokens, energy, cost


def latency_efficiency(oc: OnChip, colls, metric: str, stack: "StackProfile | str | None" = None):
    """Fast path for the DSE sweep: (latency_s, tokens per J or per USD); ``colls`` may be a
    list of topologies' collective tables (results then have a leading topology axis).
    ``stack``: the serving-stack profile (default ``vllm-tpu``)."""
    if isinstance(colls, list):
        colls = stack_collectives(colls)
    t_stage, _, _, dyn, t_sum = _timing(oc, colls)
    latency, cycle, tokens, energy, cost = _schedule(oc, t_stage, dyn, t_sum, get_stack(stack))
    return latency, tokens / (energy if metric == "energy" else cost)


def roofline(work: Work, chip: ChipSpec, topo: ICITopology, oc: OnChip | None = None,
             stack: "StackProfile | str | None" = None) -> Roofline:
    """Full roofline of one allocation (every quantity, per grid point), with the serving
    stack's software time (default ``vllm-tpu``)."""
    oc = oc or on_chip(work, chip)
    par = work.par
    t_stage, slow, ici, dyn, t_sum = _timing(oc, collectives(topo, chip, par))
    latency, cycle, tokens, energy, cost = _schedule(oc, t_stage, dyn, t_sum, get_stack(stack))
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


__all__ = ["CostModel", "Roofline", "roofline", "on_chip", "OnChip", "latency_efficiency",
           "PHASES", "METRICS", "REASONS", "BOUNDS", "infeasible_message",
           "HBM_USABLE_FRACTION", "MODEL_VERSION",
           # re-exported from dse.parallel and dse.torus
           "Parallelism", "ATTN_LAYOUTS", "LAYOUT_SUFFIX", "dispatch_tokens",
           "busiest_active_experts", "busiest_expert_tokens", "MOE_HOT_FACTOR",
           "validate_parallelism", "enumerate_parallelisms", "runs_on", "stage_layout",
           "weight_bytes", "stage_weights", "max_weights_bytes", "group_dims", "Collective",
           "allreduce_cost", "allgather_cost", "alltoall_cost", "p2p_cost", "collectives",
           "stack_collectives"]
