"""`specaudit`: the command line. `specaudit audit` is the README's main job.

This module is the boundary: it parses arguments, builds one typed settings object per
command (`specaudit.config.settings`) and hands it to the command's module, which never sees
argparse. Bad input anywhere below is a `UsageError`, caught here once: one line on stderr,
exit 2, never a traceback. Otherwise the exit status is the command's: 0 pass, 1 fail
(`specaudit.contracts.exits`: EXIT_PASS, EXIT_FAIL, EXIT_USAGE).

The command modules pull in torch, so each is imported when its command runs: building the
parser (`specaudit --help`, a usage error) stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from specaudit.config.settings import (
    DEFAULT_CHECK_RATE,
    DEFAULT_EXAMPLES,
    DEFAULT_GATE_OUT,
    DEFAULT_JUNIT,
    DEFAULT_MINIMIZE_BUDGET,
    DEFAULT_MINIMIZE_OUT,
    REAL_DTYPES,
    VLLM_CONFIGURATIONS,
    VLLM_DEFAULT_PYTHON,
    VLLM_MODEL_NAMES,
    AuditSettings,
    BlackboxSettings,
    EngineMinimizeSettings,
    GateSettings,
    MinimizeSettings,
    RealAuditSettings,
    VllmAuditSettings,
)
from specaudit.config.shards import parse_shard
from specaudit.config.xfails import KnownFailures, load_xfails
from specaudit.contracts.builtins import DEFAULT_DECODERS, MODELS, parse_models
from specaudit.contracts.errors import UsageError
from specaudit.contracts.exits import EXIT_FAIL, EXIT_PASS, EXIT_USAGE

REAL_MODEL_ONLY = ("draft", "prompts", "device", "dtype", "check_rate", "batch_size", "max_new_tokens",
                   "num_draft_tokens", "max_prompts", "timeout")  # fmt: skip


# ---------------------------------------------------------------------------------------
# Commands: settings from the arguments, then the command's module


def cmd_audit(args: argparse.Namespace) -> int:
    if args.target is not None:
        if args.engine:
            raise UsageError("--engine has no real-model mode (engines run on the built-in models of --models)")
        fleet = (("--xfails", args.xfails), ("--jobs", args.jobs), ("--shard", args.shard), ("--ray", args.ray or None))
        built_in = [flag for flag, value in fleet if value is not None]
        if built_in:
            raise UsageError(f"{', '.join(built_in)}: built-in models only, not with --target (real-model mode)")
        real = real_audit_settings(args)
        from specaudit.audits.realaudit import run_real_audit

        return run_real_audit(real)
    given = [f"--{name.replace('_', '-')}" for name in REAL_MODEL_ONLY if getattr(args, name) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --target (real-model mode)")
    settings = AuditSettings(
        decoders=tuple(args.decoder),
        models=tuple(parse_models(args.models)),
        examples=args.examples,
        seed=args.seed,
        quiet=args.quiet,
        out=args.out,
        engines=tuple(args.engine),
        xfails=load_xfails(args.xfails) if args.xfails is not None else KnownFailures(),
        jobs=args.jobs,
        shard=parse_shard(args.shard) if args.shard is not None else None,
        ray=args.ray,
        strict_efficiency=args.strict_efficiency,
    )
    from specaudit.audits.audit import run_audit

    return run_audit(settings)


def real_audit_settings(args: argparse.Namespace) -> RealAuditSettings:
    """Real-model options; the ones left out take the settings' defaults. The built-in `smollm2`
    brings its own draft; the shipped prompt set is the default for `--prompts`."""
    from specaudit.models.pretrained import DEFAULT_PROMPTS, default_draft

    draft = args.draft or default_draft(args.target)
    if draft is None:
        raise UsageError("--target needs --draft (only a built-in target such as smollm2 has a default draft)")
    given = {
        "device": args.device,
        "dtype": args.dtype,
        "check_rate": args.check_rate,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "max_prompts": args.max_prompts,
        "timeout_s": args.timeout,
        "decoders": tuple(args.decoder) or None,
    }
    return RealAuditSettings(
        target=Path(args.target),
        draft=Path(draft),
        prompts=Path(args.prompts) if args.prompts else DEFAULT_PROMPTS,
        seed=args.seed,
        out=args.out,
        **{name: value for name, value in given.items() if value is not None},
    )


def engine_file(args: argparse.Namespace) -> bool:
    """Whether FILE is taken as an engine reproducer (it has "ops"): with --engine always (the
    file is checked then), with --decoder never (an engine file is refused), else by its content."""
    from specaudit.artifacts.reproducer import is_engine_reproducer

    if args.engine is not None:
        if args.decoder is not None:
            raise UsageError("give --decoder (a case file) or --engine (an engine reproducer), not both")
        return True
    engine = is_engine_reproducer(args.case)
    if engine and args.decoder is not None:
        raise UsageError(f"{args.case} is an engine reproducer (it has 'ops'): give --engine, not --decoder")
    if not engine and args.decoder is None:
        raise UsageError(f"{args.case}: --decoder MODULE:ATTR is required for a case file")
    return engine


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay any reproducer (`specaudit.commands.replay.replay`: a decoder or real-model case, an
    engine's rules, a black-box plan) against the subject it names or the one given, and print
    what it gives: the diagnosis, the engine's violations, the black-box table."""
    import json

    from specaudit.artifacts.reproducer import load_reproducer
    from specaudit.commands.replay import replay

    reproducer = load_reproducer(args.case, check=False)  # options are checked against its kind first
    given = {name: getattr(args, name) for name in ("engine", "server", "target", "draft", "device")}
    outcome = replay(reproducer, args.decoder, **given)
    print(json.dumps(outcome.to_json(), indent=1) if args.json else outcome.render())
    return EXIT_PASS if outcome.passed else EXIT_FAIL


