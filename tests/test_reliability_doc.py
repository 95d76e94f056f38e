"""docs/reliability.md's bad-input catalogue names every malformed-input case the tests hold
(a case added to a test's table must be added to the catalogue too)."""

from __future__ import annotations

from pathlib import Path

import test_bad_input
import test_checkpoint
import test_layer
import test_quant

DOC = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()


def test_catalogue_lists_every_bad_input_case():
    ids = [b.id for b in test_bad_input.BAD_EXPERTS] + [b.id for b in test_bad_input.BAD_ROUTING]
    ids += [f"{b.scheme}-{b.field}" for b in test_quant.BAD_QUANT]
    ids += [b.id for b in test_checkpoint.BAD] + [b.id for b in test_layer.BAD_LOADS]
    missing = [i for i in ids if f"`{i}`" not in DOC]
    assert not missing, f"add to docs/reliability.md: {missing}"


def test_catalogue_names_only_tests_that_exist():
    import re

    tests_dir = Path(__file__).parent
    for module, name in set(re.findall(r"`(test_\w+)\.py::(test_\w+)", DOC)):
        assert f"def {name}(" in (tests_dir / f"{module}.py").read_text(), f"{module}.py::{name}"
