#!/usr/bin/env python3
"""Pools `thaw-bench cache` calls (session 11, issue 11). usage: cache-pool.py DIR... (each holds a cache.json).
Rounds pair by (DIR prefix before the last "-", round); the DIR suffix names the cost variant:
-new/-gdsf: expected-reload-seconds-per-page size term (eb1a98f), -old/-pp: per-page size term.
Quantiles as thaw-bench Stats::of (index round((n-1)p)).
LINK below is --emulated-link-gbps=0.002 in bytes/s (a copy's own time = adapter_bytes / LINK)."""
import json, sys, math, re
from collections import defaultdict
def q(xs, p):
    xs = sorted(xs); 
    if not xs: return float('nan')
    return xs[int(math.floor((len(xs)-1)*p + 0.5))]  # thaw-bench's Stats::of
def med(v):
    v = sorted(v); return v[len(v)//2] if v else float('nan')
runs = defaultdict(dict)  # policy -> seed-round key -> run
for d in sys.argv[1:]:
    for r in json.load(open(d.rstrip('/') + '/cache.json')):
        m = re.match(r'(\d+) adapters (\d+)% (\S+) round (\d+)', r['label'])
        tag = d.rstrip('/').rsplit('-', 1)[1]
        pol = m.group(3)
        if pol == 'cost':
            pol = {'new': 'cost GDSF', 'gdsf': 'cost GDSF', 'old': 'cost per-page', 'pp': 'cost per-page'}[tag]
        # round key: the directory's seed base + round
        key = (d.rstrip('/').split('/')[-1].rsplit('-', 1)[0], int(m.group(4)))
        runs[pol][key] = r
def p99(r): 
    return q([x['ttft_s'] for x in r['records'] if x['error'] is None and x['ttft_s'] is not None], .99) * 1e3
def p50(r):
    return q([x['ttft_s'] for x in r['records'] if x['error'] is None and x['ttft_s'] is not None], .5) * 1e3
fixed = runs.get('fixed-slots', {})
lru = runs.get('lru', {})
print("| policy | rounds | hit rate (median) | P50 ms (median) | pooled P50 ms | P99 ms (median of rounds) | vs fixed | pooled P99 ms | vs fixed | paired per-round P99 vs fixed (median) | better than fixed in | paired vs lru (median) | done/failed | evictions (median) | prefetch hits (median) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
fmed = med([p99(r) for r in fixed.values()]) if fixed else float('nan')
fpool = q([x['ttft_s'] for r in fixed.values() for x in r['records'] if x['error'] is None], .99)*1e3 if fixed else float('nan')
order = sorted(runs, key=lambda p: ['cost per-page','cost GDSF','lru','fixed-slots'].index(p) if p in ['cost per-page','cost GDSF','lru','fixed-slots'] else 9)
for pol in order:
    rs = runs[pol]; keys = sorted(rs)
    hr = med([r['hits']/max(1, r['hits']+r['misses']) for r in rs.values()])
    t = [x['ttft_s'] for r in rs.values() for x in r['records'] if x['error'] is None]
    m99 = med([p99(r) for r in rs.values()]); pool = q(t, .99)*1e3
    pd = [p99(rs[k])/p99(fixed[k]) - 1 for k in keys if k in fixed]
    pl = [p99(rs[k])/p99(lru[k]) - 1 for k in keys if k in lru]
    done = sum(r['summary']['completed'] for r in rs.values()); failed = sum(r['summary']['failed'] for r in rs.values())
    print(f"| {pol} | {len(rs)} | {hr:.3f} | {med([p50(r) for r in rs.values()]):.1f} | {q(t,.5)*1e3:.1f} | {m99:.1f} | {(m99/fmed-1)*100:+.1f}% | {pool:.1f} | {(pool/fpool-1)*100:+.1f}% | {med(pd)*100:+.1f}% | {sum(1 for x in pd if x<0)}/{len(pd)} | {med(pl)*100:+.1f}% | {done}/{failed} | {med([r['evictions'] for r in rs.values()]):.0f} | {med([r['prefetch_hits'] for r in rs.values()]):.0f} |")
print()
for pol in order:
    rs = runs[pol]; keys = sorted(rs)
    print(f"- {pol} per-round P99 ms: " + "/".join(f"{p99(rs[k]):.0f}" for k in keys))
    if pol != 'fixed-slots':
        pd = [p99(rs[k])/p99(fixed[k]) - 1 for k in keys if k in fixed]
        print(f"  paired vs fixed: " + "/".join(f"{x*100:+.0f}%" for x in pd))
pp = runs.get('cost per-page', {}); g = runs.get('cost GDSF', {})
ks = sorted(k for k in pp if k in g)
if ks:
    d = [p99(g[k])/p99(pp[k]) - 1 for k in ks]
    print("- GDSF vs per-page, paired per round: " + "/".join(f"{x*100:+.0f}%" for x in d) + f" (median {med(d)*100:+.1f}%)")
    d = [p99(pp[k])/p99(lru[k]) - 1 for k in ks if k in lru]
    print("- per-page cost vs lru, paired per round: " + "/".join(f"{x*100:+.0f}%" for x in d) + f" (median {med(d)*100:+.1f}%)")
print()
LINK = 0.002e9  # bytes/s of --emulated-link-gbps=0.002
for pol in order:
    w = [x for r in runs[pol].values() for x in r.get('server_waits', [])]
    if not w: 
        print(f"- {pol}: no server per-request lines"); continue
    th = q([x['ttft_ms'] for x in w], .99)
    tail = [x for x in w if x['ttft_ms'] >= th]
    n = len(tail); mean = lambda k: sum(x[k] for x in tail)/n
    own = [x['adapter_bytes']/LINK*1e3 for x in tail if x.get('adapter_bytes') and x['link_ms']>0]
    big = sum(1 for x in tail if (x.get('adapter_bytes') or 0) >= 200000)
    allm = lambda k: sum(x[k] for x in w)/len(w)
    misses = sum(1 for x in tail if x['hit'] is False)
    s = f"- {pol}: server P99 tail (TTFT ≥ {th:.0f} ms, pooled): {n} requests, {misses} misses, {big} rank-128; mean {mean('ttft_ms'):.0f} ms = batch {mean('batch_ms'):.1f} + kv {mean('kv_ms'):.1f} + disk {mean('disk_ms'):.1f} + link {mean('link_ms'):.1f}"
    if own: s += f" (own copy {sum(own)/len(own):.0f} ms, so ~{mean('link_ms')-sum(own)/len(own):.0f} ms queued behind other copies)"
    s += f"; all {len(w)}: mean {allm('ttft_ms'):.1f} = batch {allm('batch_ms'):.1f} + kv {allm('kv_ms'):.2f} + disk {allm('disk_ms'):.2f} + link {allm('link_ms'):.1f}"
    print(s)
