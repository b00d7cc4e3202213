"""The row rules (collider_core/src/row_rules.h) proven on PyTorch's own sample inputs, and their
table in docs/ROW_RULES.md kept true.

- Every OpInfo operator whose graph is one node of a type collider cuts is run on its float64 CPU
  samples, and for every dimension its rule lets collider cut, no output element depends on two
  rows and changing one row moves no other row's output or gradient (row_property.py).
- docs/ROW_RULES.md lists the rule of every node type of the torch it was generated with
  (python python/tests/row_rules_table.py); under that torch its rows equal collider.row_rules().
  pytest python/tests/test_row_rules.py
"""
import re
from pathlib import Path

import pytest
import torch

import collider
import row_property

DOC = Path(__file__).resolve().parents[2] / "docs" / "ROW_RULES.md"


@pytest.fixture(scope="module")
def outcome():
    return row_property.run_all()


def test_rules_hold_on_opinfo_samples(outcome):
    assert not outcome.violations, "\n".join(f"{op} ({node}) along dim {d}: {what}"
                                             for op, node, d, what in outcome.violations)
    # The number proven is what the torch of the pinned environment gives (163 types under 2.11);
    # a much smaller count means the sampler stopped seeing the operators.
    assert outcome.checked > 500 and len(outcome.proven) > 120, (outcome.checked, len(outcome.proven))


def test_every_type_proven_is_one_collider_cuts(outcome):
    rules = {t: r for t, r, _ in collider.row_rules()}
    assert all(rules[t] in row_property.CUT_RULES for t in outcome.proven)


def test_doc_table_is_the_rules_of_this_torch():
    text = DOC.read_text()
    version = re.search(r"torch (\S+)", text).group(1)
    if version != torch.__version__.split("+")[0]:
        pytest.skip(f"docs/ROW_RULES.md was generated under torch {version}")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([a-z ]+) \|", text, flags=re.M))
    assert rows == {t: r for t, r, _ in collider.row_rules()}, (
        "docs/ROW_RULES.md is out of date: python python/tests/row_rules_table.py")