def cmd_minimize(args: argparse.Namespace) -> int:
    if engine_file(args):
        from specaudit.commands.minimize import minimize_engine

        engine_settings = EngineMinimizeSettings(case=args.case, engine=args.engine, out=args.out, budget=args.budget)
        return minimize_engine(engine_settings)
    settings = MinimizeSettings(
        case=args.case, decoder=args.decoder, out=args.out, budget=args.budget, keep_divergence=args.keep_divergence
    )
    from specaudit.commands.minimize import run_minimize

    return run_minimize(settings)


def cmd_gate(args: argparse.Namespace) -> int:
    settings = GateSettings(
        decoders=tuple(args.decoder) or (() if args.engine else DEFAULT_DECODERS),
        models=tuple(parse_models(args.models)),
        examples=args.examples,
        seed=args.seed,
        junit=args.junit,
        out=args.out,
        min_exact_match=args.min_exact_match,
        xfails=load_xfails(args.xfails) if args.xfails is not None else KnownFailures(),
        quiet=args.quiet,
        engines=tuple(args.engine),
        jobs=args.jobs,
        shard=parse_shard(args.shard) if args.shard is not None else None,
        ray=args.ray,
        strict_efficiency=args.strict_efficiency,
    )
    from specaudit.audits.gate import run_gate

    return run_gate(settings)


def cmd_merge(args: argparse.Namespace) -> int:
    """The shards of one plan joined (`specaudit.fleet.merge`); a missing or foreign shard is exit 2."""
    from specaudit.fleet.merge import run_merge

    return run_merge(list(args.shards), args.out, args.junit)


def cmd_blackbox(args: argparse.Namespace) -> int:
    """A server or an in-process engine that owns its models, judged at the output level."""
    settings = BlackboxSettings(
        target=args.target,
        server=args.server,
        engine=args.engine,
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        spread=args.spread,
        prompts=args.prompts,
        eos_token_id=args.eos_token_id,
        likely_eos=args.likely_eos,
        mixed_max_tokens=args.mixed_max_tokens,
        served_model=args.served_model,
        timeout_s=args.timeout,
        max_batch=args.max_batch,
        dtype=args.dtype,
        replay=args.replay,
        out=args.out,
        json=args.json,
        quiet=args.quiet,
    )
    from specaudit.commands.blackbox import run_blackbox

    return run_blackbox(settings)


# ---------------------------------------------------------------------------------------
# The parser


def add_search_options(parser: argparse.ArgumentParser, decoder_default: str) -> None:
    """Options the audit and the gate share: decoders, models, budget, seed, progress."""
    parser.add_argument(
        "--decoder", action="append", default=[], metavar="MODULE:ATTR", help=f"decoder (repeatable; {decoder_default})"
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="continuous-batching engine, run through the engine state machine (repeatable; alone: engines only)",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated built-in models")
    parser.add_argument(
        "--examples",
        type=int,
        default=DEFAULT_EXAMPLES,
        help=f"generated cases per decoder and model (default {DEFAULT_EXAMPLES})",
    )
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (same seed, same cases)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def add_strict_efficiency_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strict-efficiency",
        action="store_true",
        help="fail a decoder on an efficiency finding (token preservation alone: output and invariants right, "
        "verified drafts thrown away); by default such a finding is reported at its own level, EFFICIENCY",
    )


