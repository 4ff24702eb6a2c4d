"""Write README.md's measured figures from the committed notebook outputs, or check that they agree.

Each figure in README.md sits between invisible markers, `<!-- fig:NAME -->18.8x<!-- /fig -->`, and
FIGURES below says where NAME is printed: a notebook, a substring of one code cell's source (the
anchor), and a regex whose group 1 is the figure as that cell's text output prints it.
usage: python scripts/readme_figures.py            rewrite README.md in place
       python scripts/readme_figures.py --check    exit 1, listing every figure that drifted
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- fig:(?P<name>[\w-]+) -->(?P<value>.*?)<!-- /fig -->")
PLACEHOLDER = re.compile(r"\{fig:([\w-]+)\}")   # in a pattern: an earlier figure's value, escaped


@dataclass(frozen=True)
class Source:
    """Where one figure is printed."""

    notebook: str          # its number: "01" is notebooks/01_*.ipynb
    anchor: str            # a substring of exactly one code cell's source
    pattern: str           # regex on that cell's text output; group 1 is the figure
    pick: str = "first"    # "first" match, or "max" over all matches (numbers only)

    def __post_init__(self):
        if self.pick not in ("first", "max"):
            raise ValueError(f"pick must be 'first' or 'max', got {self.pick!r}")


@dataclass(frozen=True)
class Found:
    """One figure as its source prints it, and where."""

    value: str             # the figure as the notebook prints it
    where: str             # notebook and cell, for messages


class FigureError(Exception):
    """A figure that cannot be sourced, or a README marker that names no figure."""


FIGURES: dict[str, Source] = {
    "w7b_params": Source("00", "gb_7b = footprint(SEVEN_B)", r"for a (\d+B) parameter model"),
    "w7b_int4_shrink": Source("00", "gb_7b = footprint(SEVEN_B)", r"FP32 -> INT4: ([\d.]+x) smaller"),
    "kv_threads": Source("01", "lab.device.describe()", r"threads +: (\d+)"),
    "kv_new_tokens": Source("01", "bench.kv_comparison(", r"with the KV cache : .* for (\d+) tokens"),
    "kv_speedup": Source("01", "bench.kv_comparison(", r"the cache is ([\d.]+x) faster"),
    "kv7b_params": Source("01", "weights_7b = ", r"(\d+B) weights in FP16"),
    "kv7b_context": Source("01", "weights_7b = ", r"GiB per (\d+)-token sequence"),
    "kv7b_mha_heads": Source("01", "weights_7b = ", r"MHA, +(\d+) KV heads"),
    "kv7b_mha_gib": Source("01", "weights_7b = ", r"MHA, +\d+ KV heads: ([\d.]+ GiB)"),
    "kv7b_gqa_heads": Source("01", "weights_7b = ", r"GQA, +(\d+) KV heads"),
    "kv7b_gqa_gib": Source("01", "weights_7b = ", r"GQA, +\d+ KV heads: ([\d.]+ GiB)"),
    "ppl_int8": Source("02", "quant_eval.scheme_table(", r"int8: perplexity ([+-][\d.]+%) vs fp32"),
    "ppl_int4_g64": Source("02", "quant_eval.scheme_table(", r"int4 g64: ([+-][\d.]+%)"),
    "ppl_int4_g64_float_head": Source("02", "quant_eval.scheme_table(", r"int4 g64, float head: ([+-][\d.]+%)"),
    "ppl_gptq": Source("02", "quant_eval.scheme_table(", r"int4 g64 \+ GPTQ: ([+-][\d.]+%)"),
    "mm_shape": Source("02", "quant_eval.matmul_speedup(", r"(\d+x\d+) at batch"),
    "mm_batch": Source("02", "quant_eval.matmul_speedup(", r"at batch (\d+):"),
    "mm_int8_speedup": Source("02", "quant_eval.matmul_speedup(", r"-> ([\d.]+x) faster"),
    "static_util": Source("03", "lab.static_batch_utilization(", r"STATIC batching, batch-slot utilization: ([\d.]+%)"),
    "skew_requests": Source("03", "same_hf = ", r"= transformers for \d+/(\d+) requests"),
    "skew_new_tokens": Source("03", "batching.skewed_lengths(N_REQ", r"output tokens: .*, total (\d+)"),
    "cont_vs_static": Source("03", "same_hf = ", r"continuous / static +: ([\d.]+x) throughput"),
    "cont_vs_hf": Source("03", "same_hf = ", r"continuous / transformers : ([\d.]+x) throughput"),
    "cont_same_hf": Source("03", "same_hf = ", r"= transformers for (\d+/\d+) requests"),
    "kv_paged_share": Source("03", "stats.kv_real_share,", r"real token: paged ([\d.]+%)"),
    "kv_contig_share": Source("03", "stats.kv_real_share,", r"tokens per sequence ([\d.]+%)"),
    "attn_max_n": Source("04", "peak_intermediate_bytes(", r"(?m)^ *(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", "max"),
    "attn_naive_growth": Source("04", "peak_intermediate_bytes(", r"naive (?:[\d.]+x, )*([\d.]+x) \|"),
    "attn_tiled_growth": Source("04", "peak_intermediate_bytes(", r"(?m)tiled (?:[\d.]+x, )*([\d.]+x)$"),
    "flash_err_fp32": Source("04", "CASES = [", r"(?m)(?:True|False) +(\S+) +\S+$", "max"),
    "flash_err_fp16": Source("04", "CASES = [", r"(?m)(?:True|False) +\S+ +(\S+)$", "max"),
    "spec_same": Source("05", "speculative identical to the target:", r"speculative identical .*: (\d+/\d+) prompts"),
    "spec_tv": Source("05", "speculative.verify(", r"emitted vs target p = ([\d.]+)"),
    "spec_best_k": Source("05", "best_k = max(KS", r"best k = (\d+):"),
    "spec_tpp": Source("05", "best_k = max(KS", r"(?m)^ *{fig:spec_best_k} +[\d.]+ +([\d.]+) "),
    "spec_formula": Source("05", "best_k = max(KS", r"(?m)^ *{fig:spec_best_k} +[\d.]+ +[\d.]+ +([\d.]+) "),
    "spec_speedup": Source("05", "best_k = max(KS", r"best k = \d+: ([\d.]+x) the target alone"),
    "spec_vs_hf": Source("05", "hf_pair=(hf_target, hf_draft)", r"draft model, k=\d+: .*\(([\d.]+x)\)"),
    "lookup_speedup": Source("05", "lb, lk = look[", r"prompt lookup: \d+ tok/s \(([\d.]+x)\)"),
    "spec_real_dtype": Source("05", "real_k = max(REAL_KS", r"SmolLM2 alone in (\w+)"),
    "spec_real_k": Source("05", "real_k = max(REAL_KS", r"real pair, best k = (\d+):"),
    "spec_real_speedup": Source("05", "real_k = max(REAL_KS", r"real pair, best k = \d+: ([\d.]+x) SmolLM2 alone"),
    "spec_real_vs_hf": Source("05", "real_k = max(REAL_KS", r"SmolLM2 alone in \w+, identical tokens: \w+; ([\d.]+x) transformers"),
    "wall_fp32_gain": Source("02", "wall_fns = {", r"(?m)^fp32 +[\d.]+ms +[\d.]+ms +([\d.]+)x"),
    "wall_int8_gain": Source("02", "wall_fns = {", r"(?m)^int8 +[\d.]+ms +[\d.]+ms +([\d.]+)x"),
    "wall_int4_gain": Source("02", "wall_fns = {", r"(?m)^int4 g64 +[\d.]+ms +[\d.]+ms +([\d.]+)x"),
    "wall_fp32_share": Source("02", "wall_fns = {", r"(?m)^fp32 +.* (\d+%)$"),
    "exact_drift_fp32": Source("05", "row_count_drift(m, drift_ids", r"(?m)^fp32 +(\S+) "),
    "exact_drift_bf16": Source("05", "row_count_drift(m, drift_ids", r"(?m)^bf16 +(\S+) "),
    "exact_held_n": Source("05", "held = heldout_prompts(", r"fp32, default mode *: \d+/(\d+) outputs"),
    "exact_fp32_rate": Source("05", "held = heldout_prompts(", r"fp32, default mode *: \d+/\d+ outputs identical \((\d+%)\)"),
    "exact_bf16_rate": Source("05", "held = heldout_prompts(", r"bf16, default mode *: \d+/\d+ outputs identical \((\d+%)\)"),
    "exact_pass_default": Source("05", "inv_cost = {name: invariant_costs", r"(?m)^bf16 +[\d.]+ +[\d.]+ +([\d.]+x)"),
    "exact_pass_invariant": Source("05", "inv_cost = {name: invariant_costs", r"(?m)^bf16 +[\d.]+ +[\d.]+ +[\d.]+x +([\d.]+x)"),
    "prefix_ttft": Source("03", "cache_runs = prefix_caching_runs(", r"target with caching: TTFT p50 ([\d.]+x) lower"),
    "prefix_tput": Source("03", "cache_runs = prefix_caching_runs(",
                          r"target with caching: TTFT p50 [\d.]+x lower, throughput ([\d.]+x)"),
    "prefix_hit": Source("03", "cache_runs = prefix_caching_runs(", r"prefix cache: ([\d.]+%) of looked-up"),
    "prefix_ttft_smol": Source("03", "smol_cache = prefix_caching_runs(",
                               r"SmolLM2 with caching: TTFT p50 ([\d.]+x) lower"),
    "prefix_tput_smol": Source("03", "smol_cache = prefix_caching_runs(",
                               r"SmolLM2 with caching: TTFT p50 [\d.]+x lower, throughput ([\d.]+x)"),
    "prefix_smol_sessions": Source("03", "smol_cache = prefix_caching_runs(", r"^(\d+) sessions x \d+ turns"),
    "prefix_smol_turns": Source("03", "smol_cache = prefix_caching_runs(", r"^\d+ sessions x (\d+) turns"),
    "prefix_smol_system": Source("03", "smol_cache = prefix_caching_runs(", r"^\d+ sessions x \d+ turns, system prompt (\d+) tokens"),
    "spec_engine_b1": Source("05", "points = speculation_points(", r"(?m)^ +1 +[\d.]+ +[\d.]+ +([\d.]+x)"),
    "spec_engine_b16": Source("05", "points = speculation_points(", r"(?m)^ +16 +[\d.]+ +[\d.]+ +([\d.]+x)"),
    "ladder_combined": Source("07", "base, combined = rungs[0], rungs[-1]", r"combined / rung 0: ([\d.]+x) tokens/s"),
    "ladder_ppl": Source("07", "base, combined = rungs[0], rungs[-1]", r"perplexity ([+-][\d.]+%)"),
    "interplay_fp32": Source("07", "fits = ladder.memory_interplay(", r"(?m)^ +fp32 +fp32 +\d+ +[\d.]+ +(\d+) "),
    "interplay_int8": Source("07", "fits = ladder.memory_interplay(", r"(?m)^ +int8 +int8 +\d+ +[\d.]+ +(\d+) "),
    "kd_bpb": Source("06", "students, logs, train_s = {}", r"(?m)^distilled +([\d.]+)"),
    "kd_bpb_hard": Source("06", "students, logs, train_s = {}", r"(?m)^hard labels +([\d.]+)"),
    "eagle_mib": Source("05", "eagle = lab.load_feature_draft(smol)", r"([\d.]+) MiB on disk"),
    "eagle_kept_k3": Source("05", "best_key = max(lab_rows", r"feature draft at k = 3: accepted/proposed ([\d.]+)"),
    "eagle_distilled_kept_k3": Source("05", "best_key = max(lab_rows", r"distilled draft at k = 3: ([\d.]+)"),
    "eagle_best": Source("05", "best_key = max(lab_rows", r"best: (the [\w ]+? draft at k = \d+, [\d.]+x)"),
    "eagle_engine_b1": Source("05", "best_key = max(lab_rows", r"batch 1 ([\d.]+x)"),
    "eagle_engine_draft": Source("05", "best_key = max(lab_rows", r"engine with the ([\w ]+? draft at k = \d+) /"),
    "kd_alpha": Source("06", "students, logs, train_s = {}", r"(?m)^distilled +[\d.]+ +[\d.]+% +([\d.]+%)"),
    "kd_alpha_hard": Source("06", "students, logs, train_s = {}", r"(?m)^hard labels +[\d.]+ +[\d.]+% +([\d.]+%)"),
    "smol_draft_share": Source("06", "card_dir = bundled_model_dir(", r"parameters = ([\d.]+) of SmolLM2"),
    "smol_draft_alpha": Source("06", "card_dir = bundled_model_dir(", r"k = 4: acceptance ([\d.]+%)"),
    "cpu_00": Source("00", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_01": Source("01", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_02": Source("02", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_03": Source("03", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_04": Source("04", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_05": Source("05", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_06": Source("06", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_07": Source("07", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
    "cpu_08": Source("08", "lab.device.describe().items()", r"(?m)^device +: cpu \((.*)\)$"),
}


def notebook_path(root: Path, number: str) -> Path:
    """The one notebook notebooks/NUMBER_*.ipynb under root."""
    paths = sorted((root / "notebooks").glob(f"{number}_*.ipynb"))
    if len(paths) != 1:
        raise FigureError(f"expected one notebooks/{number}_*.ipynb, found {len(paths)}")
    return paths[0]


def find_cell(nb, anchor: str, path: str) -> tuple[int, nbformat.NotebookNode]:
    """The index and code cell whose source holds anchor; exactly one must."""
    hits = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and anchor in c.source]
    if len(hits) != 1:
        raise FigureError(f"anchor {anchor!r} is in {len(hits)} code cells of {path}, expected 1")
    return hits[0]


def output_text(cell) -> str:
    """The cell's printed text: streams and text/plain results, in order."""
    parts = [o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
             for o in cell.get("outputs", [])]
    return "".join(parts)


