"""A bounded soak of the shared server: a few hundred mixed requests (completions and chat,
streamed or not, n up to 2, some invalid), a seeded third of them abandoned part-way, and
then the engine must be clean: integrity ok, no orphan request, no KV block in use."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.e2e.server_utils import Server, wait_idle

NUM_REQUESTS = 300
CONCURRENCY = 12
SEED = 9


def _body(rng: random.Random) -> tuple[str, dict]:
    max_tokens = rng.randint(1, 24)
    common = {"max_tokens": max_tokens, "ignore_eos": True, "n": rng.choice((1, 1, 2)),
              "temperature": rng.choice((0.0, 1.0)), "stream": rng.random() < 0.5}
    if rng.random() < 0.05:
        common["seed"] = 2 ** 64  # invalid: a 400 that must leave nothing behind
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": f"soak {rng.random()} once upon a"}
    return "/v1/chat/completions", {**common, "messages": [
        {"role": "user", "content": f"soak {rng.random()}: tell me a story"}]}


async def _one(client: httpx.AsyncClient, rng: random.Random, stats: dict[str, int]) -> None:
    path, body = _body(rng)
    abandon_after = rng.randint(0, 6) if rng.random() < 1 / 3 else None
    expect_ok = "seed" not in body
    if body["stream"]:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == (200 if expect_ok else 400), await r.aread()
            num_events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    num_events += 1
                    # NOTE: an error event is an object with an "error" key; the text a
                    # random model generates may itself be the word "error".
                    payload = line[len("data: "):]
                    assert payload == "[DONE]" or "error" not in json.loads(payload), line
                    if abandon_after is not None and num_events > abandon_after:
                        stats["abandoned"] += 1
                        return  # NOTE: leaving the block closes the connection mid-stream
            assert not expect_ok or line == "data: [DONE]" or num_events > 0
    elif abandon_after is not None and expect_ok:
        try:
            await asyncio.wait_for(client.post(path, json=body), timeout=0.01 * abandon_after)
        except TimeoutError:
            stats["abandoned"] += 1
            return
    else:
        r = await client.post(path, json=body)
        assert r.status_code == (200 if expect_ok else 400), r.text
        if expect_ok:
            usage = r.json()["usage"]
            assert usage["completion_tokens"] == body["max_tokens"] * body["n"], r.text
    stats["ok" if expect_ok else "invalid"] += 1


def test_soak_with_random_aborts_leaves_the_engine_clean(server: Server,
                                                         client: httpx.Client) -> None:
    rng = random.Random(SEED)
    stats = {"ok": 0, "invalid": 0, "abandoned": 0}

    async def run_all() -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0,
                                     limits=limits) as c:
            queue = list(range(NUM_REQUESTS))

            async def worker() -> None:
                while queue:
                    queue.pop()
                    await _one(c, rng, stats)

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CONCURRENCY))),
                                   timeout=240)

    asyncio.run(run_all())
    print(f"soak: {stats}")
    assert sum(stats.values()) == NUM_REQUESTS
    assert stats["abandoned"] >= NUM_REQUESTS // 5 and stats["invalid"] > 0, stats
    report = wait_idle(client, timeout_s=30)
    assert report["ok"] and report["num_orphans"] == 0, report
    assert report["kv_cache_usage"] == 0.0 and report["num_unfinished"] == 0, report
