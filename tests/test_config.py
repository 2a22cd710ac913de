"""Configs from TOML/JSON files, presets, and the `xds decode` command."""

from __future__ import annotations

import json

import msgspec
import pytest

from xds.cli.main import main
from xds.config import load_config
from xds.errors import ConfigError
from xds.hw import ASCEND_910C_DIE
from xds.model.costs import KernelEfficiency
from xds.serve.decode import DecodeConfig
from xds.serve.jitter import JitterConfig
from xds.serve.prefill import PrefillConfig
from xds.serve.presets import PRESETS, decode_config
from xds.serve.replay import PDConfig


def test_toml_and_json_configs(tmp_path):
    t = tmp_path / "d.toml"
    t.write_text(
        "dies = 32\nbatch_per_die = 8\nshared_expert_dies = 0\n[mtp]\nk = 2\n"
        "acceptance = [0.9, 0.4]\n"
    )
    cfg = decode_config(str(t))
    assert cfg.dies == 32 and cfg.mtp_config.k == 2
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"dies": 32, "shared_expert_dies": 0}))
    assert load_config(j, DecodeConfig).dies == 32
    assert decode_config("peak-decode") is PRESETS["peak-decode"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dies = -3\n", "dies: must be >= 1"),
        ("diez = 3\n", "diez: unknown field"),
        ("dies = 32\nshared_expert_dies = 0\n[mtp]\nk = 'two'\n", "mtp.k: Expected `int`"),
        ("dies = 32\nshared_expert_dies = 40\n", "shared_expert_dies: must be >= 0 and below"),
        ("dies = [\n", "cannot parse"),
    ],
)
def test_bad_configs_name_the_file_and_field(tmp_path, text, message):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        decode_config(str(p))
    assert str(p) in str(info.value) and message in str(info.value)


def test_decode_command(tmp_path, capsys):
    p = tmp_path / "small.toml"
    p.write_text("dies = 32\nbatch_per_die = 4\noutput_tokens = 32\nshared_expert_dies = 0\n")
    assert main(["decode", "--deployment", str(p)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per chip" in out and "per-kernel" in out
    assert main(["decode", "--deployment", "nowhere"]) == 2
    assert "unknown deployment" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: PrefillConfig(tes=0), "tes"),
        (lambda: PrefillConfig(max_tokens_per_dp=2.5), "max_tokens_per_dp"),
        (lambda: DecodeConfig(batch_per_die="60"), "batch_per_die"),
        (lambda: KernelEfficiency(attention_compute=1.5), "attention_compute"),
        (lambda: JitterConfig(preempt_probability=-0.1), "preempt_probability"),
        (lambda: msgspec.structs.replace(ASCEND_910C_DIE, hbm_bandwidth=-1.0), "hbm_bandwidth"),
    ],
)
def test_configs_built_in_python_are_checked_like_loaded_ones(build, field):
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.field == field


def test_checked_configs_keep_their_own_rules_and_build_normally():
    with pytest.raises(ConfigError, match="multiple of attention_tp") as err:
        PrefillConfig(dies_per_te=30)
    assert err.value.field == "prefill.dies_per_te"
    cfg = PDConfig(prefill=PrefillConfig(tes=2, long_pool_tes=0))
    assert cfg.prefill.tes == 2
    assert msgspec.structs.replace(cfg.decode, batch_per_die=8).batch_per_die == 8


def test_nested_dicts_and_numpy_scalars_in_python_built_configs():
    import numpy as np

    with pytest.raises(ConfigError, match="expected a PrefillConfig, got a dict") as err:
        PDConfig(prefill={"tes": 2, "long_pool_tes": 0})
    assert err.value.field == "prefill"
    with pytest.raises(ConfigError) as err:  # the other fields are still checked
        PDConfig(prefill=PrefillConfig(tes=2, long_pool_tes=0), decode_tes=0)
    assert err.value.field == "decode_tes"
    # a sweep over numpy ranges builds configs from numpy scalars
    assert DecodeConfig(batch_per_die=np.int64(8)).batch_per_die == 8
    assert KernelEfficiency(attention_compute=np.float64(0.5)).attention_compute == 0.5