def read_figure(source: Source, root: Path, found: dict[str, Found]) -> Found:
    """One figure's value as its notebook cell prints it."""
    path = notebook_path(root, source.notebook)
    rel = path.relative_to(root).as_posix()
    index, cell = find_cell(nbformat.read(path, as_version=4), source.anchor, rel)
    where = f"{rel} cell #{index} (id {cell.get('id', '?')}, anchor {source.anchor.strip()!r})"

    def earlier(m: re.Match) -> str:
        if m[1] not in found:
            raise FigureError(f"pattern refers to {m[1]!r}, which is not an earlier figure")
        return re.escape(found[m[1]].value)

    pattern = PLACEHOLDER.sub(earlier, source.pattern)
    values = [m[1] for m in re.finditer(pattern, output_text(cell))]
    if not values:
        raise FigureError(f"pattern {pattern!r} matches nothing in the output of {where}")
    if source.pick == "max" and not all(re.fullmatch(r"[-+\d.e]+", v) for v in values):
        raise FigureError(f"pick='max' needs numbers, got {values} from {where}")
    value = max(values, key=float) if source.pick == "max" else values[0]
    return Found(value, where)


def source_values(figures: dict[str, Source], root: Path = ROOT) -> dict[str, Found]:
    """Every figure's value from its notebook; FigureError names each figure that cannot be found."""
    found, errors = {}, []
    for name, source in figures.items():
        try:
            found[name] = read_figure(source, root, found)
        except FigureError as e:
            errors.append(f"{name}: {e}")
    if errors:
        raise FigureError("figures without a source:\n  " + "\n  ".join(errors))
    return found


