"""ipywidgets controls the notebooks share.

Each builder draws its first state at once and returns the widget; it never
waits for input, so a notebook runs the same headless (nbval, nbclient).
"""
from __future__ import annotations

from collections.abc import Mapping

import ipywidgets as W
import matplotlib.pyplot as plt

from .metrics import weight_memory_gb
from .plots import memory_bars


def memory_line(num_params: float, precision: str, bytes_per_param: float) -> str:
    """'precision: N parameters x b bytes = M GB' for one model size (GB = 1024**3 bytes)."""
    gb = weight_memory_gb(num_params, bytes_per_param)
    return (f"{precision}: {num_params:,.0f} parameters x {bytes_per_param:g} bytes "
            f"= {gb:,.2f} GB ({gb * 1024:,.1f} MB)")


def memory_calculator(precisions: Mapping[str, float], num_params: float = 7e9,
                      precision: str | None = None) -> W.VBox:
    """Parameters (log slider) x precision (dropdown) -> weight memory, printed and plotted."""
    slider = W.FloatLogSlider(value=num_params, base=10, min=6, max=12, step=0.01,
                              description="parameters", readout_format=".3s",
                              continuous_update=False, layout=W.Layout(width="420px"))
    dropdown = W.Dropdown(options=list(precisions), value=precision or list(precisions)[1],
                          description="precision")
    out = W.Output()

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            n, name = slider.value, dropdown.value
            print(memory_line(n, name, precisions[name]))
            gb = {p: weight_memory_gb(n, b) for p, b in precisions.items()}
            memory_bars(gb, "GB", ax=plt.subplots(figsize=(6, 2.6))[1], highlight=name,
                        title=f"weights of a {n / 1e9:.3g}B-parameter model")
            plt.show()

    slider.observe(redraw, "value")
    dropdown.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([slider, dropdown]), out])


def kv_cache_line(config, context: int, batch: int, bytes_per_element: float) -> str:
    """'KV cache: 2 x L x H_kv x D x context x batch x bytes = N GiB' for one setting."""
    from .costs import kv_cache_bytes
    nbytes = kv_cache_bytes(config, context, batch, bytes_per_element)
    return (f"KV cache: 2 x {config.n_layers} layers x {config.n_kv_heads} KV heads x {config.head_dim} "
            f"head dim x {context:,} tokens x batch {batch} x {bytes_per_element:g} bytes "
            f"= {nbytes / 1024**3:,.3f} GiB")


def _kv_controls(precisions: Mapping[str, float], n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 context: int, batch: int, budget_gib: float) -> dict[str, W.ValueWidget]:
    """The calculator's controls, by name."""
    style = dict(continuous_update=False, layout=W.Layout(width="320px"), style={"description_width": "110px"})
    return {
        "layers": W.IntSlider(value=n_layers, min=1, max=128, description="layers", **style),
        "heads": W.IntSlider(value=n_heads, min=1, max=128, description="query heads", **style),
        "kv_heads": W.IntSlider(value=n_kv_heads, min=1, max=128, description="KV heads", **style),
        "head_dim": W.Dropdown(options=[32, 64, 80, 96, 128, 256], value=head_dim, description="head dim",
                               style=style["style"]),
        "context": W.IntSlider(value=context, min=256, max=131072, step=256, description="context", **style),
        "batch": W.IntSlider(value=batch, min=1, max=256, description="batch", **style),
        "precision": W.Dropdown(options=list(precisions), value=list(precisions)[1], description="precision",
                                style=style["style"]),
        "budget": W.FloatSlider(value=budget_gib, min=1, max=640, step=1, description="memory (GiB)", **style),
    }


def _draw_kv(config, context: int, batch: int, bytes_per_element: float, budget_gib: float) -> None:
    """Print the KV size and the largest batch that fits; plot KV memory against batch size."""
    from .costs import kv_cache_bytes
    per_seq = kv_cache_bytes(config, context, 1, bytes_per_element) / 1024**3
    print(kv_cache_line(config, context, batch, bytes_per_element))
    print(f"one sequence of {context:,} tokens: {per_seq:,.3f} GiB; {budget_gib:g} GiB holds the caches of at "
          f"most {int(budget_gib // per_seq)} such sequences ({config.n_heads // config.n_kv_heads} query heads "
          f"share each KV head)")
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, batch})
    ax = plt.subplots(figsize=(6, 2.6))[1]
    ax.plot(sizes, [s * per_seq for s in sizes], "o-")
    ax.axhline(budget_gib, color="tab:red", ls="--", label=f"memory {budget_gib:g} GiB")
    ax.plot([batch], [batch * per_seq], "o", ms=10, mfc="none", color="black")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("KV cache (GiB)")
    ax.legend()
    plt.show()


