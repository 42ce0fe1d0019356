"""How a model is split over the chips of a vPod: TP x PP x EP, its pipeline stages and the
weights each chip holds.

Shared by the roofline (:mod:`dse.costmodel`) and the per-operator chip model
(:mod:`sim.chip`), so both judge the same shards; the torus side (which dimensions each group
spans, what its collectives cost) is :mod:`dse.torus`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NeuScaleError
from .models import BYTES_PER_PARAM, ModelArch
from .vpod import is_pow2
from .xla_cost import ShardDims

B2 = BYTES_PER_PARAM  # bf16 weights


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
    d = ShardDims.of(a, par.tp, par.ep)
    W = weight_bytes(a, d)
    return max(stage_weights(W, d, nd, nm, he, hl)
               for nd, nm, he, hl, _ in stage_layout(a, par.pp))


__all__ = ["Parallelism", "validate_parallelism", "enumerate_parallelisms", "stage_layout",
           "weight_bytes", "stage_weights", "max_weights_bytes"]