def check_markers(text: str, figures: dict[str, Source]) -> None:
    """Raise FigureError unless README's markers and FIGURES name the same figures."""
    named = {m["name"] for m in MARKER.finditer(text)}
    unknown, unused = sorted(named - figures.keys()), sorted(figures.keys() - named)
    if unknown or unused:
        raise FigureError(f"README markers with no source: {unknown}; figures with no README marker: {unused}")


def drift(text: str, found: dict[str, Found]) -> list[str]:
    """One line per marker whose README text differs from its source's value."""
    return [f"{m['name']}: README says {m['value']!r}, source says {found[m['name']].value!r} "
            f"in {found[m['name']].where}"
            for m in MARKER.finditer(text) if m["value"] != found[m["name"]].value]


def rewrite(text: str, found: dict[str, Found]) -> str:
    """README text with every marker's value replaced by its source's value."""
    return MARKER.sub(lambda m: f"<!-- fig:{m['name']} -->{found[m['name']].value}<!-- /fig -->", text)


def load(readme: Path, figures: dict[str, Source], root: Path) -> tuple[str, dict[str, Found]]:
    """README's text and every figure's source value; FigureError when a marker or a figure has no match."""
    text = readme.read_text(encoding="utf-8")
    check_markers(text, figures)
    return text, source_values(figures, root)


def check(readme: Path, figures: dict[str, Source] = FIGURES, root: Path = ROOT) -> list[str]:
    """The drift lines for readme against the notebooks under root; empty when all agree."""
    return drift(*load(readme, figures, root))


def main(argv: list[str] | None = None) -> int:
    """Rewrite README.md, or with --check report its drift; 1 on drift or on a figure without a source."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift instead of rewriting README.md")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args(argv)
    try:
        text, found = load(args.readme, FIGURES, ROOT)
    except FigureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    problems = drift(text, found)
    if args.check:
        print("\n".join(problems) or f"all {len(FIGURES)} README figures match the notebooks")
        return 1 if problems else 0
    args.readme.write_text(rewrite(text, found), encoding="utf-8")
    print(f"{args.readme.name}: {len(problems)} of {len(FIGURES)} figures rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
