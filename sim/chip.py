"""Per-operator NPU chip model: the ground truth the roofline is judged by (paper §4).

One engine step of a sharded LLM on a vPod is expanded into the operators each chip executes
(the same shards the DSE uses: :class:`dse.xla_cost.ShardDims`), and each operator runs on the
unit that does its work:

* matmuls on the systolic arrays (SA): weight tiles of ``width x width`` (128 or 256) are loaded
  (double-buffered) and the activation rows streamed through, ``ceil(K/w) * ceil(N/w)`` tiles of
  ``max(M, w)`` cycles spread over the MXUs - so narrow operands (decode at small batch, head_dim 128 on a 256-wide
  array, a few tokens per expert) waste most of the array;
* SRAM-limited tiling: when the streamed activation block does not fit in half the SRAM the
  weights are re-read from HBM once per block;
* vector work (norms, RoPE, softmax, SwiGLU, routing, sampling) on the VU;
* HBM at an achieved fraction of peak plus a DMA start per op; compute and memory overlap inside
  an op only partly (``OVERLAP``);
* attention with the model's real KV shapes: GQA reads the chip's KV heads (not query heads);
  DeepSeek MLA decode attends in the compressed latent space (absorbed projections, one latent
  + RoPE key per token shared by all heads); prefill is flash-style, re-reading K/V once per
  query block sized to the SRAM;
* ICI collectives on the TP/EP sub-torus (ring per dimension, bidirectional with wrap-around,
  per-hop latency, achieved link bandwidth, a launch cost per collective);
* MoE expert imbalance: the hottest expert receives 7x the mean tokens (§4), and the EP group
  waits for the chip that hosts it, which reads as many experts' weights as the busiest
  expert group has routed experts (:func:`dse.parallel.busiest_active_experts`);
* pipeline stages with their own layer counts, explicit bubbles;
* the serving stack's host time per step and per sequence and its attention-kernel efficiency
  (:mod:`dse.stacks`).

Energy per component: SA/VU FLOPs, SRAM/HBM/ICI bytes and static power x time, calibrated in
:mod:`sim.hardware` to Table 2's peak efficiencies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dse.catalog import Catalog, ChipSpec
from dse.errors import NeuScaleError
from dse.models import ModelArch
from dse.parallel import (MOE_HOT_FACTOR, Parallelism, busiest_active_experts, dispatch_tokens,
                          max_weights_bytes, stage_layout,
                          validate_parallelism)
from dse.stacks import StackProfile, get_stack
from dse.torus import allgather_cost, allreduce_cost, alltoall_cost, group_dims
from dse.vpod import ICITopology

from .hardware import (COLLECTIVE_LAUNCH_S, HBM_OP_LATENCY_S, KERNEL_LAUNCH_S, OVERLAP,
                       Hardware, hardware)

B2 = 2      # bf16


@dataclass
class Op:
    """One operator on one chip (x ``count`` identical instances per step)."""
    name: str
    unit: str                 # SA | VU | HBM | ICI: the unit that bounds it
    time_s: float
    sa_flops: float = 0.0
    vu_flops: float = 0.0
    hbm_bytes: float = 0.0
    sram_bytes: float = 0.0
    ici_bytes: float = 0.0
    count: int = 1

    def scaled(self, n: int) -> "Op":
        return Op(self.name, self.unit, self.time_s, self.sa_flops, self.vu_flops,
                  self.hbm_bytes, self.sram_bytes, self.ici_bytes, self.count * n)

    def energy_j(self, hw: Hardware) -> float:
        return self.count * (self.sa_flops * hw.e_sa_j_per_flop + self.vu_flops * hw.e_vu_j_per_flop
                             + self.hbm_bytes * hw.e_hbm_j_per_byte
                             + self.sram_bytes * hw.e_sram_j_per_byte
                             + self.ici_bytes * hw.e_ici_j_per_byte)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepResult:
    latency_s: float          # TTFT of the batch (prefill) / TPOT (decode) / one mixed step
    cycle_s: float            # steady-state time per batch (pipelined), for throughput/energy
    energy_j: float           # whole vPod, per cycle
    tokens: float
    bound: str                # unit with the largest share of the slowest stage's time
    ops: list[Op] = field(default_factory=list)   # slowest stage, per chip
    stage_times_s: list[float] = field(default_factory=list)
    hbm_bytes_per_chip: float = 0.0

    @property
    def throughput_tok_per_s(self) -> float:
        return self.tokens / self.cycle_s

    @property
    def energy_j_per_token(self) -> float:
        return self.energy_j / self.tokens

    def to_json(self, ops: bool = False) -> dict[str, Any]:
        d = {"latency_s": self.latency_s, "cycle_s": self.cycle_s, "energy_j": self.energy_j,
             "tokens": self.tokens, "throughput_tok_per_s": self.throughput_tok_per_s,
             "energy_j_per_token": self.energy_j_per_token, "bound": self.bound,
             "stage_times_s": self.stage_times_s}
        if ops:
            d["ops"] = [o.to_json() for o in self.ops]
        return d


class ChipModel:
    """The per-operator model of one allocation (model x chip x topology x parallelism)."""

    def __init__(self, arch: ModelArch, chip: ChipSpec, topo: ICITopology, par: Parallelism,
                 stack: "StackProfile | str | None" = None):
        """``stack``: the serving-stack profile (:mod:`dse.stacks`; default ``vllm-tpu``) whose
        per-step and per-sequence software time every step adds and whose attention kernel
        efficiency stretches the attention operators."""
        if topo.num_chips != par.chips:
            raise NeuScaleError(f"{par} needs {par.chips} chips; topology {topo} has "
                                f"{topo.num_chips}")
        self.arch, self.chip, self.topo, self.par = arch, chip, topo, par
        self.stack = get_stack(stack)
        self.hw = hardware(chip)
        self.d = par.shard(arch)
        gd = group_dims(topo, chip, par)
        self._ar = allreduce_cost(gd["tp"], chip)
        self._ag = allgather_cost(gd["tp"], chip)
        self._a2a = alltoall_cost(gd["ep"], chip)
        self._ep_ag = allgather_cost(gd["ep"], chip)     # the "allgather" MoE dispatch's
        self._ep_ar = allreduce_cost(gd["ep"], chip)
        self.stages = stage_layout(arch, par.pp)

    @classmethod
    def of(cls, arch: ModelArch, catalog: Catalog, chip: str, topology: str, tp: int,
           pp: int = 1, ep: int = 1, stack: "StackProfile | str | None" = None,
           attn: str = "dp") -> "ChipModel":
        """The model of an allocation given by names: ``chip`` is resolved through ``catalog``
        (aliases accepted), ``topology`` is a pod shape such as ``"2x2x1"``; ``attn`` the MoE
        layout (:class:`dse.parallel.Parallelism`)."""
        spec = catalog.get(chip)
        par = Parallelism(tp, pp, ep, attn)
        validate_parallelism(arch, par)
        return cls(arch, spec, ICITopology.parse(topology).for_chip(spec), par, stack)

    # ---- operator primitives ----------------------------------------------------------------
    def _finish(self, name: str, tc: float, tv: float, hbm: float, **kw: float) -> Op:
        hw = self.hw
        tm = hbm / hw.hbm_bw_eff_bytes_per_s + (HBM_OP_LATENCY_S if hbm else 0.0)
        tcomp = tc + tv
        t = max(tcomp, tm) + (1 - OVERLAP) * min(tcomp, tm) + KERNEL_LAUNCH_S
        unit = "HBM" if tm >= tcomp else ("SA" if tc >= tv else "VU")
        return Op(name, unit, t, hbm_bytes=hbm, **kw)

    def matmul(self, name: str, M: float, K: int, N: int, groups: float = 1, weights: bool = True,
               a_bytes: float | None = None, extra_hbm: float = 0.0) -> Op:
        """``groups`` independent (M x K) @ (K x N) products; B is a weight from HBM."""
        hw, w = self.hw, self.hw.width
        if M <= 0 or groups <= 0:
            return Op(name, "SA", 0.0)
        tiles = math.ceil(K / w) * math.ceil(N / w) * groups
        waves = math.ceil(tiles / hw.mxus)
        # weight tiles are double-buffered: loading the next (w cycles) overlaps streaming the
        # M rows of this one, so a tile costs max(M, w) cycles, plus one pipeline fill per op
        tc = (waves * max(M, w) + w) / hw.clock_hz
        flops = 2.0 * M * K * N * groups
        a = (M * K * B2 * groups) if a_bytes is None else a_bytes
        b = K * N * B2 * groups if weights else 0.0
        rereads = max(1, math.ceil(M * K * B2 / (hw.sram_bytes / 2))) if weights else 1
        hbm = a + b * rereads + M * N * B2 * groups + extra_hbm
        return self._finish(name, tc, 0.0, hbm, sa_flops=flops, sram_bytes=2.0 * flops / w)

    def vector(self, name: str, elems: float, flop_per_elem: float, hbm: float) -> Op:
        if elems <= 0:
            return Op(name, "VU", 0.0)
        vf = elems * flop_per_elem
        return self._finish(name, 0.0, vf / self.hw.vu_flops_per_s, hbm, vu_flops=vf,
                            sram_bytes=2.0 * hbm)

    def _collective(self, name: str, c, group: int, msg_bytes: float) -> Op:
        """A collective with cost coefficients ``c`` (from :mod:`dse.torus`) at the
        achieved link bandwidth, plus the group's synchronisation."""
        if group == 1 or msg_bytes <= 0:
            return Op(name, "ICI", 0.0)
        eff = self.hw.ici_link_eff_bytes_per_s / self.chip.ici_link_bw_bytes_per_s
        t = c.alpha_s + c.beta_s_per_byte * msg_bytes / eff + COLLECTIVE_LAUNCH_S
        return Op(name, "ICI", t, ici_bytes=c.gamma * msg_bytes, sram_bytes=2 * msg_bytes)

    def allreduce(self, name: str, msg_bytes: float, under: Op | None = None) -> Op:
        """A TP all-reduce; ``under``: the matmul whose output it reduces. XLA overlaps the two
        (async collectives; collective matmul decomposes the matmul and the reduction into
        ``tp`` steps, each step's transfer running under the next step's compute), so only the
        collective's latency (hops, launch), the first of its ``tp`` transfer steps and whatever
        transfer outlasts the matmul stay exposed (:func:`exposed_collective_s`)."""
        tp = self.par.attn_tp
        op = self._collective(name, self._ar, tp, msg_bytes)
        if under is not None and op.time_s > 0:
            fixed = self._ar.alpha_s + COLLECTIVE_LAUNCH_S
            op.time_s = fixed + exposed_collective_s(op.time_s - fixed, under.time_s, tp)
        return op

    def alltoall(self, name: str, msg_bytes: float) -> Op:
        return self._collective(name, self._a2a, self.par.moe_ep, msg_bytes)

    def p2p(self, name: str, msg_bytes: float) -> Op:
        t = (self.chip.ici_hop_latency_s + msg_bytes / self.hw.ici_link_eff_bytes_per_s
             + COLLECTIVE_LAUNCH_S)
        return Op(name, "ICI", t, ici_bytes=msg_bytes)

    # ---- attention ------------------------------------------------------------------------
    def _q_block(self, heads: int, head_dim: int) -> int:
        """Largest power-of-two query block whose Q, O (fp32 accumulator) fit in half the SRAM."""
        qb = 128
        while qb < 4096 and 2 * qb * heads * head_dim * (B2 + 4) <= self.hw.sram_bytes / 2:
            qb *= 2
        return qb

    def attention(self, p_tokens: float, p_ctx: float, n_dec: float, dec_kv: float) -> list[Op]:
        """Ragged attention of one step: prefill chunks (``p_tokens`` new tokens attending
        ``p_ctx`` keys in total) and ``n_dec`` decoding sequences over ``dec_kv`` cached keys;
        each kernel at the serving stack's attention efficiency (its time / eff; the work, and
        so the dynamic energy, unchanged)."""
        ops = self._attention_kernels(p_tokens, p_ctx, n_dec, dec_kv)
        eff_p, eff_d = self.stack.attn_prefill_eff, self.stack.attn_decode_eff
        for o in ops:
            eff = eff_p if o.name.startswith("attn_prefill") else eff_d
            if eff != 1.0:
                o.time_s /= eff
        return ops

    def _attention_kernels(self, p_tokens: float, p_ctx: float, n_dec: float, dec_kv: float
                           ) -> list[Op]:
        d, w, hw = self.d, self.hw.width, self.hw
        ops: list[Op] = []
        if d.is_mla:
            qk, dv, lat = d.nope + d.rope, d.v_dim, d.kv_lora + d.rope
            if p_tokens > 0:     # prefill: decompressed K/V per head (vLLM/DeepSeek practice)
                qb = self._q_block(d.heads, qk)
                flops = 2.0 * d.heads * (qk + dv) * p_ctx
                eff = (qk / (w * math.ceil(qk / w)) + dv / (w * math.ceil(dv / w))) / 2
                tc = flops / (hw.sa_flops_per_s * eff * min(1.0, p_tokens / (p_tokens + w)))
                kv_read = p_ctx / qb * d.heads * (qk + dv) * B2
                hbm = kv_read + p_tokens * d.heads * (qk + dv) * B2 * 2
                ops.append(self._finish("attn_prefill_flash", tc, 0.0, hbm, sa_flops=flops,
                                        sram_bytes=2 * flops / w))
                ops.append(self.vector("attn_prefill_softmax", d.heads * p_ctx, 8, 0.0))
            if n_dec > 0:        # decode: absorbed, all heads against the shared latent
                per_seq_L = dec_kv / n_dec
                a = self.matmul("attn_decode_scores", d.heads, lat, per_seq_L, groups=n_dec,
                                weights=False, a_bytes=n_dec * d.heads * lat * B2,
                                extra_hbm=dec_kv * lat * B2)
                b = self.matmul("attn_decode_values", d.heads, per_seq_L, d.kv_lora,
                                groups=n_dec, weights=False, a_bytes=0.0)
                ops += [a, b, self.vector("attn_decode_softmax", d.heads * dec_kv, 8, 0.0)]
            return ops
        hd, g = d.head_dim, max(1, d.heads // d.kv_heads)
        if p_tokens > 0:
            qb = self._q_block(d.heads, hd)
            flops = 4.0 * d.heads * hd * p_ctx
            eff = hd / (w * math.ceil(hd / w))
            tc = flops / (hw.sa_flops_per_s * eff * min(1.0, p_tokens / (p_tokens + w)))
            kv_read = p_ctx / qb * 2 * d.kv_heads * hd * B2
            hbm = kv_read + p_tokens * (d.heads * 2 + 2 * d.kv_heads) * hd * B2
            ops.append(self._finish("attn_prefill_flash", tc, 0.0, hbm, sa_flops=flops,
                                    sram_bytes=2 * flops / w))
            ops.append(self.vector("attn_prefill_softmax", d.heads * p_ctx, 8, 0.0))
        if n_dec > 0:
            per_seq_L = dec_kv / n_dec
            # per sequence and KV head: (g x hd) @ (hd x L), then (g x L) @ (L x hd)
            a = self.matmul("attn_decode_scores", g, hd, per_seq_L, groups=n_dec * d.kv_heads,
                            weights=False, a_bytes=n_dec * d.heads * hd * B2,
                            extra_hbm=dec_kv * 2 * d.kv_heads * hd * B2)
            b = self.matmul("attn_decode_values", g, per_seq_L, hd, groups=n_dec * d.kv_heads,
                            weights=False, a_bytes=0.0)
            ops += [a, b, self.vector("attn_decode_softmax", d.heads * dec_kv, 8, 0.0)]
        return ops

    # ---- layers -----------------------------------------------------------------------------
    def attention_block(self, t: float, p_tokens: float, p_ctx: float, n_dec: float,
                        dec_kv: float) -> list[Op]:
        d, H = self.d, self.d.hidden
        ops = [self.vector("attn_norm", t * H, 4, 2 * t * H * B2)]
        if d.is_mla:
            qk = d.nope + d.rope
            ops += [self.matmul("q_a_proj", t, H, d.q_lora),
                    self.vector("q_norm", t * d.q_lora, 4, 2 * t * d.q_lora * B2),
                    self.matmul("q_b_proj", t, d.q_lora, d.heads * qk),
                    self.matmul("kv_a_proj", t, H, d.kv_lora + d.rope),
                    self.vector("rope", t * (d.heads + 1) * d.rope, 3,
                                2 * t * (d.heads + 1) * d.rope * B2)]
            if p_tokens > 0:
                ops.append(self.matmul("kv_b_proj", p_tokens, d.kv_lora,
                                       d.heads * (d.nope + d.v_dim)))
            if n_dec > 0:
                ops += [self.matmul("q_absorb", 1, d.nope, d.kv_lora, groups=n_dec * d.heads,
                                    weights=False, extra_hbm=d.heads * d.nope * d.kv_lora * B2),
                        self.matmul("v_absorb", 1, d.kv_lora, d.v_dim, groups=n_dec * d.heads,
                                    weights=False, extra_hbm=d.heads * d.kv_lora * d.v_dim * B2)]
            ops += self.attention(p_tokens, p_ctx, n_dec, dec_kv)
            ops.append(self.matmul("o_proj", t, d.heads * d.v_dim, H))
        else:
            hd = d.head_dim
            ops += [self.matmul("qkv_proj", t, H, (d.heads + 2 * d.kv_heads) * hd),
                    self.vector("rope", t * (d.heads + d.kv_heads) * hd, 3,
                                2 * t * (d.heads + d.kv_heads) * hd * B2)]
            ops += self.attention(p_tokens, p_ctx, n_dec, dec_kv)
            ops.append(self.matmul("o_proj", t, d.heads * hd, H))
        ops.append(self.allreduce("attn_allreduce", t * H * B2, under=ops[-1]))
        return ops

    def mlp_block(self, t: float) -> list[Op]:
        d, H = self.d, self.d.hidden
        return [self.vector("mlp_norm", t * H, 4, 2 * t * H * B2),
                self.matmul("gate_up_proj", t, H, 2 * d.inter),
                self.vector("swiglu", t * d.inter, 6, 3 * t * d.inter * B2),
                down := self.matmul("down_proj", t, d.inter, H),
                self.allreduce("mlp_allreduce", t * H * B2, under=down)]

    def moe_block(self, t: float, stage_tokens: float) -> list[Op]:
        """``t`` tokens through this chip's attention DP group; ``stage_tokens`` in the whole
        EP group. The chip hosting the hottest expert sets the pace. Dispatch/combine: each
        chip sends its DP group's tokens (``"dp"`` layout) or its ``1/(tp*ep)`` slice of the
        stage's tokens (``"tp"`` layout, :func:`dse.parallel.dispatch_tokens`)."""
        d, H, k, E = self.d, self.d.hidden, self.d.top_k, self.d.n_experts_total
        n = self.par.moe_ep
        a2a_msg = dispatch_tokens(self.par, t) * k * H * B2 * (n - 1) / n
        ops = [self.vector("moe_norm", t * H, 4, 2 * t * H * B2),
               self.matmul("router", t, H, E, a_bytes=t * H * B2),
               self.vector("router_topk", t * E, 8, t * E * 4)]
        if d.shared_inter:
            ops += [self.matmul("shared_gate_up", t, H, 2 * d.shared_inter),
                    self.vector("shared_swiglu", t * d.shared_inter, 6, 3 * t * d.shared_inter * B2),
                    self.matmul("shared_down", t, d.shared_inter, H)]
        gather = self.stack.moe_dispatch == "allgather"
        if gather:
            # every token of the stage to every chip of the expert group (the message: all of
            # them), each chip computes its experts' share, an all-reduce sums the outputs
            ops.append(self._collective("dispatch_allgather", self._ep_ag, n,
                                        stage_tokens * H * B2))
        else:
            ops.append(self.alltoall("dispatch_a2a", a2a_msg))
        assignments = stage_tokens * k
        mean = assignments / E
        p_active = 1.0 - (1.0 - k / E) ** stage_tokens
        # the chip that sets the pace: as many routed experts as the busiest expert group has
        # (each expert read once), one of them the hottest expert, the rest at the mean load
        # (at least the token that makes them routed)
        active = max(1.0, float(busiest_active_experts(d.experts, E, p_active)))
        hot = min(MOE_HOT_FACTOR * mean, stage_tokens) if mean > 0 else 0.0
        others = max(0.0, active - 1)
        per_other = (mean * d.experts - hot) / max(others, 1.0) if d.experts > 1 else 0.0
        per_other = max(per_other, 1.0 if others > 0 else 0.0)
        for nm, tok, n in (("hot", hot, 1.0), ("rest", per_other, others)):
            if tok <= 0 or n <= 0:
                continue
            M = max(tok, 1.0)
            ops += [self.matmul(f"experts_{nm}_gate_up", M, H, 2 * d.moe_inter, groups=n),
                    self.vector(f"experts_{nm}_swiglu", n * M * d.moe_inter, 6,
                                3 * n * M * d.moe_inter * B2),
                    self.matmul(f"experts_{nm}_down", M, d.moe_inter, H, groups=n)]
        ops.append(self._collective("combine_allreduce", self._ep_ar, n, stage_tokens * H * B2)
                   if gather else self.alltoall("combine_a2a", a2a_msg))
        # the experts' TP partial sums ("dp" layout) and the shared expert's; whole experts
        # ("tp" layout) leave only the shared expert's (the routed outputs are added into it)
        if self.par.moe_tp > 1 or d.shared_inter:
            shared = next((o for o in ops if o.name == "shared_down"), None)
            ops.append(self.allreduce("moe_allreduce", t * H * B2, under=shared))
        return ops

    def head(self, n_logits: float) -> list[Op]:
        d, H = self.d, self.d.hidden
        ops = [self.vector("final_norm", n_logits * H, 4, 2 * n_logits * H * B2),
               self.matmul("lm_head", n_logits, H, d.vocab),
               self.vector("sampling", n_logits * d.vocab, 4, n_logits * d.vocab * 4)]
        if self.par.attn_tp > 1:
            # fp32 logits gathered at the peak link bandwidth (no achieved-bandwidth scaling)
            c, msg = self._ag, n_logits * self.arch.vocab * 4
            ops.append(Op("logits_allgather", "ICI",
                          c.alpha_s + c.beta_s_per_byte * msg + COLLECTIVE_LAUNCH_S,
                          ici_bytes=c.gamma * msg))
        return ops

    # ---- a step -----------------------------------------------------------------------------
    def stage_ops(self, n_dense: int, n_moe: int, has_embed: bool, has_lm: bool,
                  p_tokens: float, p_ctx: float, n_dec: float, dec_kv: float,
                  n_logits: float, stage_tokens: float, p_pad: float | None = None
                  ) -> list[Op]:
        """Operators of one pipeline stage for one micro-batch, on one chip (per-chip shares:
        the caller passes per-DP-group quantities). ``p_pad``: the prompt tokens the matmuls and
        the MoE run (the stack's padding, :meth:`dse.stacks.StackProfile.padded_prefill`);
        attention runs the ``p_tokens`` that are real."""
        t = (p_tokens if p_pad is None else p_pad) + n_dec
        attn = self.attention_block(t, p_tokens, p_ctx, n_dec, dec_kv)
        ops: list[Op] = []
        if has_embed:
            ops.append(self.vector("embed_gather", t * self.d.hidden, 0, 2 * t * self.d.hidden * B2))
        nl = n_dense + n_moe
        ops += [o.scaled(nl) for o in attn]
        if n_dense:
            ops += [o.scaled(n_dense) for o in self.mlp_block(t)]
        if n_moe:
            ops += [o.scaled(n_moe) for o in self.moe_block(t, stage_tokens)]
        if has_lm:
            ops += self.head(n_logits)
        elif self.par.pp > 1:
            ops.append(self.p2p("pp_send", t * self.d.hidden * B2))
        return [o for o in ops if o.time_s > 0 or o.hbm_bytes > 0]

    def parts_local(self, p_loc: float, c_loc: float, nd_loc: float, kv_loc: float,
                    logits: float, stage_tokens: float, p_pad: float | None = None
                    ) -> dict[str, tuple[float, float]]:
        """(time_s, dynamic energy J of the whole vPod) of one micro-batch through all stages,
        split by what each operator depends on: ``tok`` (tokens in the step), ``prefill_attn``
        (prefill tokens and their context), ``decode_attn`` (decoding sequences and their KV),
        ``head`` (sequences sampling). Per-chip (local) quantities in; the sum of the parts plus
        the step overhead is the step latency (:meth:`mixed_step`)."""
        out = {k: [0.0, 0.0] for k in CATEGORIES}
        for n_dense, n_moe, has_embed, has_lm, count in self.stages:
            for o in self.stage_ops(n_dense, n_moe, has_embed, has_lm, p_loc, c_loc, nd_loc,
                                    kv_loc, logits, stage_tokens, p_pad):
                acc = out[category(o.name)]
                acc[0] += count * o.time_s * o.count
                acc[1] += count * self.par.stage_chips * o.energy_j(self.hw)
        return {k: (v[0], v[1]) for k, v in out.items()}

    def mixed_step(self, prefill_tokens: float, prefill_ctx: float, n_decode: float,
                   decode_kv: float, n_prefill_seqs: float = 0.0) -> StepResult:
        """One engine step (one micro-batch through every stage): ``prefill_tokens`` new prompt
        tokens with ``prefill_ctx`` attended keys in total, ``n_decode`` decoding sequences
        with ``decode_kv`` cached keys in total. Sequences are spread over the EP data-parallel
        attention groups (``"dp"`` layout; one group under tensor-parallel attention); the
        busiest group sets the pace."""
        ep = self.par.dp
        # a prompt is prefilled whole inside one DP group: the busiest gets ceil(seqs/ep)
        share = (math.ceil(n_prefill_seqs / ep) / n_prefill_seqs) if n_prefill_seqs else 1 / ep
        p_loc, c_loc = prefill_tokens * share, prefill_ctx * share
        nd_loc = math.ceil(n_decode / ep)
        kv_loc = decode_kv * nd_loc / n_decode if n_decode else 0.0
        logits = math.ceil((n_prefill_seqs + n_decode) / ep)
        stage_tokens = prefill_tokens + n_decode
        p_pad = None
        if self.stack.pad_tokens and prefill_tokens > 0:   # every rank runs the busiest's, padded
            p_pad = self.stack.padded_prefill(p_loc, ep)
            stage_tokens = p_pad * ep + n_decode
        times, all_ops, energy = [], [], 0.0
        for n_dense, n_moe, has_embed, has_lm, count in self.stages:
            ops = self.stage_ops(n_dense, n_moe, has_embed, has_lm, p_loc, c_loc, nd_loc, kv_loc,
                                 logits, stage_tokens, p_pad)
            ts = sum(o.time_s * o.count for o in ops)
            times += [ts] * count
            energy += count * self.par.stage_chips * sum(o.energy_j(self.hw) for o in ops)
            all_ops.append((ts, ops))
        seqs = n_decode + (n_prefill_seqs or (1.0 if prefill_tokens > 0 else 0.0))
        latency = self.stack.step_time_s(sum(times), seqs)
        slow_ops = max(all_ops, key=lambda x: x[0])[1]
        energy = self.chip.power_capped_j(energy + self.hw.static_power_w * self.par.chips
                                          * latency, self.par.chips, latency)
        return StepResult(latency, latency, energy, prefill_tokens + n_decode,
                          _bound(slow_ops), slow_ops, times)

    def step(self, phase: str, batch: int, seq_len: int) -> StepResult:
        """A whole batch as the DSE sees it: prefill of ``batch`` prompts of ``seq_len`` tokens
        (TTFT of the batch), or one decode iteration of ``batch`` sequences at KV length
        ``seq_len`` (TPOT). The batch is split into ``m = min(batch, pp)`` micro-batches that
        flow through the pipeline; bubbles and unequal stages are explicit."""
        if phase not in ("prefill", "decode"):
            raise NeuScaleError(f"phase must be 'prefill' or 'decode' (got {phase!r})")
        if batch < 1 or seq_len < 1:
            raise NeuScaleError("batch and seq_len must be >= 1")
        pp = self.par.pp
        m = min(batch, pp)
        b_mb = math.ceil(batch / m)
        if phase == "prefill":
            r = self.mixed_step(b_mb * seq_len, b_mb * seq_len * (seq_len + 1) / 2, 0, 0, b_mb)
            tokens = batch * seq_len
        else:
            r = self.mixed_step(0, 0, b_mb, b_mb * seq_len)
            tokens = batch
        stages = r.stage_times_s
        slowest = max(stages)
        st = self.stack                  # the host schedules one micro-batch per step
        fill = st.step_time_s(sum(stages), b_mb)
        if phase == "prefill":
            latency = fill + (m - 1) * slowest
            cycle = st.step_time_s(m * slowest, b_mb)     # steady state: each stage busy m slots
        else:
            latency = max(fill, st.step_time_s(m * slowest, b_mb))
            cycle = latency
        static = self.hw.static_power_w * self.par.chips
        dyn = (r.energy_j - static * r.latency_s) * m
        energy = self.chip.power_capped_j(dyn + static * cycle, self.par.chips, cycle)
        return StepResult(latency, cycle, energy, tokens, r.bound, r.ops, stages,
                          self.memory_bytes(phase, batch, seq_len))

    # ---- memory ---------------------------------------------------------------------------
    def weights_bytes(self) -> float:
        """Weights on the heaviest stage's chip (same sharding rules as the DSE)."""
        return max_weights_bytes(self.arch, self.par)

    def kv_bytes_per_chip_token(self) -> float:
        """KV bytes one token of one sequence puts on each chip holding it (all its layers on
        the heaviest stage): GQA heads split by the attention TP; MLA's latent in full."""
        kv_tok = self.arch.kv_elems_per_token_per_layer(self.par.attn_tp) * B2
        return kv_tok * max(n_d + n_m for n_d, n_m, *_ in self.stages)

    def memory_bytes(self, phase: str, batch: int, seq_len: int) -> float:
        """Weights plus the KV of the batch's sequences one chip holds: its DP group's share
        (``"dp"`` layout) or every sequence (tensor-parallel attention, ``par.dp = 1``)."""
        return (self.weights_bytes()
                + math.ceil(batch / self.par.dp) * seq_len * self.kv_bytes_per_chip_token())

    def batch_at(self, seq_len: int) -> int:
        """The most sequences of ``seq_len`` tokens the KV cache (:meth:`kv_capacity_tokens`,
        what the simulated engine's blocks hold) takes at once: each DP attention group its
        share. 0: not even one."""
        return (self.kv_capacity_tokens() // self.par.dp) // max(1, seq_len) * self.par.dp

    def holds(self, batch: int, seq_len: int) -> bool:
        """``batch`` sequences of ``seq_len`` tokens fit in the KV cache at once."""
        return batch <= self.batch_at(seq_len)

    def kv_capacity_tokens(self, usable_fraction: float = 0.9) -> int:
        """KV-cache tokens the vPod holds once weights are loaded (per DP attention group,
        times the groups: ``ep`` in the ``"dp"`` layout, 1 under tensor-parallel attention,
        where every chip holds every sequence's latent)."""
        free = usable_fraction * self.chip.hbm_bytes - self.weights_bytes()
        return max(0, int(free // self.kv_bytes_per_chip_token())) * self.par.dp


def exposed_collective_s(transfer_s: float, producer_s: float, steps: int) -> float:
    """Transfer time of a collective left exposed when it overlaps the matmul that produces
    its data (``producer_s``), decomposed into ``steps`` pieces: the first piece cannot hide,
    the rest hide under the compute up to its length."""
    return max(transfer_s / max(steps, 1), transfer_s - producer_s)


CATEGORIES = ("tok", "prefill_attn", "decode_attn", "head")
_HEAD_OPS = {"final_norm", "lm_head", "sampling", "logits_allgather"}


def category(op_name: str) -> str:
    """Which step variables an operator's cost depends on (see :meth:`ChipModel.parts_local`)."""
    if op_name.startswith("attn_prefill") or op_name == "kv_b_proj":
        return "prefill_attn"
    if op_name.startswith("attn_decode") or op_name in ("q_absorb", "v_absorb"):
        return "decode_attn"
    if op_name in _HEAD_OPS:
        return "head"
    return "tok"


def _bound(ops: list[Op]) -> str:
    share: dict[str, float] = {}
    for o in ops:
        share[o.unit] = share.get(o.unit, 0.0) + o.time_s * o.count
    return max(share, key=share.get) if share else "-"
