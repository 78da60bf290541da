#!/usr/bin/env python3
"""Pools `thaw-bench cache` calls for session 12 (issue 11, no-cache baseline).
usage: pool.py LOAD SEED:DIR[:TAG[:POLICIES]] ...  — DIR holds a cache.json whose round k has seed SEED+k-1;
TAG (optional) suffixes the policy name (e.g. a binary); POLICIES keeps only those. Only runs at LOAD% are read.
Per policy: rounds, hit rate / P50 (median of rounds), P99 median of rounds, pooled P99 and
paired per-round P99 (median over shared seeds) against fixed-slots and no-cache; done/failed,
evictions, loads, prefetch hits (median). Quantiles as thaw-bench's Stats::of."""
import json, sys, math, re
from collections import defaultdict
def q(xs, p):
    xs = sorted(xs)
    return xs[int(math.floor((len(xs)-1)*p + 0.5))] if xs else float('nan')
def med(v):
    v = sorted(v); return v[len(v)//2] if v else float('nan')
load = sys.argv[1]
runs = defaultdict(dict)  # policy -> seed -> run
for spec in sys.argv[2:]:
    parts = spec.split(':')
    seed0, d = int(parts[0]), parts[1]
    tag = parts[2] if len(parts) > 2 else ''
    only = parts[3].split(',') if len(parts) > 3 else None
    for r in json.load(open(d.rstrip('/') + '/cache.json')):
        m = re.match(r'(\d+) adapters (\d+)% (\S+) round (\d+)', r['label'])
        if not m or m.group(2) != load: continue
        if only and m.group(3) not in only: continue
        pol = m.group(3) + (f' ({tag})' if tag else '')
        runs[pol][seed0 + int(m.group(4)) - 1] = r
def ttfts(r): return [x['ttft_s'] for x in r['records'] if x['error'] is None and x['ttft_s'] is not None]
def p99(r): return q(ttfts(r), .99) * 1e3
def pooled(rs): return q([t for r in rs for t in ttfts(r)], .99) * 1e3
def pct(x): return f"{x*100:+.1f}%" if x == x else "-"
bases = {b: next((p for p in runs if p.split(' ')[0] == b), None) for b in ['fixed-slots', 'no-cache']}
print(f"| policy | seeds | hit rate | P50 ms | P99 ms (median of rounds) | vs fixed | vs no-cache | pooled P99 ms | vs fixed | vs no-cache | paired vs fixed (median; better in) | paired vs no-cache (median; better in) | done/failed | evictions | loads | prefetch hits | per-round P99 ms |")
print("|" + "---|" * 17)
for pol in sorted(runs):
    rs = runs[pol]; seeds = sorted(rs)
    row = [pol, f"{seeds[0]}–{seeds[-1]} ({len(seeds)})" if len(seeds) > 1 else str(seeds[0])]
    row.append(f"{med([r['hits']/max(1, r['hits']+r['misses']) for r in rs.values()]):.3f}")
    row.append(f"{med([q(ttfts(r), .5)*1e3 for r in rs.values()]):.1f}")
    m99 = med([p99(r) for r in rs.values()]); pl = pooled(rs.values())
    row.append(f"{m99:.1f}")
    vs_m, vs_p, vs_pair = [], [], []
    for b in ['fixed-slots', 'no-cache']:
        bp = bases[b]
        if bp is None: vs_m.append('-'); vs_p.append('-'); vs_pair.append('-'); continue
        br = runs[bp]
        vs_m.append(pct(m99 / med([p99(r) for r in br.values()]) - 1))
        vs_p.append(pct(pl / pooled(br.values()) - 1))
        common = [s for s in seeds if s in br]
        d = [p99(rs[s]) / p99(br[s]) - 1 for s in common]
        vs_pair.append(f"{pct(med(d))}; {sum(x < 0 for x in d)}/{len(d)} ({'/'.join(f'{x*100:+.0f}' for x in d)})" if d and bp != pol else '-')
    row += vs_m + [f"{pl:.1f}"] + vs_p + vs_pair
    done = sum(r['summary']['completed'] for r in rs.values()); failed = sum(r['summary']['failed'] for r in rs.values())
    row.append(f"{done}/{failed}")
    row.append(f"{med([r['evictions'] for r in rs.values()]):.0f}")
    row.append(f"{med([r.get('loads', float('nan')) for r in rs.values()]):.0f}")
    row.append(f"{med([r['prefetch_hits'] for r in rs.values()]):.0f}")
    row.append('/'.join(f"{p99(rs[s]):.0f}" for s in seeds))
    print("| " + " | ".join(row) + " |")
