"""The harness's own cost per observed target forward, apart from the model's forward (issue 40).

    python bench/harness_cost.py [--layers 12 --hidden 256 --ffn 512] [--batch-size 8] [--new-tokens 24]
                                 [--repeats 5] [--label before] [--out bench/results]

A config-built Llama pair (`bench/gpu_model.py`: `--layers` target layers, a layer-skip draft of
the first 4) is written to a temporary folder and loaded as the real-model audit loads it. On one
batch of the shipped prompts the reference EQSPEC decoder runs side by side, interleaved
`--repeats` times: bare (un-instrumented models), and instrumented at I2 check rate 1.0 and 0.25
(the GPU check's), the I1 + I2 checks timed after each instrumented run. Times are the process's
CPU seconds with one torch thread (`cpu_seconds`): on two cores shared with other work, wall
time differences of a few percent drown in the load. The model's forwards are the same work in
both runs, so

    recording per forward = (instrumented - bare) / target forwards
    checks per forward    = (I1 + I2 seconds) / target forwards
    harness ratio         = (instrumented - bare + checks) / bare

is the harness's cost apart from the model, per observed target forward and against the bare
decoder on the same run. The per-forward work (hooks, snapshots, the checks' comparisons) is
the same on any device; on a GPU the model's forward shrinks and the ratio grows by the factor
the forward got faster, which is what this table predicts. One noise-floor calibration per model
and dtype is timed too (`specaudit.numerics.calibration`, shared through the cache by every
audit of a run). Medians; appends a section labelled `--label` to bench/results/harness_cost.md
and its figures to harness_cost.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable next to the package
    sys.path.insert(0, str(ROOT))

from specaudit.adapters.realmodel import (  # noqa: E402
    checks_target,
    make_sampler,
    oracle_for,
    real_case,
    run_batch,
    timed_call,
    warm_up,
)
from specaudit.checks import check_i1, check_i2  # noqa: E402
from specaudit.contracts.decoder import load_decoder  # noqa: E402
from specaudit.models.loading import load_pair, read_prompts, special_ids, tokenize  # noqa: E402
from specaudit.models.pretrained import DEFAULT_PROMPTS  # noqa: E402
from specaudit.numerics.calibration import calibrate  # noqa: E402

DECODER = "specaudit.reference.eqspec:EqSpec"
RATES = (1.0, 0.25)
TIMEOUT_S = 600.0
RESULTS = Path(__file__).resolve().parent / "results"


def build_pair(folder: Path, args: argparse.Namespace) -> None:
    """The target and draft directories, by bench/gpu_model.py in a process of its own."""
    command = [sys.executable, str(ROOT / "bench" / "gpu_model.py"), str(folder), "--layers", str(args.layers)]
    command += ["--hidden", str(args.hidden), "--heads", "8", "--kv-heads", "4", "--ffn", str(args.ffn)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def cpu_seconds(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()` and the CPU seconds this process spent in it: with one torch thread the model runs
    in this thread, so the other agents' load on the shared cores does not land in the figure as
    it does in wall time."""
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def judge(run: Any) -> list[Any]:
    """I1 and I2 on the run, as the audit checks it."""
    return [*check_i1(run), *check_i2(run)]


