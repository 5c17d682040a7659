"""The client side of the air-gap tests, run inside their network namespace with the official openai client.

    python tests/support/airgap_client.py URL API_KEY SERVER_PID

Waits for /health (giving up if the server process is gone), then completes a chat and an embedding;
prints one JSON object with what came back.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import openai

CHAT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


def wait_for_health(url: str, server_pid: int, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        if not os.path.exists(f"/proc/{server_pid}"):
            raise SystemExit("the server exited before it was healthy")
        if time.monotonic() > deadline:
            raise SystemExit(f"the server was not healthy within {timeout:.0f} s")
        time.sleep(0.5)


def main(url: str, api_key: str, server_pid: str) -> None:
    result = {"health": wait_for_health(url, int(server_pid))}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    result["chat"] = chat.choices[0].message.content
    result["admin_login_status"] = httpx.get(f"{url}/admin/login", timeout=30).status_code
    vectors = client.embeddings.create(model=EMBEDDING_MODEL, input=["air-gapped install", "no network"])
    result["embedding_dimensions"] = [len(item.embedding) for item in vectors.data]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
