"""Every rule each check can emit, by name: what a known-failures file may list.

Torch-free, because `specaudit.config.xfails` validates a file against it before anything heavy is
imported (the checks themselves import torch), and in the foundation layer, which cannot read
the registry: so each registry entry reads its rules from here (`checks.registry.Check.rules`),
the registry refuses to import while this table names other checks or another order
(`checks.registry.validate`), and tests/contracts/test_rules.py fails when a check emits a rule
missing here (it reads the contract rule tables and the rule literals of the check modules).
"""

from __future__ import annotations

CONTRACT_RULES = frozenset(
    {
        # specaudit.contracts.decoder.RULES: the decoder contract
        "generate-returns",
        "returns-lists",
        "one-list-per-row",
        "max-new-tokens",
        "ends-at-eos",
        "inputs-unchanged",
        "models-unchanged",
        "unobserved-forward",
        "unsupported-input",
        # specaudit.contracts.engine.ENGINE_RULES: the engine contract
        "engine-builds",
        "add-request-returns",
        "step-returns",
        "step-result",
        "known-request",
        "aborted-silent",
        "finished-silent",
        "has-unfinished",
        "abort-returns",
        # specaudit.adapters.engine_blackbox.RULES: the black-box output contract
        "responds",
        "http-status",
        "json-response",
        "token-ids",
        "token-count",
    }
)

PAGED_RULES = (
    "query-spans",
    "live-request",
    "context-length",
    "query-positions",
    "query-tokens",
    "draft-count",
    "slot-mapping",
    "block-shared",
    "kv-provenance",
    "kv-overwritten",
    "greedy-commit",
    "kv-entry",
)
"""The paged layout's rules, in the order `specaudit.checks.paged` judges them."""

CHECK_RULES: dict[str, frozenset[str]] = {
    "contract": CONTRACT_RULES,
    "I1": frozenset(
        {
            "input-shape",
            "cache-length",
            "cache-batch",
            "position-shape",
            "mask-shape",
            "mask-values",
            "row-attends-nothing",
            "target-called",
        }
    ),
    "I2": frozenset(
        {
            "attends-wrong-slot",
            "row-identity",
            "position-ids",
            "input-token",
            "cache-readable",
            "history-token",
            "retired-row",  # the engine state machine
            "duplicate-row",
        }
    ),
    "paged": frozenset(PAGED_RULES),
    "equivalence": frozenset({"first-divergence"}),
    "token-preservation": frozenset({"verified-kept", "accepted-as-scheduled"}),
    "liveness": frozenset({"request-finishes", "bounded-queue", "bounded-wait"}),
    "grouped-no-realignment": frozenset({"slots-stay"}),
    "order-independence": frozenset({"keeps-contract", "same-output"}),
    "row-independence": frozenset({"rows-correlated"}),
    "distribution": frozenset({"impossible-token", "stops-early", "role-fit", "pooled-fit"}),
}
"""Check name (in the registry's order) -> the rule names its violations carry."""

CHECK_NAMES = tuple(CHECK_RULES)
