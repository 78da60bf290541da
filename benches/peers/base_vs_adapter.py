"""f32 single stream, base model and one adapter, on `thaw serve` and llama.cpp's `llama-server`.

Starts both servers exactly as side_by_side.py does (its classes), then per round sends one
64-token-prompt, 32-token greedy request to the base model (thaw: its base name; llama.cpp:
every LoRA at scale 0) and one with the adapter, to each server, the order flipped each round.
Prints per-request tok/s and, per request kind, the medians and the paired round ratios.

    python3 benches/peers/base_vs_adapter.py --thaw target/release/thaw \
        --llama-server /work/peers/llama-build/bin/llama-server --peers /work/peers/smollm2 --rounds 12
"""
import os
import random
import statistics as st
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as S  # noqa: E402


def main():
    p = S.server_args(__doc__, 12)
    p.add_argument("--adapter", default="r16-qkvo", choices=S.ADAPTERS)
    a = p.parse_args()
    systems = [S.Thaw(a, f"{a.peers}/hf-f32", 18441), S.Llama(a, f"{a.peers}/gguf/model-f32.gguf", 18442)]
    try:
        for s in systems:
            for ad in S.ADAPTERS + [None]:
                s.complete([100, 200, 300, 400], ad)
        res = {}
        kinds = (("base", None), (a.adapter, a.adapter))
        for rnd in range(a.rounds):
            for kind, ad in kinds:
                for s in systems if rnd % 2 == 0 else systems[::-1]:
                    rng = random.Random(9000 + rnd)
                    prompt = [rng.randrange(100, 40000) for _ in range(64)]
                    t0 = time.perf_counter()
                    n, _ = s.complete(prompt, ad)
                    dt = time.perf_counter() - t0
                    if n != S.OUT_TOKENS:
                        sys.exit(f"{s.name} returned {n} tokens, not {S.OUT_TOKENS}")
                    res.setdefault((kind, s.name), []).append(n / dt)
                    print(f"round {rnd} {kind:8} {s.name:10} {n / dt:6.1f} tok/s", flush=True)
        for kind, _ in kinds:
            t, l = res[(kind, "thaw serve")], res[(kind, "llama.cpp")]
            r = [x / y for x, y in zip(t, l)]
            print(f"{kind}: thaw median {st.median(t):.1f}, llama.cpp median {st.median(l):.1f}, paired ratios "
                  + " ".join(f"{x:.2f}" for x in r)
                  + f" (median {st.median(r):.3f}, thaw ahead in {sum(x > 1 for x in r)}/{len(r)})")
    finally:
        for s in systems:
            s.proc.terminate()


if __name__ == "__main__":
    main()
