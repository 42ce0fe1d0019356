"""A trained length predictor on disk and in memory: encoder + head + what it was built for.

A model directory holds ``manifest.json`` (kind, format, the bucket edges, the encoder's
fingerprint and runtime settings, the families it was conditioned on, the data it was trained
on, its held-out evaluation with the confusion matrix the cluster simulator replays) and
``head.npz`` (the weights). Loading checks every one of those against what is asked of it: a
head trained on another encoder's embeddings, or on other bucket edges, is refused with one
line that says which.

Predictions, for a prompt of ``prompt_tokens`` tokens:

* :meth:`LengthModel.distribution`: P(output bucket) for each bucket of the DB's edges;
* :meth:`LengthModel.point`: the median of that distribution (linear inside a bucket);
* :meth:`LengthModel.remaining_point`: given ``generated`` tokens so far, the median of the
  distribution conditioned on the answer being longer than that (paper §3.4's re-prediction:
  the head's own distribution, truncated — no second model).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dse.errors import NeuScaleError
from dse.files import read_text, write_atomic

from .data import FAMILY_NAMES, family_of
from .head import Head

KIND = "neuscale-length-predictor"
FORMAT = 1


def default_model_dir() -> Path:
    """The model that ships with the package (see the README: trained on the shared data)."""
    return Path(__file__).resolve().parent / "default"


def features(emb: np.ndarray, prompt_tokens, families, family_names=FAMILY_NAMES) -> np.ndarray:
    """Head input: the embedding, the prompt length (log), the family one-hot (all zero when
    the family is unknown: the head is trained with families blanked at random, so that is
    the unconditioned prediction)."""
    n = len(emb)
    lp = np.log1p(np.asarray(prompt_tokens, dtype=np.float32).reshape(n, 1))
    fam = np.zeros((n, len(family_names)), np.float32)
    idx = {f: i for i, f in enumerate(family_names)}
    for i, f in enumerate(families):
        j = idx.get(f) if f is not None else None
        if j is not None:
            fam[i, j] = 1.0
    return np.concatenate([np.asarray(emb, np.float32), lp / 10.0, (lp / 10.0) ** 2, fam],
                          axis=1)


@dataclass
class LengthModel:
    head: Head
    edges: tuple[int, ...]
    encoder_name: str
    max_tokens: int
    families: tuple[str, ...] = FAMILY_NAMES
    manifest: dict[str, Any] = field(default_factory=dict)
    encoder: Any = None                     # predictor.encoder.Encoder, loaded on demand
    bucket_median: np.ndarray | None = None  # training median per bucket (point estimates)
    embed_dim: int = 384

    # ---- persistence --------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        import io
        d = Path(out_dir)
        buf = io.BytesIO()
        arrays = dict(self.head.arrays())
        if self.bucket_median is not None:
            arrays["bucket_median"] = self.bucket_median.astype(np.float32)
        np.savez(buf, **arrays)
        try:
            write_atomic(d / "head.npz", buf.getvalue())
            man = dict(self.manifest, kind=KIND, format=FORMAT, edges=list(self.edges),
                       encoder=self.encoder_name, max_tokens=self.max_tokens,
                       families=list(self.families), embed_dim=self.embed_dim)
            write_atomic(d / "manifest.json", json.dumps(man, indent=1) + "\n")
        except OSError as e:
            raise NeuScaleError(f"cannot write the model to {str(d)!r}: {e.strerror or e}") \
                from None
        return d

    @classmethod
    def load(cls, model_dir: str | Path | None = None, *, edges: tuple[int, ...] | None = None,
             encoder=None) -> "LengthModel":
        """Load a model directory (default: the shipped one). ``edges``: the bucket edges the
        caller routes by (a model built for others is refused). ``encoder``: an already
        loaded :class:`predictor.encoder.Encoder` to check and use."""
        d = Path(model_dir) if model_dir else default_model_dir()
        if not d.is_dir():
            raise NeuScaleError(f"no predictor model at {str(d)!r} (train one: orchestrator "
                                "predictor train --data FILE.jsonl --out DIR)")
        try:
            man = json.loads(read_text(d / "manifest.json", "predictor manifest", 1 << 22))
        except json.JSONDecodeError as e:
            raise NeuScaleError(f"{str(d / 'manifest.json')!r} is not JSON ({e.msg})") from None
        if not isinstance(man, dict) or man.get("kind") != KIND:
            raise NeuScaleError(f"{str(d)!r} is not a NeuScale length-predictor model "
                                f"(manifest kind {man.get('kind') if isinstance(man, dict) else None!r})")
        if man.get("format") != FORMAT:
            raise NeuScaleError(f"{str(d)!r} is predictor format {man.get('format')!r}; this "
                                f"version reads {FORMAT}: retrain it")
        try:
            m_edges = tuple(int(x) for x in man["edges"])
            enc_name, max_tok = str(man["encoder"]), int(man["max_tokens"])
            fams = tuple(str(x) for x in man.get("families", FAMILY_NAMES))
        except (KeyError, TypeError, ValueError):
            raise NeuScaleError(f"{str(d / 'manifest.json')!r} lacks edges/encoder/max_tokens"
                                ) from None
        if edges is not None and tuple(edges) != m_edges:
            raise NeuScaleError(f"the predictor at {str(d)!r} was trained for {len(m_edges)} "
                                f"buckets up to {m_edges[-1]:,} tokens, not this DB's "
                                f"{len(edges)} up to {edges[-1]:,}: retrain it on these edges")
        try:
            with np.load(d / "head.npz", allow_pickle=False) as z:
                head = Head.from_arrays(z)
                med = np.asarray(z["bucket_median"], np.float64) if "bucket_median" in z \
                    else None
        except FileNotFoundError:
            raise NeuScaleError(f"{str(d)!r} has no head.npz") from None
        except (OSError, ValueError, KeyError) as e:
            raise NeuScaleError(f"{str(d / 'head.npz')!r} is damaged ({e}); retrain the "
                                "model") from None
        try:
            emb_dim = int(man["embed_dim"])
        except (KeyError, TypeError, ValueError):
            raise NeuScaleError(f"{str(d / 'manifest.json')!r} lacks embed_dim") from None
        if head.w2.shape[1] != len(m_edges) or head.w1.shape[0] != emb_dim + 2 + len(fams):
            raise NeuScaleError(f"{str(d)!r}: head and manifest disagree (buckets or "
                                "features); retrain the model")
        if encoder is not None and encoder.name != enc_name:
            raise NeuScaleError(f"the predictor at {str(d)!r} was trained on encoder "
                                f"{enc_name}, not {encoder.name}: pass the encoder it was "
                                "trained with (--encoder DIR) or retrain")
        return cls(head=head, edges=m_edges, encoder_name=enc_name, max_tokens=max_tok,
                   families=fams, manifest=man, encoder=encoder, bucket_median=med,
                   embed_dim=emb_dim)

    def attach_encoder(self, model_dir=None, runtime: str = "auto"):
        from .encoder import Encoder
        enc = Encoder(model_dir, runtime=runtime, max_tokens=self.max_tokens)
        if enc.name != self.encoder_name:
            raise NeuScaleError(f"the predictor was trained on encoder {self.encoder_name}, "
                                f"not {enc.name} (at {str(enc.dir)!r}): pass the encoder it "
                                "was trained with (--encoder DIR) or retrain")
        self.encoder = enc
        return enc

    # ---- prediction ---------------------------------------------------------------------------
    def distribution_from_emb(self, emb: np.ndarray, prompt_tokens, families=None) -> np.ndarray:
        fams = families if families is not None else [None] * len(emb)
        return self.head.probs(features(emb, prompt_tokens, fams, self.families))

    def embed(self, prompts: list[str]) -> np.ndarray:
        if self.encoder is None:
            self.attach_encoder()
        return self.encoder.encode(prompts)

    def distribution(self, prompts: list[str], prompt_tokens, model: str | None = None
                     ) -> np.ndarray:
        fam = family_of(model)
        return self.distribution_from_emb(self.embed(prompts), prompt_tokens,
                                          [fam] * len(prompts))

    def _lo_hi(self, k: int) -> tuple[float, float]:
        return (0.0 if k == 0 else float(self.edges[k - 1])), float(self.edges[k])

    def point(self, p: np.ndarray) -> int:
        """The median output length of one distribution ``p`` over buckets."""
        return self.remaining_point(p, 0)

    def remaining_point(self, p: np.ndarray, generated: int) -> int:
        """Median whole length given more than ``generated`` tokens (always > generated)."""
        q = np.asarray(p, np.float64).copy()
        g = float(max(0, generated))
        for k in range(len(q)):
            lo, hi = self._lo_hi(k)
            if hi <= g:
                q[k] = 0.0
            elif lo < g:
                q[k] *= (hi - g) / (hi - lo)
        s = q.sum()
        if not s > 1e-12:
            return int(max(2 * g, g + 1))
        c = np.cumsum(q) / s
        k = int(np.searchsorted(c, 0.5))
        k = min(k, len(q) - 1)
        lo, hi = self._lo_hi(k)
        lo = max(lo, g)
        below = c[k - 1] if k else 0.0
        frac = (0.5 - below) / max(c[k] - below, 1e-12)
        if self.bucket_median is not None and g <= 0 and math.isfinite(self.bucket_median[k]):
            # inside the bucket, the training answers' median is the better point
            return int(max(1, round(self.bucket_median[k])))
        return int(max(g + 1, round(lo + frac * (hi - lo))))

    def predicted_bucket(self, p: np.ndarray) -> int:
        return int(np.argmax(p))
