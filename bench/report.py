"""Markdown summary and figures for bench/cost.py's results (a dict, as written to cost.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALIGN_VARIANTS = ("EQSPEC", "EQSPEC-loop", "LazySpec")
POOL_DECODERS = ("EXSPEC", "EQSPEC", "batched-greedy")
POOL_LABELS = {
    "random": "random prompt lengths",
    "identical": "identical prompt lengths",
    "identical+eos": "identical, EOS stops",
}
HATCHES = (None, "//", "..")
WORKLOADS = {"fixed": "fixed output length", "eos": "EOS stops"}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def headline(results: dict[str, Any]) -> dict[str, str]:
    """The numbers the README records, as sentences keyed by topic."""
    lines: dict[str, str] = {}
    align = results.get("alignment")
    if align:
        b = str(max(align["batch_sizes"]))
        v, r = align["variants"], align["ratios"]
        lines["loop_vs_vectorized"] = (
            f"B={b}: per-row-loop realignment takes {r['loop_over_vectorized_realign'][b]:.1f}x the vectorized "
            f"gather's time ({v['EQSPEC-loop'][b]['realign_ms_per_round']:.2f} vs "
            f"{v['EQSPEC'][b]['realign_ms_per_round']:.2f} ms per round); share of decode time "
            f"{_pct(v['EQSPEC-loop'][b]['share'])} vs {_pct(v['EQSPEC'][b]['share'])}; "
            f"whole generate {r['loop_over_vectorized_total'][b]:.2f}x"
        )
        lines["lazy_vs_eqspec"] = (
            f"B={b}: LazySpec's realign (mask update + {v['LazySpec'][b]['compactions']} compactions) takes "
            f"{r['lazy_over_eqspec_realign'][b]:.2f}x EQSPEC's ({_pct(v['LazySpec'][b]['share'])} vs "
            f"{_pct(v['EQSPEC'][b]['share'])} of decode time); whole generate {r['lazy_over_eqspec_total'][b]:.2f}x"
        )
    group = results.get("grouping")
    if group:
        for pool, what in (("identical", "identical-length pool"), ("identical+eos", "same pool with EOS stops")):
            per_b = group["pools"][pool]
            parts = [f"B={b}: {per_b[b]['exspec_over_eqspec_verify_calls']:.2f}x" for b in per_b]
            lines[f"verify_calls_{pool}"] = f"EXSPEC/EQSPEC verification calls, {what}: " + ", ".join(parts)
    lat = results.get("latency")
    for workload, w in (lat or {}).get("workloads", {}).items():
        ratios = {b: e["exspec_over_eqspec"] for b, e in w["batch_sizes"].items()}
        parts = [
            f"B={b}: P50 {x['p50_s']:.2f}x, P90 {x['p90_s']:.2f}x, P99 {x['p99_s']:.2f}x, "
            f"throughput {x['tokens_per_s']:.2f}x (busy {x['busy_tokens_per_s']:.2f}x)"
            for b, x in ratios.items()
        ]
        lines[f"latency_{workload}"] = f"EXSPEC/EQSPEC latency, {WORKLOADS[workload]}: " + "; ".join(parts)
    return lines


def _lengths(stats: dict[str, Any]) -> str:
    return f"min {stats['min']}, median {stats['median']}, max {stats['max']} ({stats['at_limit']} at the limit)"


def markdown(results: dict[str, Any]) -> str:
    cfg, mach = results["config"], results["machine"]
    out = [
        "# Cost of correctness: tiny Llama pair" + (" (quick run)" if cfg["quick"] else ""),
        "",
        f"Machine: {mach['device']}"
        + (f" ({mach['gpu']})" if "gpu" in mach else f", {mach['cpu_count']} CPU cores, shared")
        + f"; torch {mach['torch']}, transformers {mach['transformers']}, {mach['torch_threads']} torch thread(s)"
        + (f"; load average at start {mach['loadavg_at_start']}" if "loadavg_at_start" in mach else "")
        + ".",
        f"Model: {cfg['model']}, {cfg['dtype']}; K={cfg['k']}, max_new_tokens={cfg['max_new_tokens']}, "
        f"prompt lengths {cfg['prompt_lengths'][0]}..{cfg['prompt_lengths'][1]}, no EOS; seed {cfg['seed']}. "
        f"Runtime {results.get('runtime_s', 0):.0f} s.",
        "EqSpecLoop check (repad unit check + identical tokens to EQSPEC): "
        + ("passed." if results["loop_check"]["ok"] else "FAILED."),
        "",
    ]
    lines = headline(results)
    if lines:
        out += ["## Key numbers", ""] + [f"- {line}" for line in lines.values()] + [""]
    align = results.get("alignment")
    if align:
        v, r = align["variants"], align["ratios"]
        out += [
            f"## 1. Alignment overhead (median of {align['repeats']} interleaved repeats)",
            "",
            "share = time in `realign` / whole `generate`; ms/round = realign time per round.",
            "",
            "| B | EQSPEC share | loop share | LazySpec share | EQSPEC ms/round | loop ms/round | LazySpec ms/round "
            "| loop/vec realign | Lazy/EQSPEC total | EQSPEC tok/s | Lazy compactions |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for b in map(str, align["batch_sizes"]):
            e, lp, lz = v["EQSPEC"][b], v["EQSPEC-loop"][b], v["LazySpec"][b]
            out.append(
                f"| {b} | {_pct(e['share'])} | {_pct(lp['share'])} | {_pct(lz['share'])} "
                f"| {e['realign_ms_per_round']:.3f} | {lp['realign_ms_per_round']:.3f} "
                f"| {lz['realign_ms_per_round']:.3f} | {r['loop_over_vectorized_realign'][b]:.2f}x "
                f"| {r['lazy_over_eqspec_total'][b]:.2f}x | {e['tokens_per_s']:.0f} | {lz['compactions']} |"
            )
        same = all(v[n][b]["same_tokens_as_eqspec"] for n in v for b in v[n])
        out += ["", f"All three variants produced identical tokens at every batch size: {same}.", ""]
    group = results.get("grouping")
    if group:
        out += [
            f"## 2. EXSPEC grouping, verification calls, throughput (pool of {group['pool_size']}, "
            f"window 2B, median of {group['repeats']} repeats)",
            "",
            f"Pools: `random` prompt lengths {cfg['prompt_lengths'][0]}..{cfg['prompt_lengths'][1]}; `identical` "
            f"all {group['same_length']} tokens; both run to max_new_tokens={cfg['max_new_tokens']} (no EOS). "
            f"`identical+eos`: the identical prompts, EOS = token {group['eos_pool']['eos_token_id']} (the target's "
            f"most frequent greedy token there), max_new_tokens={group['eos_pool']['max_new_tokens']}: output lengths "
            f"{_lengths(group['eos_pool']['output_lengths'])}.",
            "",
            "Verification calls are target forwards on a non-empty cache (prefill calls excluded; batched greedy's "
            "are its one-token decode steps). Alignment share: EQSPEC's realign, EXSPEC's stack/unstack "
            "(round minus propose and verify), over total time.",
            "",
            "| pool | B | grouping rate | EXSPEC verify (prefill) | EQSPEC verify | EXSPEC/EQSPEC calls "
            "| rows/round EX / EQ | tok/s EX / EQ / greedy | align share EX / EQ | EX tokens = EQ |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for pool, per_b in group["pools"].items():
            for b, e in per_b.items():
                ex, eq, gr = e["EXSPEC"], e["EQSPEC"], e["batched-greedy"]
                out.append(
                    f"| {pool} | {b} | {_pct(ex['grouping_rate'])} | {ex['verify_calls']} ({ex['prefill_calls']}) "
                    f"| {eq['verify_calls']} | {e['exspec_over_eqspec_verify_calls']:.2f} "
                    f"| {ex['mean_rows_per_round']:.2f} / {eq['mean_rows_per_round']:.2f} "
                    f"| {ex['tokens_per_s']:.0f} / {eq['tokens_per_s']:.0f} / {gr['tokens_per_s']:.0f} "
                    f"| {_pct(ex['alignment_share'])} / {_pct(eq['alignment_share'])} "
                    f"| {_pct(ex['same_tokens_as_eqspec'])} |"
                )
        out.append("")
    lat = results.get("latency")
    if lat:
        out += [
            f"## 3. Online latency ({lat['requests']} requests, Poisson arrivals at load {lat['load']}, "
            f"median of {lat['repeats']} repeats)",
            "",
            "Load 1.0: mean inter-arrival gap = EQSPEC's offline busy time per request at that B (measured "
            "just before). Random prompt lengths. tok/s = tokens / makespan; busy tok/s = tokens / compute time.",
            "",
            "| workload | B | gap ms | decoder | P50 ms | P90 ms | P99 ms | max ms | tok/s | busy tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for w in lat["workloads"].values():
            label = (
                f"fixed ({w['max_new_tokens']} tokens)"
                if w["eos_token_id"] is None
                else f"EOS {w['eos_token_id']}, max {w['max_new_tokens']}"
            )
            for b, e in w["batch_sizes"].items():
                for name in ("EQSPEC", "EXSPEC"):
                    d = e[name]
                    out.append(
                        f"| {label} | {b} | {e['mean_interarrival_ms']:.1f} | {name} | {1e3 * d['p50_s']:.0f} "
                        f"| {1e3 * d['p90_s']:.0f} | {1e3 * d['p99_s']:.0f} | {1e3 * d['max_s']:.0f} "
                        f"| {d['tokens_per_s']:.0f} | {d['busy_tokens_per_s']:.0f} |"
                    )
        out.append("")
    return "\n".join(out)


def figures(results: dict[str, Any], out: Path) -> list[str]:
    """Write the PNGs that exist for the parts present; returns their file names (none without
    matplotlib, e.g. on a device machine: the tables in cost.md carry every number)."""
    try:
        import matplotlib
    except ImportError:
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    align, group, lat = results.get("alignment"), results.get("grouping"), results.get("latency")
    device = results["machine"]["device"]
    if align or group:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        ax = axes[0]
        if align:
            sizes = align["batch_sizes"]
            for name, style in zip(ALIGN_VARIANTS, ("o-", "s--", "^-.")):
                share = [100 * align["variants"][name][str(b)]["share"] for b in sizes]
                ax.plot(sizes, share, style, label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.set_xlabel("batch size")
            ax.set_ylabel("realignment / decode time (%)")
            ax.set_title(f"(a) alignment overhead ({device})")
            ax.legend()
            ax.grid(alpha=0.3)
        ax = axes[1]
        if group:
            sizes = group["batch_sizes"]
            for pool, style in zip(group["pools"], ("o-", "s--", "^:")):
                rate = [100 * group["pools"][pool][str(b)]["EXSPEC"]["grouping_rate"] for b in sizes]
                ax.plot(sizes, rate, style, label=POOL_LABELS.get(pool, pool))
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.set_ylim(0, 105)
            ax.set_xlabel("batch size (window = 2B)")
            ax.set_ylabel("grouped rounds / all rounds (%)")
            ax.set_title("(b) EXSPEC grouping rate")
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "fig5_cost.png", dpi=120)
        plt.close(fig)
        written.append("fig5_cost.png")
    if align:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        sizes = align["batch_sizes"]
        for name, style in zip(ALIGN_VARIANTS, ("o-", "s--", "^-.")):
            ax.plot(sizes, [align["variants"][name][str(b)]["realign_ms_per_round"] for b in sizes], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("realign time per round (ms)")
        ax.set_title(f"realignment cost per round ({device})")
        ax.legend()
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        fig.savefig(out / "realign_per_round.png", dpi=120)
        plt.close(fig)
        written.append("realign_per_round.png")
    if group:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        sizes = group["batch_sizes"]
        pools = list(group["pools"])
        bars = [(p, d) for p in pools for d in POOL_DECODERS]
        width = 0.8 / len(bars)
        for j, (pool, dec) in enumerate(bars):
            xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(sizes))]
            label = f"{dec}, {pool}"
            hatch = HATCHES[pools.index(pool) % len(HATCHES)]
            calls = [group["pools"][pool][str(b)][dec]["verify_calls"] for b in sizes]
            tps = [group["pools"][pool][str(b)][dec]["tokens_per_s"] for b in sizes]
            color = f"C{POOL_DECODERS.index(dec)}"
            axes[0].bar(xs, calls, width, label=label, color=color, hatch=hatch, edgecolor="black", linewidth=0.3)
            axes[1].bar(xs, tps, width, label=label, color=color, hatch=hatch, edgecolor="black", linewidth=0.3)
        for ax, ylabel in zip(axes, ("target calls after prefill", "tokens / s")):
            ax.set_xticks(range(len(sizes)), [f"B={b}" for b in sizes])
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, axis="y")
        axes[0].set_title(f"verification calls, pool of {group['pool_size']}")
        axes[1].set_title(f"throughput ({device})")
        axes[0].set_yscale("log")
        axes[1].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "calls_throughput.png", dpi=120)
        plt.close(fig)
        written.append("calls_throughput.png")
    if lat:
        workloads = lat["workloads"]
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
        for ax, (workload, w) in zip(axes[0], workloads.items()):
            sizes = list(w["batch_sizes"])
            width = 0.13
            for j, (name, q) in enumerate((n, q) for n in ("EQSPEC", "EXSPEC") for q in ("p50", "p90", "p99")):
                xs = [i + (j - 2.5) * width for i in range(len(sizes))]
                ys = [1e3 * w["batch_sizes"][b][name][f"{q}_s"] for b in sizes]
                color = "C0" if name == "EQSPEC" else "C1"
                alpha = {"p50": 0.45, "p90": 0.7, "p99": 1.0}[q]
                ax.bar(xs, ys, width, color=color, alpha=alpha, label=f"{name} {q.upper()}", edgecolor="black", lw=0.3)
            ax.set_xticks(range(len(sizes)), [f"B={b}" for b in sizes])
            ax.set_ylim(0, 1.4 * ax.get_ylim()[1])  # room for the legend above the bars
            ax.set_ylabel("request latency (ms)")
            ax.set_title(f"{WORKLOADS[workload]}: {lat['requests']} Poisson arrivals, load {lat['load']} ({device})")
            ax.legend(fontsize=7, ncol=2)
            ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=120)
        plt.close(fig)
        written.append("latency.png")
    return written
