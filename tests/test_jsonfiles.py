"""Files that exitspec reads name themselves, and the line, when they are not JSON."""

import pytest

from exitspec.data import prompts_file
from exitspec.drafters.dflash_model import DFlashConfig
from exitspec.jsonfiles import read_json, read_jsonl


def test_a_broken_jsonl_line_is_named(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"prompt": "there"\n')
    with pytest.raises(ValueError, match=rf"^{path}, line 3: not valid JSON \("):
        prompts_file(path)
    path.write_text('{"prompt": "hi"}\n\n{"prompt": "there"}\n')
    assert [s.turns for s in prompts_file(path)] == [("hi",), ("there",)]
    assert read_jsonl(path) == [{"prompt": "hi"}, {"prompt": "there"}]


def test_a_drafter_folder_whose_config_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8,\n  oops}')
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: not valid JSON \(.* at line 2, column 3\)$"):
        DFlashConfig.load(tmp_path)
    (tmp_path / "x.json").write_text("[1, 2]")
    assert read_json(tmp_path / "x.json") == [1, 2]
