#!/usr/bin/env python3
"""The NUMPY_GREEDY oracle of engine/tests/model_real.rs, from first principles.

An independent Gemma 3 forward pass in float64 NumPy over weights dequantized by gguf-py
(llama.cpp's own Python package), without activation quantization and without a KV cache (a full
forward per generated token). It shares no code with plumbline. It prints the prompt ids (looked
up by exact string in the file's vocabulary), the greedy continuation and the top logits at
each step.

    python3 -m venv /tmp/np && /tmp/np/bin/pip install numpy gguf
    /tmp/np/bin/python engine/tests/data/numpy_greedy/gen_greedy.py \
        ~/.cache/plumbline/models/gemma-3-270m-q4_k_m.gguf

Gemma 3 as llama.cpp runs it: embeddings scaled by sqrt(n_embd); RMSNorm (eps from the file)
with the stored weights (the converter already added Gemma's +1); per-head RMSNorm of q and k;
NeoX RoPE with base 10000 on sliding-window layers and the file's base on every sixth (global)
layer; q scaled by 1/sqrt(head_dim); causal attention (the 512-token window does not bind at
this length); norms after attention and after the FFN; GELU (tanh) gated FFN; tied output head.
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPT = ["<bos>", "The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is"]
N_GREEDY = 10


def field(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    return v.tolist()[0] if len(v) == 1 else v.tolist()


def main(path):
    r = GGUFReader(path)
    tokens = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in r.fields["tokenizer.ggml.tokens"].data]
    ids = {t: i for i, t in enumerate(tokens)}
    prompt = [ids[p] for p in PROMPT]
    arch = "gemma3"
    n_layer = field(r, f"{arch}.block_count")
    n_head = field(r, f"{arch}.attention.head_count")
    n_kv = field(r, f"{arch}.attention.head_count_kv")
    hd = field(r, f"{arch}.attention.key_length")
    eps = field(r, f"{arch}.attention.layer_norm_rms_epsilon")
    base_global = field(r, f"{arch}.rope.freq_base")
    w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x, base):  # x [T, H, hd], NeoX: pairs (i, i + hd/2)
        t = np.arange(x.shape[0])[:, None]
        inv = base ** (-np.arange(0, hd, 2) / hd)
        ang = (t * inv)[:, None, :]
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        c, s = np.cos(ang), np.sin(ang)
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    emb = w["token_embd.weight"]

    def forward(seq):
        T = len(seq)
        x = emb[seq] * np.sqrt(emb.shape[1])
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for il in range(n_layer):
            p = f"blk.{il}."
            base = base_global if (il + 1) % 6 == 0 else 10000.0
            h = rms(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(T, n_head, hd)
            k = (h @ w[p + "attn_k.weight"].T).reshape(T, n_kv, hd)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
            q = rope(rms(q, w[p + "attn_q_norm.weight"]), base) / np.sqrt(hd)
            k = rope(rms(k, w[p + "attn_k_norm.weight"]), base)
            out = np.empty((T, n_head, hd))
            for hh in range(n_head):
                kv = hh * n_kv // n_head
                s = q[:, hh] @ k[:, kv].T + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                out[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv]
            a = out.reshape(T, n_head * hd) @ w[p + "attn_output.weight"].T
            x = x + rms(a, w[p + "post_attention_norm.weight"])
            h = rms(x, w[p + "ffn_norm.weight"])
            f = gelu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
            f = f @ w[p + "ffn_down.weight"].T
            x = x + rms(f, w[p + "post_ffw_norm.weight"])
        return rms(x[-1], w["output_norm.weight"]) @ emb.T

    print("prompt ids:", prompt)
    seq, out = list(prompt), []
    for step in range(N_GREEDY):
        logits = forward(seq)
        top = np.argsort(-logits)[:3]
        print(f"step {step}: " + ", ".join(f"{i} ({tokens[i]!r}) {logits[i]:.3f}" for i in top))
        out.append(int(top[0]))
        seq.append(int(top[0]))
    print("greedy:", out)


if __name__ == "__main__":
    main(sys.argv[1])