def test_a_deployment_file_changes_only_what_it_writes(tmp_path):
    from xds.serve.presets import decode_config, pd_config
    from xds.serve.replay import PDConfig

    f = tmp_path / "d.toml"
    f.write_text('[decode]\npull_order = "staggered"\n[decode.mtp]\nacceptance = [0.8]\n')
    cfg = pd_config(str(f))
    base = PDConfig()
    assert cfg.decode.pull_order == "staggered" and cfg.decode.mtp.acceptance == (0.8,)
    assert cfg.decode.mtp.k == base.decode.mtp_config.k
    assert (
        msgspec.structs.replace(cfg.decode, pull_order="static", mtp=base.decode.mtp) == base.decode
    )  # the 4P1D decode TE (128 dies, batch 32), not the peak-decode defaults
    assert cfg.prefill == base.prefill and cfg.chips == base.chips
    g = tmp_path / "g.toml"
    g.write_text("batch_per_die = 8\n")
    assert decode_config(str(g)).dies == 288  # a decode file starts from the peak deployment


def test_a_byte_order_mark_in_a_config_file_is_fine(tmp_path):
    from xds.serve.presets import pd_config

    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf[decode]\nbatch_per_die = 8\n")
    assert pd_config(str(f)).decode.batch_per_die == 8


def test_help_shows_each_fields_type_default_and_note():
    """help() shows the notes written under config fields (and Annotated descriptions)."""
    import pydoc

    from xds.hw.specs import DieSpec
    from xds.serve.ma_config import MADecodeConfig

    text = pydoc.render_doc(MADecodeConfig, renderer=pydoc.plaintext)
    assert "domain_turns: Literal['exclusive', 'relaxed'] = 'exclusive'" in text
    assert "Relax interval of the expert dies' persistent kernels" in text
    assert "aiv: int = 48" in DieSpec.__doc__ and "CANN vector_core_cnt=48" in DieSpec.__doc__


