"""FIELD=VALUE settings over a deployment: the API (apply_settings, the presets' loaders) and
the CLI's --set and NAME@FIELD=VALUE."""

from __future__ import annotations

import json

import msgspec
import pytest

from xds.cli.main import main
from xds.config import apply_settings, parse_setting
from xds.errors import ConfigError
from xds.serve.decode_model import DecodeConfig
from xds.serve.presets import decode_config, ma_config, pd_config
from xds.serve.probe import ProbeConfig


def test_values_read_as_toml_or_as_a_bare_word():
    assert parse_setting("prefill.tes=5") == ("prefill.tes", 5)
    assert parse_setting(" sla.ttft_ms = 1.5e3 ") == ("sla.ttft_ms", 1500.0)
    assert parse_setting("decode.jitter.enabled=true") == ("decode.jitter.enabled", True)
    assert parse_setting("decode.model=kimi-k2") == ("decode.model", "kimi-k2")
    assert parse_setting('decode.model="glm-4.5"') == ("decode.model", "glm-4.5")
    assert parse_setting("x.attention_int8_layers=[3, 4]") == ("x.attention_int8_layers", [3, 4])
    assert parse_setting("probe={ period_ns = 5 }") == ("probe", {"period_ns": 5})
    for bad in ("prefill.tes", "=5", "a b=1", "a..b=1", "1x=2"):
        with pytest.raises(ConfigError, match="FIELD=VALUE") as exc:
            parse_setting(bad)
        assert exc.value.source == f"setting {bad!r}"
    with pytest.raises(ConfigError, match="quote a string"):
        parse_setting("decode.model=two words")


def test_settings_change_only_what_they_write_and_are_checked_as_a_file_is():
    base = pd_config("production-4p1d")
    cfg = apply_settings(
        base, ["decode.model=qwen3-235b", "decode.shared_expert_dies=0", "prefill.tes=5"]
    )
    assert (cfg.decode.model, cfg.decode.shared_expert_dies, cfg.prefill.tes) == (
        "qwen3-235b",
        0,
        5,
    )
    assert cfg.decode.dies == base.decode.dies
    assert cfg.prefill.dies_per_te == base.prefill.dies_per_te
    assert apply_settings(base, []) is base
    assert apply_settings(base, ["prefill.tes=2", "prefill.tes=3"]).prefill.tes == 3  # last wins
    # a table that is off turns on with its defaults for the rest
    probed = apply_settings(base, ["probe.period_ns=500_000_000"])
    assert probed.probe == ProbeConfig(period_ns=500_000_000)

    with pytest.raises(ConfigError, match="did you mean 'tes'") as exc:
        apply_settings(base, ["prefill.tess=5"])
    assert (exc.value.source, exc.value.field) == ("setting 'prefill.tess=5'", "prefill.tess")
    with pytest.raises(ConfigError, match=">= 1") as exc:
        apply_settings(base, ["prefill.tes=2", "prefill.tes=0"])
    assert exc.value.source == "setting 'prefill.tes=0'"
    with pytest.raises(ConfigError, match="Expected `int`, got `str`"):
        apply_settings(base, ['prefill.tes="5"'])
    # a path through a value, or through an unknown table, blames that setting
    with pytest.raises(ConfigError, match=r"runs through prefill\.tes") as exc:
        apply_settings(base, ["prefill.tes.x=1"])
    assert exc.value.source == "setting 'prefill.tes.x=1'"
    assert str(exc.value).endswith("runs through prefill.tes, which is not a table)")
    # a setting inside a table that fails a check of the whole table: no table hint
    small = DecodeConfig(dies=32, shared_expert_dies=4, batch_per_die=8)
    with pytest.raises(ConfigError, match=r"use at least 260 dies, or no \[eplb\]") as exc:
        apply_settings(small, ["eplb.policy=xds-greedy"])
    assert str(exc.value).endswith("(the setting writes inside eplb)")
    with pytest.raises(ConfigError, match="unknown field") as exc:
        apply_settings(base, ["prefill.nope.x=1"])
    assert exc.value.source == "setting 'prefill.nope.x=1'"
    with pytest.raises(ConfigError, match="one line"):
        apply_settings(base, ["prefill.tes=5\nx=1"])
    # everything but what the settings write stays as it was
    flat_before, flat_after = _flat(msgspec.to_builtins(base)), _flat(msgspec.to_builtins(cfg))
    changed = {k for k in flat_before if flat_before[k] != flat_after[k]}
    assert changed == {"decode.model", "decode.shared_expert_dies", "prefill.tes"}
    # a check failing on a field no setting wrote says so
    with pytest.raises(ConfigError, match="no setting writes this field") as exc:
        apply_settings(base, ["decode.model=qwen3-235b"])
    assert exc.value.field == "decode.shared_expert_dies" and exc.value.source is None