def add_fleet_options(parser: argparse.ArgumentParser) -> None:
    """Options the audit and the gate share for running a plan over several machines."""
    parser.add_argument(
        "--shard",
        metavar="I/N",
        help="run shard I of N (1-based) of the plan: its cells chosen by a stable hash of each cell's name; "
        "join the shards' --out directories with specaudit merge",
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="run the plan's cells as Ray tasks (one GPU each where the cluster has GPUs, else one CPU; "
        "$RAY_ADDRESS, else a local Ray); needs pip install 'specaudit[ray]'",
    )


def add_merge(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "merge",
        help="join the shards' report.json, JUnit and reproducers into one report; exit 0 pass / 1 fail / "
        "2 a shard missing",
        description="Join the --out directories of `specaudit audit|gate --shard I/N` into one report.json (the "
        "plan's order), one JUnit XML (the gate's) and the reproducers. A missing, unfinished or foreign shard "
        "is an error (exit 2), a failed shard fails the merge (exit 1).",
    )
    parser.add_argument("shards", type=Path, nargs="+", metavar="DIR", help="one shard's --out directory each")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the merged report and reproducers")
    parser.add_argument(
        "--junit",
        type=Path,
        default=None,
        metavar="PATH",
        help="merged JUnit XML of gate shards (default: OUT/junit.xml)",
    )
    parser.set_defaults(func=cmd_merge)


def add_xfails_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--xfails",
        type=Path,
        default=None,
        metavar="FILE",
        help="known failures, one `decoder model check rule` per line ('*' matches any): reported, not fatal; "
        "entries that match nothing are listed at the end",
    )


def add_audit(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser(
        "audit",
        help="audit decoders and engines on the built-in models (default: the reference decoders and engines, "
        "and the planted bugs)",
    )
    add_search_options(audit, "default: the reference decoders and the planted bugs")
    audit.add_argument("--out", type=Path, default=None, metavar="DIR", help="write DIR/report.json and DIR/repro/")
    add_xfails_option(audit)
    add_strict_efficiency_option(audit)
    audit.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for the decoder x model and engine audits (default: $SPECAUDIT_JOBS, else one per "
        "core); the results and their order do not depend on N",
    )
    real = audit.add_argument_group("real-model mode (when --target is given; defaults from specaudit.config.settings)")
    real.add_argument(
        "--target", metavar="DIR", help="target model directory (Hugging Face format, local), or the built-in smollm2"
    )
    real.add_argument("--draft", metavar="DIR", help="draft model directory (same tokenizer as the target)")
    real.add_argument(
        "--prompts",
        metavar="FILE",
        help="JSONL with SpecBench-style `turns`, or one prompt per line (default: the shipped set)",
    )
    real.add_argument("--device", help="torch device for both models (default: cpu)")
    real.add_argument("--dtype", choices=REAL_DTYPES, help="model dtype (default: the checkpoint's)")
    real.add_argument(
        "--check-rate",
        type=float,
        metavar="P",
        help=f"fraction of target calls whose K/V are checked for I2 (I1: every call; default {DEFAULT_CHECK_RATE})",
    )
    real.add_argument("--batch-size", type=int, help="prompts per batch (default 8)")
    real.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 64)")
    real.add_argument("--num-draft-tokens", type=int, help="K, drafts per round (default 4)")
    real.add_argument("--max-prompts", type=int, metavar="N", help="use the first N prompts only")
    real.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds a decoder call may go without a forward of the models (default 600)",
    )
    add_fleet_options(audit)
    audit.set_defaults(func=cmd_audit)


