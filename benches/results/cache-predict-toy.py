#!/usr/bin/env python3
"""Session 12 toy replay (`python3 cache-predict-toy.py [H] [CAP]`) (issue 11): does a histogram predictor (Shahrad et al. 2020, Chameleon §4)
move P99 TTFT in Chameleon's setting? Poisson arrivals, 100 adapters (20 per rank, rank power law),
a 2 MB/s link with 2 layers per adapter, demand copies ahead of prefetches at each layer boundary,
a cache of CAP pages with a per-page frequency/recency score (cost), TTFT = land - arrival + 5 ms.
mode: none | free (predicted prefetch into free pages only) | replace (may evict an idle adapter the
predictor ranks lower) | oracle (prefetch the next requests' adapters, replace as above)."""
import random, math, sys
RANKS = [8, 16, 32, 64, 128]; L = 2
def pages(r): return math.ceil(1792 * r / 8192)
def copy(r): return 1792 * r / 2e6 + 0.0002
def q(xs, p): xs = sorted(xs); return xs[int(math.floor((len(xs) - 1) * p + 0.5))]
def run(mode, seed, rate, cap=350, N=100, nreq=400, warm=160, H=1.0, head=0.05, kmin=4, hl=60.0):
    rng = random.Random(seed); w = [1 / (i + 1) for i in range(5)]
    rank = lambda a: RANKS[a % 5]
    t, reqs = 0.0, []
    for _ in range(nreq):
        t += rng.expovariate(rate); g = rng.choices(range(5), w)[0]
        reqs.append((t, rng.randrange(g, N, 5)))
    res = {}                      # adapter -> layers landed (L = resident)
    freq, fat, last, gaps, seen = {}, {}, {}, {}, [0] * 5
    demand, pf, waiting, ttft, hit = [], None, {}, [None] * nreq, [False] * nreq
    pf_made, pf_used, pf_pending = 0, 0, set()
    def score(a, now):  # cost: per-page decayed frequency + recency (size/reload per page ~ const)
        return 0.45 * freq.get(a, 0) * 2 ** (-(now - fat.get(a, now)) / hl) / pages(rank(a)) + 0.1 * last.get(a, 0) / max(now, 1e-9)
    def prob(a, now):   # predictor: P(arrival within H | time since last use), gap histogram
        gs = gaps.get(a, [])
        if len(gs) < kmin:  # too few samples: the rank class's rate per adapter
            lam = seen[a % 5] / (N / 5) / max(now, 1e-9); return 1 - math.exp(-lam * H)
        s = now - last[a]
        if s < q(gs, head): return 0.0
        later = [g for g in gs if g > s]
        return sum(1 for g in later if g <= s + H) / len(later) if later else 0.0
    def idle_victims(now):
        busy = set(demand) | set(waiting) | ({pf} if pf is not None else set())
        return sorted((a for a in res if a not in busy), key=lambda a: score(a, now))
    def used(): return sum(pages(rank(a)) for a in res)
    def make_room(a, now, allowed):  # evict idle adapters in score order until a fits
        for v in idle_victims(now):
            if used() + pages(rank(a)) <= cap: break
            if not allowed(v): return False
            del res[v]; pf_pending.discard(v)
        return used() + pages(rank(a)) <= cap
    def pick_prefetch(now, i):
        if mode == 'oracle':
            soon = {a for _, a in reqs[i:i + 8]}
            cands = [a for _, a in reqs[i:i + 8] if a not in res][:1]
            better = lambda c: (lambda v: v not in soon)
        else:
            cands = sorted((a for a in range(N) if a not in res), key=lambda a: -prob(a, now))[:1]
            cands = [a for a in cands if prob(a, now) > 0]
            better = lambda c: (lambda v: mode == 'replace' and prob(v, now) < prob(c, now))
        for c in cands:
            if make_room(c, now, better(c)): return c
        return None
    clock, i, layer = 0.0, 0, None   # layer: (adapter, end time) of the layer on the link
    while True:
        if layer is None:
            who = demand[0] if demand else pf
            if who is None and mode != 'none' and i < nreq:
                who = pf = pick_prefetch(clock, i)
                if pf is not None: res[pf] = 0; pf_made += 1; pf_pending.add(pf)
            if who is not None: layer = (who, clock + copy(rank(who)) / L)
        nxt = reqs[i][0] if i < nreq else math.inf
        if layer is not None and layer[1] <= nxt:
            clock, who = layer[1], layer[0]; layer = None; res[who] += 1
            if res[who] == L:
                for k in waiting.pop(who, []): ttft[k] = clock - reqs[k][0] + 0.005
                if who in demand: demand.remove(who)
                else: pf = None
            continue
        if i >= nreq: break
        clock, a = reqs[i]
        if a in last: gaps.setdefault(a, []).append(clock - last[a])
        freq[a] = freq.get(a, 0) * 2 ** (-(clock - fat.get(a, clock)) / hl) + 1; fat[a] = clock
        last[a] = clock; seen[a % 5] += 1
        if a in pf_pending: pf_pending.discard(a); pf_used += 1
        if res.get(a) == L: ttft[i] = 0.005; hit[i] = True
        else:
            if a not in res: make_room(a, clock, lambda v: True); res[a] = 0
            if a == pf: pf = None  # promoted: a demand load now
            if a not in demand: demand.append(a)
            waiting.setdefault(a, []).append(i)
        i += 1
    m = range(warm, nreq)
    tail = sorted(m, key=lambda k: -ttft[k])[:max(1, len(m) // 100)]
    return ([ttft[k] for k in m], sum(hit[k] for k in m) / len(m), pf_made, pf_used,
            sum(1 for k in m if reqs[k][1] % 5 == 4 and not any(reqs[j][1] == reqs[k][1] for j in range(k))) / len(m))
if __name__ == "__main__":
    H = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0; cap = int(sys.argv[2]) if len(sys.argv) > 2 else 350
    for rate in (20.0, 10.0):
        for mode in ('none', 'free', 'replace', 'oracle'):
            p99, p50, hr, pool, made, usedp, r128 = [], [], [], [], 0, 0, []
            for s in range(200):
                tt, h, pm, pu, f = run(mode, 2023 + s, rate, cap=cap, H=H)
                p99.append(q(tt, .99)); p50.append(q(tt, .5)); hr.append(h); pool += tt; made += pm; usedp += pu; r128.append(f)
            print(f"rate {rate:4.0f} {mode:8s} H={H} cap={cap} hit {q(hr,.5):.3f} P50 {q(p50,.5)*1e3:6.1f} "
                  f"P99 med {q(p99,.5)*1e3:6.1f} pooled {q(pool,.99)*1e3:6.1f}  prefetches/round {made/200:5.1f} "
                  f"accuracy {usedp/max(made,1):.2f}  r128 first uses {sum(r128)/len(r128)*100:.1f}%")
