#!/usr/bin/env python3
"""The peer of `thaw-bench gpu` (issue 29): the same generated model in transformers + PyTorch,
greedy generation, decode tokens/s at the same batch sizes and prefill TFLOP/s at the same prompt
lengths, printed in the same table format as `thaw-bench gpu`'s decode and prefill tables so the
two sit side by side.

Two modes:
- default: a static KV cache (`cache_implementation="static"`), which recent transformers
  compile with torch.compile — once per batch size and cache length, so on a 100 s budget only
  batch 1 finished (cuda-h100.md §7);
- `--eager`: no torch.compile, every shape runs at once: the dynamic cache by default
  (`--cache dynamic`), or the static one with compilation disabled (`--cache static`,
  transformers' `disable_compile`). Batch 1/8/32/64 of llama-7b-shape fit in about a minute;
  the figures are eager PyTorch's (kernel launches from Python), the mode most users run.

The model is the directory `thaw gen-model` writes (config.json + safetensors, what transformers
`save_pretrained` writes): no export step. Base model only (adapters: 0).

Decode time per step = (generate(prompt_len + S new tokens) - generate(1 new token)) / S: the
prefill and the first token cancel. GB/step counts what a step must read at least, the same
accounting as thaw-bench gpu (weights once, every sequence's KV over its context); transformers'
static cache may read more (the whole preallocated cache), which is its cost, not the roofline's.

    python3 benches/peers/transformers_gpu.py --model /tmp/thaw-gpu-work/model-llama-7b-shape \\
        --device cuda --batches 1,8,32,64 --prompt-len 128 --decode-steps 32 [--peak-gbs 2976]
    python3 benches/peers/transformers_gpu.py --model /tmp/thaw-gpu-work/model-llama-7b-shape \\
        --device cuda --eager --reps 2                              # every batch in ~60 s
    python3 benches/peers/transformers_gpu.py --model /tmp/tiny --device cpu --batches 1,4 \\
        --prompt-len 16 --decode-steps 4 --prefill-tokens 16,64 --eager  # smoke run on a CPU

Needs torch, transformers and safetensors (pip).
"""
import argparse
import statistics
import sys
import time


def ints(s):
    return [int(x) for x in s.split(",") if x]


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (thaw gen-model --out)")
    p.add_argument("--device", default="cuda", help="torch device: cuda or cpu")
    p.add_argument("--dtype", default="auto", help="bfloat16, float16, float32 or auto (config.json)")
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prefill-tokens", type=ints, default=[128, 2048])
    p.add_argument("--reps", type=int, default=3, help="timed repetitions; the median is reported")
    p.add_argument("--peak-gbs", type=float, help="roofline GB/s; measured (tensor copy) when absent")
    p.add_argument("--peak-tflops", type=float, help="roofline TFLOP/s; measured (matmul) when absent")
    p.add_argument("--eager", action="store_true",
                   help="no torch.compile: every batch size runs at once (default cache: dynamic)")
    p.add_argument("--cache", choices=["static", "dynamic"],
                   help="KV cache: static (the default without --eager; compiled per shape) or "
                        "dynamic (the default with --eager); --cache static --eager disables "
                        "compilation")
    a = p.parse_args()
    if a.cache is None:
        a.cache = "dynamic" if a.eager else "static"
    if a.cache == "dynamic" and not a.eager:
        p.error("--cache dynamic is eager already; add --eager")
    return a


def generate_kwargs(a, transformers):
    """The generate() arguments that pick the cache and whether it is compiled, or exit with
    what to use where this transformers cannot do what was asked."""
    kw = {}
    if a.cache == "static":
        kw["cache_implementation"] = "static"
        if a.eager:
            if not hasattr(transformers.GenerationConfig(), "disable_compile"):
                sys.exit(f"transformers {transformers.__version__} cannot run a static cache "
                         "uncompiled (no GenerationConfig.disable_compile); use --eager "
                         "--cache dynamic")
            kw["disable_compile"] = True
    return kw


def mode_name(a):
    if not a.eager:
        return 'cache_implementation="static" (torch.compile per shape)'
    if a.cache == "static":
        return 'eager, cache_implementation="static", disable_compile=True'
    return "eager, dynamic cache"


def sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def median_s(torch, dev, reps, f):
    f()
    sync(torch, dev)
    t = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        f()
        sync(torch, dev)
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def peaks(torch, dev, dtype, a):
    if a.peak_gbs:
        gbs, gsrc = a.peak_gbs, "--peak-gbs"
    else:
        mib = 1024 if dev.type == "cuda" else 64
        n = (mib << 20) // 4
        x = torch.empty(n, dtype=torch.float32, device=dev)
        y = torch.empty_like(x)
        s = median_s(torch, dev, 5, lambda: y.copy_(x))
        gbs, gsrc = 2 * n * 4 / s / 1e9, f"measured: tensor copy of {mib} MiB, read + write"
    if a.peak_tflops:
        tf, tsrc = a.peak_tflops, "--peak-tflops"
    else:
        d = 8192 if dev.type == "cuda" else 256
        x = torch.randn(d, d, dtype=dtype, device=dev)
        w = torch.randn(d, d, dtype=dtype, device=dev)
        s = median_s(torch, dev, 5, lambda: x @ w)
        tf, tsrc = 2 * d**3 / s / 1e12, f"measured: torch matmul {d}×{d}×{d} in {dtype}"
    return gbs, gsrc, tf, tsrc


