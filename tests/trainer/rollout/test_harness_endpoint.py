"""The capture endpoint's protocol, driven by the real ``openai`` client, over a scripted sampler.

The sampler here is a stand-in that answers each request with a text the test chose (as token ids
of the real tiny-model tokenizer, with made-up log-probs): what is tested is the endpoint's side
(parsing tool calls into OpenAI's format, streaming, the exact-text echo, stop strings, auth and
errors, agents cut or crashing), where a real vLLM server would only make the replies random. The
same endpoint runs against the real server in ``test_harness_training.py``.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from trainer.metrics import RecordBuffer
from trainer.records import TurnRecord
from trainer.rollout.agents import AgentTask, check_agent, run_agent
from trainer.rollout.harness import CaptureServer, CaptureSession
from trainer.rollout.reconcile import reconcile_turns

INCREMENT = {"type": "function", "function": {
    "name": "increment", "description": "Increment the counter.",
    "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}, "required": ["step"]}}}
CALL_TEXT = '<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>'


class ScriptedSampler:
    """Answers the i-th request with ``texts[i]`` (then the last one), ending with EOS unless cut."""

    def __init__(self, tokenizer: Any, texts: list[str], delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.delay_s = delay_s
        self.calls: list[tuple[list[int], int | None, list[str]]] = []

    async def __call__(self, prompt_ids: list[int], max_tokens: int | None, stop: list[str]) -> TurnRecord:
        self.calls.append((prompt_ids, max_tokens, stop))
        await asyncio.sleep(self.delay_s)
        text = self.texts[min(len(self.calls) - 1, len(self.texts) - 1)]
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = ids[:max_tokens] if max_tokens and len(ids) > max_tokens else ids + [self.tokenizer.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids),
                          finish_reason="length" if max_tokens and len(ids) == max_tokens else "stop")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer (Qwen-style template with tool calling)."""
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def _server(tokenizer: Any, sampler: Callable[..., Any], **kw: Any) -> CaptureServer:
    server = CaptureServer(sampler, tokenizer, "tiny", max_model_len=kw.pop("max_model_len", 1024),
                           records=RecordBuffer(), **kw)
    await server.start()
    return server


def _client(session: CaptureSession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.secret, max_retries=0)


def run(coro: Any) -> Any:
    """Run one test coroutine."""
    return asyncio.run(coro)


def test_tool_calls_come_back_in_openai_format_and_the_echo_extends_the_sample(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = ScriptedSampler(tokenizer, [CALL_TEXT, "The counter is at 2."])
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=8)
        async with _client(session) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            messages: list[Any] = [{"role": "user", "content": "Increment the counter to 2."}]
            first = await client.chat.completions.create(model="x", messages=messages, tools=[INCREMENT])
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            (call,) = choice.message.tool_calls
            assert call.function.name == "increment" and json.loads(call.function.arguments) == {"step": 2}
            assert first.usage.completion_tokens == len(session.turns[0].output_ids)
            # The agent echoes the reply as the SDK gives it (content None, its own serialisation).
            messages += [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "2"}]
            second = await client.chat.completions.create(model="x", messages=messages, tools=[INCREMENT])
            assert second.choices[0].message.content == "The counter is at 2."
            assert second.choices[0].finish_reason == "stop"
        server.close(session)
        await server.stop()
        sequences, stats = reconcile_turns(session.turns)
        assert stats.forks == 0 and len(sequences) == 1, "the echoed reply renders as generated: one sample"
        generated = [t for turn in session.turns for t in turn.output_ids]
        (seq,) = sequences
        trained = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
        assert trained == generated, "every generated token trained once"
        assert session.tool_calls == 1 and session.tool_failures == 0
        assert session.conversation[-1] == {"role": "assistant", "content": "The counter is at 2."}

    run(go())


def test_streamed_replies_parse_with_the_openai_client(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = ScriptedSampler(tokenizer, [f"Let me step.\n{CALL_TEXT}", "Done."])
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=8)
        async with _client(session) as client:
            stream = await client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Go."}], tools=[INCREMENT], stream=True,
                stream_options={"include_usage": True})
            content, calls, finish, usage = "", {}, None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for tc in choice.delta.tool_calls or []:
                        entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        entry["name"] += tc.function.name or ""
                        entry["arguments"] += tc.function.arguments or ""
                    finish = choice.finish_reason or finish
            assert content == "Let me step." and finish == "tool_calls"
            assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("increment", {"step": 2})]
            assert usage is not None and usage.completion_tokens == len(session.turns[0].output_ids)
        server.close(session)
        await server.stop()

    run(go())


