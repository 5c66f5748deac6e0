"""The loader for people's YAML files (agent/yamlfile.py): a key given twice is refused with
both lines; everything else loads as yaml.safe_load loads it."""

from __future__ import annotations

import pytest
import yaml

from agent import yamlfile


def test_a_merge_key_override_is_no_repeat_but_a_repeat_beside_it_is() -> None:
    """``<<: *base`` then one of its keys is YAML's override, even where the alias was
    flattened before (a merge of a merge); an alias that contains itself is walked once."""
    text = ("base: &b {x: 1, z: 0}\nmore: &m {<<: *b, z: 9}\n"
            "d:\n  <<: *m\n  x: 2\nloop: &l {self: *l}\n")
    loaded, expected = yamlfile.load(text), yaml.safe_load(text)
    assert loaded["loop"]["self"] is loaded.pop("loop")
    expected.pop("loop")
    assert loaded == expected and loaded["d"]["x"] == 2
    with pytest.raises(yamlfile.DuplicateKeyError) as caught:
        yamlfile.load(text + "e:\n  <<: *b\n  y: 3\n  y: 4\n")
    assert (caught.value.path, caught.value.first, caught.value.second) == ("e.y", 9, 10)
    assert str(caught.value) == "e.y: given twice (lines 9 and 10)"


@pytest.mark.parametrize(("text", "message"), [
    ("1: a\n0x1: b\n", "1: given twice (lines 1 and 2)"),
    ("x:\n  yes: a\n  true: b\n", "x.true: given twice (lines 2 and 3)"),
    ("x: [{a: 1}, {b: 2, 'b': 3}]\n", "x[1].b: given twice (lines 1 and 1)"),
    ("~: a\nnull: b\n", "null: given twice (lines 1 and 2)"),
], ids=["int-spellings", "bool-spellings", "quoted-in-a-list", "null"])
def test_keys_equal_once_built_are_the_same_key(text: str, message: str) -> None:
    """safe_load keeps the last of them: the mapping built would silently lose the first."""
    assert len(yaml.safe_load(text)) == 1
    with pytest.raises(yamlfile.DuplicateKeyError) as caught:
        yamlfile.load(text)
    assert str(caught.value) == message
