"""presets.config_for / build_model: a bad model config is one short ScheduleError naming
the file, from the API as from the command line (not transformers' list of every class)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slapo_fn as sf
from slapo_fn.presets import build_model, config_for

CASES = {
    "not JSON": ('{"model_type": "llama", ', r"config.json': not valid JSON: .* at line 1, column 25"),
    "no model_type": ('{"hidden_size": 64}', r'config.json\': has no "model_type"'),
    "unknown model_type": ('{"model_type": "lama"}', r"unknown model_type 'lama'; close matches: 'llama'"),
    "bad values": ('{"model_type": "llama", "rope_parameters": 3}', r"transformers cannot make a 'llama' config"),
    "not a language model": ('{"model_type": "vit", "hidden_size": 64}', r"model_type 'vit' has no language model"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_config_is_one_short_error_naming_the_file(case: str, tmp_path: Path) -> None:
    text, message = CASES[case]
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(sf.ScheduleError, match=message) as e:
        build_model(str(tmp_path), meta=True)
    assert str(tmp_path / "config.json") in str(e.value) and len(str(e.value).splitlines()) == 2
    assert len(str(e.value)) < 400


def test_an_unknown_name_suggests_presets() -> None:
    with pytest.raises(sf.ScheduleError, match=r"'llama-7c': unknown model: .*close matches: 'llama-7b'"):
        config_for("llama-7c")


def test_a_good_folder_and_a_preset_still_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "num_attention_heads": 4, "num_hidden_layers": 1}))
    assert config_for(str(tmp_path)).hidden_size == 64 and config_for(str(tmp_path)).use_cache is False
    assert type(build_model("llama-tiny", meta=True)).__name__ == "LlamaForCausalLM"
