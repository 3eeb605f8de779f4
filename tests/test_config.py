"""Every setting is checked against its row of ``config.SETTINGS`` (kind, range, choices),
whichever way it is given: the constructor, an assignment (PAI-Blade's nested
``gpu_config`` too), a ``with`` block's Config, a command-line flag. A bad value is one
``SettingError`` line naming the setting and what it takes; the cases are drawn from the
same table, so a setting without a row fails here."""

from __future__ import annotations

import dataclasses

import pytest

import bladesmith
from bladesmith.config import SETTINGS, Config
from bladesmith.errors import BladesmithError, SettingError

# Per kind: a value of the wrong type, and a value of the right type out of range (None
# where the kind has no range).
WRONG_TYPE = {
    "bool": "False",
    "int": "3",
    "number": "1e-3",
    "choice": 5,
    "names": 5,
    "suffix": 5,
    "callable": 5,
    "data": "images/",
}


def out_of_range(setting):
    if setting.kind == "choice":
        return "nonsense"
    if setting.kind == "names":
        return [""]  # an empty name
    if setting.kind == "suffix":
        return "pt"  # no leading dot
    if setting.kind == "bool":
        return 1  # a truthy number: only True and False are taken
    if setting.kind == "data":
        return []  # no entry
    low = setting.low if setting.low is not None else 0
    below = low - 1 if setting.kind == "int" else (low if setting.above else low - 0.5)
    return below


def test_every_field_has_a_row():
    assert tuple(SETTINGS) == tuple(f.name for f in dataclasses.fields(Config))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_wrong_type_is_one_line_naming_the_setting(name):
    setting = SETTINGS[name]
    bad = WRONG_TYPE[setting.kind]
    with pytest.raises(SettingError) as raised:
        Config(**{name: bad})
    message = str(raised.value)
    assert message.startswith(f"Config.{name}: expected {setting.expected}"), message
    assert "\n" not in message and isinstance(raised.value, BladesmithError)
    config = Config()
    with pytest.raises(SettingError, match=f"Config.{name}: expected"):
        setattr(config, name, bad)
    assert getattr(config, name) == getattr(Config(), name)  # left as it was


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_value_out_of_range_is_refused(name):
    setting = SETTINGS[name]
    bad = out_of_range(setting)
    with pytest.raises(SettingError, match=f"Config.{name}: expected"):
        Config(**{name: bad})


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"rtol": "1e-3"}, "Config.rtol: expected a number >= 0 or None, got '1e-3' (a str)"),
        ({"iou_threshold": "0.5"}, "Config.iou_threshold: expected a number in (0, 1]"),
        ({"exclude": 5}, "Config.exclude: expected a pass name or a list of pass names"),
        ({"min_speedup": None}, "Config.min_speedup: expected a number > 0, got None"),
        ({"allow_degenerate": "no"}, "Config.allow_degenerate: expected True or False"),
        ({"disable_fp16_accuracy_check": "yes"}, "expected True or False, got 'yes'"),
        ({"min_speedup": float("nan")}, "Config.min_speedup: expected a number > 0"),
        ({"iters": 2.5}, "Config.iters: expected an integer >= 1 or None, got 2.5"),
        ({"warmup": True}, "Config.warmup: expected an integer >= 0 or None, got True"),
    ],
)
def test_the_issues_cases(settings, named):
    with pytest.raises(SettingError) as raised:
        Config(**settings)
    assert named in str(raised.value)


def test_a_name_that_is_no_setting_is_one_line():
    with pytest.raises(SettingError, match="Config has no setting 'rtl'; settings are rtol, "):
        Config(rtl=1e-3)


def test_pai_blades_nested_setting_is_typed():
    config = Config()
    with pytest.raises(SettingError) as raised:
        config.gpu_config.disable_fp16_accuracy_check = "False"
    assert str(raised.value).startswith(
        "Config.gpu_config.disable_fp16_accuracy_check: expected True or False, got 'False'"
    )
    assert config.disable_fp16_accuracy_check is False  # the check stays on
    config.gpu_config.disable_fp16_accuracy_check = True
    assert config.disable_fp16_accuracy_check is True


def test_good_values_are_kept_as_the_setting_holds_them():
    config = Config(rtol=1, iou_threshold=1, exclude="fp16", save_as=".pt", warmup=0)
    assert config.rtol == 1.0 and isinstance(config.rtol, float)
    assert config.exclude == ("fp16",) and config.save_as == ".pt" and config.warmup == 0


def test_optimize_refuses_what_is_not_a_config():
    import torch

    with pytest.raises(SettingError, match="config: expected a bladesmith.Config"):
        bladesmith.optimize(
            torch.nn.Linear(2, 2), device="cpu", test_data=[torch.ones(1, 2)], config={"rtol": 1}
        )


def test_a_with_block_holds_only_checked_settings():
    with Config(iters=3) as config:
        with pytest.raises(SettingError, match="Config.iters"):
            config.iters = 0
        assert Config.current().iters == 3


def test_the_docs_list_the_settings_as_the_table_says():
    from pathlib import Path

    from bladesmith.config import settings_table

    docs = Path(__file__).resolve().parents[1] / "docs" / "optimize.md"
    assert settings_table() in docs.read_text(), "docs/optimize.md: paste settings_table()"
