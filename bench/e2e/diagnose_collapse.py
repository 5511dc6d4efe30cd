"""Instrument a counter training run and take its collapse apart (the study of ``bench/e2e/README.md``).

Four commands, each on the folder the first one writes::

    # the demo's run (trainer seed 3), recording every trained sample, each step's micro-batches,
    # the weights after every step and the log history; evaluated before and after (144 episodes)
    .venv/bin/python bench/e2e/diagnose_collapse.py run outputs/diag/s3 --seed 3 --episodes-per-target 24
    #   ... with the old behaviour (every sampled token trained), or other config fields
    .venv/bin/python bench/e2e/diagnose_collapse.py run outputs/diag/s3-old --seed 3 --set tail_token_prob=null
    # per weight snapshot: P(<tool_call> opens turn 1), P(the exact call), P(the clean final answer)
    .venv/bin/python bench/e2e/diagnose_collapse.py probe outputs/diag/s3
    # which samples (and, with --tokens, which of their tokens) carry step 2's gradient
    .venv/bin/python bench/e2e/diagnose_collapse.py grads outputs/diag/s3 2 --tokens 2
    # the run's first 4 steps again, offline, on the same samples, with one thing changed
    .venv/bin/python bench/e2e/diagnose_collapse.py replay outputs/diag/s3-old --steps 4 --variant tail:1e-3

``run`` starts its own env server and vLLM CPU server (or uses ``--vllm-url``/``--env-url``). The
replay uses the trainer's own loss (``packed_grpo_loss``) and AdamW with the run's learning-rate
schedule, on the samples and micro-batches the run recorded; a variant changes which tokens train.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, get_scheduler

from toolgym.kit.counter_experiment import counter_config, counter_trainer, evaluate_counter, serve_policy, warm_model
from toolgym.kit.warm_start import counter_tools
from trainer.records import TrainingSample, TrainingSequence
from trainer.rollout.tail import train_until_tail
from trainer.rollout.turn_baseline import turn_advantages
from trainer.training.loss import LossConfig, packed_grpo_loss
from trainer.training.packing import build_row
from trainer.training.tree_attention import enable_tree_attention

FINAL_TURN = "<|im_start|>assistant\n"


class _Recorder(TrainerCallback):
    """Writes every trained sample (``samples.jsonl``), each micro-batch's size and the weights per step."""

    def __init__(self, out: Path, tokenizer: Any) -> None:
        self.out, self.tokenizer = out, tokenizer
        (out / "weights").mkdir(parents=True, exist_ok=True)
        self.samples = open(out / "samples.jsonl", "w")  # noqa: SIM115  # closed at train end
        self.batches = open(out / "microbatches.jsonl", "w")  # noqa: SIM115
        self.trainer: Any = None

    def record(self, stream: Any) -> None:
        """Stands in for the trainer's ``_report_completions``: the samples trained since the last log."""
        step = self.trainer.state.global_step
        for s in stream.take_trained_samples():  # kept because log_completions=True
            seq = s.sequence
            start = seq.loss_mask.index(1) if 1 in seq.loss_mask else len(seq.input_ids)
            tops = [None if t is None else {str(k): v for k, v in t.items()} for t in seq.sampler_top_logprobs or []]
            self.samples.write(json.dumps(dict(
                step=step, group=s.group_id, version=s.policy_version, reward=s.reward, adv=s.advantage,
                text=self.tokenizer.decode(seq.input_ids[start:], skip_special_tokens=False),
                ids=seq.input_ids, mask=seq.loss_mask, logq=seq.sampler_logprobs, tops=tops)) + "\n")
        self.samples.flush()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   self.out / "weights" / f"step{state.global_step}.pt")

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.samples.close()
        self.batches.close()


