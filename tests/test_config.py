"""Config: defaults validate, overrides apply, bad keys and values fail naming them."""

import pytest
from pydantic import ValidationError

from dice_ray.config import load_config


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
     ("sampling.remasking=sometimes", "remasking"), ("sampling.max_new_tokens=30", "block_size")],
)
def test_bad_key_or_value_names_it(override, named):
    with pytest.raises((ValidationError, ValueError), match=named):
        load_config(None, [override])


def test_malformed_override():
    with pytest.raises(ValueError, match="dotted.key=value"):
        load_config(None, ["rl.steps"])


def test_compile_baseline_needs_seccomp_off():
    from dice_ray.config import VerifyConfig

    with pytest.raises(ValueError, match="seccomp=false"):
        VerifyConfig(compile_baseline=True)
    assert VerifyConfig(compile_baseline=True, seccomp=False).compile_baseline
