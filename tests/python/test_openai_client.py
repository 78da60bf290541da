"""The official `openai` Python client, unmodified, against a `thaw serve` this test starts.

Run by .ci/run: THAW_BIN points at the release binary. Uses the tiny preset so the whole
file runs in a few seconds.
"""
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import threading
import time

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
THAW = os.environ.get("THAW_BIN", str(ROOT / "target" / "release" / "thaw"))
API_KEY = "sk-thaw-test"


def banner_port(proc, within=60):
    """The port `thaw serve --port 0` bound, from its banner (`... on http://127.0.0.1:PORT ...`).

    Asking the kernel for a free port and passing it on would race: another process on a busy
    CI machine can take it between the probe and the server's bind. A thread reads stdout to
    its end, so the server never blocks on a full pipe.
    """
    lines = queue.Queue()

    def pump():
        for raw in proc.stdout:
            lines.put(raw.decode(errors="replace"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.time() + within
    while True:
        left = deadline - time.time()
        assert left > 0, f"thaw serve printed no banner within {within} s"
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        assert line is not None, "thaw serve exited before its banner"
        if "http://" in line:
            return int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("thaw")
    model, adapters = tmp / "model", tmp / "adapters"
    subprocess.run([THAW, "gen-model", "--preset", "tiny", "--out", model], check=True)
    subprocess.run([THAW, "gen-adapters", "--model", model, "--count", "2", "--ranks", "8,16",
                    "--out", adapters], check=True)
    # Runtime adapter loading is off by default and confined to --lora-root when on; every
    # /v1 route needs the key (the client sends it as a bearer token).
    proc = subprocess.Popen([THAW, "serve", "--model", model, "--lora-dir", adapters,
                             "--served-model-name", "tiny", "--port", "0",
                             "--shutdown-timeout", "5", "--api-key", API_KEY,
                             "--allow-runtime-lora-updating", "--lora-root", tmp],
                            stdout=subprocess.PIPE, stderr=sys.stderr)
    port = banner_port(proc)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    deadline = time.time() + 60
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            assert proc.poll() is None, "thaw serve exited during start-up"
            assert time.time() < deadline, "thaw serve did not start within 60 s"
            time.sleep(0.1)
    names = sorted(p.name for p in adapters.iterdir())
    yield client, names, tmp, adapters
    proc.terminate()
    proc.wait(timeout=15)


def test_models_list(server):
    client, names, _, _ = server
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == "tiny"
    assert sorted(ids[1:]) == names
    extra = models.data[1].model_extra
    assert extra["tier"] == "device" and extra["rank"] in (8, 16)
    assert extra["landed_layers"] == extra["num_layers"]


def test_completions(server):
    client, names, _, _ = server
    r = client.completions.create(model=names[0], prompt="The quick brown fox", max_tokens=5,
                                  temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    again = client.completions.create(model=names[0], prompt="The quick brown fox", max_tokens=5,
                                      temperature=0.7, seed=3, extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text, "same seed, same text"
    r = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    assert len(r.choices[0].logprobs.tokens) == 2
    # Echo with logprobs scores the prompt: every token but the first has a logprob.
    r = client.completions.create(model=names[1], prompt="The quick brown fox", max_tokens=3,
                                  echo=True, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The quick brown fox")
    assert len(lp.tokens) == r.usage.prompt_tokens + 3 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_and_streaming_with_usage(server):
    client, names, _, _ = server
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=names[1], messages=msgs, max_tokens=4,
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)
    chunks = list(client.completions.create(model=names[0], prompt="x", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3


def test_adapter_load_unload(server):
    client, names, tmp, adapters = server
    r = client.post("/load_lora_adapter", cast_to=object,
                    body={"lora_name": "fresh", "lora_path": str(adapters / names[0])})
    assert r["generation"] == 1
    assert "fresh" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="fresh", prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    client.post("/unload_lora_adapter", cast_to=object, body={"lora_name": "fresh"})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fresh", prompt="hi", max_tokens=2)


def test_errors(server):
    client, names, tmp, adapters = server
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi")
    assert "The model `nope` does not exist." in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=100000)
    assert e.value.body["code"] == "context_length_exceeded"
    dora = tmp / "dora"
    shutil.copytree(adapters / names[0], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.post("/load_lora_adapter", cast_to=object, body={"lora_name": "d", "lora_path": str(dora)})
    assert "DoRA" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.post("/load_lora_adapter", cast_to=object,
                    body={"lora_name": "m", "lora_path": str(tmp / "missing")})
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", cast_to=object, body={"lora_name": "never-loaded"})


def test_api_key_and_lora_root(server):
    client, names, tmp, adapters = server
    wrong = client.with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.body["code"] == "invalid_api_key"
    messages = set()
    for path in ["/etc/passwd", "/etc", "/root", "/proc/self", str(tmp / ".." / "elsewhere")]:
        with pytest.raises(openai.PermissionDeniedError) as e:
            client.post("/load_lora_adapter", cast_to=object,
                        body={"lora_name": "x", "lora_path": path})
        messages.add(e.value.body["message"])
    assert len(messages) == 1, "the refusal must not depend on what exists"