def measure_rate(case: Any, target: Any, draft: Any, rate: float, repeats: int) -> dict[str, Any]:
    """Bare decoder, instrumented decoder at I2 rate `rate`, then I1 + I2: interleaved, medians."""
    factory = load_decoder(DECODER)
    oracle, _ = oracle_for(checks_target(target), case)
    warm_up(DECODER, factory, target, draft, case, TIMEOUT_S)
    bare, audited, checks = [], [], []
    run = None
    for _ in range(repeats):
        bare.append(cpu_seconds(lambda: timed_call(DECODER, factory, target, draft, case, TIMEOUT_S))[1])
        sample = make_sampler(0, 0, rate)
        batch = partial(run_batch, DECODER, factory, case, target, draft, sample=sample, sample_rate=rate,
                        baseline=False, oracle=oracle)  # fmt: skip
        run, seconds = cpu_seconds(batch)
        audited.append(seconds)
        violations, seconds = cpu_seconds(partial(judge, run))
        checks.append(seconds)
        assert not violations, f"EQSPEC must pass; the harness found {violations[:2]}"
    assert run is not None
    return {
        "rate": rate,
        "target_forwards": len(run.recording.target_calls),
        "sampled": run.sampled_calls,
        "bare": statistics.median(bare),
        "recording": statistics.median(a - b for a, b in zip(audited, bare)),
        "checks": statistics.median(checks),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        build_pair(Path(tmp), args)
        target, draft, tokenizer = load_pair(Path(tmp) / "target", Path(tmp) / "draft", "cpu", args.dtype)
    eos, pad = special_ids(tokenizer)
    tokens = tokenize(tokenizer, read_prompts(DEFAULT_PROMPTS)[: args.batch_size])
    tokens = [t[: args.max_prompt] for t in tokens]
    case = real_case(tokens, num_draft_tokens=4, max_new_tokens=args.new_tokens, eos_token_id=None,
                     pad_token_id=pad, model="bench", dtype=args.dtype)  # fmt: skip
    out = []
    for rate in RATES:
        m = measure_rate(case, target, draft, rate, args.repeats)
        n, harness = m["target_forwards"], m["recording"] + m["checks"]
        out.append({
            "rate": rate, "target_forwards": n, "sampled": m["sampled"],
            "bare_ms_per_forward": 1e3 * m["bare"] / n,
            "recording_ms_per_forward": 1e3 * m["recording"] / n,
            "checks_ms_per_forward": 1e3 * m["checks"] / n,
            "harness_ms_per_forward": 1e3 * harness / n,
            "harness_ratio": harness / m["bare"],
            "bare_tokens_per_second": args.batch_size * args.new_tokens / m["bare"],
            "audited_tokens_per_second": args.batch_size * args.new_tokens / (m["bare"] + harness),
        })  # fmt: skip
        print(f"rate {rate}: {out[-1]}", flush=True)
    oracle, _ = oracle_for(checks_target(target), case, keep_kv=False)
    sequences = [list(p) + list(o.tokens) for p, o in zip(case.prompts, oracle)]
    _, floor_seconds = cpu_seconds(lambda: calibrate(target, sequences, [len(t) for t in tokens], pad, label="bench"))
    return {"rows": out, "noise_floor_seconds": floor_seconds}


def render(label: str, args: argparse.Namespace, result: dict[str, Any]) -> str:
    lines = [
        f"## {label}",
        "",
        f"`python bench/harness_cost.py {shlex.join(sys.argv[1:])}`: {args.layers}-layer Llama (hidden {args.hidden}, "
        f"ffn {args.ffn}), {args.dtype}, batch {args.batch_size}, {args.new_tokens} new tokens, K=4, EQSPEC, "
        f"1 torch thread, CPU seconds, {platform.processor() or platform.machine()}, median of {args.repeats}.",
        "",
        "| I2 rate | target forwards | bare ms/forward | recording ms/forward | checks ms/forward | harness ms/forward "
        "| harness / bare | tok/s bare | tok/s audited |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['rate']:.2f} | {r['target_forwards']} | {r['bare_ms_per_forward']:.1f} "
            f"| {r['recording_ms_per_forward']:.1f} | {r['checks_ms_per_forward']:.1f} "
            f"| {r['harness_ms_per_forward']:.1f} | {r['harness_ratio']:.2f} | {r['bare_tokens_per_second']:.0f} "
            f"| {r['audited_tokens_per_second']:.0f} |"
        )
    lines += ["", f"Noise floor, once per model and dtype: {result['noise_floor_seconds']:.1f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept per row")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="measured")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "harness_cost.md"
    head = "" if md.exists() else "# The harness's cost per observed target forward (bench/harness_cost.py)\n\n"
    md.write_text((md.read_text() if md.exists() else head) + render(args.label, args, result) + "\n")
    store = args.out / "harness_cost.json"
    data = json.loads(store.read_text()) if store.exists() else {}
    data[args.label] = {"args": vars(args) | {"out": str(args.out)}, **result}
    store.write_text(json.dumps(data, indent=1) + "\n")
    print(render(args.label, args, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