def run(args: argparse.Namespace) -> None:
    """One instrumented demo run (``counter_trainer``), evaluated before and after."""
    from sdk import remote_factory
    from trainer.launch.envserver import EnvServerProcess
    from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

    torch.set_num_threads(1)
    out = Path(args.folder)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = warm_model(Path(args.cache), seed=0)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    with EnvServerProcess(["environments.counter:IncrementEnv"]) if not args.env_url else _Given(args.env_url) as env, \
            VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) if not args.vllm_url \
            else _Given(args.vllm_url) as server:
        url = server.base_url
        factory = remote_factory(env.url, "IncrementEnv")
        serve_policy(url, model_dir)
        n = args.episodes_per_target
        before = evaluate_counter(url, model_dir, factory, n) if n else None
        config = counter_config(out, url, args.steps, args.seed, log_completions=True, **overrides)
        recorder = _Recorder(out, AutoTokenizer.from_pretrained(model_dir))
        trainer = counter_trainer(model_dir, factory, config, callbacks=[recorder])
        recorder.trainer = trainer
        trainer._report_completions = recorder.record
        step = trainer.training_step

        def recorded_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            recorder.batches.write(json.dumps(dict(step=trainer.state.global_step + 1, n=inputs.num_samples)) + "\n")
            return step(model, inputs, num_items_in_batch)

        trainer.training_step = recorded_step
        t0 = time.monotonic()
        trainer.train()
        train_s = time.monotonic() - t0
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=0))
        after = evaluate_counter(url, model_dir, factory, n) if n else None
    result = dict(seed=args.seed, steps=args.steps, overrides=overrides, train_s=round(train_s, 1),
                  before=before.success_rate if before else None, after=after.success_rate if after else None)
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


@dataclasses.dataclass
class _Given:
    """A server someone else started: the ``with`` protocol of the launchers, doing nothing."""

    url: str

    @property
    def base_url(self) -> str:
        return self.url

    def __enter__(self) -> _Given:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------------------------------------------- probe
def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=counter_tools(), add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=False))


def _call(step: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}


@torch.no_grad()
def _logp(model: Any, context: list[int], continuation: list[int]) -> tuple[float, torch.Tensor]:
    """log P(continuation | context) and the next-token log-probs after ``context``."""
    logits = model(torch.tensor([context + continuation])).logits[0].float().log_softmax(-1)
    picked = logits[len(context) - 1:-1].gather(1, torch.tensor(continuation)[:, None])
    return float(picked.sum()), logits[len(context) - 1]


def probe_policy(model: Any, tokenizer: Any) -> dict[str, float]:
    """P(``<tool_call>`` opens turn 1), P(the exact call), P(the clean final answer) averaged over targets 1-6."""
    opener, end = tokenizer.convert_tokens_to_ids("<tool_call>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    opens, exact, answers = [], [], []
    for target in range(1, 7):
        user = [{"role": "user", "content": f"Increment the counter to {target}."}]
        context = _render(tokenizer, user, True)
        full = _render(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [_call(target)]}], False)
        call = full[len(context):]
        logp, first = _logp(model, context, call[:call.index(end) + 1])
        opens.append(float(first[opener].exp()))
        exact.append(math.exp(logp))
        for step in range(1, 7):
            after = _render(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [_call(step)]},
                                        {"role": "tool", "content": str(step)}], True)
            answer = tokenizer.encode(f"The counter is now {step}.") + [end]
            answers.append(math.exp(_logp(model, after, answer)[0]))
    return {"P(opener)": sum(opens) / 6, "P(exact call)": sum(exact) / 6, "P(final answer)": sum(answers) / 36}


def _model(folder: Path | None, step: int, cache: str) -> Any:
    model = AutoModelForCausalLM.from_pretrained(warm_model(Path(cache), seed=0), dtype=torch.float32)
    if folder is not None and step > 0:
        model.load_state_dict(torch.load(folder / "weights" / f"step{step}.pt"))
    return model