def add_replay(sub: argparse._SubParsersAction) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay a reproducer of any kind (decoder case, real-model case, engine rules, black-box plan)",
        description="Run a reproducer again against the decoder, engine, server or models it names, or the ones "
        "given; files written before the reproducer envelope are read too. Exit 0 it passes, 1 it fails, 2 usage.",
    )
    replay.add_argument("case", type=Path, metavar="FILE")
    replay.add_argument("--decoder", metavar="MODULE:ATTR", help="the decoder (decoder and real-model cases)")
    replay.add_argument(
        "--engine", metavar="MODULE:ATTR", help="the engine (engine rules, black-box plans; default: the file's)"
    )
    replay.add_argument("--server", metavar="URL", help="the server (black-box plans; default: the file's)")
    replay.add_argument(
        "--target", metavar="NAME|DIR", help="the target model (real-model cases, black-box plans; default: the file's)"
    )
    replay.add_argument("--draft", metavar="DIR", help="the draft model directory (real-model cases)")
    replay.add_argument("--device", help="torch device for the real models (default: the file's, else cpu)")
    replay.add_argument("--json", action="store_true", help="print the outcome (the diagnosis) as JSON")
    replay.set_defaults(func=cmd_replay)


def add_minimize(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "minimize",
        help="delta-debug a failing case file down to a minimal case; write a reproducer and a regression test",
        description="Delta-debug a failing case file (rows, prompt tokens, schedule, K, max_new_tokens, padding, "
        "EOS), keeping its failure class; write DIR/<name>.json and DIR/test_regression_<name>.py.",
    )
    parser.add_argument("case", type=Path, metavar="FILE", help="a case file or reproducer (JSON)")
    parser.add_argument("--decoder", metavar="MODULE:ATTR", help="the decoder that fails the case")
    parser.add_argument(
        "--engine",
        metavar="MODULE:ATTR",
        help="the engine that fails an engine reproducer (a file with 'ops'; default: the file's); its rules are "
        "delta-debugged",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_MINIMIZE_OUT,
        metavar="DIR",
        help=f"output directory (default: {DEFAULT_MINIMIZE_OUT})",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_MINIMIZE_BUDGET,
        metavar="N",
        help=f"at most N decoder runs (default: {DEFAULT_MINIMIZE_BUDGET}); then the smallest failing case is kept",
    )
    parser.add_argument(
        "--allow-exact-output",
        dest="keep_divergence",
        action="store_false",
        help="let a case whose output diverges shrink to one whose output is exact but fails the same check "
        "(default: a diverging case stays diverging)",
    )
    parser.set_defaults(func=cmd_minimize)


def add_gate(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "gate",
        help="the audit with thresholds for CI: JUnit XML, reproducers, exit 0 pass / 1 fail / 2 usage error",
        description="Run the audit for every decoder x model, write JUnit XML and apply the thresholds: every "
        "decoder must pass every check on every model, except the known failures listed with --xfails.",
    )
    add_search_options(parser, "default: the reference decoders")
    parser.add_argument(
        "--junit", type=Path, default=DEFAULT_JUNIT, metavar="PATH", help=f"JUnit XML report (default: {DEFAULT_JUNIT})"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_GATE_OUT,
        metavar="DIR",
        help=f"reproducers of failures (default: {DEFAULT_GATE_OUT})",
    )
    add_xfails_option(parser)
    add_strict_efficiency_option(parser)
    parser.add_argument(
        "--min-exact-match",
        type=float,
        default=0.0,
        metavar="F",
        help="minimum exact-row rate per decoder x model, in [0, 1] (default 0; bites through known failures)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for the decoder x model and engine searches (default: $SPECAUDIT_JOBS, else one per "
        "core); the verdicts, the testcases and their order do not depend on N",
    )
    add_fleet_options(parser)
    parser.set_defaults(func=cmd_gate)


