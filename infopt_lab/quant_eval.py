"""Moved to `infopt_lab.bench.quant`; its names stay importable here for notebook 02."""
from .bench.decode import decode_tokens_per_s
from .bench.quant import (MB, Scheme, SchemeRow, cached_perplexity, default_schemes, divides_all, format_table,
                          matmul_speedup, scheme_table)

__all__ = ["MB", "Scheme", "SchemeRow", "cached_perplexity", "decode_tokens_per_s", "default_schemes", "divides_all",
           "format_table", "matmul_speedup", "scheme_table"]
