"""Config: defaults validate, overrides apply, bad keys and values fail naming them."""

import pytest
from pydantic import ValidationError

from dice_ray.config import DiceConfig, load_config


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["rl.num_generations=8", "cluster.address=null", "sampling.remasking=static"])
    assert cfg.rl.num_generations == 8 and cfg.cluster.address is None and cfg.sampling.remasking == "static"
    f = tmp_path / "c.yaml"
    f.write_text("rl:\n  steps: 3\n")
    assert load_config(f, ["rl.steps=5"]).rl.steps == 5


def test_repo_presets_validate():
    from pathlib import Path

    for preset in sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")):
        load_config(preset)


@pytest.mark.parametrize(
    "override, named",
    [("rl.num_generationz=4", "num_generationz"), ("rl.num_generations=1", "num_generations"),
     ("sampling.remasking=sometimes", "remasking"), ("sampling.max_new_tokens=30", "block_size"),
     # values that used to pass and fail later: every verdict a compile_error, an actor's traceback, a folder elsewhere
     ("verify.arch=sm_bogus", r"arch\n.*should match pattern"),
     ("model.num_attention_heads=3", "num_attention_heads=3 must be a multiple of model.num_key_value_heads=2"),
     ("rl.seed=18446744073709551616", r"seed\n.*less than 4294967296"), ("rl.seed=-1", "seed"),
     ("verify.seed=4294967296", "seed"), ("run_name=../../elsewhere", "must be one folder name"),
     ("run_name=a/b", "must be one folder name"), ("run_name=..", "must be one folder name")],
)
def test_bad_key_or_value_names_it(override, named):
    with pytest.raises((ValidationError, ValueError), match=named):
        load_config(None, [override])


def test_malformed_override():
    with pytest.raises(ValueError, match="dotted.key=value"):
        load_config(None, ["rl.steps"])


def test_compile_baseline_needs_seccomp_and_landlock_off():
    from dice_ray.config import VerifyConfig

    for on in ({}, {"seccomp": False}, {"landlock": False}):
        with pytest.raises(ValueError, match="seccomp=false and verify.landlock=false"):
            VerifyConfig(compile_baseline=True, **on)
    assert VerifyConfig(compile_baseline=True, seccomp=False, landlock=False).compile_baseline


@pytest.mark.parametrize(
    "text, says",
    [
        (b"rl:\n  steps: [1\n", "line 3, column 1: not valid YAML"),
        (b"!!python/object:os.system x\n", "line 1, column 1: not valid YAML"),
        (b"rl:\n  steps: 3\n  steps: 4\n", "line 3, column 3: not valid YAML: found duplicate key 'steps'"),
        (b"rl:\n  steps: 3\nrl:\n  epsilon: 0.1\n", "found duplicate key 'rl'"),
        (b"\xff\xferl: 1\n", "not UTF-8 text"),
        (b"- a\n- b\n", "top level must be a mapping, got list"),
    ],
)
def test_malformed_config_file_names_the_file_and_the_rule(tmp_path, text, says):
    f = tmp_path / "bad.yaml"
    f.write_bytes(text)
    with pytest.raises(ValueError) as err:
        load_config(f)
    assert not isinstance(err.value, ValidationError)
    assert str(f) in str(err.value) and says in str(err.value)


def test_config_path_that_is_a_folder_or_has_a_bom(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        load_config(tmp_path)
    f = tmp_path / "bom.yaml"
    f.write_bytes(b"\xef\xbb\xbfrl:\n  steps: 3\n")
    assert load_config(f).rl.steps == 3
    f.write_text("")
    assert load_config(f) == DiceConfig()  # an empty file: the defaults


@pytest.mark.parametrize(
    "override, says",
    [("=3", "has an empty part"), (".rl=3", "has an empty part"), ("rl..steps=3", "has an empty part"),
     ("rl.steps=[1", "override 'rl.steps=[1': line 1, column 3: not valid YAML")],
)
def test_malformed_override_key_or_value(override, says):
    with pytest.raises(ValueError, match=None) as err:
        load_config(None, [override])
    assert not isinstance(err.value, ValidationError) and says in str(err.value)


@pytest.mark.parametrize(
    "override, loc, says",
    [("rl.steps=true", ("rl", "steps"), "expected a number, got true"),
     ("verify.seed=false", ("verify", "seed"), "expected a number, got false"),
     ("rl.learning_rate=true", ("rl", "learning_rate"), "expected a number"),
     ("verify.rtol=.inf", ("verify", "rtol"), "finite"),
     ("verify.atol=.inf", ("verify", "atol"), "finite"),
     ("reward.correct_reward=.nan", ("reward", "correct_reward"), "finite"),
     ("tasks.max_tasks=true", ("tasks", "max_tasks"), "expected a number")],
)
def test_bools_and_non_finite_numbers_are_refused(override, loc, says):
    with pytest.raises(ValidationError) as err:
        load_config(None, [override])
    first = err.value.errors()[0]
    assert first["loc"] == loc and says in first["msg"]
    assert load_config(None, ["sft.enabled=false", "verify.dry_run=true"]).sft.enabled is False  # bools stay bools