def add_blackbox(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "blackbox",
        help="send staggered requests to a server or engine that owns its models; compare each output with the "
        "batch-size-1 greedy oracle (output level only: no I1/I2)",
        description="Send requests at seeded staggered arrivals to an OpenAI-compatible completions server "
        "(--server) or an in-process engine (--engine) that owns its models, and compare each request's tokens with "
        "the batch-size-1 greedy oracle of --target, tie-aware. Output level only: the engine's forwards are not "
        "observed, so there is no I1, no I2 and no diagnosis of the cause. Exit 0 every request matches, 1 one "
        "diverges or breaks the output contract, 2 usage error.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="URL", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--engine",
        metavar="MODULE:ATTR",
        help="in-process engine owning its models: a step-wise engine or generate(prompts, max_new_tokens), or a "
        "class/zero-argument factory building one",
    )
    parser.add_argument(
        "--target",
        metavar="NAME|DIR",
        help=f"the model served, run in process for the oracle: a built-in name ({', '.join(MODELS)}, smollm2) or a "
        "Hugging Face directory",
    )
    parser.add_argument("--requests", type=int, metavar="N", help="requests to send (default 8)")
    parser.add_argument("--max-new-tokens", type=int, metavar="M", help="max_tokens per request (default 16)")
    parser.add_argument("--seed", type=int, help="seeds the prompts, arrivals and batch cuts (default 0)")
    parser.add_argument(
        "--spread", type=float, metavar="X", help="arrivals over [0, X]: seconds for --server (default 0.5), steps "
        "or arrival order for --engine (default 6)"
    )  # fmt: skip
    parser.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help="prompts: token ids (one JSON list per line), or text tokenized with the --target directory's "
        "tokenizer (default: N prompts drawn from the seed)",
    )
    parser.add_argument(
        "--eos-token-id", type=int, metavar="ID", help="the EOS id, sent as the only stop token (default: none; "
        "ignore_eos is sent and every request runs to its limit)"
    )  # fmt: skip
    parser.add_argument(
        "--likely-eos", action="store_true", help="EOS: a token the target's greedy continuations of these prompts "
        "emit part-way, so some requests stop early (chosen once, kept in the reproducer)"
    )  # fmt: skip
    parser.add_argument(
        "--mixed-max-tokens", action="store_true", help="each request's max_tokens drawn from the seed in "
        "[M/4, M] (the first M), so limits land at different places"
    )  # fmt: skip
    parser.add_argument("--served-model", metavar="NAME", help="the `model` field of each request (--server)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds per request (default 60)")
    parser.add_argument(
        "--max-batch", type=int, default=3, metavar="B", help="largest staggered batch for a generate() engine"
    )
    parser.add_argument("--dtype", choices=REAL_DTYPES, help="the target's dtype for the oracle")
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="FILE",
        help="send the requests and arrivals of a reproducer (DIR/repro.json) again; its server/engine and target "
        "unless given",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="write DIR/repro.json (before sending) and DIR/report.json"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=cmd_blackbox)


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def vllm_settings(args: argparse.Namespace) -> VllmAuditSettings:
    return VllmAuditSettings(
        python=args.vllm_python,
        models=comma_list(args.models),
        configurations=comma_list(args.configurations),
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        spread=args.spread,
        health_timeout_s=args.health_timeout,
        request_timeout_s=args.timeout,
        out=args.out,
        whitebox_examples=args.whitebox_examples,
        whitebox_minutes=args.whitebox_minutes,
        plant=args.plant,
    )


def cmd_audit_vllm(args: argparse.Namespace) -> int:
    """A real vLLM server per speculative configuration under the black-box audit."""
    from specaudit.commands.audit_vllm import run_audit_vllm

    return run_audit_vllm(vllm_settings(args))


def add_vllm(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "audit-vllm",
        help="vLLM per served model and speculative configuration at both levels: a server black-box, the engine "
        "white-box under drawn workloads",
        description="For each served model and configuration (control: no speculation; ngram; draft: a draft "
        "model; self-draft: the target as its own draft; disagree: the same with a share of its drafts wrong), "
        "start vLLM's OpenAI-compatible server from the vLLM venv on 127.0.0.1, wait for /health, send staggered "
        "token-id requests (specaudit blackbox), compare each with the batch-size-1 greedy oracle, read "
        "drafted/accepted tokens from /metrics, and stop the server; then the white box (whitebox-vllm) on an "
        "in-process engine with the configuration's settings. Writes DIR/report.md and DIR/report.json. Exit 0 "
        "only when every configuration passes at both levels.",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("SPECAUDIT_VLLM_PYTHON", VLLM_DEFAULT_PYTHON),
        metavar="PATH",
        help=f"python of the vLLM venv (default: $SPECAUDIT_VLLM_PYTHON, else {VLLM_DEFAULT_PYTHON})",
    )
    parser.add_argument("--models", default=",".join(VLLM_MODEL_NAMES), help="served models, comma-separated")
    parser.add_argument(
        "--configurations", default=",".join(VLLM_CONFIGURATIONS), help="speculative configurations, comma-separated"
    )
    parser.add_argument("--requests", type=int, default=16, metavar="N", help="requests per configuration")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="M", help="max_tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and arrivals")
    parser.add_argument("--spread", type=float, default=0.5, metavar="S", help="arrivals over [0, S] seconds")
    parser.add_argument(
        "--health-timeout", type=float, default=300.0, metavar="S", help="seconds a server may take to be healthy"
    )
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per request")
    parser.add_argument("--out", type=Path, default=Path("specaudit-out/vllm"), metavar="DIR", help="report dir")
    wb = "the in-process white box"
    parser.add_argument("--whitebox-examples", type=int, default=6, metavar="N",
                        help=f"workloads {wb} draws per configuration (0: black box only)")  # fmt: skip
    parser.add_argument("--whitebox-minutes", type=float, default=2.0, metavar="M",
                        help=f"{wb}'s budget per configuration, drawing and shrinking")  # fmt: skip
    parser.add_argument("--plant", metavar="NAME",
                        help="a planted vLLM bug (specaudit.reference.vllm_mutants) in every server and white box: "
                        "the negative control, so both levels should fail")  # fmt: skip
    parser.set_defaults(func=cmd_audit_vllm)


