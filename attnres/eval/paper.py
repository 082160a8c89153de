"""The paper's downstream numbers (Kimi Team, "Attention Residuals", arXiv:2603.15031, its downstream results table).

This is the only place the published numbers live: the report, the chart and the table in docs/evaluation.md all read them from
here. Keys are the benchmark names the task YAMLs carry as `group_alias`, so a row of the table is matched to its
paper numbers by name.
"""

from typing import NamedTuple


class PaperScore(NamedTuple):
    """One row of the paper's table: 48B-A3B Kimi Linear, 1.4T tokens, baseline vs Block AttnRes, in percent."""

    baseline: float
    attnres: float

    @property
    def delta(self) -> float:
        return round(self.attnres - self.baseline, 1)


PAPER_MODEL = "Kimi Linear 48B-A3B, 1.4T tokens (Block AttnRes)"

# In the paper's row order.
PAPER_SCORES: dict[str, PaperScore] = {
    "MMLU": PaperScore(65.9, 67.0),
    "MMLU-Pro Hard": PaperScore(35.8, 38.1),
    "GPQA-Diamond": PaperScore(37.5, 45.0),
    "BBH": PaperScore(66.3, 67.6),
    "ARC-Challenge": PaperScore(75.8, 76.2),
    "HellaSwag": PaperScore(79.7, 79.9),
    "TriviaQA": PaperScore(72.0, 73.9),
    "GSM8K": PaperScore(74.9, 77.4),
    "MGSM": PaperScore(58.6, 61.4),
    "Minerva Math": PaperScore(35.9, 39.5),
    "HumanEval": PaperScore(53.7, 56.8),
    "MBPP": PaperScore(67.6, 68.8),
    "CMMLU": PaperScore(73.2, 73.5),
    "C-Eval": PaperScore(64.0, 64.7),
}
