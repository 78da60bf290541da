#!/usr/bin/env python3
"""usage: cache-tokcheck.py [BENCH_WORKDIR] [THAW]. Same greedy tokens with --cold-start=on-demand (0 workers) and auto (1 worker), Chameleon's setting.
Starts both servers on the bench's tiny model and 100 adapters, sends the same 200 requests
(32 at a time, adapters drawn at random so most are cold), compares the completions."""
import json, random, subprocess, sys, time, urllib.request, concurrent.futures as cf, os
W = sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefetch-s12/work"; B = sys.argv[2] if len(sys.argv) > 2 else "target/release/thaw"
common = ['serve', '--model', f'{W}/model-tiny', '--lora-dir', f'{W}/subset-100', '--max-lora-rank', '128',
          '--emulated-link-gbps=0.002', '--device-memory-bytes=4194304']
cfgs = {'on-demand': (18431, ['--lora-workers=0', '--cold-start=on-demand']),
        'auto': (18432, ['--lora-workers=1', '--cold-start=auto'])}
def post(port, body):
    r = urllib.request.Request(f'http://127.0.0.1:{port}/v1/completions', json.dumps(body).encode(),
                               {'Content-Type': 'application/json'})
    return json.load(urllib.request.urlopen(r, timeout=300))['choices'][0]['text']
rng = random.Random(12)
adapters = sorted(os.listdir(f'{W}/subset-100'))
words = 'the a of cold adapter link page cache token serve rank queue step layer host device'.split()
reqs = [{'model': rng.choice(adapters), 'prompt': ' '.join(rng.choice(words) for _ in range(rng.randint(4, 60))),
         'max_tokens': rng.randint(4, 24), 'temperature': 0} for _ in range(200)]
out = {}
for name, (port, extra) in cfgs.items():
    log = open(f'{W}/tok-{name}.log', 'w')
    p = subprocess.Popen([B] + common + ['--port', str(port)] + extra, stdout=log, stderr=log)
    try:
        for _ in range(300):
            try: urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=1); break
            except Exception: time.sleep(0.5)
        with cf.ThreadPoolExecutor(32) as ex:
            out[name] = list(ex.map(lambda b: post(port, b), reqs))
        m = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics').read().decode()
        print(name, [l for l in m.splitlines() if l.startswith(('thaw_cpu_assisted_rows_total', 'thaw_adapter_cache_misses_total', 'thaw_adapter_misses'))][:4])
    finally:
        p.terminate(); p.wait()
same = sum(a == b for a, b in zip(out['on-demand'], out['auto']))
print(f'{same} of {len(reqs)} completions identical; distinct adapters {len({r["model"] for r in reqs})}')
for i, (a, b) in enumerate(zip(out['on-demand'], out['auto'])):
    if a != b: print('DIFF', i, reqs[i]['model'], repr(a), repr(b))
