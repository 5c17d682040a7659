"""The baseline for serve_bench: the same model behind one HF transformers `generate` call per request,
one request at a time, streamed in OpenAI's chat chunk format. What you get without an engine.

    python bench/naive_server.py --port 8100 [--data-dir .tokenmill] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.config import EngineConfig
from engine.loader import DEFAULT_MODEL_NAME, checkpoint_folder


class TokenQueue(BaseStreamer):
    """Hands each generated token id to the event loop; the first `put` is the prompt."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.seen_prompt = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for token_id in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token_id)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(model, tokenizer, model_name: str) -> FastAPI:
    app = FastAPI()
    one_at_a_time = asyncio.Lock()
    # one long-lived generate thread, as a real single-worker server has (a fresh thread per request
    # would also start a fresh OpenMP team each time)
    generate_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        prompt = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        options = dict(
            max_new_tokens=max_tokens,
            do_sample=temperature > 0,
            pad_token_id=tokenizer.eos_token_id,
            attention_mask=torch.ones_like(prompt),
        )
        if temperature > 0:
            options["temperature"] = temperature
        if body.get("ignore_eos"):
            options["min_new_tokens"] = max_tokens
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name}

        async def events():
            async with one_at_a_time:
                queue: asyncio.Queue = asyncio.Queue()
                loop = asyncio.get_running_loop()
                streamer = TokenQueue(loop, queue)
                generation = loop.run_in_executor(
                    generate_thread, lambda: model.generate(prompt, streamer=streamer, **options)
                )
                yield (
                    "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
                )
                count = 0
                while (token_id := await queue.get()) is not None:
                    count += 1
                    delta = {"content": tokenizer.decode([token_id], skip_special_tokens=True)}
                    yield "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta}]}) + "\n\n"
                await generation
            usage = {
                "prompt_tokens": prompt.shape[1],
                "completion_tokens": count,
                "total_tokens": prompt.shape[1] + count,
            }
            finish = "length" if count >= max_tokens else "stop"
            yield (
                "data: "
                + json.dumps({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                + "\n\n"
            )
            yield "data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        if not body.get("stream"):
            return JSONResponse(
                {
                    "error": {
                        "message": "the baseline only streams",
                        "type": "invalid_request_error",
                        "param": "stream",
                        "code": None,
                    }
                },
                status_code=400,
            )
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--data-dir", default=".tokenmill")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    config = EngineConfig(dtype=args.dtype, data_dir=args.data_dir)
    folder, _ = checkpoint_folder(config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=config.torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"naive baseline: serving {DEFAULT_MODEL_NAME} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(model, tokenizer, DEFAULT_MODEL_NAME), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
