"""Moved to `infopt_lab.bench.speculative`; its names stay importable here for notebook 05."""
from .bench.speculative import REPEAT_PROMPT, SPEC_PROMPTS, SpecRun, pass_costs, prompt_lookup_runs, speculative_runs

__all__ = ["REPEAT_PROMPT", "SPEC_PROMPTS", "SpecRun", "pass_costs", "prompt_lookup_runs", "speculative_runs"]