def probe(args: argparse.Namespace) -> None:
    """The probe of every weight snapshot of a run, as a table."""
    folder = Path(args.folder)
    tokenizer = AutoTokenizer.from_pretrained(warm_model(Path(args.cache), seed=0))
    steps = sorted(int(p.stem[4:]) for p in (folder / "weights").glob("step*.pt"))
    rows = [(step, probe_policy(_model(folder, step, args.cache).eval(), tokenizer)) for step in [0, *steps]]
    print("| after step | " + " | ".join(rows[0][1]) + " |\n|---" * (len(rows[0][1]) + 1) + "|")
    for step, values in rows:
        print(f"| {step} | " + " | ".join(f"{v:.4f}" for v in values.values()) + " |")


# --------------------------------------------------------------------------------------------- grads
def _samples(folder: Path, step: int) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, open(folder / "samples.jsonl")) if r["step"] == step]


def _training_sample(r: dict[str, Any], loss_mask: list[int] | None = None) -> TrainingSample:
    tops = [None if t is None else {int(k): v for k, v in t.items()} for t in r["tops"]] or None
    sequence = TrainingSequence(r["ids"], loss_mask or r["mask"], r["logq"], tops)
    return TrainingSample(sequence, r["adv"], r["group"], r["version"])


def _flat_grad(model: Any) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def grads(args: argparse.Namespace) -> None:
    """Per-sample gradient norms of a step's loss, at the weights the trainer had then (the step before)."""
    folder = Path(args.folder)
    model = enable_tree_attention(_model(folder, args.step - 1, args.cache))
    tokenizer = AutoTokenizer.from_pretrained(warm_model(Path(args.cache), seed=0))
    rows, per_sample = _samples(folder, args.step), []
    for r in rows:
        model.zero_grad()
        loss, _ = packed_grpo_loss(model, build_row([_training_sample(r)]), 1.0, LossConfig(), 1)
        loss.backward()
        per_sample.append((_flat_grad(model).clone(), r))
    total = torch.stack([g for g, _ in per_sample]).sum(0)
    norms = sorted(((float(g.norm()), float(g @ total) / (float(g.norm()) * float(total.norm()) + 1e-12), r)
                    for g, r in per_sample), key=lambda x: -x[0])
    print(f"step {args.step}: {len(rows)} samples; median sample gradient norm "
          f"{norms[len(norms) // 2][0]:.1f}, norm of their sum {float(total.norm()):.1f}")
    for norm, cosine, r in norms[:args.top]:
        print(f"  |g| {norm:7.1f}  cos(step) {cosine:+.2f}  A {r['adv']:+.2f}  final turn "
              f"{r['text'].split(FINAL_TURN)[-1][:70]!r}")
    for _, _, r in norms[:args.tokens]:
        print(f"per token (A {r['adv']:+.2f}): " + "  ".join(
            f"{t!r} p={p:.2g} |g|={g:.0f}" for t, p, g in _token_gradients(model, tokenizer, r)))


