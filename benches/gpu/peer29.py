#!/usr/bin/env python3
"""Issue 29's side-by-side: thaw against its transformers + PyTorch peer on the same generated
model, from the two tables files attn29.sh's peer step writes:
  --thaw  the output of `thaw-bench gpu` (its "### Decode" and "### Prefill, one sequence"
          tables; the base-model rows, adapters 0);
  --peer  the output of benches/peers/transformers_gpu.py (the same two tables, same format).
Prints one Markdown table per part: decode tok/s per batch (thaw, peer, thaw ÷ peer) and
prefill ms per prompt length (thaw, peer, peer ÷ thaw: thaw's speed-up), with TFLOP/s both.
A batch or length one side lacks reads "n/a" (a run cut short by its timeout). Standard
library only.

    python3 benches/gpu/peer29.py --thaw "$OUT/attn29-peer-thaw.md" --peer "$OUT/attn29-peer.md"
"""
import argparse


def rows(text, header):
    """The body rows of the first Markdown table after the line starting with `header`, as
    lists of cells."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header):
            break
    else:
        return []
    out = []
    body = False
    for line in lines[i + 1:]:
        if line.startswith("|---"):
            body = True
            continue
        if not line.startswith("|"):
            if body:
                break
            continue
        if body:
            out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def num(s):
    try:
        return float(s)
    except ValueError:
        return None


def decode(text):
    """batch -> tok/s of the base-model rows (adapters 0)."""
    d = {}
    for r in rows(text, "### Decode"):
        if len(r) >= 5 and r[1] == "0" and num(r[0]) is not None and num(r[4]) is not None:
            d[int(r[0])] = num(r[4])
    return d


def prefill(text):
    """tokens -> (ms, TFLOP/s)."""
    d = {}
    for r in rows(text, "### Prefill, one sequence"):
        if len(r) >= 5 and num(r[0]) is not None and num(r[1]) is not None:
            d[int(r[0])] = (num(r[1]), num(r[4]))
    return d


def cell(v, fmt):
    return "n/a" if v is None else fmt.format(v)


def table(thaw, peer):
    out = ["### thaw vs transformers + PyTorch, same generated model, base model, greedy",
           "| batch | thaw tok/s | peer tok/s | thaw ÷ peer |", "|---|---|---|---|"]
    td, pd = decode(thaw), decode(peer)
    for b in sorted(set(td) | set(pd)):
        t, p = td.get(b), pd.get(b)
        ratio = t / p if t and p else None
        out.append(f"| {b} | {cell(t, '{:.1f}')} | {cell(p, '{:.1f}')} | {cell(ratio, '{:.2f}')} |")
    out += ["", "| prefill tokens | thaw ms | peer ms | peer ÷ thaw | thaw TFLOP/s | peer TFLOP/s |",
            "|---|---|---|---|---|---|"]
    tp, pp = prefill(thaw), prefill(peer)
    for n in sorted(set(tp) | set(pp)):
        (tm, tt), (pm, pt) = tp.get(n, (None, None)), pp.get(n, (None, None))
        ratio = pm / tm if tm and pm else None
        out.append(f"| {n} | {cell(tm, '{:.2f}')} | {cell(pm, '{:.2f}')} | {cell(ratio, '{:.2f}')} | "
                   f"{cell(tt, '{:.2f}')} | {cell(pt, '{:.2f}')} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--thaw", required=True, help="thaw-bench gpu's output")
    p.add_argument("--peer", required=True, help="transformers_gpu.py's output")
    a = p.parse_args()

    def read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    print(table(read(a.thaw), read(a.peer)))


if __name__ == "__main__":
    main()