def cmd_observe_vllm(args: argparse.Namespace) -> int:
    """vLLM in process, every target forward observed and judged by the paged-layout checks."""
    from specaudit.adapters.vllm.whitebox import default_payload, observe_in_process, write_failure

    run = observe_in_process(args.model, args.draft, default_payload(args.new_tokens))
    print(run.render())
    if run.passed:
        return EXIT_PASS
    print(f"reproducer written to {write_failure(args.out, run)}")
    return EXIT_FAIL


def add_observe_vllm(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "observe-vllm",
        help="run vLLM in process (from the vLLM venv) and check every target forward's paged layout (white box)",
        description="Four greedy requests arriving at different steps, one aborted, through an in-process vllm.LLM "
        "(float32, eager); every target forward's packed tokens, positions, query spans, context lengths, slot "
        "mapping and block table are recorded and judged by the paged-layout checks, and the K/V written are "
        "compared with the model's batch-size-1 entries; each request's output is judged against batch-size-1 "
        "greedy. Exit 0 when no paged or output rule is broken.",
    )
    parser.add_argument("model", help="a model directory, or a built-in name (smollm2)")
    parser.add_argument("--draft", help="a draft model directory or name (default: ngram prompt lookup)")
    parser.add_argument("--new-tokens", type=int, default=40, metavar="N", help="tokens per request (default 40)")
    parser.add_argument(
        "--out", type=Path, default=Path("specaudit-out/vllm-observe"), metavar="DIR", help="a failure's reproducer"
    )
    parser.set_defaults(func=cmd_observe_vllm)


def cmd_whitebox_vllm(args: argparse.Namespace) -> int:
    """vLLM's white box for one configuration: drawn workloads through an in-process engine."""
    from specaudit.adapters.vllm.whitebox import EngineOptions
    from specaudit.commands.whitebox_vllm import WhiteboxSettings, run_whitebox

    options = EngineOptions(args.method, args.k, args.block_size, args.max_num_batched_tokens, args.kv_blocks,
                            args.prefix_caching, args.max_model_len, args.disagree)  # fmt: skip
    return run_whitebox(WhiteboxSettings(args.model, args.json, args.draft, options, args.max_prompt, args.max_tokens,
                                         args.examples, args.minutes, args.seed, args.mutant, args.out))  # fmt: skip


def add_whitebox_vllm(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "whitebox-vllm",
        help="vLLM's white box for one engine configuration under drawn workloads (run from the vLLM venv)",
        description="Hypothesis draws workloads (arrivals, aborts, duplicate and shared-prefix prompts, lengths "
        "across block boundaries, max_tokens, a stop token) through an in-process vllm.LLM; every target forward is "
        "judged by the paged rules and every request by its outputs; a failure is shrunk within the budget and "
        "written as a reproducer. `specaudit audit-vllm` runs it per configuration. Exit 1 on a failure.",
    )
    add = parser.add_argument
    add("--model", required=True, help="the target's directory")
    add("--draft", help="the draft model's directory (method draft)")
    add("--method", default="ngram", choices=["ngram", "draft", "self-draft", "none"])
    add("--k", type=int, default=3, help="the engine's draft tokens per step; each workload's drawn from 1..K")
    add("--disagree", type=float, default=0.0, metavar="RATE", help="share of drafted tokens made wrong (0..1)")
    add("--block-size", type=int, default=32)
    add("--max-num-batched-tokens", type=int, help="small: chunked prefill")
    add("--kv-blocks", type=int, help="small: preemption")
    add("--prefix-caching", action="store_true")
    add("--max-model-len", type=int, default=512)
    add("--max-prompt", type=int, default=48, help="longest prompt drawn")
    add("--max-tokens", type=int, default=48, help="largest max_tokens drawn")
    add("--examples", type=int, default=8, help="workloads drawn at most")
    add("--minutes", type=float, default=3.0, help="the budget, drawing and shrinking")
    add("--seed", type=int, default=0)
    add("--mutant", help="plant this bug of specaudit.reference.vllm_mutants for the run")
    add("--json", type=Path, required=True, help="where the result goes")
    add("--out", type=Path, default=Path("specaudit-out/vllm-whitebox"), help="a failure's reproducer")
    parser.set_defaults(func=cmd_whitebox_vllm)


