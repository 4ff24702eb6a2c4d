"""Exercises and grading: `assign` writes exercises/ from solutions/, `grade` runs and scores submissions.

Importing this package is cheap; the grader's modules load when a command needs them:
`infopt_lab.grading.assign`, `infopt_lab.grading.grade`, `infopt_lab.grading.checks`.
"""