def test_a_toml_error_names_the_key_path_and_its_line(tmp_path):
    from xds.serve.replay import PDConfig

    f = tmp_path / "d.toml"
    f.write_text("# a deployment\n[prefill]\ntes = 4\ntess = 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(f, PDConfig)
    assert err.value.field == "prefill.tess"
    assert str(err.value) == f"{f}: prefill.tess: unknown field (did you mean 'tes'?) (line 4)"
    f.write_text('[decode]\n\nbatch_per_die = "x"\n')
    with pytest.raises(ConfigError, match=r"decode\.batch_per_die: Expected `int`.*\(line 3\)"):
        load_config(f, PDConfig)
    f.write_text("[prefill]\ntes = 30\n")  # a deployment check, on the key that set it
    with pytest.raises(ConfigError, match=r"prefill\.tes: .*\(line 2\)$"):
        load_config(f, PDConfig)


def test_an_error_in_the_second_array_table_names_its_index_and_line(tmp_path):
    from xds.serve.reliability import ReliabilityConfig

    f = tmp_path / "group.toml"
    text = (
        "dps = 8\n\n[[faults]]\nkind = 'network_error'\ndp = 2\niteration = 4\n\n"
        "[[faults]]\nkind = 'executor_crash'\ndp = {}\niteration = 3\n"
    )
    f.write_text(text.format(-1))  # a type/bound error msgspec finds
    with pytest.raises(ConfigError, match=r"faults\[1\]\.dp: Expected `int` >= 0 \(line 10\)"):
        load_config(f, ReliabilityConfig)
    f.write_text(text.format(9))  # a check of the struct's own: field and line kept
    with pytest.raises(ConfigError, match=r"faults\[1\]\.dp: DP 9 does not exist.*\(line 10\)"):
        load_config(f, ReliabilityConfig)


def test_a_bad_element_of_a_list_names_the_line_of_its_key(tmp_path):
    from xds.serve.reliability import ReliabilityConfig

    f = tmp_path / "r.toml"
    f.write_text("[rollback]\ncodes = ['LINK_FLAP', 3]\n")
    with pytest.raises(ConfigError, match=r"rollback\.codes\[1\]: Expected `str`.*\(line 2\)"):
        load_config(f, ReliabilityConfig)


def test_mtp_defaults_to_the_models_own_and_needs_an_mtp_layer(tmp_path):
    from xds.serve.ma_config import MADecodeConfig
    from xds.serve.mtp import MTPConfig

    kimi = dict(model="kimi-k2", dies=128, batch_per_die=16, shared_expert_dies=0)
    assert DecodeConfig().mtp_config == MTPConfig(k=1, acceptance=(0.9,))  # DeepSeek: 1 layer
    assert DecodeConfig(**kimi).mtp_config.k == 0  # Kimi K2 has none
    with pytest.raises(ConfigError, match="Kimi K2 has no MTP layer") as err:
        DecodeConfig(**kimi, mtp=MTPConfig(k=1))
    assert err.value.field == "mtp.k"
    with pytest.raises(ConfigError, match="Kimi K2 has no MTP layer"):
        MADecodeConfig(model="kimi-k2", mtp=MTPConfig(k=2))
    # a file that only switches the model gets that model's MTP, not the base's
    f = tmp_path / "pk.toml"
    f.write_text('[decode]\nmodel = "kimi-k2"\n')
    from xds.serve.presets import pd_config

    assert pd_config(str(f)).decode.mtp_config.k == 0
    d = tmp_path / "dk.toml"
    d.write_text('model = "kimi-k2"\ndies = 128\nbatch_per_die = 16\nshared_expert_dies = 0\n')
    assert decode_config(str(d)).mtp_config.k == 0
    from xds.model import Precision

    with pytest.raises(ConfigError, match=r"layers 0\.\.60 \(no MTP layer\)"):
        DecodeConfig(**kimi, precision=Precision(attention_int8_layers=(61,)))
    with pytest.raises(ConfigError, match=r"layer\(s\) \[3\] more than once"):
        Precision(attention_int8_layers=(3, 4, 3))


def test_memory_that_cannot_exist_is_refused():
    from xds.serve.ma_config import MADecodeConfig

    with pytest.raises(ConfigError, match="more than a die's 64 GiB of HBM") as err:
        DecodeConfig(
            batch_per_die=2048, kv_blocks_per_die=10_000_000, input_tokens=4096, output_tokens=64
        )
    assert err.value.field == "kv_blocks_per_die"
    assert DecodeConfig(kv_blocks_per_die=12_000).kv_blocks_per_die == 12_000  # a what-if: fits
    with pytest.raises(ConfigError, match=r"154\.9 GiB of weights") as err:
        MADecodeConfig(
            domains=1,
            attention_dies_per_domain=4,
            expert_dies=4,
            shared_expert_dies=0,
            batch_per_die=32,
        )
    assert err.value.field == "expert_dies"
    with pytest.raises(ConfigError, match="shared_expert_dies = 127") as err:
        DecodeConfig(model="kimi-k2", dies=128, shared_expert_dies=127)


def test_a_pd_file_given_to_xds_decode_says_what_it_is(tmp_path, capsys):
    f = tmp_path / "pd.toml"
    f.write_text('[decode]\nmodel = "kimi-k2"\n')
    assert main(["decode", "--deployment", str(f)]) == 2
    err = capsys.readouterr().err
    assert "decode: unknown field (a [decode] table makes this a PD deployment file" in err
    # a decode file given to ma-decode or replay, an MA file given to decode, say so too
    (tmp_path / "dc.toml").write_text("dies = 64\n")
    (tmp_path / "ma.toml").write_text("domains = 2\n")
    (tmp_path / "neither.toml").write_text("domains = 2\ndies = 64\n")
    for command, name, says in (
        ("ma-decode", "dc", "decode"),
        ("replay", "dc", "decode"),
        ("decode", "ma", "ma-decode"),
    ):
        assert main([command, "--deployment", str(tmp_path / f"{name}.toml")]) == 2
        assert f"; the file reads as an `xds {says}` deployment" in capsys.readouterr().err
    assert main(["decode", "--deployment", str(tmp_path / "neither.toml")]) == 2
    assert "reads as" not in capsys.readouterr().err


def test_weights_are_sized_at_the_deployments_precision():
    from xds.model import Precision
    from xds.serve.decode_model import decode_weight_bytes
    from xds.serve.ma_config import MADecodeConfig

    bf16 = Precision(moe_int8=False, mla_int8=False)
    int8 = DecodeConfig(dies=64, shared_expert_dies=0)
    wide = DecodeConfig(dies=64, shared_expert_dies=0, precision=bf16)
    assert decode_weight_bytes(wide) > 1.8 * decode_weight_bytes(int8)  # 2 bytes a parameter
    assert DecodeConfig(dies=32, shared_expert_dies=0, batch_per_die=1, kv_blocks_per_die=0)
    with pytest.raises(ConfigError, match="no room for KV") as err:
        DecodeConfig(dies=32, shared_expert_dies=0, precision=Precision(moe_int8=False))
    assert err.value.field == "dies"
    small = dict(
        domains=1,
        attention_dies_per_domain=8,
        expert_dies=16,
        shared_expert_dies=0,
        batch_per_die=8,
        output_tokens=16,
    )
    assert MADecodeConfig(**small).expert_dies == 16  # INT8: 16 experts a die fit
    with pytest.raises(ConfigError, match="GiB of weights") as err:
        MADecodeConfig(**small, precision=Precision(moe_int8=False))
    assert err.value.field == "expert_dies"
    assert (
        MADecodeConfig(**small).kv_blocks_per_die
        > MADecodeConfig(**small, precision=Precision(mla_int8=False)).kv_blocks_per_die
    )  # BF16 attention weights leave less room for KV


def test_a_window_must_start_on_a_whole_token():
    import anyio

    import xds
    from xds.serve.ma_config import MADecodeConfig
    from xds.serve.ma_decode import MADecodeInstance

    cfg = MADecodeConfig(
        domains=1,
        attention_dies_per_domain=4,
        expert_dies=16,
        shared_expert_dies=0,
        batch_per_die=4,
        output_tokens=8,
    )

    async def main():
        with pytest.raises(ConfigError, match=r"from_token: must be an integer in 0\.\.7"):
            await MADecodeInstance(cfg).serve(from_token=1.5)
        await anyio.sleep(0)

    xds.run(main)


def test_a_misspelt_key_or_preset_gets_a_suggestion(tmp_path):
    from xds.serve.presets import pd_config

    f = tmp_path / "t.toml"
    f.write_text("decode_te = 2\n")
    with pytest.raises(
        ConfigError, match=r"decode_te: unknown field \(did you mean 'decode_tes'\?\)"
    ):
        pd_config(str(f))
    f.write_text("[decode]\nbatch_per_dei = 8\n")
    with pytest.raises(ConfigError, match="did you mean 'batch_per_die'"):
        pd_config(str(f))
    f.write_text("[decode]\nzzz = 8\n")
    with pytest.raises(ConfigError, match=r"decode.zzz: unknown field \(line 2\)"):
        pd_config(str(f))  # nothing close: no suggestion
    with pytest.raises(ConfigError, match="did you mean 'production-4p1d'"):
        pd_config("production-4pld")


def test_a_config_nested_too_deeply_is_one_clear_error(tmp_path):
    from xds.serve.replay import PDConfig

    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 5000 + "1" + "}" * 5000)
    with pytest.raises(ConfigError, match="nested too deeply") as exc:
        load_config(deep, PDConfig)
    assert exc.value.source == str(deep)
