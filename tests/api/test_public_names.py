"""The public names users reach from ``import hp_fastload as hf`` keep working whatever the layers below."""

from __future__ import annotations

import hp_fastload as hf


def test_public_names_are_attributes_of_the_package() -> None:
    for name in (
        "load",
        "plan",
        "save",
        "transfer",
        "from_pretrained",
        "read_many",
        "read_into",
        "HuggingFaceCheckpointer",
        "LoadReport",
        "LoadPlan",
        "SaveReport",
        "TransferReport",
        "HpFastloadError",
        "rules",
    ):
        assert hasattr(hf, name), name
    assert hf.rules.WeightConverter.__name__ == "WeightConverter"
    assert hf.rules.PermuteForRope.__name__ == "PermuteForRope"
    for name in hf.__all__:
        assert hasattr(hf, name), name


def test_rules_and_dcp_modules_keep_their_names() -> None:
    from hp_fastload import dcp, rules

    assert {"HuggingFaceStorageReader", "QuantizedHuggingFaceStorageReader"} <= set(dcp.__all__)
    for name in rules.__all__:
        assert getattr(rules, name) is not None, name
