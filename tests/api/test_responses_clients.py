"""Real clients of the Responses API, unchanged, against the real server and the embedded model: the
OpenAI Agents SDK (a function tool, tool_choice="required") and Codex CLI (`codex exec`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.config import EngineConfig
from tests.support.server import MODEL, running_server

pytestmark = pytest.mark.real_model

# .ci/run installs the pinned Codex CLI here when npm exists; TOKENMILL_CODEX may name another binary.
CODEX_CACHE = Path.home() / ".cache" / "tokenmill-ci" / "codex" / "node_modules" / ".bin" / "codex"


def test_agents_sdk_runs_a_function_tool(smollm2):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    with running_server(smollm2) as server:
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="Answer questions about the weather with the tool.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0),
            tool_use_behavior="stop_on_first_tool",
        )

        async def run_both():
            whole = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
            streamed = agents.Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=3)
            kinds = [event.type async for event in streamed.stream_events()]
            return whole, streamed, kinds

        whole, streamed, kinds = asyncio.run(run_both())
    assert len(asked) == 2 and whole.final_output == f"It is sunny in {asked[0]}."
    assert streamed.final_output == f"It is sunny in {asked[1]}." and "raw_response_event" in kinds
    for result in (whole, streamed):
        assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]


def codex_binary() -> str | None:
    configured = os.environ.get("TOKENMILL_CODEX")
    if configured:
        return configured
    if CODEX_CACHE.exists():
        return str(CODEX_CACHE)
    return shutil.which("codex")


CODEX_CONFIG = """model = "{model}"
model_provider = "tokenmill"
model_instructions_file = "{instructions}"
model_context_window = {context}
web_search = "disabled"
include_permissions_instructions = false
include_environment_context = false
include_apps_instructions = false

[agents]
enabled = false

[features]
goals = false
image_generation = false
apps = false
plugins = false
tool_suggest = false
skill_search = false
sleep_tool = false
computer_use = false
browser_use = false

[model_providers.tokenmill]
name = "tokenmill"
base_url = "{base_url}"
env_key = "TOKENMILL_API_KEY"
wire_api = "responses"
"""


def test_codex_cli_exec_gets_an_answer(smollm2, tmp_path):
    codex = codex_binary()
    if codex is None:
        pytest.skip(
            "Codex CLI is not installed: .ci/run installs @openai/codex@0.169.0 with npm when npm exists "
            f"(into {CODEX_CACHE.parent.parent.parent}), or set TOKENMILL_CODEX"
        )
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer in one short sentence, without tools.\n")
    # Codex sends no temperature: the server's default makes the answer greedy, so the test is repeatable.
    with running_server(
        smollm2, engine_config=EngineConfig(dtype="float32", num_kv_blocks=1024), default_temperature=0.0
    ) as server:
        (home / "config.toml").write_text(
            CODEX_CONFIG.format(
                model=MODEL, instructions=instructions, context=server.engine.max_model_len, base_url=server.base_url
            )
        )
        env = {**os.environ, "CODEX_HOME": str(home), "TOKENMILL_API_KEY": "unused", "NO_COLOR": "1"}
        finished = subprocess.run(
            [codex, "exec", "--skip-git-repo-check", "What is the capital of France?"],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
    transcript = finished.stdout + finished.stderr
    assert finished.returncode == 0, transcript
    assert "Paris" in finished.stdout, transcript  # the agent's last message, greedy
    lines = transcript.lower().splitlines()
    assert not [
        line
        for line in lines
        if line.startswith("error") or "reconnecting" in line or "stream error" in line or "retrying" in line
    ], transcript
