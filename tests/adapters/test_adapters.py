"""The adapters: HF assisted generation under the decoder contract, and black-box engines."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from specaudit.adapters import BlackBoxEngine, DecoderEngine, HFAssisted, audit_blackbox
from specaudit.adapters.hf_assisted import cut
from specaudit.checks.diagnosis import all_violations, diagnose
from specaudit.contracts.case import Case
from specaudit.fixtures.tiny import build_tiny
from specaudit.running.runner import oracle_continuation, run_case
from specaudit.search.strategies import pattern_from_rounds

HF = "specaudit.adapters.hf_assisted:HFAssisted"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------
# Hugging Face assisted generation


def test_hf_assisted_is_equivalent_on_tiny_llama() -> None:
    """HF assisted generation, row by row, matches the batch-size-1 oracle with I1 and I2 intact."""
    prompts = ((5, 6, 7, 8), (9, 0, 11), (3, 1, 4, 1, 5, 9, 2))  # the pad id 0 is a real token of row 1
    case = Case(prompts, ((),) * 3, 3, 8, None, 0, 1, "llama", "tiny")
    run = run_case(HF, case)
    diagnosis = diagnose(run)
    assert diagnosis.passed and diagnosis.verdict == "exact", diagnosis.render()
    assert len(run.recording.target_calls) < 3 * 8  # drafts were accepted: fewer target calls than tokens


def test_hf_assisted_stops_at_eos() -> None:
    """The adapter returns new tokens only, ending at the first EOS, like the oracle."""
    prompt = (12, 34, 56)
    continuation = oracle_continuation("llama", "float64", prompt, 16).tokens
    eos = next(t for i, t in enumerate(continuation) if i >= 2 and t not in continuation[:i])
    case = Case((prompt,), ((),), 2, 10, eos, 0, 0, "llama", "tiny")
    run = run_case(HF, case)
    assert diagnose(run).passed
    assert run.outputs[0][-1] == eos and len(run.outputs[0]) == continuation.index(eos) + 1


def test_hf_assisted_passes_every_check_on_the_exact_models() -> None:
    """On the transparent target and scripted draft, I1, I2, equivalence and token preservation hold."""
    prompts = ((5, 6, 7, 8), (9, 10, 11), (1, 2, 3, 4, 5, 6, 7))
    accept = (
        pattern_from_rounds(True, [2, 0, 3], 20),
        pattern_from_rounds(False, [1], 20),
        pattern_from_rounds(True, [3], 20),
    )
    pad = 127
    case = Case(prompts, accept, 3, 12, None, pad, 0)
    run = run_case(HF, case)
    assert all(pad not in o.tokens for o in run.oracle)  # see the next test for a pad inside a sequence
    assert not all_violations(run), diagnose(run).render()


def test_hf_assisted_pad_token_in_sequence_costs_only_acceptance() -> None:
    """A generated token equal to the pad id may cost acceptance (HF's draft infers its mask from
    the pad id), never correctness: only token preservation may object."""
    prompts = ((5, 6, 7, 8), (9, 10, 11))
    accept = (pattern_from_rounds(True, [3], 20), pattern_from_rounds(True, [3], 20))
    pad = oracle_continuation("transparent", "float64", prompts[1], 16).tokens[1]
    case = Case(prompts, accept, 3, 12, None, pad, 0)
    run = run_case(HF, case)
    assert run.outputs is not None and all(r == o.tokens for r, o in zip(map(tuple, run.outputs), run.oracle))
    assert all(v.check == "token-preservation" for v in all_violations(run))


def test_hf_assisted_leaves_the_draft_config_alone() -> None:
    """The draft's generation config is swapped for the call only and restored unchanged."""
    target, draft = build_tiny("llama"), build_tiny("llama", "draft")
    config = draft.generation_config
    before = config.to_dict()
    ids, mask = torch.tensor([[0, 7, 8, 9]]), torch.tensor([[0, 1, 1, 1]])
    out = HFAssisted().generate(
        target, draft, ids, mask, num_draft_tokens=2, max_new_tokens=4, eos_token_id=None, pad_token_id=0
    )
    assert len(out) == 1 and len(out[0]) == 4
    assert draft.generation_config is config and config.to_dict() == before


