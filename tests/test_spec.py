import pytest

from specdraft.heads.spec import TargetSpec, default_aux_layer_ids


def test_default_aux_layers_follow_eagle3_for_smollm2_depth():
    # hidden_states indexing: id i = stream entering layer i; (2, N//2, N-3) for N = 30.
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(32) == (2, 16, 29)


def test_default_aux_layers_refuse_shallow_targets():
    with pytest.raises(ValueError, match="N >= 6"):
        default_aux_layer_ids(4)


def test_spec_json_round_trip(tiny_target):
    spec = tiny_target.spec
    assert TargetSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("aux", [(0, 4), (-1,), (2, 1), (1, 1)])
def test_spec_rejects_invalid_aux_layer_ids(tiny_target, aux):
    data = tiny_target.spec.to_dict()
    data["aux_layer_ids"] = list(aux)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        TargetSpec.from_dict(data)


def test_spec_from_dict_names_unknown_and_missing_fields(tiny_target):
    data = tiny_target.spec.to_dict()
    data["colour"] = "blue"
    del data["vocab_size"]
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\], missing fields \['vocab_size'\]"):
        TargetSpec.from_dict(data)


def test_spec_from_dict_checks_format_version(tiny_target):
    data = tiny_target.spec.to_dict()
    data["format_version"] = 99
    with pytest.raises(ValueError, match="format_version 99"):
        TargetSpec.from_dict(data)
