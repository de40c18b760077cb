import json

import pytest
import torch

from walrus.data.vocab import FieldVocabulary


def test_ids_are_stable_under_extension():
    v = FieldVocabulary(["density", "velocity_x", "velocity_y"])
    w = v.extend(["pressure", "velocity_x", "tracer"])
    assert v.names == ["density", "velocity_x", "velocity_y"]  # original untouched
    assert w.names[:3] == v.names
    assert torch.equal(w.ids(["tracer", "density", "pressure"]), torch.tensor([4, 0, 3]))
    assert w.ids(["density"]).dtype == torch.long
    assert len(w) == 5 and "tracer" in w and "tracer" not in v


def test_add_in_place_returns_ids():
    v = FieldVocabulary()
    assert v.add(["a", "b", "a"]) == [0, 1, 0]
    assert v.add(["c", "b"]) == [2, 1]


def test_round_trip_through_json():
    v = FieldVocabulary(["u", "v", "w"])
    again = FieldVocabulary.from_dict(json.loads(json.dumps(v.to_dict())))
    assert again == v and again.names == ["u", "v", "w"]


def test_unknown_name_is_named():
    v = FieldVocabulary(["u"])
    with pytest.raises(ValueError, match="'salinity'"):
        v.ids(["u", "salinity"])


def test_bad_dicts_and_names():
    with pytest.raises(ValueError, match="duplicate"):
        FieldVocabulary.from_dict({"names": ["a", "a"]})
    with pytest.raises(ValueError, match="names"):
        FieldVocabulary.from_dict({})
    with pytest.raises(TypeError):
        FieldVocabulary("abc")