def _flat(data, prefix=""):
    if isinstance(data, dict):
        return {k: v for key, x in data.items() for k, v in _flat(x, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def test_every_loader_takes_settings_and_its_own_at_settings(tmp_path):
    assert pd_config("production-4p1d@prefill.tes=5").prefill.tes == 5
    assert pd_config("production-4p1d", ["prefill.tes=5"]).prefill.tes == 5
    # the spec's own settings come after the shared ones
    assert pd_config("production-4p1d@prefill.tes=3", ["prefill.tes=5"]).prefill.tes == 3
    assert decode_config("peak-decode@batch_per_die=8").batch_per_die == 8
    assert ma_config("ma-peak-decode", ["batch_per_die=48"]).batch_per_die == 48
    # a file's own value failing with a setting: the file and its line, and the note
    small = tmp_path / "small.toml"
    small.write_text("dies = 32\nbatch_per_die = 8\nshared_expert_dies = 4\n")
    for load in (decode_config, ma_config):
        if load is ma_config:
            small.write_text(
                "domains = 3\nattention_dies_per_domain = 8\nexpert_dies = 32\n"
                "shared_expert_dies = 0\nbatch_per_die = 8\n"
            )
        with pytest.raises(ConfigError, match="no setting writes this field") as exc:
            load(str(small), ["input_tokens=160000"])
        assert exc.value.source == str(small) and exc.value.field == "batch_per_die"
        assert str(exc.value).endswith(
            "set it too) (line 2)" if load is decode_config else "(line 5)"
        )
    with pytest.raises(ConfigError, match="KV blocks") as exc:  # the loader's checks run
        decode_config("peak-decode", ["batch_per_die=800"])
    assert exc.value.source == "setting 'batch_per_die=800'"
    # settings never go through a file name: long ones, and values holding an @
    long = "decode.model=" + "x" * 300
    with pytest.raises(ConfigError, match="unknown model") as exc:
        pd_config("production-4p1d", [long])
    assert exc.value.source == f"setting {long!r}"
    with pytest.raises(ConfigError, match="unknown model 'a@b'"):
        pd_config("production-4p1d", ['decode.model="a@b"'])
    with pytest.raises(ConfigError, match="unknown model"):
        pd_config("production-4p1d@" + "@".join(["prefill.tes=4"] * 40) + "@decode.model=x")
    dep = tmp_path / "mine@v2.toml"  # an existing file is taken whole, @ and all
    dep.write_text("[prefill]\ntes = 2\n")
    assert pd_config(str(dep)).prefill.tes == 2
    assert pd_config(f"{dep}@prefill.tes=3").prefill.tes == 3
    plain = tmp_path / "plain.toml"
    plain.write_text("[prefill]\ntes = 2\n")
    assert pd_config(f"{plain}@prefill.tes=3").prefill.tes == 3
    with pytest.raises(ConfigError, match="did you mean 'production-4p1d'"):
        pd_config("production-4p1@prefill.tes=5")


def test_cli_set_and_at_settings(capsys):
    argv = ["replay", "--synthetic", "12", "--rate", "2", "--json"]
    assert main([*argv, "--set", "decode.model=kimi-k2", "--set", "prefill.tes=2"]) == 0
    kimi = json.loads(capsys.readouterr().out)
    assert main([*argv, "--deployment", "production-4p1d@decode.model=kimi-k2@prefill.tes=2"]) == 0
    assert json.loads(capsys.readouterr().out) == kimi
    assert kimi["deployment"] == "production-4p1d@decode.model=kimi-k2@prefill.tes=2"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) != kimi
    assert main([*argv, "--set", "prefill.tess=2"]) == 2
    assert "setting 'prefill.tess=2': prefill.tess: unknown field (did you mean 'tes'?)" in (
        capsys.readouterr().err
    )
    assert main(["decode", "--iterations", "2", "--json", "--set", "batch_per_die=4"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    assert main(["decode", "--iterations", "2", "--set", "batch_per_die=4"]) == 0
    assert "peak-decode@batch_per_die=4" in capsys.readouterr().out.replace("\n", "")
    assert main(["replay", "--synthetic", "12", "--set", 'decode.model="a@b"']) == 2
    assert "setting 'decode.model=\"a@b\"': decode.model: unknown model 'a@b'" in (
        capsys.readouterr().err
    )
    compare = ["compare", "--synthetic", "12", "--rate", "2", "--seeds", "2", "--json"]
    assert main([*compare, "--deployment", "production-4p1d", "--deployment",
                 "production-4p1d@prefill.tes=2"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert [v["name"] for v in out["variants"]] == [
        "production-4p1d",
        "production-4p1d@prefill.tes=2",
    ]
    # --set applies to every deployment, before each one's own settings; names say both
    assert main([*compare, "--set", "prefill.tes=3", "--deployment", "production-4p1d",
                 "--deployment", "production-4p1d@prefill.tes=2"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert [v["name"] for v in out["variants"]] == [
        "production-4p1d@prefill.tes=3",
        "production-4p1d@prefill.tes=3@prefill.tes=2",
    ]
    assert [v["chips"] for v in out["variants"]] == [64 + 48, 64 + 32]


def test_a_missing_file_whose_name_holds_an_at_is_named_whole(tmp_path):
    missing = tmp_path / "v@2.toml"
    with pytest.raises(ConfigError, match="file not found") as exc:
        pd_config(f"{missing}@prefill.tes=3")
    assert exc.value.source == str(missing)
    with pytest.raises(ConfigError, match="FIELD=VALUE"):  # a trailing @: an empty setting
        pd_config("production-4p1d@prefill.tes=3@")


def test_settings_must_be_a_list_of_strings_not_one_string():
    for load, name in ((pd_config, "production-4p1d"), (decode_config, "peak-decode")):
        with pytest.raises(ConfigError, match=r"the one string 'x=1' \(write \['x=1'\]\)") as err:
            load(name, "x=1")
        assert err.value.field == "settings"
    with pytest.raises(ConfigError, match="got int") as err:
        ma_config("ma-peak-decode", [5])
    assert err.value.field == "settings[0]"
    with pytest.raises(ConfigError, match="got NoneType"):
        apply_settings(pd_config("production-4p1d"), None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"a config \(a msgspec Struct\), got int") as err:
        apply_settings(5, ["a=1"])
    assert err.value.field == "config"
    assert pd_config("production-4p1d", ("prefill.tes=5",)).prefill.tes == 5  # a tuple is fine
