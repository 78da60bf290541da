#!/usr/bin/env python3
"""usage: cache-pair.py DIR_A DIR_B. Pair two `thaw-bench cache` runs round by round (same seeds): per-round P99/P50, pooled, paired ratio,
and a check that every request's output token count matches (same requests, greedy)."""
import json, sys, math
def q(xs, p): xs = sorted(xs); return xs[int(math.floor((len(xs) - 1) * p + 0.5))]
def med(v): v = sorted(v); return v[len(v) // 2]
a, b = (json.load(open(d + '/cache.json')) for d in sys.argv[1:3])
def stats(runs):
    t = [[x['ttft_s'] * 1e3 for x in r['records'] if x['error'] is None] for r in runs]
    return t, [q(x, .99) for x in t], [q(x, .5) for x in t]
ta, pa, ma = stats(a); tb, pb, mb = stats(b)
print("A", sys.argv[1], "per-round P99", "/".join(f"{x:.0f}" for x in pa), "P50", "/".join(f"{x:.1f}" for x in ma),
      "pooled P99 %.1f P50 %.1f" % (q(sum(ta, []), .99), q(sum(ta, []), .5)))
print("B", sys.argv[2], "per-round P99", "/".join(f"{x:.0f}" for x in pb), "P50", "/".join(f"{x:.1f}" for x in mb),
      "pooled P99 %.1f P50 %.1f" % (q(sum(tb, []), .99), q(sum(tb, []), .5)))
r = [y / x - 1 for x, y in zip(pa, pb)]
print("paired B vs A P99 per round:", "/".join(f"{x*100:+.0f}%" for x in r), "median %+.1f%%" % (med(r) * 100),
      "| median of round P99 A %.1f B %.1f (%+.1f%%)" % (med(pa), med(pb), (med(pb) / med(pa) - 1) * 100),
      "| pooled %+.1f%%" % ((q(sum(tb, []), .99) / q(sum(ta, []), .99) - 1) * 100))
same = sum(x['output_tokens'] == y['output_tokens'] and x['model'] == y['model'] for ra, rb in zip(a, b) for x, y in zip(ra['records'], rb['records']))
n = sum(len(ra['records']) for ra in a)
print(f"same adapter and output token count in {same} of {n} requests; done/failed A {sum(r['summary']['completed'] for r in a)}/{sum(r['summary']['failed'] for r in a)} B {sum(r['summary']['completed'] for r in b)}/{sum(r['summary']['failed'] for r in b)}",
      "hit rate A %.3f B %.3f" % (med([r['hits'] / max(1, r['hits'] + r['misses']) for r in a]), med([r['hits'] / max(1, r['hits'] + r['misses']) for r in b])))
