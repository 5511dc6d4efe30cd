"""``HarnessAsyncGRPOTrainer``: train the agent you already have, through an OpenAI-compatible endpoint.

The agent is a black box: an async Python function (it gets an
:class:`~trainer.rollout.agents.AgentTask` with the row, the environment, a per-rollout base URL
and a ready ``openai.AsyncOpenAI`` client) or a command line run as a subprocess with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set. Every chat-completions request it makes is sampled
from the policy being trained and recorded token for token by the rollout worker's capture
endpoint (:mod:`trainer.rollout.harness`); the rest of the pipeline is
:class:`~trainer.AsyncGRPOTrainer`'s. See ``docs/harness.md``::

    async def agent(task):
        reply = await task.client.chat.completions.create(model=task.model, messages=task.prompt)
        return score(reply.choices[0].message.content)

    trainer = HarnessAsyncGRPOTrainer(model="path/to/model", agent=agent,
                                      args=HarnessAsyncGRPOConfig(...), train_dataset=dataset)
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from trainer.async_grpo_trainer import AsyncGRPOTrainer
from trainer.exceptions import ConfigError
from trainer.harness_config import HarnessAsyncGRPOConfig
from trainer.rollout.agents import Agent, check_agent
from trainer.rollout.harness_loop import HarnessRolloutLoop, HarnessSettings
from trainer.rollout.training_templates import rollout_chat_template

__all__ = ["HarnessAsyncGRPOConfig", "HarnessAsyncGRPOTrainer"]


class HarnessAsyncGRPOTrainer(AsyncGRPOTrainer):
    """GRPO on a black-box agent's conversations (see the module docstring and ``docs/harness.md``).

    Args:
        model: As :class:`~trainer.AsyncGRPOTrainer`.
        agent: An async function ``agent(task: AgentTask) -> float | None``, or a command line (a
            string or a list of arguments) run once per rollout. Must pickle (module level).
        reward_funcs: Reward functions; they receive the captured conversation as ``completions``.
            Optional when the agent returns its reward or the environment scores.
        args: A :class:`HarnessAsyncGRPOConfig`.
        train_dataset: One row per task. A ``prompt`` column is optional: the agent gets the whole row.
        processing_class: As :class:`~trainer.AsyncGRPOTrainer`.
        callbacks: As :class:`~trainer.AsyncGRPOTrainer`.
        optimizers: As :class:`~trainer.AsyncGRPOTrainer`.
        peft_config: As :class:`~trainer.AsyncGRPOTrainer`.
        environment_factory: As :class:`~trainer.AsyncGRPOTrainer`: one instance per rollout, reset
            before the agent runs (its text joins ``task.prompt``), scored with ``get_reward`` after.
    """

    loop_cls = HarnessRolloutLoop
    prompt_column_required = False

    def __init__(
        self,
        model: Any,
        agent: Agent,
        reward_funcs: Callable[..., Any] | list[Callable[..., Any]] | None = None,
        args: HarnessAsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
    ) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = HarnessAsyncGRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-HarnessGRPO")
        if not isinstance(args, HarnessAsyncGRPOConfig):
            raise ConfigError(f"args must be a HarnessAsyncGRPOConfig (it adds agent_timeout and the endpoint's "
                              f"settings to AsyncGRPOConfig), got {type(args).__name__}")
        self.agent = agent
        check_agent(agent)
        super().__init__(model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, environment_factory=environment_factory)
        if self.rollout_chat_template is None and environment_factory is None:
            # The agents' requests are multi-turn whatever the trainer knows of their tools: check the template.
            tokenizer: Any = self.processing_class
            kwargs: Any = args.chat_template_kwargs or {}  # a dict once the config's __post_init__ ran
            self.rollout_chat_template = rollout_chat_template(tokenizer, None, **dict(kwargs))

    def rollout_loop_kwargs(self) -> dict[str, Any]:
        """The agent and its limits, for :class:`~trainer.rollout.harness_loop.HarnessRolloutLoop`."""
        args = cast(HarnessAsyncGRPOConfig, self.args)  # checked in __init__
        return {"agent": self.agent, "harness": HarnessSettings.from_config(args)}
