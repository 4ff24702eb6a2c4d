"""Moved to `infopt_lab.bench.attention`; its names stay importable here for notebook 04."""
from ..bench.attention import (PEAK_TFLOPS_16BIT, AttentionTiming, attention_flops, device_peak_tflops,
                               gpu_contenders, interpreter_check, time_attention)

__all__ = ["PEAK_TFLOPS_16BIT", "AttentionTiming", "attention_flops", "device_peak_tflops", "gpu_contenders",
           "interpreter_check", "time_attention"]
