"""Several servers in ``vllm_server_base_url``: the URLs parsed (:func:`trainer.config.server_urls`) and
each server read once and checked to agree (:func:`trainer.vllm.servers.read_servers_info`), against
HTTP servers on loopback that answer vLLM's routes."""

from __future__ import annotations

import copy

import pytest

from tests.trainer.vllm.test_server_info import MODELS, fake_vllm
from trainer.config import AsyncGRPOConfig, server_urls
from trainer.exceptions import ConfigError
from trainer.launch.vllm_server import free_port
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.servers import read_servers_info


@pytest.mark.parametrize(("value", "urls"), [
    ("http://a:8000", ("http://a:8000",)),
    ("http://a:8000/, http://b:8000", ("http://a:8000", "http://b:8000")),
    (["http://a:8000", "http://b:8000/"], ("http://a:8000", "http://b:8000")),
])
def test_one_url_commas_or_a_list_name_the_servers(value: str | list[str], urls: tuple[str, ...]) -> None:
    assert server_urls(value) == urls


@pytest.mark.parametrize(("value", "match"), [
    ("http://a:8000,,http://b:8000", "empty entry"),
    ([], "empty entry"),
    ("http://a:8000,http://a:8000/", "more than once"),
])
def test_an_empty_entry_or_a_server_named_twice_is_refused(value: str | list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        server_urls(value)


def test_the_config_takes_a_list_or_commas_and_checks_them(tmp_path) -> None:
    one = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                          vllm_server_base_url=["http://a:8000"])  # type: ignore[arg-type]  # YAML's list
    assert one.vllm_server_base_url == "http://a:8000"
    assert one.vllm_server_base_urls == ("http://a:8000",)
    two = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                          vllm_server_base_url="http://a:8000, http://b:8000/")
    assert two.vllm_server_base_urls == ("http://a:8000", "http://b:8000")
    with pytest.raises(ConfigError, match="more than once"):
        AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                        vllm_server_base_url=["http://a:8000", "http://a:8000/"])  # type: ignore[arg-type]


def test_servers_that_agree_are_each_read_once() -> None:
    ports = [free_port(), free_port()]
    with fake_vllm(ports[0], {"/v1/models": MODELS}) as hits_a, fake_vllm(ports[1], {"/v1/models": MODELS}) as hits_b:
        infos = read_servers_info([VLLMAdminClient(f"http://127.0.0.1:{p}", timeout_s=10) for p in ports])
    assert [(i.model, i.max_model_len) for i in infos] == [("org/base", 2048)] * 2
    assert hits_a["/v1/models"] == hits_b["/v1/models"] == 1


@pytest.mark.parametrize(("field", "value", "match"), [
    ("id", "org/other", r"disagree on model .*'org/base'.*'org/other'"),
    ("max_model_len", 4096, r"disagree on max_model_len .*2048.*4096"),
])
def test_servers_that_disagree_are_refused_naming_each_value(field: str, value: object, match: str) -> None:
    other = copy.deepcopy(MODELS)
    other["data"][1][field] = value
    if field == "id":
        other["data"][0]["parent"] = value
    ports = [free_port(), free_port()]
    with fake_vllm(ports[0], {"/v1/models": MODELS}), fake_vllm(ports[1], {"/v1/models": other}):
        with pytest.raises(ConfigError, match=match):
            read_servers_info([VLLMAdminClient(f"http://127.0.0.1:{p}", timeout_s=10) for p in ports])
