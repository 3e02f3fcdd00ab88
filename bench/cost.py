"""Cost of correctness for batch speculative decoding on the tiny Llama pair (paper, 3.2, 4.3, E).

    python bench/cost.py [--quick] [--device cuda]

Three measurements, every compared variant run side by side (interleaved, order rotated per
repeat) and summarized by medians over repeats:

1. alignment: share of generate time spent in `realign` against batch size, for EQSPEC's
   vectorized gather, a per-row Python-loop realignment (`bench.variants.EqSpecLoop`) and
   LazySpec (mask update plus occasional compaction);
2. grouping: EXSPEC's grouping rate (grouped / all rounds) on a random-length pool and an
   identical-length pool, target verification calls and tokens/s for EXSPEC, EQSPEC and
   non-speculative batched greedy on the same pools;
3. latency: per-request P50/P90/P99 latency and throughput of EQSPEC static batches vs an
   EXSPEC pool under one seeded Poisson arrival trace (`bench.serving`).

Writes bench/results/cost.json, cost.md and PNG figures (see bench/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable next to the package
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.serving import ExSpecServer, arrival_trace, pad_prompts, serve_eqspec  # noqa: E402
from bench.variants import (  # noqa: E402
    CallCounter,
    TimedBatchedGreedy,
    TimedEqSpec,
    TimedEqSpecLoop,
    TimedExSpec,
    TimedLazySpec,
    check_repad_loop,
    synchronizer,
)
from specaudit.fixtures import VOCAB_SIZE  # noqa: E402
from specaudit.fixtures.tiny import build_tiny  # noqa: E402

FULL = {
    "align_batch_sizes": [1, 2, 4, 8, 16, 32],
    "align_repeats": 11,
    "group_batch_sizes": [2, 4, 8, 16],
    "pool_size": 32,
    "group_repeats": 3,
    "latency_batch_sizes": [2, 4, 8],
    "requests": 32,
    "latency_repeats": 4,
    "calibration_runs": 3,
}
QUICK = {
    "align_batch_sizes": [1, 4, 32],
    "align_repeats": 2,
    "group_batch_sizes": [2, 8],
    "pool_size": 16,
    "group_repeats": 1,
    "latency_batch_sizes": [4],
    "requests": 16,
    "latency_repeats": 1,
    "calibration_runs": 1,
}
MIN_LEN, MAX_LEN, SAME_LEN = 8, 48, 28
EOS_MAX_NEW = 96  # length limit of the pool whose rows stop at an EOS


def make_prompts(n: int, seed: int, *, length: int | None = None) -> list[list[int]]:
    """n prompts of uniform lengths MIN_LEN..MAX_LEN (or all `length`), tokens uniform over the vocabulary."""
    rng = random.Random(seed)
    lengths = [length or rng.randint(MIN_LEN, MAX_LEN) for _ in range(n)]
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n_tok)] for n_tok in lengths]


def rotated(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = QUICK if args.quick else FULL
        self.device = torch.device(args.device)
        self.sync = synchronizer(self.device)
        dtype = getattr(torch, args.dtype)
        # the built models are cached and shared: copy before moving, never mutate them
        self.target = copy.deepcopy(build_tiny("llama", "target", dtype=dtype)).to(self.device)
        self.draft = copy.deepcopy(build_tiny("llama", "draft", dtype=dtype)).to(self.device)
        self.k, self.max_new = args.k, args.max_new_tokens

    def generate(
        self, decoder: Any, prompts: list[list[int]], *, eos: int | None = None, max_new: int | None = None
    ) -> list[list[int]]:
        ids, mask = pad_prompts(prompts, self.device)
        return decoder.generate(
            self.target,
            self.draft,
            ids,
            mask,
            num_draft_tokens=self.k,
            max_new_tokens=max_new or self.max_new,
            eos_token_id=eos,
            pad_token_id=0,
        )

    def new(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        decoder = cls(*args, **kwargs)
        decoder.sync = self.sync
        decoder.reset_timers()
        return decoder

    # ---------------------------------------------------------------- 0: EqSpecLoop is correct
    def check_loop(self) -> dict[str, Any]:
        """The per-row loop realignment must be a drop-in: same repad result, same tokens as EQSPEC."""
        unit = check_repad_loop(self.device)
        batches = []
        for b, seed in ((3, 11), (8, 12), (16, 13)):
            prompts = make_prompts(b, seed)
            vec = self.generate(self.new(TimedEqSpec), prompts)
            loop = self.generate(self.new(TimedEqSpecLoop), prompts)
            batches.append({"batch_size": b, "identical": vec == loop})
        ok = unit["ok"] and all(x["identical"] for x in batches)
        if not ok:
            raise SystemExit(f"EqSpecLoop is not equivalent to EqSpec: {unit}, {batches}")
        return {"ok": ok, "repad_unit_check": unit, "generate_checks": batches}

    # ---------------------------------------------------------------- 1: alignment overhead
    def alignment(self) -> dict[str, Any]:
        variants = {"EQSPEC": TimedEqSpec, "EQSPEC-loop": TimedEqSpecLoop, "LazySpec": TimedLazySpec}
        sizes = self.cfg["align_batch_sizes"]
        prompts = {b: make_prompts(b, self.args.seed * 1000 + b) for b in sizes}
        for cls in variants.values():  # warm-up
            self.generate(self.new(cls), make_prompts(4, 1))
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {n: {b: [] for b in sizes} for n in variants}
        agree: dict[str, dict[int, list[list[int]]]] = {n: {} for n in variants}  # first-repeat outputs
        for rep in range(self.cfg["align_repeats"]):
            for i, b in enumerate(sizes):
                for name in rotated(list(variants), rep + i):
                    decoder = self.new(variants[name])
                    out = self.generate(decoder, prompts[b])
                    if rep == 0:
                        agree[name][b] = out
                    times = dict(decoder.times)
                    runs[name][b].append(
                        {
                            **{
                                f"{p}_s": times.get(p, 0.0)
                                for p in ("total", "prefill", "propose", "verify", "realign")
                            },
                            "rounds": decoder.counts.get("realign", 0),
                            "compactions": getattr(decoder, "compactions", None),
                            "tokens": sum(map(len, out)),
                        }
                    )
            print(f"  alignment repeat {rep + 1}/{self.cfg['align_repeats']} done", flush=True)
        summary: dict[str, Any] = {"batch_sizes": sizes, "variants": {}}
        for name in variants:
            per_b = {}
            for b in sizes:
                rs = runs[name][b]
                per_b[str(b)] = {
                    "total_ms": 1e3 * median([r["total_s"] for r in rs]),
                    "realign_ms": 1e3 * median([r["realign_s"] for r in rs]),
                    "realign_ms_per_round": 1e3 * median([r["realign_s"] / max(r["rounds"], 1) for r in rs]),
                    "share": median([r["realign_s"] / r["total_s"] for r in rs]),
                    "share_iqr": _iqr([r["realign_s"] / r["total_s"] for r in rs]),
                    "non_model_share": median(
                        [(r["total_s"] - r["prefill_s"] - r["propose_s"] - r["verify_s"]) / r["total_s"] for r in rs]
                    ),
                    "rounds": rs[0]["rounds"],
                    "compactions": rs[0]["compactions"],
                    "tokens_per_s": median([r["tokens"] / r["total_s"] for r in rs]),
                    "same_tokens_as_eqspec": agree[name][b] == agree["EQSPEC"][b],
                }
            summary["variants"][name] = per_b
        summary["ratios"] = {
            ratio: {
                str(b): median([x[field] / y[field] for x, y in zip(runs[num][b], runs["EQSPEC"][b])]) for b in sizes
            }
            for ratio, num, field in (
                ("loop_over_vectorized_realign", "EQSPEC-loop", "realign_s"),
                ("loop_over_vectorized_total", "EQSPEC-loop", "total_s"),
                ("lazy_over_eqspec_realign", "LazySpec", "realign_s"),
                ("lazy_over_eqspec_total", "LazySpec", "total_s"),
            )
        }
        summary["repeats"] = self.cfg["align_repeats"]
        return summary

    # ---------------------------------------------------------------- 2: grouping, calls, throughput
    def grouping(self) -> dict[str, Any]:
        n, sizes = self.cfg["pool_size"], self.cfg["group_batch_sizes"]
        same = make_prompts(n, self.args.seed * 1000 + 8, length=SAME_LEN)
        eos = self.frequent_token(same)
        # pool -> (prompts, eos, max_new_tokens); the last one has ragged output lengths, as real
        # requests do: EOS is the target's most frequent greedy token on those prompts
        pools = {
            "random": (make_prompts(n, self.args.seed * 1000 + 7), None, self.max_new),
            "identical": (same, None, self.max_new),
            "identical+eos": (same, eos, EOS_MAX_NEW),
        }
        counter = CallCounter(self.target)
        decoders = ["EXSPEC", "EQSPEC", "batched-greedy"]
        runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        outputs: dict[tuple[str, int, str], list[list[int]]] = {}
        try:
            for rep in range(self.cfg["group_repeats"]):
                for i, b in enumerate(sizes):
                    for pool_name, (prompts, pool_eos, max_new) in pools.items():
                        for name in rotated(decoders, rep + i):
                            counter.reset()
                            run, out = self._pool_run(name, b, prompts, pool_eos, max_new)
                            run.update(prefill_calls=counter.prefill, verify_calls=counter.decode)
                            runs.setdefault((pool_name, b, name), []).append(run)
                            outputs.setdefault((pool_name, b, name), out)
                print(f"  grouping repeat {rep + 1}/{self.cfg['group_repeats']} done", flush=True)
        finally:
            counter.remove()
        summary: dict[str, Any] = {
            "batch_sizes": sizes,
            "pool_size": n,
            "same_length": SAME_LEN,
            "eos_pool": {"eos_token_id": eos, "max_new_tokens": EOS_MAX_NEW},
            "pools": {},
        }
        for pool_name in pools:
            per_b = {}
            for b in sizes:
                entry: dict[str, Any] = {"window": 2 * b}
                for name in decoders:
                    rs = runs[(pool_name, b, name)]
                    entry[name] = {
                        "total_ms": 1e3 * median([r["total_s"] for r in rs]),
                        "tokens_per_s": median([r["tokens"] / r["total_s"] for r in rs]),
                        "verify_calls": rs[0]["verify_calls"],
                        "prefill_calls": rs[0]["prefill_calls"],
                        "alignment_share": median([r["align_s"] / r["total_s"] for r in rs]),
                        "same_tokens_as_eqspec": _row_agreement(
                            outputs[(pool_name, b, name)], outputs[(pool_name, b, "EQSPEC")]
                        ),
                    }
                    if name == "EXSPEC":
                        grouped, fallback = rs[0]["grouped_rounds"], rs[0]["fallback_rounds"]
                        entry[name].update(
                            grouped_rounds=grouped,
                            fallback_rounds=fallback,
                            grouping_rate=grouped / max(grouped + fallback, 1),
                            mean_rows_per_round=rs[0]["row_rounds"] / max(grouped + fallback, 1),
                        )
                    if name == "EQSPEC":
                        entry[name]["mean_rows_per_round"] = rs[0]["row_rounds"] / max(rs[0]["verify_calls"], 1)
                ex, eq = runs[(pool_name, b, "EXSPEC")], runs[(pool_name, b, "EQSPEC")]
                entry["exspec_over_eqspec_verify_calls"] = ex[0]["verify_calls"] / eq[0]["verify_calls"]
                entry["exspec_over_eqspec_tokens_per_s"] = median(
                    [(x["tokens"] / x["total_s"]) / (y["tokens"] / y["total_s"]) for x, y in zip(ex, eq)]
                )
                per_b[str(b)] = entry
            summary["pools"][pool_name] = per_b
        lengths = sorted(len(row) for row in outputs[("identical+eos", sizes[0], "EQSPEC")])
        summary["eos_pool"]["output_lengths"] = {
            "min": lengths[0],
            "median": statistics.median(lengths),
            "max": lengths[-1],
            "at_limit": sum(n == EOS_MAX_NEW for n in lengths),
        }
        summary["repeats"] = self.cfg["group_repeats"]
        return summary

    def frequent_token(self, prompts: list[list[int]]) -> int:
        """The target's most frequent greedy token on `prompts` (EOS-blind EQSPEC run, ties to the lower id)."""
        out = self.generate(self.new(TimedEqSpec), prompts, max_new=EOS_MAX_NEW)
        counts = Counter(t for row in out for t in row)
        return min(counts, key=lambda t: (-counts[t], t))

    def _pool_run(
        self, name: str, b: int, prompts: list[list[int]], eos: int | None, max_new: int
    ) -> tuple[dict[str, Any], list[list[int]]]:
        """One decoder over the whole pool: EXSPEC takes the pool at once (window 2B); EQSPEC and
        batched greedy take static batches of B in arrival order."""
        if name == "EXSPEC":
            decoder = self.new(TimedExSpec, batch_size=b, window=2 * b)
            row_rounds = 0
            original = decoder.schedule

            def schedule(active: list[Any]) -> list[Any]:
                nonlocal row_rounds
                batch = original(active)
                row_rounds += len(batch)
                return batch

            decoder.schedule = schedule
            out = self.generate(decoder, prompts, eos=eos, max_new=max_new)
            t = decoder.times
            align = t["round"] - t["propose"] - t["verify"]  # stack + unstack + accept/commit
            return {
                "total_s": t["total"],
                "align_s": align,
                "tokens": sum(map(len, out)),
                "grouped_rounds": decoder.grouped_rounds,
                "fallback_rounds": decoder.fallback_rounds,
                "row_rounds": row_rounds,
            }, out
        cls = TimedEqSpec if name == "EQSPEC" else TimedBatchedGreedy
        out, total, align, row_rounds = [], 0.0, 0.0, 0
        for start in range(0, len(prompts), b):
            decoder = self.new(cls)
            if name == "EQSPEC":
                original = decoder.batch_verify

                def verify(target: Any, state: Any, drafts: Any, _orig: Any = original) -> Any:
                    nonlocal row_rounds
                    row_rounds += int(drafts.shape[0])
                    return _orig(target, state, drafts)

                decoder.batch_verify = verify
            out += self.generate(decoder, prompts[start : start + b], eos=eos, max_new=max_new)
            total += decoder.times["total"]
            align += decoder.times.get("realign", 0.0)
        return {"total_s": total, "align_s": align, "tokens": sum(map(len, out)), "row_rounds": row_rounds}, out

    # ---------------------------------------------------------------- 3: online latency
    def latency(self) -> dict[str, Any]:
        n = self.cfg["requests"]
        prompts = make_prompts(n, self.args.seed * 1000 + 9)
        eos = self.frequent_token(prompts)
        # workload -> (eos, max_new_tokens): every request wants the same number of tokens, or
        # requests stop at an EOS (the target's most frequent greedy token) and lengths vary
        workloads = {"fixed": (None, self.max_new), "eos": (eos, EOS_MAX_NEW)}
        summary: dict[str, Any] = {"requests": n, "load": self.args.load, "workloads": {}}
        for workload, (w_eos, max_new) in workloads.items():
            common = {"k": self.k, "max_new_tokens": max_new, "device": self.device, "sync": self.sync}
            common["eos_token_id"] = w_eos
            per_b: dict[str, Any] = {}
            for b in self.cfg["latency_batch_sizes"]:
                # calibration: EQSPEC's busy time with every request present at t=0 (median of a few
                # runs) sets the trace's scale, so the load factor means the same on any device
                offline = [0.0] * n
                serve_eqspec(self.target, self.draft, prompts[: 2 * b], offline[: 2 * b], batch_size=b, **common)
                service = median(
                    [
                        serve_eqspec(self.target, self.draft, prompts, offline, batch_size=b, **common).busy_s
                        for _ in range(self.cfg["calibration_runs"])
                    ]
                )
                mean_gap = service / n / self.args.load
                trace = arrival_trace(n, mean_gap, self.args.seed * 1000 + b)
                runs: dict[str, list[dict[str, float]]] = {"EQSPEC": [], "EXSPEC": []}
                for rep in range(self.cfg["latency_repeats"]):
                    for name in rotated(list(runs), rep):
                        if name == "EQSPEC":
                            res = serve_eqspec(self.target, self.draft, prompts, trace, batch_size=b, **common)
                        else:
                            server = ExSpecServer(batch_size=b, window=2 * b)
                            res = server.serve(self.target, self.draft, prompts, trace, **common)
                        runs[name].append(_latency_stats(res))
                entry: dict[str, Any] = {
                    "mean_interarrival_ms": 1e3 * mean_gap,
                    "eqspec_offline_busy_ms": 1e3 * service,
                    "window": 2 * b,
                }
                for name, rs in runs.items():
                    entry[name] = {key: median([r[key] for r in rs]) for key in rs[0]}
                entry["exspec_over_eqspec"] = {
                    key: entry["EXSPEC"][key] / entry["EQSPEC"][key]
                    for key in ("p50_s", "p90_s", "p99_s", "tokens_per_s", "busy_tokens_per_s")
                }
                per_b[str(b)] = entry
                print(f"  latency {workload} B={b} done", flush=True)
            summary["workloads"][workload] = {"eos_token_id": w_eos, "max_new_tokens": max_new, "batch_sizes": per_b}
        summary["repeats"] = self.cfg["latency_repeats"]
        return summary


