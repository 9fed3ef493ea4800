#!/usr/bin/env python3
"""Writes the expected token ids that engine/tests/tokenizer_*.rs compare against.

The ids come from llama.cpp itself (through llama-cpp-python, which compiles llama.cpp from
source), never from plumbline:

    CMAKE_ARGS="-DGGML_NATIVE=off" pip install llama-cpp-python gguf
    python3 engine/tests/data/tokenizer/gen_expected.py [MODEL_DIR]

1. gemma3.json: the real Gemma 3 270M vocabulary (SPM with byte fallback), loaded with
   vocab_only=True from MODEL_DIR (default $PLUMBLINE_MODELS or ~/.cache/plumbline/models).
2. tiny-gpt2-<pre>.gguf + tiny_gpt2.json: a small byte-level BPE vocabulary built here with
   gguf-py (no download), one file per pre-tokenizer, and llama.cpp's ids for each case.
"""

import json
import os
import sys
from pathlib import Path

import llama_cpp

HERE = Path(__file__).resolve().parent
MODEL = "gemma-3-270m-q4_k_m.gguf"

# (name, text, add_special, parse_special)
GEMMA_CASES = [
    ("ascii", "Hello, world!", True, False),
    ("sentence", "The quick brown fox jumps over the lazy dog.", True, False),
    ("sentence_no_bos", "The quick brown fox jumps over the lazy dog.", False, False),
    ("accents", "Café naïve résumé — Ångström, façade, Straße", True, False),
    ("cjk", "你好，世界。日本語のテキスト。한국어 문장", True, False),
    ("emoji", "👋🌍 🚀✨ 👨‍👩‍👧 🏳️‍🌈", True, False),
    ("digits", "1234567890 3.14159 1,000,000 007", True, False),
    ("spaces", "a  b   c    d     e", True, False),
    ("leading_trailing", "  leading and trailing  ", True, False),
    ("tabs", "\tindented\t\ttabs\t", True, False),
    ("newlines", "line1\nline2\n\nline3\n\n\n", True, False),
    ("mixed_ws", " \t \n \r\n  \t\t\n", True, False),
    ("code", 'fn main() {\n    println!("hi {}", 1 + 2);\n}\n', True, False),
    ("repeat", "a" * 40 + " " + "ab" * 20, True, False),
    ("scripts", "Привет мир! مرحبا بالعالم שלום नमस्ते", True, False),
    ("byte_fallback", "\x07\x1b[0m \ue000 𓀀 \U0010fffd", True, False),
    ("chat_special",
     "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", True, True),
    ("chat_literal",
     "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", True, False),
    ("bos_special", "<bos>hello", True, True),
    ("bos_literal", "<bos>hello", True, False),
    ("bos_special_no_add", "<bos>hello", False, True),
    ("empty", "", True, False),
    ("empty_no_bos", "", False, False),
    ("sp_char", "a\u2581b", True, False),
]

# A byte-level BPE vocabulary: the 256 GPT-2 byte characters, then merge results.
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("Ġ", "w"), ("o", "r"),
    ("l", "d"), ("Ġw", "or"), ("Ġwor", "ld"), ("Ġ", "Ġ"), ("1", "2"), ("12", "3"),
    ("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("'", "s"), ("Ċ", "Ċ"),
    ("ĠĠ", "ĠĠ"), ("Ã", "©"),
]
GPT2_PRES = ["gpt-2", "llama-bpe", "qwen2", "default"]
GPT2_CASES = [
    ("words", "Hello the world", True, False),
    ("the", "the then in a world", True, False),
    ("digits", "12345 123 1 12", True, False),
    ("spaces", "a    b  c\n\nd\t e ", True, False),
    ("contraction", "it's HE'S", True, False),
    ("unicode", "café 你好 👋", True, False),
    ("punct", "hi, there!! $5+3=8 <x>", True, False),
    ("special", "Hello<|endoftext|>world", True, True),
    ("special_literal", "Hello<|endoftext|>world", True, False),
    ("empty", "", True, False),
]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tokenize(llm, text, add_special, parse_special):
    return llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)


def detok(llm, ids):
    """llama.cpp's own llama_detokenize (remove_special=False, unparse_special=False).

    Not Llama.detokenize: that Python wrapper also drops a leading space after BOS.
    """
    import ctypes

    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    cap = 64 + 16 * len(ids)
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, cap, False, False)
    if n < 0:
        raise RuntimeError(f"detokenize needs {-n} bytes")
    return buf.raw[:n].decode("utf-8", errors="replace")


def run_cases(llm, cases):
    out = []
    for name, text, add_special, parse_special in cases:
        ids = tokenize(llm, text, add_special, parse_special)
        out.append({
            "name": name, "text": text, "add_special": add_special,
            "parse_special": parse_special, "ids": ids, "detokenized": detok(llm, ids),
        })
    return out


def gemma(model_dir):
    path = Path(model_dir) / MODEL
    if not path.exists():
        print(f"skipping gemma3.json: {path} not found", file=sys.stderr)
        return
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    doc = {
        "generator": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp built from its sdist)",
        "model": MODEL,
        "cases": run_cases(llm, GEMMA_CASES),
    }
    (HERE / "gemma3.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")


def tiny_gpt2():
    import gguf

    chars = bytes_to_unicode()
    tokens = list(chars) + [a + b for a, b in MERGES] + ["<|endoftext|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    eot = len(tokens) - 1
    docs = {}
    for pre in GPT2_PRES:
        path = HERE / f"tiny-gpt2-{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        # Hyperparameters llama.cpp reads even for vocab_only; no tensors.
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_block_count(1)
        w.add_feed_forward_length(16)
        w.add_head_count(1)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([f"{a} {b}" for a, b in MERGES])
        w.add_bos_token_id(eot)
        w.add_eos_token_id(eot)
        w.add_add_bos_token(True)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        docs[pre] = run_cases(llm, GPT2_CASES)
    doc = {
        "generator": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp built from its sdist)",
        "pres": docs,
    }
    (HERE / "tiny_gpt2.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "PLUMBLINE_MODELS", str(Path.home() / ".cache/plumbline/models"))
    gemma(model_dir)
    tiny_gpt2()


if __name__ == "__main__":
    main()
