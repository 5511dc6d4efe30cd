"""``toolgym tiny-model --family NAME``: another family's tiny model, with its template, markers and stop tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from toolgym.cli.tiny_model import main
from trainer.families import GLM4, family_for
from trainer.rollout.chat_template import check_prefix_preserving, stop_token_ids


def test_the_tiny_model_of_a_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "glm"), "--family", "glm4", "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "glm")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "glm")
    assert family_for(tokenizer) is GLM4
    for marker in (*GLM4.tokens, *GLM4.special_tokens):  # each marker is one token
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    stops = stop_token_ids(tokenizer, GLM4)
    assert json.loads((tmp_path / "glm" / "generation_config.json").read_text())["eos_token_id"] == stops
    assert tokenizer.eos_token == "<|user|>" and tokenizer.pad_token == "<|endoftext|>"
    assert check_prefix_preserving(tokenizer, [{"type": "function", "function": {
        "name": "increment", "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}}}}])


def test_an_unknown_family_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--family", "qwen35"])
    assert "invalid choice: 'qwen35'" in capsys.readouterr().err
