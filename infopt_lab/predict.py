"""Predict, then measure: the sentence that compares what a student wrote down with what the run printed.

    MY_PREDICTION = {"shrink": 4.0}          # before the measurement
    ...                                      # the measurement
    display(Markdown(lab.check_prediction(MY_PREDICTION["shrink"], measured, "the fp32 -> int4 shrink", unit="x")))
"""
from __future__ import annotations

import math
from numbers import Real


def check_prediction(predicted, measured, what: str, unit: str = "", digits: int = 2) -> str:
    """A markdown sentence: the prediction, the measurement and how far apart they are.

    Numbers are compared by difference and ratio; anything else (a choice: a name, a k) by equality.
    """
    if not isinstance(what, str) or not what:
        raise ValueError(f"what must name the measured quantity, got {what!r}")
    both_numbers = all(isinstance(x, Real) and not isinstance(x, bool) for x in (predicted, measured))
    if not both_numbers:
        verdict = "right" if predicted == measured else "not what was measured"
        return f"You predicted **{predicted}** for {what}; the run gave **{measured}**: {verdict}."
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        raise ValueError(f"predicted and measured must be finite numbers, got {predicted!r} and {measured!r}")
    fmt = f"{{:.{digits}f}}{unit}"
    off = f"off by {measured - predicted:+.{digits}f}{unit}"
    if predicted != 0:
        off += f", the measurement {measured / predicted:.{digits}f} times your guess"
    return f"You predicted **{fmt.format(predicted)}** for {what}; the run measured **{fmt.format(measured)}** ({off})."
