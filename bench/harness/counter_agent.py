"""The counter task played by an agent written with the ``openai`` client (the harness benchmark's agent).

It does what the built-in loop does, through the rollout's endpoint: send the conversation with the
environment's tools, run the calls of the reply, send the tool results back, until a reply calls no
tool or the built-in loop's iteration limit is reached.
"""

from __future__ import annotations

from trainer.rollout.agents import AgentTask

MAX_TOOL_CALLING_ITERATIONS = 6  # the bench's max_tool_calling_iterations for the built-in loop


async def counter_agent(task: AgentTask) -> None:
    """One counter episode through the endpoint; the environment's ``get_reward`` scores it."""
    messages = list(task.prompt)
    for _ in range(MAX_TOOL_CALLING_ITERATIONS + 1):
        reply = await task.client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            content = await task.call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