def test_cut_applies_limit_and_eos() -> None:
    """A row is cut at max_new_tokens and after the first EOS."""
    assert cut([1, 2, 3, 4], 3, None) == [1, 2, 3]
    assert cut([1, 9, 3, 9], 4, 9) == [1, 9]


# ---------------------------------------------------------------------------------------
# Black-box engines


@pytest.fixture(scope="module")
def tiny_pair():
    return build_tiny("llama"), build_tiny("llama", "draft")


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7], [9, 10, 11]]


def test_reference_engine_passes_black_box_audit(tiny_pair) -> None:
    """EQSPEC wrapped as an engine is equivalent to the oracle on every prompt."""
    target, draft = tiny_pair
    engine = DecoderEngine("specaudit.reference.eqspec:EqSpec", target, draft, num_draft_tokens=3)
    assert isinstance(engine, BlackBoxEngine)
    result = audit_blackbox(engine, target, PROMPTS, max_new_tokens=10)
    assert result.passed and result.verdict == "exact", result.render()
    assert result.exact_match == 1.0 and result.new_tokens == 40 and result.tokens_per_s > 0
    assert result.to_json()["passed"] is True


@pytest.mark.parametrize(
    ("bug", "signature"),
    [
        ("rejected_kv_attended", "bonus"),  # rejected drafts' KV is attended at batch size 1 too
        ("pads_attended", "batch-only"),  # a single row has no pads: right alone, wrong in a batch
    ],
)
def test_black_box_audit_catches_a_planted_bug(tiny_pair, bug: str, signature: str) -> None:
    """An engine running a planted bug fails on equivalence, with its evidence, and the signature
    says whether the diverging prompt is wrong alone too ("bonus") or only in the batch."""
    target, draft = tiny_pair
    engine = DecoderEngine(f"specaudit.reference.mutants:{bug}", target, draft, num_draft_tokens=3)
    result = audit_blackbox(engine, target, PROMPTS, max_new_tokens=10)
    assert not result.passed and result.verdict == "diverged"
    assert {v.check for v in result.violations} == {"equivalence"}
    assert result.signature == signature, result.reason
    assert "FAIL" in result.render()


class _Broken:
    name = "broken"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        if self.mode == "raise":
            raise RuntimeError("engine down")
        return [[1, 2]] * (len(prompts) - 1)


@pytest.mark.parametrize("mode", ["raise", "rows"])
def test_black_box_contract_breach_is_evidence(tiny_pair, mode: str) -> None:
    """An engine that raises or returns the wrong rows fails on the contract, it does not crash the audit."""
    target, _ = tiny_pair
    result = audit_blackbox(_Broken(mode), target, PROMPTS[:2], max_new_tokens=4)
    assert not result.passed and result.outputs is None and result.signature == "contract"
    assert result.violations[0].check == "contract"


def test_vllm_example_is_valid_python() -> None:
    """The documented vLLM adapter compiles and follows the black-box engine interface."""
    text = (REPO / "docs" / "vllm_example.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        compile(block, "vllm_example.md", "exec")
    code = "\n".join(blocks)
    assert "SamplingParams" in code and "prompt_token_ids" in code and "temperature=0" in code
    assert "def generate(self, prompts" in code and "audit_blackbox" in code
    for module, names in re.findall(r"^from (specaudit[\w.]*) import (.+)$", code, flags=re.M):
        imported = importlib.import_module(module)
        missing = [n.strip() for n in names.split(",") if not hasattr(imported, n.strip())]
        assert not missing, f"docs/vllm_example.md imports {missing} from {module}, which has no such names"