def kv_cache_calculator(precisions: Mapping[str, float], n_layers: int = 32, n_heads: int = 32,
                        n_kv_heads: int = 8, head_dim: int = 128, context: int = 4096, batch: int = 8,
                        budget_gib: float = 40.0) -> W.VBox:
    """Layers, heads, KV heads, context, batch, precision -> KV memory and the largest batch that fits."""
    from .config import ModelConfig
    c = _kv_controls(precisions, n_layers, n_heads, n_kv_heads, head_dim, context, batch, budget_gib)
    out = W.Output()

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            try:
                cfg = ModelConfig(vocab_size=1, dim=c["heads"].value * c["head_dim"].value,
                                  n_layers=c["layers"].value, n_heads=c["heads"].value,
                                  n_kv_heads=c["kv_heads"].value, intermediate_size=1,
                                  max_seq_len=c["context"].value)
            except ValueError as e:
                print(f"not a valid shape: {e}")
                return
            _draw_kv(cfg, c["context"].value, c["batch"].value, precisions[c["precision"].value],
                     c["budget"].value)

    for w in c.values():
        w.observe(redraw, "value")
    redraw()
    left = W.VBox([c[k] for k in ("layers", "heads", "kv_heads", "head_dim")])
    right = W.VBox([c[k] for k in ("context", "batch", "precision", "budget")])
    return W.VBox([W.HBox([left, right]), out])


def batching_explorer(request_lengths: list[int], batch_size: int = 4) -> W.VBox:
    """Request lengths (text) x batch size (slider) -> static and continuous utilization, with Gantt charts."""
    from .batching import simulate, static_batch_utilization
    from .plots import gantt
    text = W.Text(value=", ".join(map(str, request_lengths)), description="lengths",
                  continuous_update=False, layout=W.Layout(width="420px"))
    slider = W.IntSlider(value=batch_size, min=1, max=16, description="batch size", continuous_update=False)
    out = W.Output()

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            try:
                lengths = [int(x) for x in text.value.replace(",", " ").split()]
                static_batch_utilization(lengths, slider.value)
            except ValueError as e:
                print(f"cannot use these lengths: {e}. Give positive integers separated by commas.")
                return
            fig, axes = plt.subplots(2, 1, figsize=(9, 0.7 * slider.value + 3), sharex=True)
            for ax, policy in zip(axes, ("static", "continuous")):
                r = simulate(lengths, slider.value, policy)
                print(f"{policy:>10}: utilization {r.utilization:.1%}, {r.steps} steps, "
                      f"mean latency {sum(r.latency_steps) / len(lengths):.1f} steps")
                gantt(r.timeline, slider.value, ax=ax, title=f"{policy}: {r.utilization:.1%} of held slots useful")
            plt.tight_layout()
            plt.show()

    text.observe(redraw, "value")
    slider.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([text, slider]), out])


def attention_memory_line(N: int, D: int, block: int, bytes_per_element: int = 2) -> str:
    """Bytes of the score matrices naive attention holds vs the tiles a FlashAttention program holds."""
    naive = 2 * N * N * bytes_per_element                 # scores and probabilities, N x N each
    tiled = (block * block + 2 * block * D + 2 * block) * 4  # one score tile, acc and Q tile, m and l (fp32)
    return (f"N={N}, D={D}, block={block}: naive holds {naive / 2**20:,.2f} MiB of scores per head; "
            f"one tiled program holds {tiled / 2**10:,.1f} KiB ({naive / tiled:,.0f}x less)")


