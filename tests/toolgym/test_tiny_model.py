"""The tiny model kit: deterministic, offline, loadable by the Auto classes, shaped for vLLM's CPU attention."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toolgym.cli.tiny_model import main
from toolgym.kit.tiny_model import VOCAB_SIZE, build_tiny_model
from trainer.families import QWEN3

EOS_TOKEN, PAD_TOKEN = QWEN3.stop_tokens[0], QWEN3.special_tokens[0]
TOOL_CALL_START, TOOL_CALL_END = QWEN3.tokens[:2]


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_same_seed_gives_identical_files_and_another_seed_only_other_weights(
    tiny_dir: Path, tmp_path: Path
) -> None:
    again = _digests(build_tiny_model(tmp_path / "again", seed=0))
    assert again == _digests(tiny_dir)
    other = _digests(build_tiny_model(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in again.items() if k != "model.safetensors"
    }


def test_loads_with_auto_classes_and_has_the_tiny_qwen3_shape(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    config = AutoConfig.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert config.model_type == "qwen3"
    assert config.head_dim == 32 and config.hidden_size == config.num_attention_heads * config.head_dim
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert model.dtype == torch.float32
    ids = tokenizer("Increment the counter to 5.", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], VOCAB_SIZE)


def test_special_tokens_and_generation_config(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert model.generation_config.eos_token_id == eos == model.config.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    for token in ("<|im_start|>", EOS_TOKEN, PAD_TOKEN, TOOL_CALL_START, TOOL_CALL_END, "<tool_response>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    # Tool-call markers survive skip_special_tokens (vLLM's default detokenization); chat markers do not.
    ids = tokenizer(f"{TOOL_CALL_START}x{TOOL_CALL_END}{EOS_TOKEN}", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"{TOOL_CALL_START}x{TOOL_CALL_END}"


def test_tokenizer_splits_digits_and_round_trips_any_text(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]
    text = "Grüße, 世界! {\"step\": 3}\n\tdone"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_is_stored_in_the_tokenizer_config(tiny_dir: Path) -> None:
    assert "chat_template" in (tiny_dir / "tokenizer_config.json").read_text()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    conversation = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_main_builds_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_vl", "qwen3_next"])
def test_hybrid_architectures_build_offline_and_load(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    assert main([str(tmp_path / arch), "--arch", arch]) == 0
    config = AutoConfig.from_pretrained(tmp_path / arch)
    auto = AutoModelForImageTextToText if arch == "qwen3_5_vl" else AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path / arch)
    text = config.get_text_config()
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert text.linear_key_head_dim == text.linear_value_head_dim == 128  # vLLM's CPU GDN kernel takes only 128
    assert text.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path / arch)) == VOCAB_SIZE
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters()) == (arch == "qwen3_5_vl")
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model(input_ids=ids).logits.shape == (1, 4, VOCAB_SIZE)


def test_help_says_what_it_builds_and_how_long_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("Qwen3-shaped model of about 1M parameters", "chat template", "--warm_start counter",
                  "counter transcripts", "exactly as `make demo` builds it", "the demo's model",
                  ".cache/warm-counter-v2-seed0", "a few seconds", "about two minutes"):
        assert words in text, words


def test_the_cli_and_the_demo_build_the_counter_model_with_one_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import inspect

    from toolgym.kit import counter_experiment

    builder = counter_experiment.build_warm_counter_model
    calls: list[dict[str, object]] = []

    def record(*args: object, **kwargs: object) -> Path:
        bound = inspect.signature(builder).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return Path(str(bound.arguments["model_dir"]))
    monkeypatch.setattr(counter_experiment, "build_warm_counter_model", record)

    assert main([str(tmp_path / "cli"), "--warm_start", "counter"]) == 0  # toolgym tiny-model DIR --warm_start counter
    demo_dir = counter_experiment.warm_model(tmp_path / "cache", seed=0)  # what make demo (toolgym demo) calls

    assert demo_dir.name == "warm-counter-v2-seed0"
    cli, demo = calls
    assert Path(str(cli.pop("model_dir"))) == tmp_path / "cli" and Path(str(demo.pop("model_dir"))) == demo_dir
    assert cli == demo == {"seed": 0, "steps": counter_experiment.WARM_START_STEPS, "family": "qwen3", "arch": "qwen3"}