def shape(cfg):
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", heads) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    inter = cfg.intermediate_size
    layer = h * heads * hd * 2 + 2 * h * kvh * hd + 3 * h * inter
    return dict(h=h, heads=heads, kv_dim=kvh * hd, hd=hd, layers=cfg.num_hidden_layers,
                vocab=cfg.vocab_size, layer=layer)


def decode_bytes(s, welem, kvelem, contexts):
    """thaw-bench gpu's accounting (benches/src/gpu/roofline.rs): weights + norms + LM head +
    the batch's embedding rows, and every sequence's K and V over its context."""
    h = s["h"]
    weights = (s["layers"] * (s["layer"] + 2 * h) + h + s["vocab"] * h + len(contexts) * h) * welem
    kv = sum(contexts) * s["layers"] * s["kv_dim"] * 2 * kvelem
    return weights + kv


def prefill_flops(s, t):
    return 2 * t * s["layers"] * s["layer"] + 4 * t * (t + 1) / 2 * s["layers"] * s["heads"] * s["hd"] \
        + 2 * s["vocab"] * s["h"]


def main():
    a = parse()
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        sys.exit(f"{e}: pip install torch transformers safetensors")
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, but torch sees no GPU; use --device cpu")
    dtype = "auto" if a.dtype == "auto" else getattr(torch, a.dtype)
    gen_kw = generate_kwargs(a, transformers)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=dtype).to(dev).eval()
    dtype = model.dtype
    cfg = model.config
    s = shape(cfg)
    elem = torch.tensor([], dtype=dtype).element_size()
    gbs, gsrc, tf, tsrc = peaks(torch, dev, dtype, a)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    g = torch.Generator().manual_seed(7)
    vocab = cfg.vocab_size

    def generate(ids, new):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False,
                                  pad_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else 0,
                                  **gen_kw)

    print(f"## transformers {transformers.__version__} + torch {torch.__version__} — {name}")
    print(f"model: {a.model} ({s['layers']} layers, hidden {s['h']}, {dtype}), "
          f"greedy, {mode_name(a)}")
    print(f"roofline: {gbs:.0f} GB/s ({gsrc}), {tf:.1f} TFLOP/s ({tsrc})")
    print(f"\n### Decode, {a.prompt_len}-token prompts, {a.decode_steps} timed steps; "
          "GB/s = (weights + distinct adapters + KV) read per step ÷ step time")
    print("| batch | adapters | rank | step ms | tok/s | vs base | GB/step | GB/s | % of roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in a.batches:
        ids = torch.randint(3, vocab, (b, a.prompt_len), generator=g).to(dev)
        t1 = median_s(torch, dev, a.reps, lambda: generate(ids, 1))
        tn = median_s(torch, dev, a.reps, lambda: generate(ids, a.decode_steps + 1))
        if tn <= t1:
            # Timer noise above the decode time (tiny models, busy hosts): no figure.
            print(f"| {b} | 0 | - | n/a (generate of {a.decode_steps + 1} tokens not slower than "
                  f"of 1: {tn * 1e3:.2f} vs {t1 * 1e3:.2f} ms) | - | - | - | - | - |")
            continue
        step = (tn - t1) / a.decode_steps
        ctx = [sum(a.prompt_len + 1 + i for i in range(a.decode_steps)) / a.decode_steps] * b
        gb = decode_bytes(s, elem, elem, ctx)
        print(f"| {b} | 0 | - | {step * 1e3:.2f} | {b / step:.1f} | 1.00 | {gb / 1e9:.4f} | "
              f"{gb / step / 1e9:.0f} | {gb / step / 1e9 / gbs * 100:.0f}% |")
    print(f"\n### Prefill, one sequence, base model (median of {max(1, a.reps)})")
    print("| tokens | ms | tok/s | TFLOP | TFLOP/s | % of roofline |")
    print("|---|---|---|---|---|---|")
    for t in a.prefill_tokens:
        ids = torch.randint(3, vocab, (1, t), generator=g).to(dev)
        sec = median_s(torch, dev, a.reps, lambda: generate(ids, 1))
        f = prefill_flops(s, t)
        print(f"| {t} | {sec * 1e3:.2f} | {t / sec:.0f} | {f / 1e12:.3f} | {f / sec / 1e12:.2f} | "
              f"{f / sec / 1e12 / tf * 100:.0f}% |")


if __name__ == "__main__":
    main()