def attention_memory_explorer(N: int = 4096, D: int = 128, block: int = 64) -> W.VBox:
    """Sequence length, head dim and block size -> the memory of naive vs tiled attention, printed and plotted."""
    n_slider = W.IntSlider(value=N, min=128, max=65536, step=128, description="N", continuous_update=False,
                           layout=W.Layout(width="420px"))
    d_drop = W.Dropdown(options=[16, 32, 64, 128], value=D, description="head dim")
    b_drop = W.Dropdown(options=[16, 32, 64, 128], value=block, description="block")
    out = W.Output()

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            print(attention_memory_line(n_slider.value, d_drop.value, b_drop.value))
            ns = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536) if n <= max(n_slider.value, 1024)]
            naive = [2 * n * n * 2 / 2**20 for n in ns]
            tiled = [n * d_drop.value * 2 * 2 / 2**20 for n in ns]    # Q-sized output and input rows only
            ax = plt.subplots(figsize=(6, 3.2))[1]
            ax.loglog(ns, naive, "o-", label="naive: N x N scores (fp16)")
            ax.loglog(ns, tiled, "s-", label="tiled: O(N x D) rows (fp16)")
            ax.axvline(n_slider.value, color="0.6", ls=":")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("MiB per head")
            ax.legend(fontsize=8)
            plt.show()

    for w in (n_slider, d_drop, b_drop):
        w.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([n_slider, d_drop, b_drop]), out])


def rounds_html(tok, rounds, max_rounds: int | None = None) -> str:
    """A speculative run as HTML: accepted draft tokens green, rejected ones struck through in red,
    the target's own token (a correction, or a bonus after a fully accepted round) in blue."""
    import html

    def piece(token_ids, style):
        text = html.escape(tok.decode(token_ids)).replace("\n", "↵<br>").replace(" ", "&nbsp;")
        return f'<span style="{style}">{text}</span>'
    parts = []
    for r in rounds[:max_rounds]:
        parts.append(piece(r.proposed[:r.accepted], "background:#c8f7c5"))
        if r.accepted < len(r.proposed):
            parts.append(piece(r.proposed[r.accepted:], "color:#c0392b;text-decoration:line-through"))
        parts.append(piece(r.emitted[-1:], "background:#cfe3ff;font-weight:bold"))
        parts.append('<span style="color:#999">|</span>')
    legend = ('<div style="font-family:sans-serif;font-size:12px;margin-bottom:4px">'
              '<span style="background:#c8f7c5">accepted draft</span> · '
              '<span style="color:#c0392b;text-decoration:line-through">rejected draft</span> · '
              '<span style="background:#cfe3ff;font-weight:bold">target\'s token</span> · | one target pass</div>')
    return legend + f'<div style="font-family:monospace;font-size:12px;line-height:1.6">{"".join(parts)}</div>'


def speculative_explorer(target, draft, tok, prompt: str, new_tokens: int = 64, k: int = 4,
                         temperature: float = 0.0) -> W.VBox:
    """k and temperature -> a live speculative run: acceptance, tokens per pass, speed against the target alone."""
    import torch

    from .generate import generate
    from .speculative import expected_tokens_per_pass, speculative_generate
    k_slider = W.IntSlider(value=k, min=1, max=10, description="k", continuous_update=False)
    t_slider = W.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.1, description="temperature",
                             continuous_update=False)
    out = W.Output()
    ids = torch.tensor([tok.encode(prompt)], device=next(target.parameters()).device)

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            base = generate(target, tok, prompt, max_new_tokens=new_tokens, temperature=t_slider.value,
                            stop_at_eos=False)
            run = speculative_generate(target, draft, ids, k=k_slider.value, max_new_tokens=new_tokens,
                                       temperature=t_slider.value, stop_at_eos=False)
            print(f"k={k_slider.value}, temperature={t_slider.value:.1f}: acceptance {run.acceptance_rate:.2f}, "
                  f"tokens per target pass {run.tokens_per_pass:.2f} (formula "
                  f"{expected_tokens_per_pass(run.acceptance_rate, k_slider.value):.2f}), "
                  f"{run.tokens_per_s:.0f} tok/s vs target alone {new_tokens / base.e2e_s:.0f} tok/s "
                  f"({run.tokens_per_s * base.e2e_s / new_tokens:.2f}x)")

    k_slider.observe(redraw, "value")
    t_slider.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([k_slider, t_slider]), out])


