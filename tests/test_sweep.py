"""The sweep over every causal LM of the installed Transformers (`scripts/sweep.py`): each model type's tiny
checkpoint gives the row committed in docs/conversion.md (what converts converts within 1e-4 in Block and Full mode,
what is refused is refused for the structure the table names), every refusal is one line, and the README's counts
are the sweep's."""

import pytest

from scripts.sweep import CONVERTS, DOC, MAX_ABS_LOGIT_DIFF, README, REFUSED, counts_line, parse_table, sweep


@pytest.fixture(scope="module")
def results():
    return sweep()


def test_the_sweep_gives_the_committed_table(results):
    """Model type, structure and result of every row; the measured |Δlogit| varies in its last bits between
    machines, so it is held to the bound rather than to the committed digits."""
    committed = [row[:3] for row in parse_table(DOC.read_text())]
    assert [result.cells()[:3] for result in results] == committed
    for result in results:
        if result.result == CONVERTS:
            assert result.max_abs_logit_diff <= MAX_ABS_LOGIT_DIFF, result.model_type


def test_every_refusal_is_one_line_naming_the_structure(results):
    refusals = [result for result in results if result.result == REFUSED]
    assert refusals
    for result in refusals:
        assert "\n" not in result.detail and result.structure in result.detail, result.model_type


def test_the_readme_gives_the_sweeps_counts(results):
    assert counts_line(results) in README.read_text()