def _latency_stats(res: Any) -> dict[str, float]:
    lat = res.latencies
    makespan = max(res.finish) - min(res.arrival)
    return {
        "p50_s": percentile(lat, 50),
        "p90_s": percentile(lat, 90),
        "p99_s": percentile(lat, 99),
        "mean_s": statistics.fmean(lat),
        "max_s": max(lat),
        "tokens_per_s": res.tokens / makespan,
        "busy_tokens_per_s": res.tokens / res.busy_s,
        "makespan_s": makespan,
    }


def _iqr(values: list[float]) -> list[float]:
    return [percentile(values, 25), percentile(values, 75)]


def _row_agreement(out: list[list[int]], ref: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(out, ref)) / len(ref)


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer sizes and repeats")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: less noise)")
    parser.add_argument("--k", type=int, default=5, help="draft tokens per round (paper: 5)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--load", type=float, default=1.0, help="arrival rate / EQSPEC's offline service rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default bench/results (bench/results/quick with --quick)")
    parser.add_argument("--only", nargs="*", choices=["alignment", "grouping", "latency"], help="run a subset")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # reference/ creates some tensors with torch.arange / torch.tensor and no device; on an
    # accelerator they must land there too, so everything runs under a default-device context.
    context = torch.device(device) if device.type != "cpu" else contextlib.nullcontext()
    started = time.perf_counter()
    results: dict[str, Any] = {}
    # models are built (and cached by specaudit.fixtures.tiny) on the CPU, outside that context: built under
    # it, their weights would be drawn on the device, by its generator, into the shared cache
    bench = Bench(args)
    with context, torch.no_grad():
        results["config"] = {
            **bench.cfg,
            "quick": args.quick,
            "model": "tiny llama (specaudit.fixtures.tiny): target 2 layers, draft = its first layer",
            "dtype": args.dtype,
            "k": args.k,
            "max_new_tokens": args.max_new_tokens,
            "prompt_lengths": [MIN_LEN, MAX_LEN],
            "seed": args.seed,
        }
        results["machine"] = machine(device)
        print("checking EqSpecLoop against EqSpec ...", flush=True)
        results["loop_check"] = bench.check_loop()
        for part in args.only or ["alignment", "grouping", "latency"]:
            print(f"{part} ...", flush=True)
            t0 = time.perf_counter()
            results[part] = getattr(bench, part)()
            results[part]["wall_s"] = time.perf_counter() - t0
    results["runtime_s"] = time.perf_counter() - started
    out = args.out or ROOT / "bench" / "results" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "cost.md").write_text(report.markdown(results))
    figures = report.figures(results, out)
    print(report.markdown(results))
    print(f"wrote {out}/cost.json, cost.md, {', '.join(figures)} after {results['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