def distillation_explorer(teacher, student, tok, context: str, temperature: float = 1.0, weight: float = 0.9,
                          top: int = 10) -> W.VBox:
    """Temperature and weight -> the teacher's softened distribution after `context`, the student's, and the loss.

    The context's last token is held out as the label (the token the text really continues with);
    both models see the tokens before it.
    """
    import torch

    from .distill import distillation_loss
    t_slider = W.FloatSlider(value=temperature, min=0.5, max=5.0, step=0.25, description="temperature",
                             continuous_update=False)
    w_slider = W.FloatSlider(value=weight, min=0.0, max=1.0, step=0.05, description="weight",
                             continuous_update=False)
    out = W.Output()
    ids = tok.encode(context)
    x, label = torch.tensor([ids[:-1]]), ids[-1]
    with torch.inference_mode():   # each model on its own device; the plot's arithmetic on the CPU
        t_logits, s_logits = (m(x.to(next(m.parameters()).device))[0, -1].float().cpu() for m in (teacher, student))

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            T, w = t_slider.value, w_slider.value
            p, q = (t_logits / T).softmax(-1), (s_logits / T).softmax(-1)
            order = torch.topk(p, top).indices
            y = torch.tensor([label])
            hard = distillation_loss(s_logits[None], y, t_logits[None], weight=0.0).item()
            total = distillation_loss(s_logits[None], y, t_logits[None], weight=w, temperature=T).item()
            soft = (total - (1 - w) * hard) / w if w > 0 else float("nan")
            print(f"label {tok.decode([label])!r}: hard cross-entropy {hard:.3f} nats; "
                  f"T²·KL(teacher || student) at T={T:g}: {soft:.3f}; loss = {1 - w:.2f} x {hard:.3f} + "
                  f"{w:.2f} x {soft:.3f} = {total:.3f}" if w > 0 else
                  f"label {tok.decode([label])!r}: hard cross-entropy {hard:.3f} nats = the loss (weight 0)")
            print(f"teacher's probability mass outside its top {top} tokens at T={T:g}: "
                  f"{1 - p[order].sum().item():.1%}; on the label: {p[label].item():.1%}")
            fig, ax = plt.subplots(figsize=(9, 3.2))
            pos = torch.arange(top)
            ax.bar(pos - 0.2, p[order], 0.4, label=f"teacher, T={T:g}")
            ax.bar(pos + 0.2, q[order], 0.4, label=f"student, T={T:g}")
            labels = [repr(tok.decode([int(i)])) + (" ← label" if int(i) == label else "") for i in order]
            ax.set_xticks(pos, labels, rotation=40, ha="right", family="monospace", fontsize=8)
            ax.set_ylabel("probability")
            ax.legend(fontsize=8)
            plt.show()

    t_slider.observe(redraw, "value")
    w_slider.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([t_slider, w_slider]), out])


def decision_line(rungs: list[dict], scenario: str, ttft_slo_s: float, price_per_hour: float) -> str:
    """The decision guide's answer: the cheapest rung meeting the scenario's constraints, with its numbers."""
    from .bench.decision import SCENARIOS, recommend
    limits = {**SCENARIOS[scenario], "ttft_slo_s": ttft_slo_s}
    try:
        r, cost = recommend(rungs, price_per_hour, **limits)
    except ValueError as e:
        return f"{scenario}: {e}"
    budget = limits["memory_budget_bytes"]
    return (f"{scenario} (TTFT p99 <= {ttft_slo_s:g} s, perplexity within +{limits['max_ppl_delta_pct']:g}%"
            + (f", memory <= {budget / 2 ** 20:.0f} MiB" if budget else "") + f"): **{r['name']}**, "
            f"{r['throughput_tok_s']:.1f} tok/s, TTFT p99 {r['ttft_p99_s']:.2f} s, {r['peak_memory_bytes'] / 2 ** 20:.0f} MiB, "
            f"perplexity {r['ppl_delta_pct']:+.2f}%, {cost:.2f} per million tokens at {price_per_hour:.2f} per hour")


def decision_guide(rungs: list[dict], price_per_hour: float = 0.10) -> W.VBox:
    """Scenario, TTFT SLO and price -> the cheapest measured rung that meets them (`bench.decision.recommend`)."""
    from IPython.display import Markdown, display
    from .bench.decision import SCENARIOS
    scenario = W.Dropdown(options=list(SCENARIOS), description="scenario")
    slo = W.FloatLogSlider(value=SCENARIOS[scenario.value]["ttft_slo_s"], base=10, min=-2, max=3, step=0.1,
                           description="TTFT p99 SLO (s)", continuous_update=False, style={"description_width": "initial"})
    price = W.FloatText(value=price_per_hour, description="price / hour")
    out = W.Output()

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            if not price.value >= 0:
                print(f"the price must be a number >= 0, got {price.value}")
                return
            display(Markdown(decision_line(rungs, scenario.value, slo.value, price.value)))

    def new_scenario(_=None) -> None:
        slo.value = SCENARIOS[scenario.value]["ttft_slo_s"]
        redraw()

    scenario.observe(new_scenario, "value")
    slo.observe(redraw, "value")
    price.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([scenario, slo, price]), out])
