"""The one registry helper models, attention backends and proposers are looked up by."""

from __future__ import annotations

import json

import pytest

from outrider.registry import Registry


def test_entries_import_on_first_use_and_objects_come_back_as_given():
    reg = Registry("codec", {"json": "json:dumps"})
    assert reg.get("json") is json.dumps
    marker = object()
    reg.register("mine", marker)
    assert reg.get("mine") is marker
    assert reg.names() == ("json", "mine") and "mine" in reg and "other" not in reg
    assert reg.entry("json") == "json:dumps"


def test_unknown_taken_and_malformed_names_are_refused_naming_them():
    reg = Registry("codec", {"json": "json:dumps"})
    with pytest.raises(ValueError, match=r"unknown codec 'yaml': use one of json"):
        reg.get("yaml")
    with pytest.raises(ValueError, match=r"already registered as 'json'"):
        reg.register("json", "json:loads")
    with pytest.raises(ValueError, match=r"'json.dumps' is not 'module:attribute'"):
        reg.register("bad", "json.dumps")
    with pytest.raises(ValueError, match=r"one of outrider's own codecs \(json\)"):
        reg.unregister("json")
    with pytest.raises(ValueError, match=r"no codec is registered as 'gone'"):
        reg.unregister("gone")
    reg.register("tmp", "json:loads")
    reg.unregister("tmp")
    assert reg.names() == ("json",)


def test_the_house_looks_up_models_backends_and_proposers_through_it():
    from outrider.engine.proposers import proposer_names
    from outrider.layers.attn_backends.base import get_backend
    from outrider.models.registry import model_class

    assert model_class("Qwen3ForCausalLM").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture 'Nope'"):
        model_class("Nope")
    assert get_backend("torch_ref").name == "torch_ref"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash")
    assert proposer_names()[:2] == ("ngram", "eagle3")
