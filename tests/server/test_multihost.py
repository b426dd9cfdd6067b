"""Multi-host serving: two `python -m atlas_jax.serve` processes on 127.0.0.1 (2 virtual CPU devices each, gloo
collectives, one tp 4 mesh). Rank 0 answers the OpenAI client with the tokens one device gives; SIGTERM on rank 0
stops both ranks; a killed rank 1 makes rank 0 fail clearly within a bounded time. Bounded in time, loopback only."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

HERE = os.path.dirname(__file__)
DIST_TIMEOUT = 10            # seconds the coordination service waits for a silent rank
ENGINE = ["--tensor-parallel-size", "4", "--kernels", "xla", "--max-num-seqs", "2", "--max-model-len", "160",
          "--max-prefill-chunk", "16", "--max-prefill-rows", "1", "--page-size", "8", "--preemption-mode",
          "recompute", "--dist-timeout", str(DIST_TIMEOUT)]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-Next (heads divide 4) with a tokenizer and a ChatML chat_template.jinja, as checkpoints ship."""
    from atlas_jax.default_model import TINY_RANDOM_CONFIG, write_random_checkpoint, write_tiny_random_model
    path = str(tmp_path_factory.mktemp("multihost") / "qwen3_next")
    write_tiny_random_model(path)
    import json
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)
    write_random_checkpoint(path, {**TINY_RANDOM_CONFIG, "vocab_size": vocab["vocab_size"],
                                   "eos_token_id": vocab["eos_token_id"], "linear_num_key_heads": 4,
                                   "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16})
    shutil.copy(os.path.join(HERE, "..", "templates", "qwen3.jinja"), os.path.join(path, "chat_template.jinja"))
    return path


@pytest.fixture(scope="module")
def one_device(checkpoint):
    """What one device answers: the chat's text and a token prompt's ids."""
    from atlas_jax import LLM, SamplingParams
    llm = LLM(checkpoint, kernels="xla", max_num_seqs=2, max_model_len=160, max_prefill_chunk=16, page_size=8,
              warmup=False, progress=False)
    greedy = SamplingParams(**GREEDY)
    return llm.chat(MESSAGES, greedy)[0].outputs[0].text, llm.generate([5, 6, 7, 8], greedy)[0].outputs[0].token_ids


class Pair:
    """Rank 0 (HTTP on `port`) and rank 1 of one served model, their logs under `logs`."""

    def __init__(self, checkpoint, logs, cache):
        self.port, coordinator = free_port(), free_port()
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        base = [sys.executable, "-m", "atlas_jax.serve", "--model", checkpoint, "--nnodes", "2", "--dist-init-addr",
                f"127.0.0.1:{coordinator}", "--compile-cache-dir", cache, "--reasoning-parser", "none",
                "--tool-call-parser", "none", *ENGINE]
        self.logs = [os.path.join(logs, f"rank{r}.log") for r in (0, 1)]
        self.procs = [subprocess.Popen(base + ["--node-rank", str(r)] + (["--port", str(self.port)] if r == 0 else []),
                                       env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
                      for r, log in enumerate(self.logs)]
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def wait_healthy(self, timeout=420) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert all(p.poll() is None for p in self.procs), self.tail()
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise AssertionError(f"not healthy in {timeout} s\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(f"--- {log}\n" + open(log).read()[-3000:] for log in self.logs)

    def close(self) -> None:
        self.client.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("multihost_cache"))


def test_two_processes_serve_one_devices_tokens_and_stop_together(checkpoint, one_device, cache, tmp_path):
    from openai import OpenAI
    text, token_ids = one_device
    pair = Pair(checkpoint, str(tmp_path), cache)
    try:
        pair.wait_healthy()
        client = OpenAI(base_url=f"http://127.0.0.1:{pair.port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0, max_tokens=8,
                                              extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == text
        r = pair.client.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7, 8], "return_token_ids": True,
                                                      **GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == token_ids
        pair.procs[0].send_signal(signal.SIGTERM)          # drains, then stops rank 1 too
        assert [p.wait(timeout=60) for p in pair.procs] == [0, 0], pair.tail()
        assert "rank 0 stopped after" in open(pair.logs[1]).read()
    finally:
        pair.close()


def test_a_dead_rank_ends_the_service_within_a_bounded_time(checkpoint, cache, tmp_path):
    pair = Pair(checkpoint, str(tmp_path), cache)
    try:
        pair.wait_healthy()
        ok = pair.client.post("/v1/completions", json={"prompt": [5, 6, 7], **GREEDY})
        assert ok.status_code == 200, ok.text
        pair.procs[1].kill()
        pair.procs[1].wait()
        t0 = time.monotonic()
        try:                                # the step in flight fails (its collective lost a peer), or rank 0 is gone
            r = pair.client.post("/v1/completions", json={"prompt": [5, 6, 7], **GREEDY}, timeout=DIST_TIMEOUT * 4)
            assert r.status_code >= 500, r.text
        except httpx.TransportError:
            pass
        rc = pair.procs[0].wait(timeout=DIST_TIMEOUT * 6)
        assert rc != 0 and time.monotonic() - t0 < DIST_TIMEOUT * 6
        log = open(pair.logs[0]).read()
        assert "Gloo" in log or "heartbeat" in log or "another task died" in log, pair.tail()
    finally:
        pair.close()