def _token_gradients(model: Any, tokenizer: Any, r: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(token, trainer probability, gradient norm of -A log p) of each trained token of one sample."""
    out = []
    logits = model(torch.tensor([r["ids"]])).logits[0].float().log_softmax(-1)
    for i, trained in enumerate(r["mask"]):
        if trained:
            logp = logits[i - 1, r["ids"][i]]
            grad = torch.autograd.grad(-r["adv"] * logp, list(model.parameters()), retain_graph=True)
            out.append((tokenizer.decode([r["ids"][i]]), float(logp.detach().exp()),
                        float(torch.cat([g.flatten() for g in grad]).norm())))
    return out


# --------------------------------------------------------------------------------------------- replay
def _variant_mask(r: dict[str, Any], variant: str) -> list[int]:
    """The loss mask a replay variant trains ``r`` with."""
    mask = list(r["mask"])
    final = len(mask)
    while final > 0 and mask[final - 1]:
        final -= 1  # the final turn: the trained tokens after the last context token
    cut = mask[:final] + [0] * (len(mask) - final) if 1 in mask[:final] else mask
    clean = r["text"].split(FINAL_TURN)[-1].startswith("The counter is now")
    if variant == "final":  # no final turn trained
        return cut
    if variant == "final-neg":  # no final turn trained where the advantage is negative
        return cut if r["adv"] < 0 else mask
    if variant == "final-unclean":  # no final turn trained unless it is the clean answer
        return mask if clean else cut
    if variant.startswith("tail:"):
        [sequence], _ = train_until_tail([_training_sample(r).sequence], float(variant[5:]))
        return list(sequence.loss_mask)
    if variant == "positive":  # negative advantages not trained
        return mask if r["adv"] > 0 else [0] * len(mask)
    return mask


def _credit_turns(samples: list[TrainingSample]) -> None:
    """Give the samples the turn baseline's per-token advantages, group by group."""
    groups: dict[int, list[TrainingSample]] = collections.defaultdict(list)
    for sample in samples:
        groups[sample.group_id].append(sample)
    for members in groups.values():
        per_token, _, _ = turn_advantages([[s.sequence] for s in members], [s.advantage for s in members],
                                          [True] * len(members))
        for sample, [values] in zip(members, per_token, strict=True):
            sample.token_advantages = values


def replay(args: argparse.Namespace) -> None:
    """The run's first steps again on its recorded samples and micro-batches, one thing changed."""
    folder = Path(args.folder)
    tokenizer = AutoTokenizer.from_pretrained(warm_model(Path(args.cache), seed=0))
    model = enable_tree_attention(_model(None, 0, args.cache))
    history = json.loads((folder / "log_history.json").read_text())
    total_steps = max(e.get("step", 0) for e in history)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    sizes: dict[int, list[int]] = collections.defaultdict(list)
    for b in map(json.loads, open(folder / "microbatches.jsonl")):
        sizes[b["step"]].append(b["n"])
    start_values = probe_policy(model.eval(), tokenizer)
    print("| after step | gradient norm | " + " | ".join(start_values) + " |")
    print("|---|---" + "|---" * len(start_values) + "|")
    print("| 0 | | " + " | ".join(f"{v:.4f}" for v in start_values.values()) + " |")
    for step in range(1, args.steps + 1):
        samples = [_training_sample(r, _variant_mask(r, args.variant)) for r in _samples(folder, step)]
        if args.variant == "turn-baseline":
            _credit_turns(samples)
        model.train()
        optimizer.zero_grad()
        start = 0
        for n in sizes[step]:
            row = build_row([s for s in samples[start:start + n] if s.sequence.num_trained])
            start += n
            if row.num_trained:
                loss, _ = packed_grpo_loss(model, row, 1.0, LossConfig(), row.num_trained)
                (loss / len(sizes[step])).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        schedule.step()
        values = probe_policy(model.eval(), tokenizer)
        print(f"| {step} | {norm:.3f} | " + " | ".join(f"{v:.4f}" for v in values.values()) + " |", flush=True)


def main() -> None:
    """Parse the command line and run one command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=".cache")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("run")
    p.add_argument("folder")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--episodes-per-target", type=int, default=24)
    p.add_argument("--set", nargs="*", default=[], help="config fields as name=JSON value")
    p.add_argument("--vllm-url")
    p.add_argument("--env-url")
    p = commands.add_parser("probe")
    p.add_argument("folder")
    p = commands.add_parser("grads")
    p.add_argument("folder")
    p.add_argument("step", type=int)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--tokens", type=int, default=0, help="per-token gradients of this many top samples")
    p = commands.add_parser("replay")
    p.add_argument("folder")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--variant", default="none",
                   help="none, final, final-neg, final-unclean, positive, turn-baseline or tail:<tail_token_prob>")
    args = parser.parse_args()
    {"run": run, "probe": probe, "grads": grads, "replay": replay}[args.command](args)


if __name__ == "__main__":
    main()
