"""What shared/models.py reads of a checkpoint folder: its sentence-transformers pooling (as vLLM reads it), and the
default output budget of its generation_config.json."""

from __future__ import annotations

import json

import pytest

from shared import demo_training
from shared.demo_model import make_model
from shared.models import default_max_tokens, sentence_transformers_pooling


def folder(tmp_path, pooling: dict | None, normalize: bool = True):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return str(tmp_path)


@pytest.mark.parametrize(("pooling", "normalize", "expected"), [
    ({"pooling_mode_lasttoken": True}, True, {"embedding_pooling": "last", "embedding_normalize": True}),
    ({"pooling_mode_mean_tokens": True}, False, {"embedding_pooling": "mean", "embedding_normalize": False}),
    ({"pooling_mode_cls_token": True}, True, {}),  # not a pooling the engine runs: the setting's default
    (None, True, {})])
def test_sentence_transformers_pooling(tmp_path, pooling, normalize, expected):
    assert sentence_transformers_pooling(folder(tmp_path, pooling, normalize)) == expected


def test_a_folder_without_modules_says_nothing(tmp_path):
    assert sentence_transformers_pooling(str(tmp_path)) == {}
    (tmp_path / "modules.json").write_text("not json")
    assert sentence_transformers_pooling(str(tmp_path)) == {}


def test_the_default_output_budget_is_the_setting_else_the_checkpoint_s_max_new_tokens(tmp_path, monkeypatch):
    # The demo checkpoint as make_model writes it, less the seconds of training (its weights don't matter here).
    monkeypatch.setattr(demo_training, "train", lambda model, tokenizer, seed: None)
    demo = str(make_model(tmp_path / "demo"))
    assert default_max_tokens(demo, None) == 256  # the demo checkpoint's generation_config.json
    assert default_max_tokens(demo, 40) == 40  # --default-max-tokens overrides it
    assert default_max_tokens(demo, 0) is None  # 0: up to the context
    assert default_max_tokens(str(tmp_path), None) is None  # no generation_config.json
    for config in ({"max_length": 20}, {"max_new_tokens": 0}, "not json"):
        (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        assert default_max_tokens(str(tmp_path), None) is None  # max_length counts the prompt too: not a budget