def test_rewritten_history_forks_a_new_sample(tokenizer: Any) -> None:
    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["First answer.", "Second answer."]))
        session = server.open(contextvars.copy_context(), max_requests=8)
        async with _client(session) as client:
            await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi."}])
            # The agent summarises its history instead of sending it back.
            await client.chat.completions.create(model="x", messages=[
                {"role": "system", "content": "Summary: the model said hello."},
                {"role": "user", "content": "Go on."}])
        server.close(session)
        await server.stop()
        sequences, stats = reconcile_turns(session.turns)
        assert stats.forks == 1 and len(sequences) == 2
        for seq, turn in zip(sequences, session.turns, strict=True):
            assert [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m] == turn.output_ids

    run(go())


def test_stop_strings_cut_the_reply_and_the_trained_tokens(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = ScriptedSampler(tokenizer, ["Thought: step by two.\nObservation: it worked"])
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=8)
        async with _client(session) as client:
            reply = await client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Go."}], stop=["Observation:"], max_tokens=30)
        server.close(session)
        await server.stop()
        assert reply.choices[0].message.content == "Thought: step by two.\n"
        (turn,) = session.turns
        assert "Observation:" in tokenizer.decode(turn.output_ids)
        assert "it worked" not in tokenizer.decode(turn.output_ids), "tokens after the stop are not trained"
        assert len(turn.output_log_probs) == len(turn.output_ids) and sampler.calls[0][1] == 30

    run(go())


def test_malformed_and_unknown_calls_are_counted_and_shown_verbatim(tokenizer: Any) -> None:
    async def go() -> None:
        broken = '<tool_call>\n{"name": "increment", "arguments": {"step": }\n</tool_call>'
        unknown = '<tool_call>\n{"name": "decrement", "arguments": {"step": 1}}\n</tool_call>'
        server = await _server(tokenizer, ScriptedSampler(tokenizer, [broken, unknown]))
        session = server.open(contextvars.copy_context(), max_requests=8)
        async with _client(session) as client:
            messages = [{"role": "user", "content": "Go."}]
            first = await client.chat.completions.create(model="x", messages=messages, tools=[INCREMENT])
            assert first.choices[0].message.content == broken and not first.choices[0].message.tool_calls
            second = await client.chat.completions.create(model="x", messages=messages, tools=[INCREMENT])
            assert second.choices[0].message.tool_calls[0].function.name == "decrement"
        server.close(session)
        await server.stop()
        assert session.tool_calls == 2 and session.tool_failures == 2
        names = {name: value for _, name, value, _ in server.records.take()}
        assert names["tools/unknown_name_count"] == 1

    run(go())


def test_refusals_are_openai_errors(tokenizer: Any) -> None:
    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["ok"]), max_request_bytes=4096,
                               max_model_len=64)
        session = server.open(contextvars.copy_context(), max_requests=2)
        other = server.open(contextvars.copy_context(), max_requests=2)
        hello = [{"role": "user", "content": "Hi."}]
        async with _client(session) as client:
            with pytest.raises(openai.BadRequestError, match="n=1"):
                await client.chat.completions.create(model="x", messages=hello, n=2)
            with pytest.raises(openai.BadRequestError, match="image_url"):
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:,"}}]}])
            with pytest.raises(openai.APIStatusError) as too_big:
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x" * 8000}])
            assert too_big.value.status_code == 413
            with pytest.raises(openai.BadRequestError) as too_long:
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "word " * 200}])
            assert too_long.value.code == "context_length_exceeded"
            await client.chat.completions.create(model="x", messages=hello)
            await client.chat.completions.create(model="x", messages=hello)
            with pytest.raises(openai.RateLimitError, match="agent_max_requests"):
                await client.chat.completions.create(model="x", messages=hello)
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=other.secret, max_retries=0) as crossed:
            with pytest.raises(openai.AuthenticationError, match="another rollout"):
                await crossed.chat.completions.create(model="x", messages=hello)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError, match="unknown rollout"):
                await stranger.chat.completions.create(model="x", messages=hello)
        # The secret as the key alone (a fixed base URL) reaches the rollout too.
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=other.secret, max_retries=0) as by_key:
            assert (await by_key.chat.completions.create(model="x", messages=hello)).choices[0].message.content == "ok"
        server.close(session)
        async with _client(session) as late:
            with pytest.raises(openai.NotFoundError) as finished:
                await late.chat.completions.create(model="x", messages=hello)
            assert finished.value.code == "rollout_finished"
        async with aiohttp.ClientSession() as http:  # not JSON at all, or nested past any parser's stack
            for body in (b"{not json", b"[" * 2000 + b"]" * 2000):
                async with http.post(f"{other.base_url}/chat/completions", data=body) as r:
                    assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        await server.stop()

    run(go())