def cmd_audit_openvino(args: argparse.Namespace) -> int:
    """OpenVINO GenAI's continuous batching per configuration under drawn workloads (its own venv)."""
    from specaudit.adapters.openvino.audit import run_openvino

    names = [n for n in args.configurations.split(",") if n]
    return run_openvino(names, args.examples, args.minutes, args.seed, args.out, args.stop_strings, args.sampling)


def add_openvino(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "audit-openvino",
        help="OpenVINO GenAI's ContinuousBatchingPipeline per configuration under drawn workloads (run from the "
        "OpenVINO venv: make audit-openvino)",
        description="For each configuration (control: no speculation; draft: a draft model; draft-whole: the same "
        "with a whole-prompt token budget; lookup: prompt lookup; draft-bf16: the draft model at the CPU defaults, "
        "judged against the control at that precision), draw workloads (arrivals, cancels, limits, EOS, stop "
        "strings, K per request, prompts sharing prefixes or repeating motifs), run each on a fresh pipeline (f32 "
        "hints but in draft-bf16) on the built-in tiny Llama exported to IR, judge the outputs against the "
        "batch-size-1 greedy oracle, and shrink a failure. Exit 0 when every configuration passes (known OpenVINO "
        "defects counted and named).",
    )
    parser.add_argument(
        "--configurations",
        default="control,draft,draft-whole,lookup",
        help="comma-separated (draft-bf16 on request: its bf16 kernels differ by CPU, see docs/engines.md)",
    )
    parser.add_argument("--examples", type=int, default=20, metavar="N", help="workloads drawn per configuration")
    parser.add_argument("--minutes", type=float, default=3.0, metavar="M", help="time budget per configuration")
    parser.add_argument("--seed", type=int, default=0, help="seeds the drawn workloads")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="writes DIR/openvino.json")
    parser.add_argument(
        "--no-stop-strings",
        dest="stop_strings",
        action="store_false",
        help="draw no stop strings (by default about a third of the requests carry one, some with a limit inside "
        "the stop's accepted run)",
    )
    parser.add_argument(
        "--no-sampling",
        dest="sampling",
        action="store_false",
        help="skip the sampling runs (without speculation, the draft model and prompt lookup, judged against the "
        "target's exact distribution)",
    )
    parser.set_defaults(func=cmd_audit_openvino)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specaudit", description="Correctness audit for batch speculative decoders.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser(
        "suite",
        help="run the installed conformance suite: specaudit suite --decoder MODULE:ATTR | --engine MODULE:ATTR "
        "[pytest args]",
    )
    adders: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
        add_audit,
        add_replay,
        add_minimize,
        add_gate,
        add_merge,
        add_blackbox,
        add_vllm,
        add_openvino,
        add_observe_vllm,
        add_whitebox_vllm,
    )
    for add in adders:
        add(sub)
    return parser


def usage_error(message: str) -> int:
    """The one place a usage error is told: one line on stderr, exit 2."""
    line = " ".join(message.split())
    print(f"specaudit: error: {line}", file=sys.stderr)
    return EXIT_USAGE


def importable_from_here() -> None:
    """`--decoder`/`--engine mypkg.mod:X` from the user's checkout, as `python -m` would find it:
    the console script's sys.path starts at its own directory, not the working one."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["suite"]:  # everything after `suite` belongs to pytest
        from specaudit.commands.suite import run_suite

        return run_suite(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed one usage line
        return EXIT_USAGE if exc.code else EXIT_PASS
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    importable_from_here()
    try:
        return int(args.func(args))
    except UsageError as exc:
        return usage_error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
