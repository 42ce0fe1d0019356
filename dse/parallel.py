"""How a model is split over the chips of a vPod: TP x PP x EP, its pipeline stages and the
weights each chip holds.

Three layouts of a mixture-of-experts stage (``Parallelism.attn``):

* ``"dp"`` (the original one): attention is data-parallel over ``ep`` groups of ``tp`` chips
  (each group holds its own sequences and their KV cache), the routed experts are split over
  the ``ep`` groups with TP ``tp`` inside each expert;
* ``"tp"``: attention (and the shared expert, the dense layers and the LM head) is
  tensor-parallel over all ``tp * ep`` chips of the stage, the routed experts expert-parallel
  over the same chips, ``n_experts / (tp * ep)`` whole experts each (no TP inside an expert):
  vLLM's ``--tensor-parallel-size N --enable-expert-parallel``. MLA's latent KV cache is shared
  by all heads, so it cannot be split by heads: every chip holds the latent of every sequence.
* ``"hybrid"``: attention data-parallel over ``ep`` groups of TP ``tp`` (as ``"dp"``), the
  routed experts expert-parallel over all ``tp * ep`` chips of the stage, whole experts (as
  ``"tp"``): vLLM's ``--data-parallel-size ep --tensor-parallel-size tp
  --enable-expert-parallel`` (its expert-parallel group spans DP x TP ranks) and sglang-jax's
  DP attention with EPMoE. Each chip dispatches a ``1/tp`` slice of its DP group's tokens.
  Distinct from the other two only when ``tp >= 2`` and ``ep >= 2`` (``tp = 1`` is ``"dp"``,
  ``ep = 1`` is ``"tp"``), so only such splits carry it.

Which of them a serving stack can run is the stack profile's ``moe_layouts``
(:mod:`dse.stacks`): vLLM cannot put TP inside an expert group of a data-parallel vPod, so
under ``vllm-tpu`` a ``"dp"`` split with ``tp >= 2`` and ``ep >= 2`` is not enumerated.

Shared by the roofline (:mod:`dse.costmodel`) and the per-operator chip model
(:mod:`sim.chip`), so both judge the same shards; the torus side (which dimensions each group
spans, what its collectives cost) is :mod:`dse.torus`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.stats import binom

from .errors import NeuScaleError
from .models import BYTES_PER_PARAM, ModelArch
from .vpod import is_pow2
from .xla_cost import ShardDims, fit_key

B2 = BYTES_PER_PARAM  # bf16 weights


# attention data-parallel over the EP groups / TP over the stage / DP attention with the
# experts expert-parallel over the whole stage
ATTN_LAYOUTS = ("dp", "tp", "hybrid")


LAYOUT_SUFFIX = {"dp": "", "tp": "-tpattn", "hybrid": "-hybrid"}   # printed after the split


@dataclass(frozen=True, order=True)
class Parallelism:
    """``tp * pp * ep`` chips; ``attn`` is the MoE stage layout (module docstring): ``"dp"``
    attention data-parallel over ``ep`` groups of TP ``tp``, experts TP ``tp`` inside each of
    ``ep`` expert groups; ``"tp"`` attention TP over all ``tp * ep`` chips of a stage, experts
    expert-parallel over them (whole experts)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    attn: str = "dp"

    @property
    def chips(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def stage_chips(self) -> int:
        """Chips of one pipeline stage."""
        return self.tp * self.ep

    @property
    def attn_tp(self) -> int:
        """Chips attention heads (and the dense MLP, shared expert, LM head) are split over."""
        return self.tp * self.ep if self.attn == "tp" else self.tp

    @property
    def dp(self) -> int:
        """Attention data-parallel groups: each holds its own sequences and their KV cache."""
        return 1 if self.attn == "tp" else self.ep

    @property
    def moe_ep(self) -> int:
        """Expert groups the routed experts are split over (the all-to-all's group)."""
        return self.tp * self.ep if self.attn in ("tp", "hybrid") else self.ep

    @property
    def moe_tp(self) -> int:
        """TP inside one routed expert."""
        return 1 if self.attn in ("tp", "hybrid") else self.tp

    def shard(self, arch: ModelArch) -> ShardDims:
        """Chip-local sizes of ``arch`` under this split: attention, dense MLP, shared expert
        and LM head at TP :attr:`attn_tp`; routed experts ``n_experts / moe_ep`` per chip at
        width ``moe_intermediate / moe_tp``."""
        d = ShardDims.of(arch, self.attn_tp, self.moe_ep)
        if arch.is_moe and self.moe_tp != self.attn_tp:
            d = replace(d, moe_inter=-(-arch.moe_intermediate // self.moe_tp))
        return d

    def fit_key(self, component: str) -> str:
        """Key of the XLA fit a component uses under this split: the ``"tp"`` layout's
        attention/MLP/shared expert/LM head are the graphs at TP ``tp*ep``, its experts the
        graph at TP 1 and EP ``tp*ep`` (both lowered for the ``"dp"`` layout too)."""
        return fit_key(component, *self.fit_shard(component))

    def fit_shard(self, component: str) -> tuple[int, int]:
        """(tp, ep) of the fit a component uses (see :meth:`fit_key`)."""
        if component == "experts":
            return self.moe_tp, self.moe_ep
        return self.attn_tp, self.moe_ep

    def __str__(self) -> str:
        return (f"tp{self.tp}-pp{self.pp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
                + LAYOUT_SUFFIX[self.attn])


def validate_parallelism(arch: ModelArch, par: Parallelism) -> None:
    probs = []
    if par.attn not in ATTN_LAYOUTS:
        raise NeuScaleError(f"invalid parallelism for {arch.name}: attention layout "
                            f"{par.attn!r} must be one of {', '.join(ATTN_LAYOUTS)}")
    for n in ("tp", "pp", "ep"):
        if not is_pow2(getattr(par, n)):
            probs.append(f"{n}={getattr(par, n)} must be a power of two")
    if par.attn == "tp" and not arch.is_moe:
        probs.append(f"the tensor-parallel attention layout needs a mixture-of-experts model "
                     f"({arch.name} is dense; plain tp is the same thing)")
    if par.attn == "hybrid":
        if not arch.is_moe:
            probs.append(f"the hybrid layout needs a mixture-of-experts model ({arch.name} is "
                         "dense)")
        elif par.tp < 2 or par.ep < 2:
            same = "the dp layout" if par.tp < 2 else f"tp=1, ep={par.tp} with attn tp"
            probs.append(f"the hybrid layout needs tp >= 2 and ep >= 2 (with tp={par.tp}, "
                         f"ep={par.ep} it is {same})")
    if par.attn == "tp" and par.attn_tp > arch.heads:
        probs.append(f"tp*ep={par.attn_tp} (attention TP of the tpattn layout) exceeds the "
                     f"model's {arch.heads} attention heads")
    elif par.tp > arch.heads:
        probs.append(f"tp={par.tp} exceeds the model's {arch.heads} attention heads")
    if par.pp > arch.layers:
        probs.append(f"pp={par.pp} exceeds the model's {arch.layers} layers")
    if par.ep > 1 and not arch.is_moe:
        probs.append(f"ep={par.ep} needs a mixture-of-experts model ({arch.name} is dense)")
    if arch.is_moe and par.moe_ep > arch.n_routed_experts:
        probs.append(f"{'ep' if par.attn == 'dp' else 'tp*ep'}={par.moe_ep} exceeds the "
                     f"model's {arch.n_routed_experts} experts")
    if probs:
        raise NeuScaleError(f"invalid parallelism {par} for {arch.name}: " + "; ".join(probs))


def runs_on(par: Parallelism, layouts: "tuple[str, ...] | list[str]") -> bool:
    """Whether a stack that launches ``layouts`` can run ``par``: its layout is one of them,
    or it is a ``"dp"`` split with ``tp = 1`` or ``ep = 1``, the same under every layout."""
    return par.attn in layouts or (par.attn == "dp" and (par.tp == 1 or par.ep == 1))


def enumerate_parallelisms(arch: ModelArch, n_chips: int,
                           layouts: "tuple[str, ...] | list[str]" = ATTN_LAYOUTS
                           ) -> list[Parallelism]:
    """All TP x PP (x EP) factorisations of ``n_chips`` valid for the model. For a MoE model,
    in the ``layouts`` a serving stack can run (module docstring): ``"dp"`` splits (without
    ``"dp"``, only those with ``tp = 1`` or ``ep = 1``, which are the same under every
    layout); the tensor-parallel-attention layout of every stage of ``N >= 2`` chips, once per
    ``N`` as ``tp=1, ep=N`` (its physics depends on ``tp * ep`` only); the hybrid layout of
    every split with ``tp >= 2``, ``ep >= 2`` and ``tp * ep`` experts at most."""
    bad = [x for x in layouts if x not in ATTN_LAYOUTS]
    if bad or not layouts:
        raise NeuScaleError(f"MoE layouts {list(layouts)!r}: each must be one of "
                            f"{', '.join(ATTN_LAYOUTS)}")
    out = []
    tp = 1
    while tp <= min(n_chips, arch.heads):
        ep = 1
        while tp * ep <= n_chips and (ep == 1 or (arch.is_moe and ep <= arch.n_routed_experts)):
            pp = n_chips // (tp * ep)
            if tp * ep * pp == n_chips and pp <= arch.layers:
                if runs_on(Parallelism(tp, pp, ep), layouts):
                    out.append(Parallelism(tp, pp, ep))
                if tp > 1 and ep > 1 and "hybrid" in layouts \
                        and tp * ep <= arch.n_routed_experts:
                    out.append(Parallelism(tp, pp, ep, "hybrid"))
            ep *= 2
            if not arch.is_moe:
                break
        tp *= 2
    if arch.is_moe and "tp" in layouts:
        n = 2
        while n <= min(n_chips, arch.heads, arch.n_routed_experts):
            pp = n_chips // n
            if n * pp == n_chips and pp <= arch.layers:
                out.append(Parallelism(1, pp, n, "tp"))
            n *= 2
    return out


def dispatch_tokens(par: Parallelism, t_attn):
    """Tokens one chip sends in a MoE dispatch (and receives back in the combine): its DP
    group's tokens (``"dp"`` layout; every chip of the group sends them, as the chip model
    does), a ``1/(tp*ep)`` slice of the stage's tokens (``"tp"`` layout: after the attention
    all-reduce every chip holds all of them, and each dispatches its slice), or a ``1/tp``
    slice of its DP group's tokens (``"hybrid"``: the group's ``tp`` chips hold the same
    tokens after the attention all-reduce and split the dispatch)."""
    if par.attn == "tp":
        return t_attn / par.stage_chips
    return t_attn / par.tp if par.attn == "hybrid" else t_attn


# hottest expert / mean expert load (paper §4, after He et al. 2026): the chip that hosts it
# sets a MoE layer's pace, in the chip model (sim.chip) and the roofline (busiest_expert_tokens)
MOE_HOT_FACTOR = 7.0


def busiest_expert_tokens(experts: int, mean_tokens, stage_tokens):
    """Expert tokens (assignments) on the chip that sets a MoE layer's pace, ``experts``
    routed experts per chip at ``mean_tokens`` each on average: the hottest expert takes
    ``MOE_HOT_FACTOR`` x the mean (at most every token of the stage) and the chip's other
    experts the rest of its share, so the chip holds ``experts x mean`` unless the hot expert
    alone exceeds that - with fewer experts per chip than the factor (EP over 64 or more chips
    for 256 experts) it does, and that chip works up to 7x its mean share. The chip model
    prices the same split operator by operator. Floats or arrays."""
    share = experts * np.asarray(mean_tokens, dtype=float)
    hot = np.minimum(MOE_HOT_FACTOR * np.asarray(mean_tokens, dtype=float), stage_tokens)
    return np.maximum(share, hot)


def busiest_active_experts(experts: int, n_experts_total: int, p_active):
    """Experts that receive a token on the busiest of the stage's expert groups: the expected
    maximum, over the ``n_experts_total / experts`` groups of ``experts`` each, of the number
    of a group's experts that are routed at least one token, each with probability
    ``p_active`` (uniform routing, independent experts: a binomial per group). A step waits
    for the slowest group, and in decode at a small batch what a group reads is one expert's
    weights per expert it serves: the mean (``experts x p_active``) under-counts it when the
    groups are many and few tokens are routed (DeepSeek-V3, 16 sequences over 64 groups of 4
    experts: 1.6 on average, 3.8 on the busiest). One group (or every expert routed): the
    mean. Works on arrays of ``p_active``."""
    p = np.clip(np.asarray(p_active, dtype=float), 0.0, 1.0)
    e = int(experts)
    groups = max(1, int(round(n_experts_total / max(e, 1))))
    if groups == 1 or e <= 0:
        return e * p
    x = np.arange(e, dtype=float).reshape((e,) + (1,) * p.ndim)
    cdf = binom.cdf(x, e, p)                   # P(a group has <= x routed experts)
    return (1.0 - cdf ** groups).sum(axis=0)   # E[max] = sum over x of P(max > x)


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
# Weights held by one chip
# ---------------------------------------------------------------------------------------------

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


def stage_weights(W: dict[str, float], d: ShardDims, n_dense: int, n_moe: int,
                  has_embed: bool, has_lm: bool) -> float:
    """Weights on one chip of a stage of ``n_dense`` dense and ``n_moe`` MoE layers, given the
    per-group bytes ``W`` of :func:`weight_bytes`."""
    w = (n_dense + n_moe) * W["attn"] + n_dense * W["mlp"]
    if n_moe:
        w += n_moe * (W["moe_tok"] + d.experts * W["expert"])
    return w + (W["lm_head"] if has_lm else 0.0) + (W["embed"] if has_embed else 0.0)


def max_weights_bytes(a: ModelArch, par: Parallelism) -> float:
    """Weights held by one chip of the heaviest pipeline stage (cheap: no grid, no fits)."""
    d = par.shard(a)
    W = weight_bytes(a, d)
    return max(stage_weights(W, d, nd, nm, he, hl)
               for nd, nm, he, hl, _ in stage_layout(a, par.pp))


__all__ = ["Parallelism", "ATTN_LAYOUTS", "LAYOUT_SUFFIX", "dispatch_tokens",
           "busiest_active_experts", "busiest_expert_tokens", "MOE_HOT_FACTOR",
           "validate_parallelism",
           "enumerate_parallelisms", "runs_on", "stage_layout",
           "weight_bytes", "stage_weights", "max_weights_bytes"]