def _task(session: CaptureSession, timeout_s: float) -> AgentTask:
    return AgentTask(row={"target": 2}, prompt=[{"role": "user", "content": "Go."}], tools=[INCREMENT], env=None,
                     base_url=session.base_url, api_key=session.secret, model="tiny", timeout_s=timeout_s)


async def hanging_agent(task: AgentTask) -> float:
    """Makes one request, then waits forever."""
    await task.client.chat.completions.create(model=task.model, messages=task.prompt)
    await asyncio.Event().wait()
    return 1.0


async def crashing_agent(task: AgentTask) -> float:
    """Makes one request, then raises."""
    await task.client.chat.completions.create(model=task.model, messages=task.prompt)
    raise RuntimeError("the agent's parser broke")


async def slow_request_agent(task: AgentTask) -> float:
    """Its only request outlives the deadline (the sampler is slow)."""
    await task.client.chat.completions.create(model=task.model, messages=task.prompt)
    return 1.0


@pytest.mark.parametrize("agent, timed_out, error", [
    (hanging_agent, True, "deadline"),
    (crashing_agent, False, "RuntimeError: the agent's parser broke"),
])
def test_an_agent_is_cut_at_its_deadline_or_fails_alone(tokenizer: Any, agent: Any, timed_out: bool,
                                                        error: str) -> None:
    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["ok"]))
        session = server.open(contextvars.copy_context(), max_requests=8)
        outcome = await run_agent(check_agent(agent), _task(session, timeout_s=1.0))
        server.close(session)
        assert outcome.timed_out is timed_out and error in (outcome.error or "")
        assert len(session.turns) == 1 and outcome.wall_s < 5
        await server.stop()

    run(go())


def test_closing_a_session_cancels_its_request_in_flight(tokenizer: Any) -> None:
    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["ok"], delay_s=30))
        session = server.open(contextvars.copy_context(), max_requests=8)
        outcome = await run_agent(check_agent(slow_request_agent), _task(session, timeout_s=0.5))
        in_flight = set(session.tasks)
        assert outcome.timed_out and len(in_flight) == 1
        server.close(session)
        await asyncio.wait(in_flight, timeout=5)
        assert all(t.cancelled() for t in in_flight) and not session.turns
        await server.stop()

    run(go())


SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import openai
    task = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["prompt"])
    mode = task["row"]["mode"]
    if mode == "hang":
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # would outlive it
        with open(task["row"]["pidfile"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    if mode == "crash":
        sys.exit("the script gave up")
    print("some log line")
    print(len(reply.choices[0].message.content))
''')


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("mode", ["ok", "crash", "hang"])
def test_a_command_agent_gets_its_url_and_task_and_is_killed_whole(tokenizer: Any, tmp_path: Path,
                                                                   mode: str) -> None:
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)

    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["four"]))
        session = server.open(contextvars.copy_context(), max_requests=8)
        task = _task(session, timeout_s=120.0)  # Python and openai start in seconds on a loaded machine
        pidfile = tmp_path / "pids"
        task.row = {"mode": mode, "pidfile": str(pidfile)}
        stop = asyncio.Event()

        async def stop_once_hanging() -> None:  # the script writes its pids after its request, then hangs
            while not pidfile.exists() or not pidfile.read_text():
                await asyncio.sleep(0.05)
            stop.set()

        watcher = asyncio.create_task(stop_once_hanging())
        outcome = await run_agent(check_agent([sys.executable, str(script)]), task, cancel=stop)
        watcher.cancel()
        server.close(session)
        await server.stop()
        assert len(session.turns) == 1
        if mode == "ok":
            assert outcome.error is None and outcome.reward == 4.0
        elif mode == "crash":
            assert "exited with status 1" in (outcome.error or "") and "the script gave up" in outcome.error
        else:
            assert outcome.error == "stopped" and not outcome.timed_out
            pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
            for _ in range(50):  # SIGKILL is delivered at once; the exit shows within moments
                if not any(_alive(p) for p in pids):
                    break
                await asyncio.sleep(0.1)
            assert not any(_alive(p) for p in pids), "the agent and the process it started are killed"

    run(go())


def test_bad_agents_are_refused_up_front() -> None:
    def sync_agent(task: AgentTask) -> float:
        """Not async."""
        return 0.0

    with pytest.raises(ValueError, match="async"):
        check_agent(sync_agent)
    with pytest.raises(ValueError, match="non-empty"):
        check_agent([])
    assert check_agent("python -m my_agent --fast") == ["python", "-m", "my_agent", "--fast"]
