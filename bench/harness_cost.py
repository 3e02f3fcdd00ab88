"""The harness's own cost per observed target forward, apart from the model's forward (issue 40).

    python bench/harness_cost.py [--layers 12 --hidden 256 --ffn 512] [--batch-size 8] [--new-tokens 24]
                                 [--repeats 5] [--label before] [--out bench/results] [--before TREE]

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
decoder on the same run. The difference of two runs' seconds is noisy on shared cores (the bare
run alone moves by 10-20%), so the recording is also timed where it runs: the CPU seconds spent
inside the hooks' `_Watch.record` and `_Watch.finish` (inputs, snapshots, top-1), the `hooks`
column; the harness ratio is taken with the hooks' figure, `instrumented - bare` is kept beside
it as a cross-check. The per-forward work (hooks, snapshots, the checks' comparisons) is
the same on any device; on a GPU the model's forward shrinks and the ratio grows by the factor
the forward got faster, which is what this table predicts. One noise-floor calibration per model
and dtype is timed too (`specaudit.numerics.calibration`, shared through the cache by every
audit of a run). Medians; appends a section labelled `--label` to bench/results/harness_cost.md
and its figures to harness_cost.json.

`--before TREE` measures another version of the harness in the same invocation, first, with the
same settings: TREE is a source tree (`git archive <commit> harness | tar -x -C TREE`), and this
script runs again in a process of its own with TREE/harness imported as `specaudit`. Its rows are
rendered beside this tree's, one after the other on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
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
from specaudit.running.instrument import _Watch  # noqa: E402

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


class HookClock:
    """CPU seconds spent inside the recording's hooks, `_Watch.record` and `_Watch.finish` (in
    whichever harness this process imported): the recording timed where it runs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("record", "finish"):
            setattr(_Watch, name, self.timed(getattr(_Watch, name)))

    def timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        return call


def judge(run: Any) -> list[Any]:
    """I1 and I2 on the run, as the audit checks it."""
    return [*check_i1(run), *check_i2(run)]


def measure_rate(case: Any, target: Any, draft: Any, rate: float, repeats: int, clock: HookClock) -> dict[str, Any]:
    """Bare decoder, instrumented decoder at I2 rate `rate`, then I1 + I2: interleaved, medians."""
    factory = load_decoder(DECODER)
    oracle, _ = oracle_for(checks_target(target), case)
    warm_up(DECODER, factory, target, draft, case, TIMEOUT_S)
    bare, audited, hooks, checks = [], [], [], []
    run = None
    for _ in range(repeats):
        bare.append(cpu_seconds(lambda: timed_call(DECODER, factory, target, draft, case, TIMEOUT_S))[1])
        sample = make_sampler(0, 0, rate)
        batch = partial(run_batch, DECODER, factory, case, target, draft, sample=sample, sample_rate=rate,
                        baseline=False, oracle=oracle)  # fmt: skip
        clock.seconds = 0.0
        run, seconds = cpu_seconds(batch)
        audited.append(seconds)
        hooks.append(clock.seconds)
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
        "hooks": statistics.median(hooks),
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
    out, clock = [], HookClock()
    for rate in RATES:
        m = measure_rate(case, target, draft, rate, args.repeats, clock)
        n, harness = m["target_forwards"], m["hooks"] + m["checks"]
        out.append({
            "rate": rate, "target_forwards": n, "sampled": m["sampled"],
            "bare_ms_per_forward": 1e3 * m["bare"] / n,
            "recording_ms_per_forward": 1e3 * m["recording"] / n,
            "hooks_ms_per_forward": 1e3 * m["hooks"] / n,
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


def measure_before(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same measurement of the harness in `tree` (this script, `tree`/harness imported as
    `specaudit`), in a process of its own: the figures it stores."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "specaudit").symlink_to(tree.resolve() / "harness", target_is_directory=True)
        command = [sys.executable, __file__, "--out", tmp, "--label", "before"]
        for flag in ("layers", "hidden", "ffn", "dtype", "batch_size", "max_prompt", "new_tokens", "repeats"):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": tmp}, stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "harness_cost.json").read_text())["before"]


def render(label: str, args: argparse.Namespace, result: dict[str, Any]) -> str:
    before = result.get("before")
    lines = [
        f"## {label}",
        "",
        f"`python bench/harness_cost.py {shlex.join(sys.argv[1:])}`: {args.layers}-layer Llama (hidden {args.hidden}, "
        f"ffn {args.ffn}), {args.dtype}, batch {args.batch_size}, {args.new_tokens} new tokens, K=4, EQSPEC, "
        f"1 torch thread, CPU seconds, {platform.processor() or platform.machine()}, median of {args.repeats}"
        + (f"; `before`: the tree {args.before}, measured first in the same invocation." if before else "."),
        "",
        "| harness | I2 rate | target forwards | bare ms/forward | instrumented - bare ms/forward "
        "| hooks ms/forward | checks ms/forward | harness ms/forward (hooks + checks) | harness / bare "
        "| tok/s bare | tok/s audited |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [("before", before), ("this tree", result)] if before else [("this tree", result)]
    for name, run in runs:
        for r in run["rows"]:
            lines.append(
                f"| {name} | {r['rate']:.2f} | {r['target_forwards']} | {r['bare_ms_per_forward']:.1f} "
                f"| {r['recording_ms_per_forward']:.1f} | {r['hooks_ms_per_forward']:.1f} "
                f"| {r['checks_ms_per_forward']:.1f} "
                f"| {r['harness_ms_per_forward']:.1f} | {r['harness_ratio']:.2f} "
                f"| {r['bare_tokens_per_second']:.0f} | {r['audited_tokens_per_second']:.0f} |"
            )
    floors = ", ".join(f"{run['noise_floor_seconds']:.1f} s ({name})" for name, run in runs)
    lines += ["", f"Noise floor, once per model and dtype: {floors}.", ""]
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
    parser.add_argument("--before", type=Path, help="a source tree measured first, side by side (see above)")
    args = parser.parse_args(argv)
    before = measure_before(args.before, args) if args.before else None
    result = measure(args) | ({"before": before} if before else {})
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "harness_cost.md"
    head = "" if md.exists() else "# The harness's cost per observed target forward (bench/harness_cost.py)\n\n"
    md.write_text((md.read_text() if md.exists() else head) + render(args.label, args, result) + "\n")
    store = args.out / "harness_cost.json"
    data = json.loads(store.read_text()) if store.exists() else {}
    data[args.label] = {
        "args": vars(args) | {"out": str(args.out), "before": str(args.before) if args.before else None},
        **result,
    }
    store.write_text(json.dumps(data, indent=1) + "\n")
    print(render(args.label, args, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
